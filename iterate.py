"""Run a plan of training rounds: each stage starts from the previous stage's adapter and uses it, frozen, as its reference.

    python iterate.py --help

The command over dpokit/apps/iterate.py, where its options, examples and code live."""
import sys

from dpokit.core import kit
from dpokit.apps.iterate import main

if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
