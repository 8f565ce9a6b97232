"""`python -m trainer ...`: the same command line as `hybridtrain train ...`."""

import sys

from trainer.cli import main, role_in
from trainer.role_exit import exit_role

code = main(sys.argv[1:])
role = role_in(sys.argv[1:])
if role is None:
    sys.exit(code)
exit_role(role, code)
