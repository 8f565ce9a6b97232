"""`python -m trainer ...`: the same command line as `hybridtrain train ...`."""

import os
import sys

from trainer.cli import main, skips_finalisation

code = main(sys.argv[1:])
if skips_finalisation(sys.argv[1:]):
    # The parameter server has closed everything it opened (sockets, metrics, the checkpoint
    # upload) and runs no user code: interpreter finalisation with its daemon threads still
    # parked in torch code aborted it now and then ("terminate called without an active
    # exception", exit -6), turning a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
