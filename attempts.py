"""The model's own attempts as run logs: the retraining process applied to the model itself. Sample answers to each
training run's code prompt (its strategy) from a model, run each with the checker on the run's host, and write the
results as run logs in build_pairs.py's input format: the run's prompt and strategy, and one attempt per answer with
`ran`, `error` and `space_freed`, as the agent's environment logged its own attempts. build_pairs.py's rules then
make the next round's pairs from them (mixed, first-try garbled, cross-run).

    python attempts.py --help

The command over dpokit/pairs/attempts.py, where its options, examples and code live."""
import sys

from dpokit.core import kit
from dpokit.pairs.attempts import main

if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
