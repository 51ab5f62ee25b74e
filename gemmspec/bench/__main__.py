"""`python -m gemmspec.bench`: the same as `gemmspec bench`."""

import sys

from .run import main

sys.exit(main())
