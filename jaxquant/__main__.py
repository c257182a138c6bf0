"""``python -m jaxquant``: the command line."""

import sys

from jaxquant._cli import main

sys.exit(main())
