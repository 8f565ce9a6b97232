"""`python -m app.cli`: the `hybridtrain` command without its console script."""

import sys

from app.cli import main

sys.exit(main())
