"""What the CUDA image's Python layer weighs, without building it: every pin of requirements.txt resolved to the
wheel pip would install on the image (CPython 3.10, manylinux x86_64), its size read from PyPI's JSON index
(PEP 691/700), summed by group. Compressed sizes, as a registry stores layers; nothing is downloaded.

    python bench/image_size.py [--lock requirements.txt] [--index https://pypi.org/simple]

The groups: nvidia-* (CUDA's libraries as wheels), torch, triton, and the rest. CUDA's `runtime` image tag installs
much the same libraries again as system packages, which is why the image ships on the `base` tag
(docs/container.md).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dpokit.core import kit  # noqa: E402

GLIBC = (2, 35)  # Ubuntu 22.04


@dataclasses.dataclass
class SizeConfig:
    lock: str = kit.field("requirements.txt", "the lock to weigh (name==version lines)")
    index: str = kit.field("https://pypi.org/simple", "a PEP 691 JSON index")


def pins(text: str) -> list[tuple[str, str]]:
    """(name, version) of each `name==version` line, comments and markers aside."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*==\s*([^\s;#]+)", line)
        if m:
            out.append((m[1], m[2]))
    return out


def image_tags() -> list:
    """The wheel tags pip accepts on the image, most specific first."""
    from packaging import tags

    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC[1], 4, -1)] + [
        "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    return list(tags.cpython_tags((3, 10), platforms=platforms)) + list(tags.compatible_tags((3, 10), "cp310",
                                                                                              platforms))


def pick(files: list[dict], version: str, accepted: list) -> dict | None:
    """The file pip would take for this version: the wheel whose best tag ranks first among accepted."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename
    from packaging.version import Version

    rank = {t: i for i, t in enumerate(accepted)}
    best, best_rank = None, len(rank)
    for f in files:
        if not f["filename"].endswith(".whl") or f.get("yanked"):
            continue
        try:
            _, v, _, file_tags = parse_wheel_filename(f["filename"])
        except InvalidWheelFilename:
            continue
        if v != Version(version):
            continue
        r = min((rank[t] for t in file_tags if t in rank), default=None)
        if r is not None and r < best_rank:
            best, best_rank = f, r
    return best


def group(name: str) -> str:
    n = name.lower()
    return "nvidia-* (CUDA libraries)" if n.startswith("nvidia-") else n if n in ("torch", "triton") else "the rest"


def main(argv=None) -> int:
    cfg = kit.parse_config(SizeConfig, argv, __doc__)
    try:
        lock = Path(cfg.lock).read_text()
    except OSError as e:
        raise kit.UserError(f"cannot read the lock: {e.strerror}", cfg.lock) from None
    if not pins(lock):
        raise kit.UserError("no `name==version` lines: not a lock", cfg.lock)
    accepted, totals, missing = image_tags(), {}, []
    for name, version in pins(lock):
        url = f"{cfg.index.rstrip('/')}/{name}/"
        req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                f = pick(json.load(r)["files"], version, accepted)
        except (OSError, ValueError, KeyError) as e:  # unreachable, not found, or not a PEP 691 JSON index
            raise kit.UserError(f"--index: {url} gave no JSON file list ({type(e).__name__}: {e}); "
                                "the index must answer PEP 691's JSON (PyPI's does)") from None
        if f is None or f.get("size") is None:
            missing.append(f"{name}=={version}")
            continue
        g = group(name)
        totals[g] = totals.get(g, 0) + f["size"]
        print(f"{f['size'] / 1e6:9.1f} MB  {f['filename']}", file=sys.stderr)
    print("| group | wheels, compressed |\n| --- | --- |")
    for g, size in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"| {g} | {size / 1e9:.2f} GB |")
    print(f"| all | {sum(totals.values()) / 1e9:.2f} GB |")
    if missing:
        print(f"\nno wheel for CPython 3.10 on manylinux x86_64 (or no size in the index): {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
