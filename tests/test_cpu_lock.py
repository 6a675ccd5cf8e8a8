"""The install without an NVIDIA GPU (cpu_lock.py, `make venv`, the image's TORCH_VARIANT=cpu): PyTorch's CPU build
of the lock's torch from PyTorch's CPU index, the rest of the lock without CUDA wheels; with a GPU, the whole lock."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dpokit.core import cpu_lock

ROOT = Path(__file__).resolve().parent.parent
LOCK = (ROOT / "requirements.txt").read_text()
PINS = dict(re.findall(r"^([A-Za-z0-9][\w.-]*)==(\S+)", LOCK, re.M))


def test_linux_cpu_lock_names_the_cpu_build_and_its_index():
    torch_lines, rest = cpu_lock.split_lock(LOCK, "Linux")
    assert torch_lines == ["--index-url https://download.pytorch.org/whl/cpu", f"torch=={PINS['torch']}+cpu"]
    names = {line.split("==")[0] for line in rest}
    cuda = {n for n in PINS if re.match(r"(nvidia-|cuda-|triton|liger-kernel)", n)}
    assert cuda and not names & cuda  # the lock has CUDA wheels, and none of them is kept
    assert names == set(PINS) - cuda - {"torch"}  # every other pin, as pinned
    assert all(f"{n}=={PINS[n]}" in rest for n in names)


def test_macos_takes_pypis_torch_which_is_the_cpu_build_there():
    torch_lines, rest = cpu_lock.split_lock(LOCK, "Darwin")
    assert torch_lines == [f"torch=={PINS['torch']}"]
    assert cpu_lock.split_lock("torch==2.1.0+cu121\nnumpy==2.0\n", "Linux", "https://mirror/cpu") == (
        ["--index-url https://mirror/cpu", "torch==2.1.0+cpu"], ["numpy==2.0"])


def test_cli_writes_both_files_and_a_lock_without_torch_is_an_error(tmp_path):
    assert cpu_lock.main([str(ROOT / "requirements.txt"), str(tmp_path / "out"), "--system", "Linux"]) == 0
    assert (tmp_path / "out" / "torch-cpu.txt").read_text().splitlines()[1] == f"torch=={PINS['torch']}+cpu"
    bad = tmp_path / "lock.txt"
    bad.write_text("numpy==2.0\n")
    script = ROOT / "dpokit" / "core" / "cpu_lock.py"
    result = subprocess.run([sys.executable, str(script), str(bad), str(tmp_path)], capture_output=True,
                            text=True)
    assert result.returncode == 2 and result.stderr.strip() == f"{bad}: no torch==<version> pin in the lock"


@pytest.mark.parametrize("has_cuda", ["", "1"])
def test_make_venv_installs_the_cpu_build_off_gpu_and_the_whole_lock_on_one(has_cuda, tmp_path):
    dry = subprocess.run(["make", "-n", "venv", f"HAS_CUDA={has_cuda}", f"STAMP={tmp_path}/stamp"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    if has_cuda:
        assert "pip install -q -r requirements.txt" in dry and "cpu_lock.py" not in dry
    else:
        assert "cpu_lock.py requirements.txt .venv" in dry and "-r .venv/torch-cpu.txt" in dry
        assert dry.index("-r .venv/torch-cpu.txt") < dry.index("-r .venv/rest-cpu.txt")  # torch before the rest
        assert "pip install -q -r requirements.txt" not in dry
    assert "import torch" in dry  # checked right after installing, either way
