""".ci/base-digest.py (`make base-digest`): the Dockerfile's BASE_IMAGE line pinned to the tag's digest, with a
fake `skopeo` on PATH standing in for the registry (this machine reaches none): the first pin, a re-pushed tag
(the driver floor it raised is named), an unchanged one, and no client at all (one sentence, exit 2).

    .venv/bin/python -m pytest -q tests/test_base_digest.py
"""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "base-digest.py"
TAG = "nvidia/cuda:13.0.1-runtime-ubuntu22.04"
spec = importlib.util.spec_from_file_location("base_digest", SCRIPT)
base_digest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(base_digest)


def index(n: int) -> bytes:
    """A multi-platform index as the registry sends it (its sha256 is the digest)."""
    return json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                       "manifests": [{"digest": f"sha256:{n:064x}", "platform": {"os": "linux", "architecture": "amd64"}}]},
                      indent=3).encode()


def config(floor: str, created: str) -> str:
    return json.dumps({"created": created, "config": {"Env": ["PATH=/usr/bin", "CUDA_VERSION=13.0.1",
                                                               f"NVIDIA_REQUIRE_CUDA=cuda>={floor} brand=tesla,driver>=535"]}})


def fake_skopeo(tmp_path: Path, raw: bytes, configs: dict[str, str]) -> dict:
    """An environment whose PATH holds only a `skopeo` that answers --raw with raw and --config with
    configs[digest] (no docker or crane: skopeo is the client chosen)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "raw").write_bytes(raw)
    cases = "".join(f"  *{d}*) printf '%s' '{c}';;\n" for d, c in configs.items())
    (bin_dir / "skopeo").write_text("#!/bin/sh\ncase \"$*\" in\n"
                                    f"  *--raw*) exec /bin/cat '{tmp_path / 'raw'}';;\n{cases}"
                                    "  *) echo 'unknown ref' >&2; exit 1;;\nesac\n")
    (bin_dir / "skopeo").chmod(0o755)
    return {**os.environ, "PATH": str(bin_dir)}


def run(dockerfile: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(dockerfile)], capture_output=True, text=True, env=env,
                          timeout=60)


def test_the_line_is_read_and_pinned_and_nothing_else_moves():
    text = f"# x\nARG BASE_IMAGE={TAG}\nFROM ${{BASE_IMAGE}}\n"
    assert base_digest.base_line(text) == (TAG, None)
    d = "sha256:" + "a" * 64
    out = base_digest.pinned(text, d)
    assert out == f"# x\nARG BASE_IMAGE={TAG}@{d}\nFROM ${{BASE_IMAGE}}\n" and base_digest.base_line(out) == (TAG, d)
    assert base_digest.pinned(out, "sha256:" + "b" * 64).count("@sha256:") == 1  # re-pinned, not appended
    assert base_digest.repository(TAG) == "nvidia/cuda" and base_digest.repository("localhost:5000/x:1") == "localhost:5000/x"
    assert base_digest.image_env(json.loads(config("13.0", "2025-08-01T00:00:00Z"))) == {
        "NVIDIA_REQUIRE_CUDA": "cuda>=13.0 brand=tesla,driver>=535", "CUDA_VERSION": "13.0.1",
        "created": "2025-08-01T00:00:00Z"}


def test_pin_then_a_repushed_tag_says_what_changed(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"ARG BASE_IMAGE={TAG}\nFROM ${{BASE_IMAGE}}\n")
    first, second = index(1), index(2)
    d1, d2 = (f"sha256:{hashlib.sha256(x).hexdigest()}" for x in (first, second))
    configs = {d1: config("13.0", "2025-08-01T00:00:00Z"), d2: config("13.0.2", "2026-01-10T00:00:00Z")}
    out = run(dockerfile, fake_skopeo(tmp_path, first, configs))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[:2] == [f"{TAG} (skopeo): pinned by tag only -> {d1}", "  CUDA_VERSION: 13.0.1"]
    assert dockerfile.read_text() == f"ARG BASE_IMAGE={TAG}@{d1}\nFROM ${{BASE_IMAGE}}\n"
    out = run(dockerfile, fake_skopeo(tmp_path, second, configs))  # NVIDIA re-pushed the tag
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"{TAG} (skopeo): {d1} -> {d2}",
        "  NVIDIA_REQUIRE_CUDA: cuda>=13.0 brand=tesla,driver>=535 -> cuda>=13.0.2 brand=tesla,driver>=535",
        "  created: 2025-08-01T00:00:00Z -> 2026-01-10T00:00:00Z",
        f"{dockerfile}: ARG BASE_IMAGE={TAG}@{d2}"]
    out = run(dockerfile, fake_skopeo(tmp_path, second, configs))
    assert out.returncode == 0 and out.stdout.strip() == f"{TAG}: unchanged, {d2} (skopeo)"


def test_no_client_or_no_line_is_one_sentence_and_exit_2(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"ARG BASE_IMAGE={TAG}\n")
    out = run(dockerfile, {**os.environ, "PATH": str(tmp_path)})  # no docker, skopeo or crane
    assert out.returncode == 2 and out.stderr == ("error: make base-digest needs docker buildx, skopeo or crane to ask "
                                                  "the registry: install one (apt-get install skopeo).\n")
    dockerfile.write_text("FROM scratch\n")
    out = run(dockerfile, {**os.environ, "PATH": str(tmp_path)})
    assert out.returncode == 2 and "no `ARG BASE_IMAGE=" in out.stderr and "Traceback" not in out.stderr
