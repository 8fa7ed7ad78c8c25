"""python -m torch_tweak: the command line (see torch_tweak.cli)."""

import sys

from .cli import main

sys.exit(main())
