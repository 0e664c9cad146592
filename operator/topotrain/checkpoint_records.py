"""Moved to `topotrain_sdk.records` (the trainer side of the contract, issue 33); re-exported here
so the operator and older imports keep working. The SDK never imports topotrain."""

from topotrain_sdk.records import *  # noqa: F403
