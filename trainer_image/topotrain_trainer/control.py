"""Requests that reach a running trainer from outside its training loop: `topotrain_sdk.control`
(SIGTERM, checkpoint requests, a hold's release; one implementation, issue 33), re-exported."""

from topotrain_sdk.contract import EXIT_STOPPED as EXIT_STOPPED
from topotrain_sdk.control import EXIT_PEER_STOPPED as EXIT_PEER_STOPPED
from topotrain_sdk.control import EXIT_SIGTERM as EXIT_SIGTERM
from topotrain_sdk.control import Control as Control
from topotrain_sdk.control import Decision as Decision
from topotrain_sdk.control import exit_code as exit_code
