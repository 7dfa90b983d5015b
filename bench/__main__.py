"""python -m bench (in the repository): the cuflash-bench command, cuflash.bench.cli."""

import sys

from cuflash.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
