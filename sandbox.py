"""Run code a model wrote where it cannot reach the user's files, processes or network, and say how it was kept in.

    python sandbox.py answer.py [--wall_seconds 20] [--memory_mb 512]     # prints the result as JSON

Not the user's machine: a fresh temporary workspace (removed afterwards) whose `root/` directory holds what the
code may see (checker.py plants a host there: root/home/<user>, root/var, root/tmp, ...), a cleared environment
with HOME and TMPDIR inside it, limits on CPU time, address space, file size, open files and processes, a
wall-clock timeout after which every process it started is killed, its output kept to a few KB. The strongest
isolation this machine allows is used, and each result records which:

  bwrap     bubblewrap (Debian's `bubblewrap`): new user, PID, network, IPC and mount namespaces; the workspace's
            root/ directories bound at their absolute paths (/home/ci, /var, /tmp), the system's /usr, /bin, /lib
            and /etc read-only, nothing else of the machine visible; no network; all processes die with it
  unshare   (root, no bubblewrap) util-linux unshare: new PID and network namespaces; the code runs as a user of
            its own with HOME and TMPDIR in the workspace (absolute paths are the machine's, closed to that user)
  limits    neither works (a container without user namespaces, not root): the limits, a cleared environment
            and a new session only. Said once per process, loudly: the code runs as the user who runs the kit.

When the kit runs as root the code runs, in every mode, as a user id of its own drawn for this run (one no account
and no other process has): the process limit then holds, and afterwards every process with that id is killed,
even one that left the session.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import kit
from kit import field

UID_RANGE = (2_000_000_000, 100_000_000)  # as root, each run's user id is drawn from here: no other process has it
_WARNED: set = set()
_MODE: dict = {}

# Runs in the sandbox's first process, before the code: limits, then the unprivileged user, then the code (or
# bubblewrap). It forks once so that the code's parent is this process, never the kit.
LAUNCH = r"""
import json, os, resource, signal, sys
spec = json.loads(sys.argv[1])
for name, value in spec["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
if spec["uid"] is not None:
    os.setgroups([]); os.setgid(spec["uid"]); os.setuid(spec["uid"])
os.chdir(spec["cwd"])
pid = os.fork()
if pid == 0:
    os.execve(spec["argv"][0], spec["argv"], spec["env"])
_, status = os.waitpid(pid, 0)
os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""


@dataclasses.dataclass
class Limits:
    """What one run of model-written code may use."""
    wall_seconds: float = field(20.0, "wall-clock time before every process it started is killed")
    cpu_seconds: int = field(10, "CPU time per process (RLIMIT_CPU)")
    memory_mb: int = field(768, "address space per process, in MB (RLIMIT_AS)")
    file_mb: int = field(64, "largest file it may write, in MB (RLIMIT_FSIZE; its output counts)")
    open_files: int = field(64, "open files per process (RLIMIT_NOFILE)")
    processes: int = field(32, "processes of its user at once (RLIMIT_NPROC), beyond those the user has")
    output_kb: int = field(16, "how much of its stdout and stderr the result keeps, in KB each")


@dataclasses.dataclass
class Result:
    returncode: int | None
    stdout: str
    stderr: str
    reason: str  # "" when it exited 0; else why not, in a few words
    isolation: str  # bwrap, unshare or limits
    seconds: float


def python_binary() -> str:
    """The system's Python, outside any virtual environment and any user's home (the code gets the standard
    library only, and `nobody` must be able to run it): /usr/bin/python3, else /usr/local/bin/python3, else this
    interpreter's base."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(path)
        if os.path.isfile(real) and os.stat(real).st_mode & 0o001:
            return real
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _user_processes(uid: int) -> int:
    return sum(1 for d in os.listdir("/proc") if d.isdigit() and _uid_of(d) == uid)


def _rlimits(limits: Limits, uid: int) -> dict:
    mb = 1 << 20
    return {"RLIMIT_CPU": limits.cpu_seconds, "RLIMIT_AS": limits.memory_mb * mb, "RLIMIT_FSIZE": limits.file_mb * mb,
            "RLIMIT_NOFILE": limits.open_files, "RLIMIT_CORE": 0,
            "RLIMIT_NPROC": _user_processes(uid) + limits.processes}


SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def _bwrap_argv(bwrap: str, root: Path, home: str, python: str, script: str, path: str = SYSTEM_PATH) -> list[str]:
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--proc", "/proc", "--dev", "/dev",
            "--clearenv", "--setenv", "HOME", home, "--setenv", "TMPDIR", "/tmp", "--setenv", "PATH", path,
            "--setenv", "LANG", "C.UTF-8"]
    for system in ("/usr", "/bin", "/lib", "/lib64", "/etc", "/sbin"):
        if os.path.exists(system):
            argv += ["--ro-bind", system, system]
    for top in sorted(p for p in root.iterdir() if p.is_dir()):
        argv += ["--bind", str(top), f"/{top.name}"]
    if not (root / "tmp").is_dir():
        argv += ["--tmpfs", "/tmp"]
    return argv + ["--chdir", home, "--", python, "-I", script]


def isolation() -> str:
    """The strongest mode that runs here (probed once per process): bwrap, unshare or limits."""
    if "mode" in _MODE:
        return _MODE["mode"]
    mode = "limits"
    with tempfile.TemporaryDirectory(prefix="dpo-kit-sandbox-probe-") as tmp:
        root = Path(tmp) / "root"
        (root / "tmp").mkdir(parents=True)
        script = root / "tmp" / "probe.py"
        script.write_text("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), 1)\nexcept OSError:\n"
                          "    pass\nprint('ok')\n")
        uid = draw_uid()
        if uid is not None:
            os.chown(root, uid, uid)
            os.chown(root / "tmp", uid, uid)
            os.chmod(Path(tmp), 0o755)
        bwrap = shutil.which("bwrap")
        if bwrap and _launch(_bwrap_argv(bwrap, root, "/tmp", python_binary(), "/tmp/probe.py"), root, {},
                             Limits(), uid, probe=True).stdout.strip() == "ok":
            mode = "bwrap"
        elif os.getuid() == 0 and shutil.which("unshare") and subprocess.run(
                ["unshare", "--net", "--pid", "--fork", "--kill-child", "true"], capture_output=True).returncode == 0:
            mode = "unshare"
    _MODE["mode"] = mode
    return mode


def draw_uid() -> int | None:
    """As root: a user id for one run, which no account and no running process has. Otherwise None (the code runs
    as this user)."""
    if os.getuid() != 0:
        return None
    import secrets

    while True:
        uid = UID_RANGE[0] + secrets.randbelow(UID_RANGE[1])
        if not _user_processes(uid):
            return uid


def kill_uid(uid: int) -> None:
    """SIGKILL every process of uid until none is left (the process limit bounds how many can be forking)."""
    for _ in range(100):
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit() and _uid_of(d) == uid]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def _uid_of(pid: str) -> int | None:
    """The process's user id; None when it is gone or a zombie (dead, waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                return None
        return os.stat(f"/proc/{pid}").st_uid
    except (OSError, IndexError):
        return None


def _launch(argv: list[str], root: Path, env: dict, limits: Limits, uid: int | None, cwd: str | None = None,
            prefix=(), probe: bool = False) -> Result:
    """argv through LAUNCH (limits, the run's own user, one fork), stdout and stderr to capped files; afterwards
    every process of the run's user is killed."""
    spec = {"rlimits": _rlimits(limits, uid if uid is not None else os.getuid()), "uid": uid,
            "cwd": cwd or str(root), "argv": argv, "env": env}
    out_dir = Path(tempfile.mkdtemp(prefix="dpo-kit-sandbox-out-"))
    started = time.monotonic()
    try:
        with open(out_dir / "stdout", "wb") as out, open(out_dir / "stderr", "wb") as err:
            proc = subprocess.Popen([*prefix, python_binary(), "-I", "-c", LAUNCH, json.dumps(spec)], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True, cwd="/")
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_seconds if not probe else 30)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc.pid)
            proc.wait()
            if uid is not None:
                kill_uid(uid)
        cap = limits.output_kb << 10
        stdout, stderr = ((out_dir / name).open("rb").read(cap).decode("utf-8", "replace") for name in ("stdout", "stderr"))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    rc = proc.returncode
    return Result(None if timed_out else rc, stdout, stderr, _reason(rc, timed_out, stderr, limits), "", round(time.monotonic() - started, 3))


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reason(rc: int, timed_out: bool, stderr: str, limits: Limits) -> str:
    if timed_out:
        return f"timed out after {limits.wall_seconds:g} s (every process it started was killed)"
    if rc == 0:
        return ""
    signals = {128 + signal.SIGXCPU: f"CPU limit ({limits.cpu_seconds} s)",
               128 + signal.SIGXFSZ: f"file size limit ({limits.file_mb} MB; its output counts)",
               128 + signal.SIGKILL: "killed (memory or CPU limit)", 128 + signal.SIGSEGV: "crashed (segfault)"}
    if rc in signals:
        return signals[rc]
    last = [line for line in stderr.strip().splitlines() if line.strip()]
    if "MemoryError" in stderr:
        return f"memory limit ({limits.memory_mb} MB)"
    if "File too large" in stderr:  # Python ignores SIGXFSZ: the write fails with EFBIG instead
        return signals[128 + signal.SIGXFSZ]
    return f"exit status {rc}" + (f": {last[-1][:200]}" if last else "")


