"""The demo agent's environment as code: run an answer's code on a planted host in the sandbox and score it as the
agent's environment scored its attempts.

    python checker.py answer.py [--host "Host ci-runner-03, Ubuntu 22.04, user ci"]   # outcome and score (JSON)
    python checker.py --logs data/runs.jsonl     # re-score every logged attempt: how many agree with the logs
    python checker.py --logs data/runs.jsonl --emit_prompts prompts.jsonl   # for train_dpo.py --eval_prompts

The host the prompt describes (its user, or root) gets a small planted filesystem (sandbox.py binds it at its
absolute paths): a home with pip, npm, gradle, ccache and browser caches, a Trash and half-downloaded files;
/var with rotated logs, apt and dnf caches, core dumps and temporary files; and what must be kept: the user's
projects, documents, notebooks, experiment runs and keys, databases (PostgreSQL's data and WAL, MySQL), a
service's code and data, the logs services are writing. Files are sparse: sizes are realistic, the disk is not
used. The score, with build_pairs' outcome labels:

  failed     it did not compile, raised, or hit a limit             0
  no_effect  it ran and freed nothing                               0
  freed      it ran and freed space                                 bytes freed / plantable junk bytes (0..1]
  broke      it deleted or changed anything that must be kept      -1 (worse than any gain)

An answer's code is the first ```python block of a completion, else the whole text. rewards.py makes TRL reward
functions (GRPO) of the same checks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import kit
from kit import UserError, field

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
}
SYSTEM_KEEP = {
    "/var/log/syslog": 20, "/var/log/nginx/access.log": 40,
    "/var/lib/postgresql/16/main/base/16384/1259": 300,
    "/var/lib/pgsql/16/data/pg_wal/000000010000000000000042": 16,
    "/var/lib/mysql/ibdata1": 500,
    "/srv/app/data/uploads/2024/photo.jpg": 8,
    "/srv/app/src/app/views.py": 1, "/boot/vmlinuz-5.15.0-105-generic": 12,
}
# The demo's hosts as their logs show them: the tools each has beyond its distribution's, and caches it lacks.
HOST_TOOLS = {"ci-runner-03": {"docker", "npm"}, "gpu-ws-02": {"conda"}, "lea-thinkpad": {"flatpak"}}
HOST_ABSENT = {"ci-runner-03": ("~/.ccache",), "web-prod-11": ("/var/lib/systemd/coredump",),
               "gpu-ws-02": ("~/.cache/thumbnails", "~/.cache/torch_extensions")}
# Only root (or sudo) changes these; the run's user owns the rest of the planted host.
SYSTEM_DIRS = ("/var/cache", "/var/log", "/var/lib/apt", "/var/lib/systemd", "/var/lib/postgresql", "/var/lib/pgsql",
               "/var/lib/mysql", "/var/tmp", "/srv", "/boot")
TOOLS_DIR = "/opt/kit-tools/bin"
AGE_DAYS = 60  # every planted file was last modified this long ago (an answer's age filter keeps none of them)
OUTCOMES = ("failed", "no_effect", "freed", "broke")
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
    outcome: str  # one of OUTCOMES
    score: float
    freed_bytes: int
    broken: list  # paths that had to be kept and were not
    reason: str  # why it failed (the sandbox's reason), else ""
    isolation: str  # the sandbox's mode
    stdout: str


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


def plant(root: Path, files: dict) -> None:
    """Sparse files of the given sizes under root (the workspace's view of /), last modified AGE_DAYS ago."""
    import time

    old = time.time() - AGE_DAYS * 86400
    for path, size in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as f:
            f.truncate(size)
        os.utime(target, (old, old))
    (root / "tmp").chmod(0o1777) if (root / "tmp").is_dir() else None


def plant_tools(root: Path, host: Host) -> None:
    """The host's package and service tools as small stand-ins in TOOLS_DIR (first on the code's PATH)."""
    bin_dir = root / TOOLS_DIR.lstrip("/")
    bin_dir.mkdir(parents=True)
    (bin_dir / "kit-tool").write_text(TOOL_SCRIPT.replace("PRIVILEGED", repr(host.user == "root"))
                                      .replace("SUDO_OK", repr(host.sudo)))
    (bin_dir / "kit-tool").chmod(0o755)
    for name in host.tools:
        (bin_dir / name).symlink_to("kit-tool")


TOOL_SCRIPT = '''#!/usr/bin/env python3
"""Stand-ins for the planted host's tools (checker.py): what each frees, and who may run it."""
import glob, os, shutil, sys

name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
as_root = PRIVILEGED or os.environ.get("KIT_SUDO") == "1"


def need_root():
    if not as_root:
        sys.exit(print(f"{name}: Permission denied (are you root?)", file=sys.stderr) or 100)


def rm(*patterns):
    for pattern in patterns:
        for p in glob.glob(os.path.expanduser(pattern)):
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)


words = [a for a in args if not a.startswith("-")]
if name == "sudo":
    if not SUDO_OK:
        sys.exit(print(f"sudo: {os.environ.get('USER', 'user')} is not in the sudoers file", file=sys.stderr) or 1)
    os.environ["KIT_SUDO"] = "1"
    os.execvp(words[0], [words[0], *args[args.index(words[0]) + 1:]])
elif name in ("apt-get", "apt") and words[:1] in (["clean"], ["autoclean"]):
    need_root(); rm("/var/cache/apt/archives/*.deb")
elif name in ("apt-get", "apt") and words[:1] == ["autoremove"]:
    need_root(); rm("/boot/*-5.15.0-91-generic")
elif name == "journalctl" and any(a.startswith("--vacuum") for a in args):
    need_root(); rm("/var/log/journal/*/*.journal~")
elif name == "docker" and words[-1:] == ["prune"]:
    rm("/var/lib/docker/overlay2/*-dangling", "/var/lib/docker/buildkit/snapshots/*")
    print("Total reclaimed space: 1.1GB")
elif name in ("dnf", "yum") and words[:1] == ["clean"]:
    need_root(); rm("/var/cache/dnf/*")
elif name == "conda" and words[:1] == ["clean"]:
    rm("~/miniconda3/pkgs/*.tar.bz2")
elif name == "flatpak" and words[:1] == ["uninstall"]:
    rm("~/.local/share/flatpak/runtime/org.gnome.Platform/x86_64/42")
elif name == "npm" and words[:2] == ["cache", "clean"]:
    rm("~/.npm/_cacache")
elif name in ("pip", "pip3") and words[:2] in (["cache", "purge"], ["cache", "remove"]):
    rm("~/.cache/pip/*")
'''


def code_of(completion: str) -> str:
    """The code in a completion: its first ```python block, else the whole text."""
    match = CODE_BLOCK.search(completion)
    return match.group(1) if match else completion


def score(root: Path, junk: dict, keep: dict, returncode: int | None) -> tuple[str, float, int, list]:
    """(outcome, score, bytes freed, broken paths) from what is left of the planted files."""
    def size(path):
        target = root / path.lstrip("/")
        try:
            return target.stat().st_size if target.is_file() and not target.is_symlink() else 0
        except OSError:
            return 0

    broken = sorted(p for p, n in keep.items() if size(p) != n)
    freed = sum(n - min(size(p), n) for p, n in junk.items())
    if broken:
        return "broke", -1.0, freed, broken
    if returncode != 0:
        return "failed", 0.0, freed, []
    if freed == 0:
        return "no_effect", 0.0, 0, []
    return "freed", round(freed / sum(junk.values()), 6), freed, []


def check(code: str, host: str = CheckConfig.host, limits=None) -> Check:
    """Plant the host, run the code there in the sandbox, score what it did."""
    import sandbox

    host = parse_host(host)
    junk, keep = planted(host)
    with tempfile.TemporaryDirectory(prefix="dpo-kit-check-") as tmp:
        root = Path(tmp) / "root"
        plant(root, junk | keep)
        plant_tools(root, host)
        try:
            compile(code, "answer.py", "exec")
        except (SyntaxError, ValueError) as e:
            return Check("failed", 0.0, 0, [], f"does not compile: {type(e).__name__}: {e}", sandbox.isolation(), "")
        result = sandbox.run_code(code, Path(tmp), host.home, limits or sandbox.Limits(), path=(TOOLS_DIR,),
                                  root_owned=() if host.privileged else SYSTEM_DIRS)
        outcome, value, freed, broken = score(root, junk, keep, result.returncode)
    return Check(outcome, value, freed, broken, result.reason, result.isolation, result.stdout[-2000:])


def prompts_from_logs(logs: str) -> list[dict]:
    """Each run's code-asking prompt and host (build_pairs.prompts_from_logs: run logs -> prompts live there)."""
    import build_pairs

    return build_pairs.prompts_from_logs(logs)


def load_prompts(path: str) -> list[dict]:
    """--eval_prompts and GRPO's prompts: JSONL rows {"prompt": text or [messages], "host": text, "run_id"?, "item"?}
    (item: fields an OpenAI-style grader reads); FILE:LINE errors."""
    import formats

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
    import build_pairs

    import sandbox

    rows, ran_same, ok_same, n = [], 0, 0, 0
    for run in build_pairs.read_runs(logs):
        host = build_pairs.host_of_run(run)
        for attempt in run.attempts:
            result = check(attempt.code, host, limits)
            ran, succeeded = result.outcome in ("no_effect", "freed"), result.outcome == "freed"
            n += 1
            ran_same += ran == attempt.ran
            ok_same += succeeded == attempt.succeeded
            rows.append({"run_id": run.run_id, "logged": {"ran": attempt.ran, "succeeded": attempt.succeeded},
                         "checker": {"outcome": result.outcome, "score": result.score, "reason": result.reason}})
    return {"attempts": n, "ran_agree": ran_same, "succeeded_agree": ok_same, "isolation": sandbox.isolation(),
            "rows": rows}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--file", argv[0], *argv[1:]]
    cfg = kit.parse_config(CheckConfig, argv, __doc__)
    import sandbox

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
