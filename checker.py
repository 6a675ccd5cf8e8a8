"""The demo agent's environment as code: run an answer's code on a planted host in the sandbox and score it as the
agent's environment scored its attempts.

    python checker.py --help

The command over dpokit/scoring/checker.py, where its options, examples and code live."""
import sys

from dpokit.core import kit
from dpokit.scoring.checker import main

if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