def run_code(code: str, workspace: Path | None = None, home: str = "/tmp", limits: Limits | None = None,
             path: tuple = (), root_owned: tuple = ()) -> Result:
    """Run `code` (Python) in the sandbox. workspace: a directory whose root/ holds what the code may see (absolute
    paths under bwrap; see the module docstring); a fresh one, removed after, when None. home: HOME inside it.
    path: directories (as the code sees them) put first on its PATH. root_owned: directories under root/ that stay
    the kit's (root's) instead of the run's user's: the code cannot change them, as a user without sudo cannot."""
    limits = limits or Limits()
    mode = isolation()
    if mode == "limits" and "limits" not in _WARNED:
        _WARNED.add("limits")
        print("[sandbox] WARNING: neither bubblewrap nor namespaces work here: model-written code runs with limits, "
              "a cleared environment and a workspace HOME only, as this user (install bubblewrap: apt-get install "
              "bubblewrap)", file=sys.stderr, flush=True)
    own = workspace is None
    workspace = Path(tempfile.mkdtemp(prefix="dpo-kit-sandbox-")) if own else Path(workspace)
    try:
        root = workspace / "root"
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        script = root / "tmp" / ".answer.py"
        script.write_text(code, encoding="utf-8", errors="surrogatepass")
        inside = root / home.lstrip("/")
        inside.mkdir(parents=True, exist_ok=True)
        uid = draw_uid()
        if uid is not None:  # the run's own user runs it: the workspace is that user's, the path to it traversable
            kept = [root / d.lstrip("/") for d in root_owned]
            for entry in [root, *root.rglob("*")]:
                if not any(entry == k or k in entry.parents for k in kept):
                    os.lchown(entry, uid, uid)
            os.chmod(workspace, 0o755)
        search = ":".join([*path, SYSTEM_PATH])
        python = python_binary()
        if mode == "bwrap":
            argv = _bwrap_argv(shutil.which("bwrap"), root, home, python, "/tmp/.answer.py", search)
            env, cwd, prefix = {}, None, ()
        else:
            argv = [python, "-I", str(script)]
            outside = ":".join(str(root / p.lstrip("/")) for p in path)  # no namespace: the workspace's real paths
            env = {"HOME": str(inside), "TMPDIR": str(root / "tmp"), "LANG": "C.UTF-8",
                   "PATH": ":".join(x for x in (outside, SYSTEM_PATH) if x)}
            cwd = str(inside)
            prefix = ("unshare", "--net", "--pid", "--fork", "--kill-child") if mode == "unshare" else ()
        result = _launch(argv, root, env, limits, uid, cwd, prefix)
        result.isolation = mode
        return result
    finally:
        if own:
            shutil.rmtree(workspace, ignore_errors=True)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", help="a Python file (what a model wrote)")
    for f in dataclasses.fields(Limits):
        parser.add_argument(f"--{f.name}", type=type(f.default), default=f.default, help=f.metadata.get("help"))
    args = parser.parse_args(argv)
    try:
        code = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise kit.UserError(f"cannot read it: {e}", args.file) from None
    limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
    print(json.dumps(dataclasses.asdict(run_code(code, limits=limits)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
