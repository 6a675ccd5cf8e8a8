"""Fine-tune a causal LM on preference pairs with DPO (on unpaired labelled examples with KTO, or online with GRPO:
sampled answers scored by running them): 4-bit NF4 base, LoRA adapter, frozen reference.

    python train_dpo.py --help

The command over dpokit/train/training.py, where its options, examples and code live."""
import sys

from dpokit.core import kit
from dpokit.train.training import main

if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
