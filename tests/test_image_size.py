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


def test_a_missing_lock_a_file_that_is_no_lock_and_an_index_that_does_not_answer_are_one_sentence(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("torch is a library\n")
    (tmp_path / "lock.txt").write_text("six==1.17.0\n")
    refused = "http://127.0.0.1:9/simple"  # nothing listens on port 9 (discard): refused at once, no network
    for argv, said in ((["--lock", str(tmp_path / "absent.txt")], "cannot read the lock"),
                       (["--lock", str(tmp_path / "notes.txt")], "not a lock"),
                       (["--lock", str(tmp_path / "lock.txt"), "--index", refused], "gave no JSON file list")):
        assert image_size.kit.run_cli(image_size.main, argv) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err
