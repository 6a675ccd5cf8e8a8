"""bench/image_size.py: the lock's pins, and the wheel pip would take on the image (CPython 3.10, manylinux
x86_64, glibc 2.35), chosen from an index's file list without the network."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import image_size  # noqa: E402


def test_pins_read_name_and_version_and_skip_comments_and_markers():
    text = "# comment\ntorch==2.13.0\n    # via x\nfoo[bar]==1.0 ; python_version < '3.11'\nbaz>=2\n"
    assert image_size.pins(text) == [("torch", "2.13.0"), ("foo", "1.0")]


def files(*names, yanked=()):
    return [{"filename": n, "size": i + 1, "yanked": n in yanked} for i, n in enumerate(names)]


def test_the_pick_is_the_wheel_the_image_can_install():
    accepted = image_size.image_tags()
    listing = files("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",       # another Python
                    "torch-2.13.0-cp310-cp310-manylinux_2_28_aarch64.whl",      # another machine
                    "torch-2.13.0-cp310-cp310-manylinux_2_39_x86_64.whl",       # newer glibc than Ubuntu 22.04's
                    "torch-2.12.0-cp310-cp310-manylinux_2_28_x86_64.whl",       # another version
                    "torch-2.13.0.tar.gz",
                    "torch-2.13.0-cp310-cp310-manylinux_2_28_x86_64.whl")
    assert image_size.pick(listing, "2.13.0", accepted)["filename"] == listing[-1]["filename"]
    pure = files("six-1.17.0-py2.py3-none-any.whl")
    assert image_size.pick(pure, "1.17.0", accepted)["filename"] == "six-1.17.0-py2.py3-none-any.whl"
    abi3 = files("x-1.0-cp39-abi3-manylinux_2_17_x86_64.whl", "x-1.0-py3-none-any.whl")
    assert image_size.pick(abi3, "1.0", accepted)["filename"].startswith("x-1.0-cp39-abi3")  # the built one first
    assert image_size.pick(files("y-1.0-cp310-cp310-manylinux_2_28_x86_64.whl",
                                 yanked={"y-1.0-cp310-cp310-manylinux_2_28_x86_64.whl"}), "1.0", accepted) is None


def test_groups_put_cuda_libraries_apart():
    assert image_size.group("nvidia-cublas") == "nvidia-* (CUDA libraries)"
    assert image_size.group("torch") == "torch" and image_size.group("trl") == "the rest"
