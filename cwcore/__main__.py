"""``python -m cwcore``: the ``cwcore`` command line (:mod:`cwcore.cli`), for an environment whose scripts
folder is not on PATH."""

from .cli import main

raise SystemExit(main())
