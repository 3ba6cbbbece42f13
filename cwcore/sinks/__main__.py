"""``python -m cwcore.sinks``: see :mod:`cwcore.sinks.cli`."""

from .cli import main

raise SystemExit(main())
