"""Turn an agent's run logs (JSONL, one run per line) into DPO preference pairs (or KTO examples) by the retraining rules.

    python build_pairs.py --help

The command over dpokit/pairs/from_logs.py, where its options, examples and code live."""
import sys

from dpokit.core import kit
from dpokit.pairs.from_logs import main

if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
