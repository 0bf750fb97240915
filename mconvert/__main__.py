"""`python -m mconvert ...` (and `torchrun ... -m mconvert ...`): the command line."""

from mconvert.cli import run

run()
