"""``python -m cwcore.faithfulness``: see :mod:`cwcore.faithfulness.cli`."""

import sys

from .cli import main

sys.exit(main())  # one line on stderr and status 2 for bad input (cwcore.cli.run_command)
