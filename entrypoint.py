"""The kit's front door (the container's ENTRYPOINT, and usable locally): dispatch to the scripts.

    python entrypoint.py model [DEST]          # convert the bundled SmolLM2-135M-Instruct GGUF to safetensors
    python entrypoint.py pairs RUNS.jsonl -o pairs.jsonl [build_pairs options]
    python entrypoint.py train --data pairs.jsonl [train_dpo options]
    python entrypoint.py check [--require_gpu]  # torch / CUDA / bitsandbytes status

No logic of its own: each subcommand hands its arguments to one script's `main`.
"""

from __future__ import annotations

import sys

import kit

USAGE = __doc__.split("\n\n")[1]


def check(argv) -> int:
    """Print what the runtime can do; exit 1 when a GPU is required and missing."""
    import torch

    require_gpu = "--require_gpu" in argv
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    for i in range(torch.cuda.device_count()):
        print(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
    try:
        import bitsandbytes as bnb

        print(f"bitsandbytes {bnb.__version__}")
    except Exception as e:  # noqa: BLE001 - report whatever stops it importing
        print(f"bitsandbytes unavailable: {e}")
        return 1
    if require_gpu and not torch.cuda.is_available():
        print("a GPU was required (--require_gpu) but CUDA sees none", file=sys.stderr)
        return 1
    return 0


def model(argv) -> int:
    import train_dpo

    train_dpo.export_bundled_model(*(argv[:1] or [train_dpo.BUNDLED_MODEL_DIR]))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        import train_dpo

        return train_dpo.main(rest)
    if command == "pairs":
        import build_pairs

        return build_pairs.main(rest)
    if command == "model":
        return model(rest)
    if command == "check":
        return check(rest)
    raise kit.UserError(f"unknown command {command!r}; expected one of: model, pairs, train, check")


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
