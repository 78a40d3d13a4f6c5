"""`python -m pagedkern.serving.cli`: the same as `pagedkern-serve`."""

import sys

from .main import main

sys.exit(main())
