"""Moved to `topotrain_sdk.contract` (the trainer side of the contract, issue 33); re-exported here
so the operator and older imports keep working. The SDK never imports topotrain."""

from topotrain_sdk.contract import *  # noqa: F403
