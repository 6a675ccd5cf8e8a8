"""Run code a model (or a user's grader) wrote where it cannot reach the user's files, processes or network, and say
how it was kept in.

    python sandbox.py --help

The command over dpokit/sandbox/sandbox.py, where its options, examples and code live."""
import sys

from dpokit.core import kit
from dpokit.sandbox.sandbox import main

if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
