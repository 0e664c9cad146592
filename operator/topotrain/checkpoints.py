"""Moved to `topotrain_sdk.checkpoints` (the trainer side of the contract, issue 33); re-exported here
so the operator and older imports keep working. The SDK never imports topotrain."""

from topotrain_sdk.checkpoints import *  # noqa: F403
