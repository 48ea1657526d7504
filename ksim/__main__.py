"""``python -m ksim``: the ``ksim`` command line."""

import sys

from ksim.cli import main

sys.exit(main())
