"""`python -m autopar ...`: the command line (autopar/cli.py), e.g. `python -m autopar plan --model llama3-8b`."""

import sys

from autopar.cli import main

if __name__ == "__main__":
    sys.exit(main())
