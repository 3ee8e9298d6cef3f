"""``python -m specdec ...``: the same as the ``specdec`` command."""

import sys

from specdec.cli import main

if __name__ == "__main__":
    sys.exit(main())
