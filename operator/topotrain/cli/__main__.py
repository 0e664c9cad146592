"""`python -m topotrain.cli`: the same as the `topotrain` command."""

import sys

from topotrain.cli.main import main

sys.exit(main())
