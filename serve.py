"""A fine-tuning jobs service: agents upload pairs (or raw run logs), start DPO jobs over HTTP, poll them and chat
with the result, through the official `openai` SDK (only `base_url` changed) or nip's language-model-server client.

    python serve.py --help

The command over dpokit/service/serve.py, where its options, examples and code live."""
import sys

from dpokit.core import kit
from dpokit.service.serve import main

if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
