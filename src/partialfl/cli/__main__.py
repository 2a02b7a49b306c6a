"""``python -m partialfl.cli``."""

import sys

from partialfl.cli import main

sys.exit(main())
