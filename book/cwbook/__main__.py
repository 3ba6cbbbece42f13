import sys

from . import evidence_build  # noqa: F401 - registers the evidence profile's build (PROVENANCE, resume)
from . import confirmatory  # noqa: F401 - registers the confirmatory profile's build (never the notebooks)
from . import main

sys.exit(main())
