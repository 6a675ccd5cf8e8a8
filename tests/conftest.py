"""Test set-up: the scripts live at the repository root, so put it on sys.path; the kit's
tokenised-data cache goes to a directory of this test session, not the user's ~/.cache; hypothesis's
settings for the property tests (derandomized, the same cases every run, where CI is set); under
pytest-xdist (`make test` runs TEST_WORKERS of them) each worker gets its share of the cores."""
import os
import sys
import tempfile
from pathlib import Path

# Under `make test ARGS=...`, make hands its command line (ARGS too) to every make below it through MAKEFLAGS: the
# tests that run make run it as a user does, from a clean command line.
for name in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL"):
    os.environ.pop(name, None)

# `pytest -n N`: N workers, each with torch's default of one thread per core, would run 2N threads on N cores and
# spin against each other (OpenMP waits busily). So each worker, and every process it starts (env is inherited),
# gets cores // N threads, set before anything imports torch. An explicit OMP_NUM_THREADS wins.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, share)))

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DPO_KIT_CACHE", tempfile.mkdtemp(prefix="dpo-kit-test-cache-"))

from hypothesis import HealthCheck, settings  # noqa: E402

# No example database (nothing written into the tree), no per-example deadline (2 busy cores vary a lot).
# CI: a fixed seed, so a red build is the same cases again; locally each run tries new ones.
settings.register_profile("kit", database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=bool(os.environ.get("CI")))
settings.load_profile("kit")

import atexit  # noqa: E402
import shutil  # noqa: E402

atexit.register(shutil.rmtree, os.environ["DPO_KIT_CACHE"], True) if "dpo-kit-test-cache-" in os.environ[
    "DPO_KIT_CACHE"] else None


def pytest_collection_modifyitems(config, items):
    """pytest.ini's `gpu` marker: skipped, saying why, where CUDA sees no device (torch imported only then)."""
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if not marked:
        return
    import pytest
    import torch

    if not torch.cuda.is_available():
        for item in marked:
            item.add_marker(pytest.mark.skip(reason="needs CUDA (bench/gpu.sh runs these on a GPU machine)"))
