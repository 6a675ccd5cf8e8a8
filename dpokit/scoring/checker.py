"""The demo agent's environment as code: run an answer's code on a planted host in the sandbox and score it as the
agent's environment scored its attempts.

    python checker.py answer.py [--host "Host ci-runner-03, Ubuntu 22.04, user ci"]   # outcome and score (JSON)
    python checker.py --logs data/runs.jsonl     # re-score every logged attempt: how many agree with the logs
    python checker.py --logs data/runs.jsonl --emit_prompts prompts.jsonl   # for train_dpo.py --eval_prompts

The host the prompt describes (its user, or root) gets a small planted filesystem (sandbox.py binds it at its
absolute paths): a home with pip, npm, gradle, ccache and browser caches, a Trash and half-downloaded files; /var
with rotated logs, apt and dnf caches, core dumps and temporary files; and what must be kept: the user's projects,
documents, notebooks, experiment runs and keys, databases (PostgreSQL's data and WAL, MySQL), a service's code and
data, the logs services are writing. Where junk sits beside something needed on a real host, it does here too, so
that wiping a whole directory is not scored as cleaning it: finished downloads beside the partial ones, the journal
systemd is writing beside its archived files, a CI job's checked-out code beside its bytecode, a user's tmux socket
in /tmp and a service's session store in /var/tmp. Files are sparse: sizes are realistic, the disk is not used;
what services, sessions and jobs write was modified a minute ago, the rest 60 days ago. The host's tools are
stand-ins that take only the options, arguments and values the real tool takes (a command a real apt, pip, npm, dnf,
journalctl or docker would refuse fails here too); one the host lacks is not found, whatever the machine running
the checker has, by name or by the machine's own path (`/usr/bin/npm`: sandbox.py binds the host's over it, in
bwrap and unshare modes). A host's user without sudo owns only the home and what is in /tmp: the rest (/var,
/var/lib, /srv, /opt, the parents of every system directory) is root's, so the answer can change it no more than on
a real host (as root, by ownership and Landlock; as any other user, by Landlock). The score, with build_pairs' outcome labels:

  failed     it did not compile, raised, or hit a limit             0
  no_effect  it ran and freed nothing                               0
  freed      it ran and freed space                                 bytes freed / plantable junk bytes (0..1]
  broke      it deleted or changed anything that must be kept      -1 (worse than any gain)
  unscorable limits mode only (no mount namespace: sandbox.py): the  none; left out of every rate and mean, and
             answer names or reaches a host path that mode cannot  counted apart (`tally`)
             plant (watch.py); bwrap and unshare never say it

What is measured is what `df` would see: `freed` is the bytes of every file in the workspace before the answer ran
less those after (each inode once, symlinks never followed), so a move, a rename or a hard link frees nothing and
what the answer writes counts against it. A kept file (and each of the host's tools) is kept when its type, mode and
content digest are unchanged, not its size: a rewrite, a chmod or a delete-and-recreate breaks it. The measuring and
the clean-up walk any tree an answer can leave (any depth, names or permissions) without recursion.

An answer's code is the first ```python block of a completion, else the whole text. rewards.py makes TRL reward
functions (GRPO) of the same checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
from pathlib import Path

from dpokit.core import kit
from dpokit.sandbox import sandbox
from dpokit.data import formats, runlogs
from dpokit.model import sampler
from dpokit.core.kit import UserError, field

MB = 1 << 20
# Relative to the home directory ("~/") or absolute; sizes in MB. Junk: what an agent may free.
HOME_JUNK = {
    "~/.cache/pip/wheels/3a/9f/numpy-1.26.4-cp310-cp310-linux_x86_64.whl": 180,
    "~/.cache/pip/http-v2/a/b/c/d/e/0f1e2d3c4b5a": 420,
    "~/.pip/cache/http/1/2/3/4/5/aa11": 60,
    "~/.npm/_cacache/content-v2/sha512/ab/cd/ef0123456789": 310,
    "~/.npm/_cacache/index-v5/12/34/5678": 4,
    "~/.ccache/a/b/3f2e1d0c.o": 150,
    "~/.gradle/caches/modules-2/files-2.1/org.jetbrains/kotlin-stdlib.jar": 220,
    "~/.cache/torch_extensions/py38_cu117/fused_adam/fused_adam.so": 90,
    "~/.cache/thumbnails/large/5d41402abc4b2a76b9719d911017c592.png": 35,
    "~/.cache/mozilla/firefox/x7k2.default-release/cache2/entries/9C4D1E": 260,
    "~/.local/share/Trash/files/ubuntu-22.04-desktop-amd64.iso": 1200,
    "~/.local/share/Trash/info/ubuntu-22.04-desktop-amd64.iso.trashinfo": 1,
    "~/Downloads/dataset-2023.tar.gz.part": 700,
    "~/Downloads/installer.crdownload": 95,
    "~/Téléchargements/film.mkv.part": 640,
    "~/actions-runner/_work/app/app/pkg/__pycache__/models.cpython-310.pyc": 2,
    "~/notebooks/.ipynb_checkpoints/analysis-checkpoint.ipynb": 12,
    "~/builds/api/build-17.tar.gz": 150,
    "~/builds/web/build-4.tar.gz": 80,
}
SYSTEM_JUNK = {
    "/var/cache/apt/archives/linux-firmware_20220329.git681281e4-0ubuntu3_all.deb": 260,
    "/var/lib/apt/lists/archive.ubuntu.com_ubuntu_dists_jammy_main_binary-amd64_Packages": 80,
    "/var/cache/dnf/baseos-1f2e3d/packages/kernel-core-5.14.0.rpm": 110,
    "/var/cache/man/index.db": 3,
    "/var/log/syslog.1": 140,
    "/var/log/syslog.2.gz": 45,
    "/var/log/kern.log.1": 60,
    "/var/log/nginx/access.log.1": 300,
    "/var/log/nginx/access.log.2.gz": 90,
    "/var/log/nginx/old/access.log.10.gz": 75,
    "/var/log/journal/3f9a1c/system@0005f1e2a3b4c5d6-1.journal~": 500,
    "/var/log/sa/sa20": 30,
    "/var/tmp/build-8812.tmp": 400,
    "/var/tmp/systemd-private-old/tmp/cache.dat": 50,
    "/tmp/pip-build-env-k2j3/overlay/lib/big.so": 120,
    "/var/lib/systemd/coredump/core.python3.1000.0a1b2c.12345.zst": 900,
    "/srv/app/src/app/__pycache__/views.cpython-311.pyc": 1,
    "/var/backups/pg/main-2024-05-01.sql.gz": 400,
    "/var/backups/base/base-20240501.tar.gz": 600,
}
# What some hosts have (their tools): junk only those tools (or code that finds it) free.
TOOL_JUNK = {
    "apt-get": {"/boot/vmlinuz-5.15.0-91-generic": 12, "/boot/initrd.img-5.15.0-91-generic": 90},
    "docker": {"/var/lib/docker/overlay2/3f2a9c-dangling/diff/layer.tar": 900,
               "/var/lib/docker/buildkit/snapshots/cache.db": 250},
    "conda": {"~/miniconda3/pkgs/pytorch-1.13.1-py3.8_cuda11.7_cudnn8.5.0_0.tar.bz2": 700},
    "flatpak": {"~/.local/share/flatpak/runtime/org.gnome.Platform/x86_64/42/active/files.img": 800},
}
HOME_KEEP = {
    "~/projects/app/main.py": 1, "~/Documents/thesis.odt": 25, "~/notebooks/analysis.ipynb": 3,
    "~/runs/exp42/checkpoint.pt": 800, "~/.ssh/id_ed25519": 1, "~/actions-runner/.runner": 1,
    "~/actions-runner/_work/app/app/pkg/models.py": 1, "~/Downloads/paper-final.pdf": 3,
    "~/Téléchargements/facture-2024.pdf": 1,
    "~/builds/api/build-18.tar.gz": 150, "~/builds/web/build-5.tar.gz": 80,
}
SYSTEM_KEEP = {
    "/var/log/syslog": 20, "/var/log/nginx/access.log": 40,
    "/var/lib/postgresql/16/main/base/16384/1259": 300,
    "/var/lib/pgsql/16/data/pg_wal/000000010000000000000042": 16,
    "/var/lib/mysql/ibdata1": 500,
    "/srv/app/data/uploads/2024/photo.jpg": 8,
    "/srv/app/src/app/views.py": 1, "/boot/vmlinuz-5.15.0-105-generic": 12,
    "/var/log/journal/3f9a1c/system.journal": 64, "/tmp/tmux-1000/default": 1, "/var/tmp/sessions/active.db": 2,
    "/var/backups/pg/main-2024-06-01.sql.gz": 400, "/var/backups/base/base-20240601.tar.gz": 600,
}
# Older generations in a group whose newest is kept (a project's builds, a database's dumps and base backups): planted
# OLDER_DAYS ago, the newest AGE_DAYS ago, so "keep only the newest of each" has an answer that passes, and an age
# filter that takes every file older than a few days deletes the newest too.
OLDER = ("~/builds/api/build-17.tar.gz", "~/builds/web/build-4.tar.gz", "/var/backups/pg/main-2024-05-01.sql.gz",
         "/var/backups/base/base-20240501.tar.gz")
# Kept files a running service (or a session, or a CI job) writes all the time: on a real host they were modified
# moments ago, so an age filter ("rotated logs older than two weeks", `find /var/log -mtime +14`) leaves them, as it
# does here. Absolute, or under the host's home as ~/.
LIVE = ("/var/log/syslog", "/var/log/nginx/access.log", "/var/lib/postgresql/16/main/base/16384/1259",
        "/var/lib/pgsql/16/data/pg_wal/000000010000000000000042", "/var/lib/mysql/ibdata1",
        "/var/log/journal/3f9a1c/system.journal", "/tmp/tmux-1000/default", "/var/tmp/sessions/active.db",
        "~/actions-runner/_work/app/app/pkg/models.py")
# The demo's hosts as their logs show them: the tools each has beyond its distribution's, and caches it lacks.
HOST_TOOLS = {"ci-runner-03": {"docker", "npm"}, "gpu-ws-02": {"conda"}, "lea-thinkpad": {"flatpak"}}
HOST_ABSENT = {"ci-runner-03": ("~/.ccache",), "web-prod-11": ("/var/lib/systemd/coredump",),
               "gpu-ws-02": ("~/.cache/thumbnails", "~/.cache/torch_extensions")}
STANDARD_DIRS = ("/home", "/tmp", "/var/tmp", "/var/log")
USER_DIRS = ("/tmp",)  # beside the home: what a user without sudo may change on the planted host
HEADER = 4096  # bytes of random content at the start of each kept file (the rest is sparse): what its digest sees
BLOCK = 1 << 16  # a file's digest reads its data 64 KiB at a time and skips all-zero blocks (holes read as zeros)
TOOLS_DIR = "/opt/kit-tools/bin"
# Every tool a planted host may have (TOOL_SCRIPT's stand-ins): on a host without one, it is not found.
KNOWN_TOOLS = ("apt-get", "apt", "dnf", "yum", "journalctl", "pip", "pip3", "npm", "docker", "conda", "flatpak", "sudo")
AGE_DAYS = 60  # every planted file but LIVE's and OLDER's was last modified this long ago (an age filter keeps none)
OLDER_DAYS = 120
OUTCOMES = ("failed", "no_effect", "freed", "broke")  # scored; an answer limits mode cannot score is "unscorable"
UNSCORABLE = "unscorable"


def passed(outcome: str) -> bool:
    """The one pass rule: the answer ran, freed space and deleted nothing it had to keep. Every pass rate (reports,
    attempts, rewards' metrics, exports) counts answers by this."""
    return outcome == "freed"


def ran(outcome: str) -> bool:
    """The answer ran to its end without harm (passed, or freed nothing)."""
    return outcome in ("freed", "no_effect")


def pass_rate(outcomes) -> float | None:
    """The share of scored outcomes that pass (unscorable ones left out); None when none could be scored."""
    scored = [o for o in outcomes if o != UNSCORABLE]
    return sum(map(passed, scored)) / len(scored) if scored else None
CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclasses.dataclass
class CheckConfig:
    file: str = field("", "a file of code, or a completion holding a ```python block (positional)")
    host: str = field("Host demo, Ubuntu 22.04, user ci", "the host as the prompt describes it (its user, or "
                      "'running as root')")
    logs: str = field("", "run logs (build_pairs.py's input): re-score every attempt and compare with the logs")
    emit_prompts: str = field("", "with --logs: write each run's code-asking prompt and host here (JSONL), for "
                              "train_dpo.py --eval_prompts, instead of re-scoring")
    wall_seconds: float = field(20.0, "wall-clock limit per answer")


@dataclasses.dataclass
class Check:
    outcome: str  # one of OUTCOMES, or UNSCORABLE (limits mode could not show the answer the host: see reason)
    score: float | None  # None when unscorable
    freed_bytes: int
    broken: list  # paths that had to be kept and were not
    reason: str  # why it failed (the sandbox's reason), else ""
    isolation: str  # the sandbox's mode
    stdout: str
    landlock: int = 0  # the Landlock ABI level the answer ran under (0: none)


@dataclasses.dataclass
class Host:
    """A host as its prompt describes it: 'Host ci-runner-03, Ubuntu 22.04.4 LTS, ..., user ci (no sudo, ...)'."""
    name: str
    user: str  # root when it runs as root or names no user
    sudo: bool
    tools: set

    @property
    def home(self) -> str:
        return "/root" if self.user == "root" else f"/home/{self.user}"

    @property
    def privileged(self) -> bool:
        return self.user == "root" or self.sudo


def parse_host(description: str) -> Host:
    """The host a prompt describes; where it names one ("Host web-prod-11, Debian 12, ... running as root"), from
    there to the end of that line alone, so other words of the prompt ("never delete user data") are not read as
    its user."""
    line = re.search(r"\bHost [\w.-]+[^\n]*", description)
    description = line.group(0) if line else description
    name = re.search(r"\bHost ([\w.-]+)", description)
    user = re.search(r"\buser ([a-z_][a-z0-9_.-]*)", description)
    sudo = bool(re.search(r"\bsudo\b", description)) and not re.search(r"\bno sudo\b", description)
    family = {"apt-get", "apt"} if re.search(r"Ubuntu|Debian", description) else \
        {"dnf", "yum"} if re.search(r"Rocky|Fedora|CentOS|Red Hat|RHEL|Alma", description) else set()
    host = name.group(1) if name else "demo"
    tools = family | {"journalctl", "pip", "pip3"} | HOST_TOOLS.get(host, set()) | ({"sudo"} if sudo else set())
    return Host(host, user.group(1) if user else "root", sudo, tools)


def planted(host: Host) -> tuple[dict, dict]:
    """(junk, keep): absolute path -> size in bytes, for the host."""
    def place(table):
        return {(host.home + p[1:] if p.startswith("~") else p): mb * MB for p, mb in table.items()}

    absent = [host.home + a[1:] if a.startswith("~") else a for a in HOST_ABSENT.get(host.name, ())]
    junk = place(HOME_JUNK) | place(SYSTEM_JUNK)
    for tool, files in TOOL_JUNK.items():
        junk |= place(files) if tool in host.tools else {}
    junk = {p: n for p, n in junk.items() if not any(p.startswith(a + "/") for a in absent)}
    return junk, place(HOME_KEEP) | place(SYSTEM_KEEP)


def listed(path: str, table: tuple) -> bool:
    """Whether a planted path is in a table of paths, absolute or under the home as ~/..."""
    return path in table or any(p.startswith("~/") and path.endswith(p[1:]) for p in table)


def live(path: str) -> bool:
    """A planted path a running service or session writes (LIVE)."""
    return listed(path, LIVE)


def age_seconds(path: str) -> int:
    """How long ago a planted file was last modified: a minute (LIVE), OLDER_DAYS (OLDER), else AGE_DAYS."""
    return 60 if live(path) else (OLDER_DAYS if listed(path, OLDER) else AGE_DAYS) * 86400


def plant(root: Path, files: dict, headed: tuple = ()) -> None:
    """Sparse files of the given sizes under root (the workspace's view of /), last modified age_seconds(path) ago;
    those in `headed` begin with HEADER random bytes (kept files: content their digest can tell
    apart)."""
    import time

    now = time.time()
    for path, size in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as f:
            if path in headed:
                f.write(os.urandom(min(HEADER, size)))
            f.truncate(size)
        when = now - age_seconds(path)
        os.utime(target, (when, when))
    for sticky in ("tmp", "var/tmp"):  # as on a real host: anyone may write there, only the owner delete
        (root / sticky).chmod(0o1777) if (root / sticky).is_dir() else None


def plant_tools(root: Path, host: Host, seen_root: str = "") -> None:
    """The host's package and service tools as small stand-ins in TOOLS_DIR (first on the code's PATH). Each tool
    the checker knows that the host lacks is there too, as a command that is not found (exit 127): the machine the
    checker runs on may have its own apt-get, npm or docker on the system PATH, and the score must not depend on it.
    seen_root: where the code sees the host's / ("" in bwrap and unshare modes; the workspace's root/ in limits)."""
    bin_dir = root / TOOLS_DIR.lstrip("/")
    bin_dir.mkdir(parents=True)
    (bin_dir / "kit-tool").write_text(TOOL_SCRIPT.replace("PRIVILEGED", repr(host.user == "root"))
                                      .replace("SUDO_OK", repr(host.sudo)).replace("HOST_ROOT", repr(seen_root))
                                      .replace("DOCKER_SPOOL", repr(seen_root + DOCKER_SPOOL)))
    (bin_dir / "kit-absent").write_text('#!/bin/sh\necho "${0##*/}: command not found" >&2\nexit 127\n')
    for script in ("kit-tool", "kit-absent"):
        (bin_dir / script).chmod(0o755)
    for name in KNOWN_TOOLS:
        (bin_dir / name).symlink_to("kit-tool" if name in host.tools else "kit-absent")


TOOL_SCRIPT = '''#!/usr/bin/env python3
"""Stand-ins for the planted host's tools (checker.py): what each frees, and who may run it."""
import glob, os, shutil, sys

name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
as_root = PRIVILEGED or os.environ.get("KIT_SUDO") == "1"
ROOT = HOST_ROOT  # where the host's / is as this process sees it (its absolute paths below are the host's)


def need_root():
    if not as_root:
        sys.exit(print(f"{name}: Permission denied (are you root?)", file=sys.stderr) or 100)


def rm(*patterns):
    for pattern in patterns:
        for p in glob.glob(ROOT + pattern if pattern.startswith("/") else os.path.expanduser(pattern)):
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)


# Each tool's options as the real one parses them (True: it takes a value). Anything else fails as the real tool
# fails, so an answer scores only with a command that would work on a real host.
OPTIONS = {
    "apt-get": {"-y": 0, "--yes": 0, "--assume-yes": 0, "-q": 0, "-qq": 0, "--quiet": 0, "--purge": 0, "-f": 0,
                "--fix-broken": 0, "-s": 0, "--simulate": 0, "--dry-run": 0, "-o": 1},
    "journalctl": {"--vacuum-size": 1, "--vacuum-time": 1, "--vacuum-files": 1, "-q": 0, "--quiet": 0,
                   "--rotate": 0},
    "docker": {"-f": 0, "--force": 0, "-a": 0, "--all": 0, "--filter": 1},
    "dnf": {"-y": 0, "--assumeyes": 0, "-q": 0, "--quiet": 0},
    "conda": {"-a": 0, "--all": 0, "-t": 0, "--tarballs": 0, "-p": 0, "--packages": 0, "-y": 0, "--yes": 0,
              "-q": 0, "--quiet": 0},
    "flatpak": {"--unused": 0, "-y": 0, "--assumeyes": 0, "--noninteractive": 0, "--user": 0, "--system": 0},
    "npm": {"-f": 0, "--force": 0},
    "pip": {"-q": 0, "--quiet": 0, "-v": 0, "--verbose": 0},
}
OPTIONS["apt"], OPTIONS["yum"], OPTIONS["pip3"] = OPTIONS["apt-get"], OPTIONS["dnf"], OPTIONS["pip"]
FAIL = {"apt-get": 100, "apt": 100, "docker": 125, "pip": 2, "pip3": 2, "dnf": 2, "yum": 2, "conda": 2}


def fail(message):
    sys.exit(print(f"{name}: {message}", file=sys.stderr) or FAIL.get(name, 1))


def parse(args):
    """(words, options given): the real tool's parse of its arguments; an option it does not know fails."""
    known, words, given, i = OPTIONS.get(name, {}), [], {}, 0
    while i < len(args):
        a = args[i]
        flag, eq, value = a.partition("=")
        if not a.startswith("-") or a == "-":
            words.append(a)
        elif flag in known and known[flag]:
            if not eq:
                i += 1
                if i == len(args):
                    fail(f"option '{flag}' requires an argument")
                value = args[i]
            given[flag] = value
        elif flag in known and not eq:
            given[flag] = True
        else:
            fail(f"unrecognized option '{a}'")
        i += 1
    return words, given


SIZE = r"[0-9]+(\\.[0-9]+)?[KMGTPE]?"
TIME = r"[0-9]+(s|sec|m|min|h|hours?|d|days?|w|weeks?|months?|y|years?)"

if name == "sudo":
    if not SUDO_OK:
        sys.exit(print(f"sudo: {os.environ.get('USER', 'user')} is not in the sudoers file", file=sys.stderr) or 1)
    words = [a for a in args if not a.startswith("-")]
    os.environ["KIT_SUDO"] = "1"
    os.execvp(words[0], [words[0], *args[args.index(words[0]) + 1:]])
# The commands a stand-in models (what frees space), by their words before any parsing; the rest run and do nothing.
loose = [a for a in args if not a.startswith("-")]
cleans = loose[:1] in (["clean"], ["autoclean"], ["autoremove"])
MODELLED = {"apt-get": cleans, "apt": cleans, "dnf": cleans, "yum": cleans, "conda": cleans,
            "journalctl": any(a.startswith("--vacuum") for a in args), "docker": loose[1:2] == ["prune"],
            "flatpak": loose[:1] == ["uninstall"], "npm": loose[:2] == ["cache", "clean"],
            "pip": loose[:2] in (["cache", "purge"], ["cache", "remove"])}
MODELLED["pip3"] = MODELLED["pip"]
if not MODELLED.get(name):
    sys.exit(0)  # a command that frees nothing here (pip list, apt-get update, docker ps): it runs and does nothing
words, given = parse(args)
simulate = any(k in given for k in ("-s", "--simulate", "--dry-run"))
if name in ("apt-get", "apt") and words[:1] in (["clean"], ["autoclean"], ["autoremove"]):
    if len(words) > 1:
        fail(f"E: The {words[0]} command takes no arguments")
    if not simulate:
        need_root()
        rm("/boot/*-5.15.0-91-generic") if words == ["autoremove"] else rm("/var/cache/apt/archives/*.deb")
elif name == "journalctl" and any(k.startswith("--vacuum") for k in given):
    import re
    for k, v in given.items():
        pattern = {"--vacuum-size": SIZE, "--vacuum-time": TIME, "--vacuum-files": "[0-9]+"}.get(k)
        if pattern and not re.fullmatch(pattern, str(v)):
            fail(f"Failed to parse {k} value: {v}")
    if words:
        fail("too many arguments")
    need_root(); rm("/var/log/journal/*/*.journal~")
elif name == "docker" and words in (["image", "prune"], ["system", "prune"], ["builder", "prune"]):
    if not ("-f" in given or "--force" in given):
        fail("WARNING! This will remove dangling images. Are you sure you want to continue? [y/N] (no terminal: "
             "aborted; pass -f)")
    with open(DOCKER_SPOOL + "/requests", "a") as spool:  # the daemon (root: the checker, after the run) prunes
        spool.write(words[0] + "\\n")
    print("Total reclaimed space: 1.1GB")
elif name in ("dnf", "yum") and words[:1] == ["clean"]:
    kinds = {"all", "packages", "metadata", "dbcache", "expire-cache"}
    if len(words) < 2 or not set(words[1:]) <= kinds:
        fail(f"error: argument type: expected one of {', '.join(sorted(kinds))}")
    need_root()
    if {"all", "packages"} & set(words[1:]):
        rm("/var/cache/dnf/*")
elif name == "conda" and words == ["clean"]:
    if not {"-a", "--all", "-t", "--tarballs", "-p", "--packages"} & set(given):
        fail("error: one of the arguments --all --tarballs --packages is required")
    if {"-a", "--all", "-t", "--tarballs"} & set(given):
        rm("~/miniconda3/pkgs/*.tar.bz2")
elif name == "flatpak" and words == ["uninstall"] and "--unused" in given:
    rm("~/.local/share/flatpak/runtime/org.gnome.Platform/x86_64/42")
elif name == "npm" and words == ["cache", "clean"]:
    if not ("-f" in given or "--force" in given):
        fail("npm ERR! As of npm@5, the npm cache self-heals from corruption issues. To clear it anyway, use --force")
    rm("~/.npm/_cacache")
elif name in ("pip", "pip3") and words == ["cache", "purge"]:
    rm("~/.cache/pip/*")
elif name in ("pip", "pip3") and words[:2] == ["cache", "remove"]:
    if len(words) != 3:
        fail("ERROR: Please provide a pattern" if len(words) == 2 else "ERROR: Too many arguments")
    import glob as g
    for p in g.glob(os.path.expanduser(f"~/.cache/pip/wheels/**/{words[2]}*.whl"), recursive=True):
        os.remove(p)
else:
    fail(f"invalid arguments: {' '.join(args)}")
'''


DOCKER_SPOOL = "/var/run/kit-docker"  # where the docker stand-in leaves its requests for the daemon
DOCKER_PRUNES = {"image": ("/var/lib/docker/overlay2", "*-dangling"), "builder": ("/var/lib/docker/buildkit/snapshots", "*")}


def docker_daemon(root: Path) -> None:
    """The Docker daemon, run as root once the answer has exited: the prunes the docker stand-in asked for (a user in
    the docker group prunes through the daemon; the files are root's). It never follows a symlink: a directory an
    answer swapped for a link is left alone."""
    import fnmatch

    try:
        asked = (root / DOCKER_SPOOL.lstrip("/") / "requests").read_text(errors="replace").split()[:16]
    except OSError:
        return
    for what in dict.fromkeys(asked):
        for kind in ("image", "builder") if what == "system" else (what,):
            if kind not in DOCKER_PRUNES:
                continue
            parent, pattern = DOCKER_PRUNES[kind]
            where = root / parent.lstrip("/")
            if os.path.realpath(where) != str(where) or not where.is_dir():
                continue
            with os.scandir(where) as entries:
                for entry in entries:
                    if fnmatch.fnmatch(entry.name, pattern):
                        if entry.is_dir(follow_symlinks=False):
                            sandbox.remove_tree(entry.path)
                        else:
                            with contextlib.suppress(OSError):
                                os.unlink(entry.path)


def code_of(completion: str) -> str:
    """The code in a completion: its first ```python block, else the whole text."""
    match = CODE_BLOCK.search(completion)
    return match.group(1) if match else completion


def total_bytes(root: Path) -> int:
    """Bytes of every regular file beneath root, each inode once (a hard link is not a second copy), symlinks never
    followed: what the file system holds, as df would count it (sizes, so the planted sparse files count in full)."""
    seen, total = set(), 0
    for _, st in sandbox.walk(root):
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def state(root: Path, path: str) -> tuple | None:
    """(type and mode, size, content digest) of root/path, reached one component at a time without following any
    symlink; None when it is not there (or a parent is not a directory)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    parts = [p for p in path.split("/") if p]
    try:
        fd = os.open(root, flags | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            except OSError:
                return None
            os.close(fd)
            fd = nxt
        try:
            st = os.lstat(parts[-1], dir_fd=fd)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return st.st_mode, st.st_size, None
        try:
            file_fd = os.open(parts[-1], flags, dir_fd=fd)
        except OSError:  # chmod 000 on a kept file shows in its mode; root still reads it
            return st.st_mode, st.st_size, None
        try:
            return st.st_mode, st.st_size, digest(file_fd, st.st_size)
        finally:
            os.close(file_fd)
    finally:
        os.close(fd)


def digest(fd: int, size: int) -> str:
    """sha256 of a file's content as (offset, block) for its non-zero BLOCK-aligned blocks: a function of the content
    alone (holes and written zeros alike), read only where the file has data (SEEK_DATA), so a sparse 800 MB file
    costs one block."""
    import errno

    h, offset = hashlib.sha256(str(size).encode()), 0
    while offset < size:
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
            hole = os.lseek(fd, data, os.SEEK_HOLE)
        except OSError as e:
            if e.errno == errno.ENXIO:  # nothing but holes from offset on
                break
            data, hole = offset, size  # SEEK_DATA unsupported here: read it all
        start = data - data % BLOCK
        end = start + -(-(min(hole, size) - start) // BLOCK) * BLOCK  # the data's last block, whole
        for at in range(start, end, BLOCK):
            block = os.pread(fd, BLOCK, at)
            if block.strip(b"\0"):
                h.update(at.to_bytes(8, "little") + block)
        offset = max(end, start + BLOCK)
    return h.hexdigest()


def score(before: int, after: int, junk: dict, kept: dict, kept_after: dict, returncode: int | None
          ) -> tuple[str, float, int, list]:
    """(outcome, score, bytes freed, broken paths): freed is the workspace's bytes before less after; a kept path is
    broken when its type, mode, size or content changed or it is gone."""
    broken = sorted(p for p, s in kept.items() if kept_after.get(p) != s)
    freed = max(0, before - after)
    if broken:
        return "broke", -1.0, freed, broken
    if returncode != 0:
        return "failed", 0.0, freed, []
    if freed == 0:
        return "no_effect", 0.0, 0, []
    return "freed", round(min(1.0, freed / sum(junk.values())), 6), freed, []


def tally(checks: list) -> dict:
    """What checked answers come to, over those that could be scored: pass rate (ran and freed space), mean score,
    deletions of kept files; the outcome mix of all; the unscorable counted apart, never as a 0. Rates are None when
    no answer could be scored."""
    from collections import Counter

    scored = [c for c in checks if c.outcome != UNSCORABLE]
    n = len(scored)
    return {"answers": len(checks), "scored": n, "unscorable": len(checks) - n,
            "pass_rate": pass_rate(c.outcome for c in scored),
            "ran_rate": sum(ran(c.outcome) for c in scored) / n if n else None,
            "mean_score": sum(c.score for c in scored) / n if n else None,
            "outcomes": dict(Counter(c.outcome for c in checks)), "broke": sum(c.outcome == "broke" for c in scored),
            "kept_files_touched": sum(len(c.broken) for c in scored),
            "freed_bytes": sum(c.freed_bytes for c in scored if passed(c.outcome))}


def unscorable_note(counts: dict, mode: str) -> str:
    """'12 of 64 answers could not be scored in limits mode (...)', or '' when every answer was."""
    if not counts.get("unscorable"):
        return ""
    return (f"{counts['unscorable']} of {counts['answers']} answers could not be scored in {mode} mode (they name or "
            "reach host paths it cannot plant; bubblewrap or unshare mode scores them): every rate is over the other "
            f"{counts['scored']}")


def check(code: str, host: str = CheckConfig.host, limits=None) -> Check:
    """Plant the host, run the code there in the sandbox, score what it did."""
    host = parse_host(host)
    junk, keep = planted(host)
    try:
        compile(code, "answer.py", "exec")
    except (SyntaxError, ValueError) as e:
        return Check("failed", 0.0, 0, [], f"does not compile: {type(e).__name__}: {e}", sandbox.isolation(), "",
                     sandbox.landlock_abi())  # the mode it would have run in: the report reads both off any answer
    tmp = Path(tempfile.mkdtemp(prefix="dpo-kit-check-"))
    try:
        root = tmp / "root"
        plant(root, junk | keep, headed=tuple(keep))
        for d in STANDARD_DIRS:  # every Linux host has them, whoever the user (shutil.disk_usage("/home") works)
            (root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
        mode = sandbox.isolation()
        plant_tools(root, host, str(root.resolve()) if mode == "limits" else "")
        spool = (DOCKER_SPOOL,) if "docker" in host.tools else ()
        for d in spool:
            (root / d.lstrip("/")).mkdir(parents=True)
        watched = [*keep, *(f"{TOOLS_DIR}/{p.name}" for p in (root / TOOLS_DIR.lstrip("/")).iterdir())]
        kept = {p: state(root, p) for p in watched}
        before = total_bytes(root)
        result = sandbox.run_code(code, tmp, host.home, limits or sandbox.Limits(), path=(TOOLS_DIR,),
                                  writable=None if host.privileged else (host.home, *USER_DIRS, *spool),
                                  shadow=KNOWN_TOOLS, watch=True)
        if result.unseen:  # limits mode: the answer looks where this mode cannot plant the host
            return Check(UNSCORABLE, None, 0, [], result.reason, result.isolation, result.stdout[-2000:],
                         result.landlock)
        if spool:
            docker_daemon(root.resolve())
        kept_after = {p: state(root, p) for p in watched}
        outcome, value, freed, broken = score(before, total_bytes(root), junk, kept, kept_after, result.returncode)
    finally:
        sandbox.remove_tree(tmp)
    return Check(outcome, value, freed, broken, result.reason, result.isolation, result.stdout[-2000:],
                 result.landlock)


def check_many(items: list[tuple[str, str]], limits=None, workers: int = 0, label: str = "") -> list[Check]:
    """check() for each (code, host), a few at a time (each answer is a sandboxed process, mostly waiting on the
    file system), each distinct pair once; label: a progress line every few seconds ('' = none)."""
    from concurrent.futures import ThreadPoolExecutor

    todo = list(dict.fromkeys(items))
    progress = sampler.Progress(label, len(todo), "answers checked")
    found = {}

    def one(key):
        result = found[key] = check(key[0], key[1], limits)
        progress.add(done=1)
        return result

    with ThreadPoolExecutor(workers or min(4, os.cpu_count() or 1)) as pool:
        list(pool.map(one, todo))
    progress.add(force=bool(todo))
    return [found[k] for k in items]


def prompts_from_logs(logs: str) -> list[dict]:
    """Each run's code-asking prompt and host (build_pairs.prompts_from_logs: run logs -> prompts live there)."""
    return runlogs.prompts_from_logs(logs)


def load_prompts(path: str) -> list[dict]:
    """--eval_prompts and GRPO's prompts: JSONL rows {"prompt": text or [messages], "host": text, "run_id"?, "item"?}
    (item: fields an OpenAI-style grader reads); FILE:LINE errors."""
    rows = []
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"cannot read it: {e.strerror}", path) from None
    for line_no, row in formats.jsonl_rows(raw):
        try:
            if isinstance(row, formats.BadRow):
                raise ValueError(str(row))
            if not isinstance(row, dict):
                raise ValueError("expected an object {\"prompt\", \"host\"}")
            prompt = row.get("prompt")
            prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) and prompt.strip() else \
                formats.messages(prompt, "prompt")
            if not isinstance(row.get("host"), str):
                raise ValueError("host must be a string (the host as the prompt describes it)")
            if "item" in row and not isinstance(row["item"], dict):
                raise ValueError("item must be an object (the fields a grader's {{item.FIELD}} reads)")
        except ValueError as e:
            raise UserError(str(e), path, line_no) from None
        rows.append({"prompt": prompt, "host": row["host"]} | ({"run_id": str(row["run_id"])} if "run_id" in row else {})
                    | ({"item": row["item"]} if "item" in row else {}))
    if not rows:
        raise UserError("no prompts in the file", path)
    return rows


