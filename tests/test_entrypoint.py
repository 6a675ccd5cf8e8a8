"""entrypoint.py: the container's front door dispatches, refuses unknown commands, and `check` (the pre-flight)
fails without a GPU.

    .venv/bin/python -m pytest -q tests/test_entrypoint.py
"""

import subprocess
import sys
from pathlib import Path

import pytest

import entrypoint
from dpokit.core import kit

ROOT = Path(__file__).resolve().parent.parent


def test_help_lists_every_subcommand(capsys):
    assert entrypoint.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("model", "pairs", "train", "check", "serve"):
        assert f"entrypoint.py {command}" in out


def test_no_command_is_a_usage_error(capsys):
    assert entrypoint.main([]) == 2


def test_unknown_command_is_one_line_and_exit_2():
    out = subprocess.run([sys.executable, str(ROOT / "entrypoint.py"), "fit"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == "error: unknown command 'fit'; expected one of: train, pairs, iterate, serve, model, check, verify, chat, merge, export, eval, runs, launch"


def test_train_validates_the_data_before_anything_loads(tmp_path):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "2+2=", "chosen": " 4", "rejected": " 5"}\n{"prompt": "x", "chosen": "y"}\n')
    out = subprocess.run([sys.executable, str(ROOT / "entrypoint.py"), "train", "--data", str(bad),
                          "--output_dir", str(tmp_path / "a")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith(f"{bad}:2:")
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


def test_check_requiring_a_gpu_fails_without_one():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = subprocess.run([sys.executable, str(ROOT / "entrypoint.py"), "check", "--require_gpu"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "CUDA available: False" in out.stdout
    [line] = out.stderr.strip().splitlines()  # one sentence saying what to do (tests/test_preflight.py: each case)
    assert line.startswith("error: ") and "Traceback" not in out.stderr
    assert kit.EXIT_USAGE == 2  # distinct from "no GPU" (1), so a launcher can tell the two apart
