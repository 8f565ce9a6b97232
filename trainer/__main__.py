"""`python -m trainer ...`: the same command line as `hybridtrain train ...`."""

import sys

from trainer.cli import main

sys.exit(main(sys.argv[1:]))
