#!/usr/bin/env python3
"""Write the lock for a machine without an NVIDIA GPU: PyTorch's CPU build from PyTorch's own CPU index, and the
rest of requirements.txt without the CUDA-only wheels.

    python3 cpu_lock.py requirements.txt OUTDIR [--torch_index URL] [--system Linux]

writes OUTDIR/torch-cpu.txt (`--index-url <CPU index>` and `torch==<lock's version>+cpu`) and OUTDIR/rest-cpu.txt
(every other pin but nvidia-*, cuda-*, triton and liger-kernel). `make venv` and the image's TORCH_VARIANT=cpu
install the two with `pip install --no-deps -r`, torch first. Why: PyPI's torch for Linux is the CUDA build; with
--no-deps and no CUDA wheels beside it, `import torch` fails (libcudnn.so.9 not found). PyTorch's CPU index holds
the same release built without CUDA as `<version>+cpu` (a few hundred MB, not several GB). On macOS PyPI's wheel
is already the CPU build, so torch comes from PyPI there under its plain version.

Standard library only, Python 3.8+, so it runs before any venv exists.
"""

import argparse
import platform
import re
import sys
from pathlib import Path

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_ONLY = re.compile(r"^(nvidia-|cuda-|triton|liger-kernel)", re.IGNORECASE)  # no use, and no wheel, off-GPU
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


def split_lock(lock: str, system: str, torch_index: str = TORCH_CPU_INDEX) -> tuple[list[str], list[str]]:
    """(torch's requirement lines, the other pins' lines) for a CPU install of this lock on `system`
    (platform.system()'s name). Comment and option lines of the lock are dropped; a lock without a torch pin is
    an error (ValueError)."""
    torch_version, rest = None, []
    for line in lock.splitlines():
        match = PIN.match(line.strip())
        if not match:
            continue
        name, version = match.groups()
        if name.lower() == "torch":
            torch_version = version.split("+")[0]
        elif not CUDA_ONLY.match(name):
            rest.append(line.strip())
    if torch_version is None:
        raise ValueError("no torch==<version> pin in the lock")
    if system == "Linux":
        return [f"--index-url {torch_index}", f"torch=={torch_version}+cpu"], rest
    return [f"torch=={torch_version}"], rest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lock", help="the pinned requirements (requirements.txt)")
    parser.add_argument("outdir", help="where torch-cpu.txt and rest-cpu.txt are written")
    parser.add_argument("--torch_index", default=TORCH_CPU_INDEX,
                        help="PyTorch's CPU wheel index, or a mirror of it (default: %(default)s)")
    parser.add_argument("--system", default=platform.system(), help="Linux, Darwin, ... (default: this machine's)")
    args = parser.parse_args(argv)
    try:
        lock = Path(args.lock).read_text()
        torch_lines, rest = split_lock(lock, args.system, args.torch_index)
    except (OSError, ValueError) as e:
        print(f"{args.lock}: {e}", file=sys.stderr)
        return 2
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "torch-cpu.txt").write_text("\n".join(torch_lines) + "\n")
    (out / "rest-cpu.txt").write_text("\n".join(rest) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
