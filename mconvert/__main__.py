"""`python -m mconvert ...` (and `torchrun ... -m mconvert ...`): the command line."""

import sys

from mconvert.cli import main

sys.exit(main())
