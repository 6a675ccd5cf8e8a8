#!/usr/bin/env python3
"""Check that every pin in a lock has a wheel for the image's CPython 3.10 x86_64 manylinux, downloading none.

    python3 .ci/check-lock.py [requirements.txt ...] [--index-url URL]      # or: make lock-check

The image runs Python 3.10 and nothing else here does, so this stands in for the download that would prove it:

    pip download --isolated --no-deps --only-binary=:all: --python-version 3.10 --implementation cp \\
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 ... --platform manylinux1_x86_64 \\
      -d /tmp/x -r requirements.txt

(pip takes --platform literally: with manylinux_2_28_x86_64 alone it rejects the many wheels tagged
manylinux_2_17/manylinux2014, which the image installs happily; the lock is compiled for glibc 2.28 and below.)
That downloads gigabytes of torch and CUDA wheels; this reads only the index's page for each project (PEP 691
JSON, or PEP 503 HTML), and for each `name==version` pin looks for a file that pip would take: a wheel whose tags
(packaging.tags for cp310 on manylinux_2_28..2_5 x86_64) match and whose Requires-Python (as the index states
it, from the wheel's metadata) admits 3.10. The index is PyPI unless --index-url says otherwise, never pip's
own configuration: the local extra indexes and find-links of this machine are not what the image build sees.

Prints `FILE:LINE: what is wrong` for each pin without such a wheel and exits 1; exits 2 when the index cannot
be read. A yanked pin is a warning only: pip still installs a yanked file pinned with == (PEP 592).
Needs the standard library and `packaging`.
"""

import argparse
import functools
import html.parser
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging import tags
from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import (InvalidSdistFilename, InvalidWheelFilename, canonicalize_name,
                             parse_sdist_filename, parse_wheel_filename)
from packaging.version import InvalidVersion, Version

PYTHON = (3, 10)
PYTHON_FULL = Version("3.10.12")  # Ubuntu 22.04's python3; Requires-Python is compared with this
GLIBC = (2, 28)  # the lock is compiled for x86_64-manylinux_2_28 (Makefile: make requirements); vLLM's for 2_31
ARCH = "x86_64"
PYPI = "https://pypi.org/simple/"
TARGET = f"CPython {PYTHON[0]}.{PYTHON[1]} {ARCH} manylinux"


def target_tags(glibc: tuple = GLIBC):
    """The wheel tags pip accepts for cp310 on glibc <= 2.28 (or glibc) x86_64, as --platform given once per
    manylinux tag."""
    platforms = [f"manylinux_{glibc[0]}_{m}_{ARCH}" for m in range(glibc[1], 4, -1)]
    platforms += [f"manylinux2014_{ARCH}", f"manylinux2010_{ARCH}", f"manylinux1_{ARCH}"]  # = 2_17, 2_12, 2_5
    return (set(tags.cpython_tags(PYTHON, abis=[f"cp{PYTHON[0]}{PYTHON[1]}"], platforms=platforms))
            | set(tags.compatible_tags(PYTHON, f"cp{PYTHON[0]}{PYTHON[1]}", platforms)))


def marker_environment():
    env = default_environment()
    env.update(python_version=f"{PYTHON[0]}.{PYTHON[1]}", python_full_version=str(PYTHON_FULL),
               implementation_name="cpython", platform_python_implementation="CPython",
               sys_platform="linux", platform_system="Linux", os_name="posix", platform_machine=ARCH)
    return env


def read_pins(path):
    """(line number, Requirement) for each pin that applies to the target, and (line number, problem)."""
    pins, problems, env = [], [], marker_environment()
    for n, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split(" #", 1)[0].strip().rstrip("\\").strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            problems.append((n, f"{line}: options (indexes, includes, hashes) are not read here"))
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as e:
            problems.append((n, f"not a name==version pin ({e})"))
            continue
        specs = list(req.specifier)
        if req.url or len(specs) != 1 or specs[0].operator not in ("==", "===") or "*" in specs[0].version:
            problems.append((n, f"{line}: not pinned to one version with =="))
        elif req.marker is None or req.marker.evaluate(env):
            pins.append((n, req))
    return pins, problems


class _Anchors(html.parser.HTMLParser):
    """PEP 503 page: one <a href=... data-requires-python=... data-yanked=...> per file."""

    def __init__(self):
        super().__init__()
        self.files = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            a = dict(attrs)
            url = a.get("href", "")
            self.files.append({"filename": urllib.parse.unquote(url.split("#")[0].rsplit("/", 1)[-1]),
                               "requires-python": a.get("data-requires-python"),
                               "yanked": "data-yanked" in a})


