"""Train data-parallel over several processes, GPUs and machines: `accelerate launch` runs train_dpo.py once per
process, and this wrapper names the failing rank in the run's status.json when one fails.

    python scaleout.py --help

The command over dpokit/apps/scaleout.py, where its options, examples and code live."""
import sys

from dpokit.core import kit
from dpokit.apps.scaleout import main

if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
