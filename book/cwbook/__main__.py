import sys

from . import main  # a profile with a build of its own (evidence, confirmatory) is imported when it is built

sys.exit(main())
