"""`python -m rlserve.cli`."""

import sys

from rlserve.cli import main

sys.exit(main())
