"""Test set-up: the scripts live at the repository root, so put it on sys.path."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
