"""``python -m ksim``: the ``ksim`` command line."""

from ksim.cli import run

run()