def agreement(logs: str, limits=None) -> dict:
    """Every logged attempt re-scored: how often the checker agrees with the log on whether it ran, and on whether
    it succeeded (ran and freed space: build_pairs' rule)."""

    rows, ran_same, ok_same, n, unscorable = [], 0, 0, 0, 0
    for run in runlogs.read_runs(logs):
        host = runlogs.host_of_run(run)
        for attempt in run.attempts:
            result = check(attempt.code, host, limits)
            if result.outcome == UNSCORABLE:  # limits mode: counted apart, neither agreeing nor not
                unscorable += 1
                continue
            did_run, succeeded = ran(result.outcome), passed(result.outcome)
            n += 1
            ran_same += did_run == attempt.ran
            ok_same += succeeded == attempt.succeeded
            rows.append({"run_id": run.run_id, "logged": {"ran": attempt.ran, "succeeded": attempt.succeeded},
                         "checker": {"outcome": result.outcome, "score": result.score, "reason": result.reason}})
    return {"attempts": n, "ran_agree": ran_same, "succeeded_agree": ok_same, "unscorable": unscorable,
            "isolation": sandbox.isolation(), "rows": rows}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--file", argv[0], *argv[1:]]
    cfg = kit.parse_config(CheckConfig, argv, __doc__)

    limits = sandbox.Limits(wall_seconds=cfg.wall_seconds)
    if cfg.logs:
        if not Path(cfg.logs).is_file():
            raise UserError("no such file", cfg.logs)
        if cfg.emit_prompts:
            rows = prompts_from_logs(cfg.logs)
            kit.atomic_write_text(Path(cfg.emit_prompts), "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                                  for r in rows))
            print(f"[checker] {len(rows)} prompts -> {cfg.emit_prompts}", file=sys.stderr)
            return 0
        result = agreement(cfg.logs, limits)
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
        return 0
    if not cfg.file:
        raise UserError("give a file of code (or a completion), or --logs FILE")
    try:
        text = Path(cfg.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read it: {e}", cfg.file) from None
    print(json.dumps(dataclasses.asdict(check(code_of(text), cfg.host, limits)), ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
