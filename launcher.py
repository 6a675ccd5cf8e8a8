"""Build the kit's image and run its jobs in a container, through the Docker SDK (Docker, or podman's socket).

    python launcher.py --help

The command over dpokit/apps/launcher.py, where its options, examples and code live."""
import sys

from dpokit.core import kit
from dpokit.apps.launcher import main

if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
