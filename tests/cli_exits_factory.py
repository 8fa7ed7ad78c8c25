"""A factory module that exits while it is imported (a script's sys.exit left at its top)."""

import sys

sys.exit(3)
