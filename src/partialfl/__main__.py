import sys

from partialfl.cli import main

sys.exit(main())
