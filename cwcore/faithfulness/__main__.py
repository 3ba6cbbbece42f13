"""``python -m cwcore.faithfulness``: see :mod:`cwcore.faithfulness.cli`."""

import sys

from .cli import main

sys.exit(main())