def index_files(index_url, project):
    """The files an index lists for a project: dicts with filename, requires-python, yanked."""
    url = urllib.parse.urljoin(index_url.rstrip("/") + "/", canonicalize_name(project) + "/")
    if url.startswith("file:"):  # a local index (pip reads <project>/index.html)
        page = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path), "index.html")
        if not page.is_file():
            return []
        url = page.as_uri()
    request = urllib.request.Request(url, headers={
        "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    for attempt in range(3):
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                body, kind = r.read(), r.headers.get("Content-Type", "")
            break
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return []
            if attempt == 2:
                raise
        except (urllib.error.URLError, TimeoutError):
            if attempt == 2:
                raise
    if "json" in kind:
        return json.loads(body)["files"]
    parser = _Anchors()
    parser.feed(body.decode("utf-8", "replace"))
    return parser.files


@functools.lru_cache(maxsize=None)
def _parse_version(text):
    try:
        return Version(text)
    except InvalidVersion:
        return None


def _version(filename):
    """The version field of a wheel or sdist file name, split as packaging.utils does, or None."""
    if filename.endswith(".whl"):
        return _parse_version(filename.split("-")[1]) if filename.count("-") >= 4 else None
    stem = filename.removesuffix(".tar.gz").removesuffix(".zip")
    return _parse_version(stem.rpartition("-")[2]) if stem != filename else None


def problem(pin, files, accepted):
    """What is wrong with a pin given its project's files on the index: None when a wheel fits, else a sentence."""
    name, version = canonicalize_name(pin.name), Version(next(iter(pin.specifier)).version)
    mine, fitting = [], []
    for f in files:
        fn = f["filename"]
        if _version(fn) != version:  # cheap look at the version field first: torch alone lists thousands of files
            continue
        try:
            if fn.endswith(".whl"):
                n, v, _, wheel_tags = parse_wheel_filename(fn)
            else:
                n, v = parse_sdist_filename(fn)
                wheel_tags = frozenset()
        except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
            continue
        if n == name and v == version:
            mine.append(fn)
            if wheel_tags & accepted:
                fitting.append(f)
    if not mine:
        return f"{pin.name}=={version} is not on the index"
    if not fitting:
        kinds = sorted({fn[:-4].split("-", 2)[2] if fn.endswith(".whl") else "sdist" for fn in mine})
        shown = ", ".join(kinds[:6]) + (", ..." if len(kinds) > 6 else "")
        return f"{pin.name}=={version} has no {TARGET} wheel (files: {shown})"
    admits = [f for f in fitting if PYTHON_FULL in SpecifierSet(f.get("requires-python") or "")]
    if not admits:
        return f"{pin.name}=={version}: its {TARGET} wheel requires Python {fitting[0]['requires-python']}"
    if all(f.get("yanked") for f in admits):
        print(f"warning: {pin.name}=={version} is yanked (pip still installs it, pinned with ==)", file=sys.stderr)
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", default=["requirements.txt"], help="pinned requirements files")
    ap.add_argument("--index-url", default=PYPI, help=f"simple index to read (default {PYPI})")
    ap.add_argument("--glibc", default=".".join(map(str, GLIBC)), help="the newest glibc the wheels may need "
                    "(2.31: requirements-vllm.txt, compiled for it)")
    args = ap.parse_args(argv)

    accepted, failed = target_tags(tuple(int(x) for x in args.glibc.split("."))), False
    for path in args.files:
        pins, problems = read_pins(path)
        try:
            with ThreadPoolExecutor(max_workers=8) as pool:  # ~90 pages (torch: 0.4 MB), mostly network waits
                pages = list(pool.map(lambda p: index_files(args.index_url, p[1].name), pins))
        except (urllib.error.URLError, TimeoutError, ValueError) as e:
            print(f"{path}: cannot read the index {args.index_url}: {e}", file=sys.stderr)
            return 2
        problems += [(n, msg) for (n, pin), files in zip(pins, pages) if (msg := problem(pin, files, accepted))]
        for n, msg in sorted(problems):
            print(f"{path}:{n}: {msg}")
        if problems:
            failed = True
            print(f"{path}: {len(problems)} of {len(pins)} pins without a {TARGET} wheel", file=sys.stderr)
        else:
            print(f"{path}: {len(pins)} pins, each has a {TARGET} wheel")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
