"""``python -m fastckpt``: the ``fastckpt`` command line (the same as the ``fastckpt`` console script)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
