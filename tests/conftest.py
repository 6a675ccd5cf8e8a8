"""Test set-up: the scripts live at the repository root, so put it on sys.path; the kit's
tokenised-data cache goes to a directory of this test session, not the user's ~/.cache."""
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DPO_KIT_CACHE", tempfile.mkdtemp(prefix="dpo-kit-test-cache-"))

import atexit  # noqa: E402
import shutil  # noqa: E402

atexit.register(shutil.rmtree, os.environ["DPO_KIT_CACHE"], True) if "dpo-kit-test-cache-" in os.environ[
    "DPO_KIT_CACHE"] else None


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu need CUDA: skipped, saying so, where there is none (CI never has one)."""
    import pytest

    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    try:
        import torch

        why = None if torch.cuda.is_available() else "needs CUDA; torch sees no GPU here"
    except ImportError:
        why = "needs CUDA; torch is not installed"
    if why:
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=why))
