"""Train on a SLURM cluster: a run becomes an sbatch script the kit writes (readable, re-runnable by hand with
`sbatch`), submitted once and followed through squeue and sacct until it ends; the jobs service's `--runner slurm`.

    python slurm.py --help

The command over dpokit/service/slurm.py, where its options, examples and code live."""
import sys

from dpokit.core import kit
from dpokit.service.slurm import main

if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
