"""Run code a model (or a user's grader) wrote where it cannot reach the user's files, processes or network, and say
how it was kept in.

    python sandbox.py answer.py [--wall_seconds 20] [--memory_mb 768]     # prints the result as JSON
    DPO_KIT_SANDBOX=unshare python sandbox.py answer.py                  # force a mode (error if it cannot run here)
    python sandbox.py --modes                                            # which modes run here, and why not

The code gets a fresh temporary workspace (removed afterwards, whatever tree the code left in it) whose `root/`
holds what it may see (checker.py plants a host there: root/home/<user>, root/var, root/tmp, ...), a cleared
environment from the first process on (HOME and TMPDIR inside the workspace), limits on CPU time, file size and open
files, a bound on what it writes in all (the workspace's file system may lose at most disk_mb while it runs), a
memory bound on the whole answer, a process bound that counts only the answer's own processes, a wall-clock
timeout after which every process it started is killed (the first process is a child subreaper: a process that left
the session still ends with it), output kept to a few KB, and an `oom_score_adj` of 1000 so that under memory
pressure the kernel's OOM killer takes the answer, never the trainer. The strongest mode this machine allows is
used (DPO_KIT_SANDBOX=bwrap|unshare|limits forces one), and each result records which, and what bound it:

  bwrap    bubblewrap (Debian's `bubblewrap`, in the kit's image): new user, PID, network, IPC, UTS and mount
           namespaces; the workspace's root/ directories bound at their absolute paths (/home/ci, /var, /tmp), the
           system's /usr, /bin, /lib and /etc read-only, a private /dev (and /dev/shm), nothing else of the machine
           visible; no network at all; every process dies with it. In a container that masks parts of /proc
           (podman's defaults) a new /proc cannot be mounted: the code then gets none
  unshare  (root, no bubblewrap) util-linux unshare: new PID, network, IPC, UTS and mount namespaces; inside them the
           first process binds the system directories read-only into the workspace, a private /dev, /dev/shm and
           /proc, and chroots there: the code sees the same paths as under bwrap and none of the machine's own /tmp,
           /var/tmp or /dev/shm; no network at all
  limits   neither works (a container without user namespaces, not root: the kit's image under Docker's defaults;
           launcher.py passes the kit's seccomp profile so that bwrap runs there): no namespaces; the code sees the
           workspace at its real path. Landlock alone keeps it in (below). A caller whose result depends on what the
           code finds at the host's absolute paths (the checker) asks for `watch`: code that names or reaches a path
           outside the workspace is not run, or stopped, and the result's `unseen` says which (watch.py)

Landlock, in every mode (Linux 5.13+; confine.py): before the code starts, its first process confines itself and all
it will start: it reads only the system directories and the workspace, writes only where the host's user may (its
home and /tmp), no /proc of other processes (their environment), no /dev/shm; from ABI 4 no TCP; from ABI 6 no
signal to a process outside it and no abstract unix socket outside it. Where the kernel has no Landlock this is said
once, loudly, and `limits` mode then keeps only the limits and the cleared environment.

When the kit runs as root the code runs, in every mode, as a user id of its own drawn for this run (one no account
and no other process has): files outside the workspace are closed to it by their permissions too, and afterwards
every process with that id is killed. The memory and process bounds are a cgroup where this machine lets the kit
make one (v2, or v1's memory and pids hierarchies); otherwise RLIMIT_AS per process and RLIMIT_NPROC over the
answer's user, with as few processes as make memory_mb x processes fit a quarter of the machine's free memory per
answer (four run at once) and the user's existing threads not counted against the answer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dpokit.core import kit
from dpokit.sandbox import confine
from dpokit.sandbox import watch as watch_module
from dpokit.core.kit import field

UID_RANGE = (2_000_000_000, 100_000_000)  # as root, each run's user id is drawn from here: no other process has it
MODES = ("bwrap", "unshare", "limits")
ENV = "DPO_KIT_SANDBOX"
SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib64", "/etc", "/sbin")
DEVICES = ("null", "zero", "full", "random", "urandom")
KIT_DIR = "/run/kit"  # where the code sees the kit's two files (confine.py, answer.py) in bwrap and unshare modes
RESERVED = {"usr", "bin", "lib", "lib64", "etc", "sbin", "dev", "proc", "run", "sys"}  # never a planted top dir
SANDBOX_TASKS = 3  # the sandbox's own processes of the run's user: the first process, bubblewrap's two
PARALLEL = 4  # answers checked at once (rewards.Checked): the no-cgroup memory bound leaves room for them all
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
COMMAND_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")  # where shadow looks
_WARNED: set = set()
_PROBED: dict = {}  # mode -> "" (runs here) or why not

# The sandbox's first process, started with an empty environment: it joins the cgroup, asks the OOM killer to take
# it first, becomes a child subreaper, (unshare mode) builds the code's view of / and chroots there, sets the limits,
# drops to the run's user, then forks once: the child execs the code (through confine.py); this process kills every
# descendant when the code ends or the kit sends SIGTERM, so nothing it started outlives it.
LAUNCH = r"""
import ctypes, json, os, resource, signal, sys
spec = json.loads(sys.argv[1])
for procs in spec["cgroup"]:
    with open(procs, "w") as f:
        f.write("0")
with open("/proc/self/oom_score_adj", "w") as f:
    f.write("1000")
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of the code become this process's children
if spec["chroot"]:
    c = spec["chroot"]
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    def mount(src, dst, fstype, flags, data=None):
        if libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags, data and data.encode()):
            raise OSError(ctypes.get_errno(), "mount " + dst)
    BIND, REC, REMOUNT, RDONLY, NOSUID, NODEV, PRIVATE = 4096, 16384, 32, 1, 2, 4, 1 << 18
    mount(None, "/", None, REC | PRIVATE)  # nothing below reaches the machine's own mount table
    root = c["root"]
    def ro_bind(src, dst):
        mount(src, dst, None, BIND | REC)
        mount(None, dst, None, BIND | REMOUNT | RDONLY | NOSUID | NODEV)
    for d in c["system"]:
        os.makedirs(root + d, exist_ok=True)
        ro_bind(d, root + d)
    for source, target in c["shadow"]:
        ro_bind(source, root + target)
    os.makedirs(root + "/dev", exist_ok=True)
    mount("tmpfs", root + "/dev", "tmpfs", NOSUID, "mode=755,size=64k")
    for name in c["devices"]:
        open(root + "/dev/" + name, "w").close()
        mount("/dev/" + name, root + "/dev/" + name, None, BIND)
    os.mkdir(root + "/dev/shm")
    mount("tmpfs", root + "/dev/shm", "tmpfs", NOSUID | NODEV, "mode=1777,size=%dk" % c["shm_kb"])
    os.makedirs(root + "/proc", exist_ok=True)
    mount("proc", root + "/proc", "proc", NOSUID | NODEV | 8)
    os.makedirs(root + "/run", exist_ok=True)
    mount("tmpfs", root + "/run", "tmpfs", NOSUID | NODEV, "mode=755,size=64k")
    os.mkdir(root + c["kit_at"])
    ro_bind(c["kit"], root + c["kit_at"])
    os.chroot(root)
for name, value in spec["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
if spec["uid"] is not None:
    os.setgroups([]); os.setgid(spec["uid"]); os.setuid(spec["uid"])
os.chdir(spec["cwd"])
class Stop(Exception):
    pass
def stop(*_):
    raise Stop
signal.signal(signal.SIGTERM, stop)
pid = os.fork()
if pid == 0:
    os.execve(spec["argv"][0], spec["argv"], spec["env"])
try:
    status = os.waitpid(pid, 0)[1]
except Stop:
    status = None
signal.signal(signal.SIGTERM, signal.SIG_IGN)
me = str(os.getpid())
def children():
    out = []
    for p in os.listdir("/proc"):
        try:
            with open("/proc/%s/stat" % p, "rb") as f:
                if p.isdigit() and f.read().rsplit(b")", 1)[1].split()[1] == me.encode():
                    out.append(int(p))
        except (OSError, IndexError):
            pass
    return out
for _ in range(2000):
    left = children()
    if not left:
        break
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
if status is None:
    os._exit(124)
os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""


@dataclasses.dataclass
class Limits:
    """What one run of model-written code may use."""
    wall_seconds: float = field(20.0, "wall-clock time before every process it started is killed")
    cpu_seconds: int = field(10, "CPU time per process (RLIMIT_CPU)")
    memory_mb: int = field(768, "memory of the whole answer, every process together, in MB (a cgroup; where none can "
                                "be made, per process, with fewer processes)")
    file_mb: int = field(64, "largest file it may write, in MB (RLIMIT_FSIZE; its output counts)")
    open_files: int = field(64, "open files per process (RLIMIT_NOFILE)")
    processes: int = field(32, "processes (and threads) of the answer at once, not counting the kit's own")
    output_kb: int = field(16, "how much of its stdout and stderr the result keeps, in KB each")
    disk_mb: int = field(1024, "how much the workspace's file system may fill while it runs, in MB, every file "
                               "together (RLIMIT_FSIZE bounds one file; this bounds a thousand of them)")


@dataclasses.dataclass
class Result:
    returncode: int | None
    stdout: str
    stderr: str
    reason: str  # "" when it exited 0; else why not, in a few words
    isolation: str  # bwrap, unshare or limits
    seconds: float
    landlock: int = 0  # the Landlock ABI level the code ran under; 0: none
    bounds: str = ""  # how memory and processes were bound: "cgroup v2", "cgroup v1", or the rlimits used
    unseen: str = ""  # watched in limits mode: what the code named or reached that this mode cannot show it, else ""


class SandboxError(kit.UserError):
    """DPO_KIT_SANDBOX names a mode this machine cannot run."""


def python_binary() -> str:
    """The system's Python, outside any virtual environment and any user's home (the code gets the standard
    library only, and the run's user must be able to run it): /usr/bin/python3, else /usr/local/bin/python3, else
    this interpreter's base."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(path)
        if os.path.isfile(real) and os.stat(real).st_mode & 0o001:
            return real
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


# ---------------------------------------------------------------------------------------------
# Which mode: probed once per process, forced by DPO_KIT_SANDBOX.
# ---------------------------------------------------------------------------------------------

def landlock_abi() -> int:
    """This kernel's Landlock ABI level (0: none), probed once."""
    if "landlock" not in _PROBED:
        _PROBED["landlock"] = confine.abi()
    return _PROBED["landlock"]


def why_not(mode: str) -> str:
    """'' when `mode` runs on this machine, else why not (one sentence). Probed once per mode, by running code."""
    if mode not in _PROBED:
        _PROBED[mode] = _probe(mode)
    return _PROBED[mode]


def _probe(mode: str) -> str:
    if mode == "bwrap" and not shutil.which("bwrap"):
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    if mode == "bwrap":  # in a container that masks parts of /proc (podman's defaults), a new /proc cannot be mounted
        reason = _probe_once(mode)
        if "mount proc" in reason:
            _PROBED["bwrap_no_proc"] = True
            return _probe_once(mode)
        return reason
    return _probe_once(mode)


def _probe_once(mode: str) -> str:
    if mode == "unshare":
        if os.getuid() != 0:
            return "it needs root (the kit runs as uid %d)" % os.getuid()
        if not shutil.which("unshare"):
            return "util-linux's unshare is not on the PATH"
    try:
        result = _run("print('ok')\n", mode, None, "/tmp", Limits(wall_seconds=30), (), None)
    except OSError as e:
        return f"it could not start: {e}"
    if result.stdout.strip() == "ok":
        return ""
    return f"a test run failed: {(result.stderr.strip().splitlines() or [result.reason])[-1][:200]}"


def isolation() -> str:
    """The mode answers run in here: DPO_KIT_SANDBOX's (an error if this machine cannot run it), else the strongest
    that runs."""
    forced = os.environ.get(ENV, "").strip()
    if forced:
        if forced not in MODES:
            raise SandboxError(f"{ENV}={forced!r}: expected one of {', '.join(MODES)}")
        reason = why_not(forced)
        if reason:
            raise SandboxError(f"{ENV}={forced}: this machine cannot run it: {reason}")
        return forced
    return next(m for m in MODES if m == "limits" or not why_not(m))


def forced_problems() -> list[str]:
    """DPO_KIT_SANDBOX's problem, if it names a mode this machine cannot run: for a run's checks up front, before a
    model loads (GRPO's reward and the held-out scores would otherwise stop at their first answer)."""
    try:
        isolation() if os.environ.get(ENV, "").strip() else None
    except SandboxError as e:
        return [str(e)]
    return []


def _warn_once() -> None:
    mode, level = isolation(), landlock_abi()
    if level < 1 and "landlock" not in _WARNED:
        _WARNED.add("landlock")
        print("[sandbox] WARNING: this kernel has no Landlock (Linux 5.13+, enabled at boot): model-written code is "
              f"kept in by the {mode} mode alone" + (", which is limits, a cleared environment and a workspace "
                                                     "HOME only, as this user" if mode == "limits" else ""),
              file=sys.stderr, flush=True)
    if mode == "limits" and "limits" not in _WARNED:
        _WARNED.add("limits")
        print("[sandbox] WARNING: neither bubblewrap nor namespaces work here (bwrap: %s): model-written code runs "
              "without namespaces (Landlock %s, limits, a cleared environment)"
              % (why_not("bwrap") or "not tried: forced", f"ABI {level}" if level else "absent"),
              file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Users, processes and cgroups
# ---------------------------------------------------------------------------------------------

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


def _user_processes(uid: int) -> int:
    return sum(1 for d in os.listdir("/proc") if d.isdigit() and _uid_of(d) == uid)


def user_tasks(uid: int) -> int:
    """Processes and threads of uid: what RLIMIT_NPROC counts (a trainer's 64 threads are 64)."""
    total = 0
    for d in os.listdir("/proc"):
        if d.isdigit() and _uid_of(d) == uid:
            try:
                total += len(os.listdir(f"/proc/{d}/task"))
            except OSError:
                pass
    return total


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


@dataclasses.dataclass
class Cgroup:
    kind: str  # "cgroup v2" or "cgroup v1"
    dirs: list  # the cgroup's directories (one in v2; memory's and pids' in v1)

    @property
    def procs(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def oom_killed(self) -> bool:
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):
                try:
                    text = Path(d, name).read_text()
                except OSError:
                    continue
                if any(line.split()[:1] == ["oom_kill"] and line.split()[1] != "0" for line in text.splitlines()):
                    return True
        return False

    def remove(self) -> None:
        for d in self.dirs:
            try:
                Path(d, "cgroup.kill").write_text("1")
            except OSError:
                pass
            for _ in range(200):
                try:
                    pids = [int(p) for p in Path(d, "cgroup.procs").read_text().split()]
                except OSError:
                    pids = []
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, file system type, options) of this process's mounts."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    return [(p[1], p[2], p[3]) for p in (line.split() for line in lines) if len(p) >= 4]


def _own_cgroups() -> dict:
    """{controller or '' (v2): this process's cgroup path}."""
    out = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    except (OSError, ValueError):
        pass
    return out


def make_cgroup(memory_bytes: int, tasks: int) -> Cgroup | None:
    """A fresh cgroup that bounds memory (swap included where it can) and tasks, if this machine lets the kit make
    one (root, or a delegated v2 subtree); None otherwise."""
    import secrets

    name = f"dpo-kit-sandbox-{secrets.token_hex(6)}"
    own, mounts = _own_cgroups(), _mounts()
    for point, fstype, _ in mounts:  # v2: under this process's own cgroup, else at the hierarchy's root
        if fstype != "cgroup2" or "" not in own:
            continue
        for parent in dict.fromkeys([point + own[""].rstrip("/"), point]):
            group = _try_v2(parent, name, memory_bytes, tasks)
            if group:
                return group
    dirs = []
    for controller, limits in (("memory", {"memory.limit_in_bytes": memory_bytes,
                                           "memory.memsw.limit_in_bytes": memory_bytes}),
                               ("pids", {"pids.max": tasks})):
        point = next((p for p, fstype, opts in mounts if fstype == "cgroup" and controller in opts.split(",")), None)
        if point is None or controller not in own:
            break
        path = os.path.join(point + own[controller].rstrip("/"), name)
        try:
            os.mkdir(path)
        except OSError:
            break
        dirs.append(path)
        try:
            for key, value in limits.items():
                try:
                    Path(path, key).write_text(str(value))
                except OSError:
                    if key != "memory.memsw.limit_in_bytes":  # swap accounting is often off: memory alone then
                        raise
        except OSError:
            break
    else:
        return Cgroup("cgroup v1", dirs)
    Cgroup("cgroup v1", dirs).remove()
    return None


def _try_v2(parent: str, name: str, memory_bytes: int, tasks: int) -> Cgroup | None:
    try:
        enabled = Path(parent, "cgroup.subtree_control").read_text().split()
        if not {"memory", "pids"} <= set(enabled):
            Path(parent, "cgroup.subtree_control").write_text("+memory +pids")
        path = os.path.join(parent, name)
        os.mkdir(path)
    except OSError:
        return None
    group = Cgroup("cgroup v2", [path])
    try:
        Path(path, "memory.max").write_text(str(memory_bytes))
        Path(path, "pids.max").write_text(str(tasks))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            Path(path, "memory.swap.max").write_text("0")
        if not os.access(os.path.join(path, "cgroup.procs"), os.W_OK):
            raise OSError("cgroup.procs not writable")
        return group
    except OSError:
        group.remove()
        return None


def _memory_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 4 << 30


def bounds(limits: Limits, uid: int, cgroup: bool) -> tuple[dict, str]:
    """(rlimits, what bounds memory and processes). With a cgroup the rlimits are a second line. Without one, each
    process gets half of memory_mb, and the answer as many processes (at least 4) as fit half the free memory shared
    by PARALLEL answers; RLIMIT_NPROC, which counts every thread of the user, starts from the user's threads now
    (plus the sandbox's own few), so the kit's threads are not the answer's."""
    mb = 1 << 20
    per_process, processes, how = limits.memory_mb, limits.processes, None
    if not cgroup:
        per_process = max(64, limits.memory_mb // 2)
        processes = max(4, min(processes, _memory_available() // 2 // PARALLEL // (per_process * mb)))
        how = f"rlimits: {per_process} MB per process x {processes} processes (no cgroup)"
    rl = {"RLIMIT_CPU": limits.cpu_seconds, "RLIMIT_AS": per_process * mb, "RLIMIT_FSIZE": limits.file_mb * mb,
          "RLIMIT_NOFILE": limits.open_files, "RLIMIT_CORE": 0,
          "RLIMIT_NPROC": user_tasks(uid) + processes + SANDBOX_TASKS}
    return rl, how


# ---------------------------------------------------------------------------------------------
# Running code
# ---------------------------------------------------------------------------------------------

def _bwrap_argv(root: Path, kit_dir: Path, home: str, path: str, inner: list[str],
                shadowed: list = ()) -> list[str]:
    """The workspace's root/ is the code's / as one mount (as unshare mode's chroot): a rename from the home to /tmp
    stays a rename, not a copy across two bind mounts; the system, /dev, /proc and the kit's files are mounted on top
    of it, at mount points made beforehand (bwrap_mount_points: the code's user may not create them there)."""
    proc = [] if _PROBED.get("bwrap_no_proc") else ["--proc", "/proc"]  # without it the code has no /proc at all
    argv = [shutil.which("bwrap"), "--unshare-all", "--die-with-parent", "--new-session", "--bind", str(root), "/",
            *proc, "--dev", "/dev", "--clearenv", "--setenv", "HOME", home, "--setenv", "TMPDIR", "/tmp",
            "--setenv", "PATH", path, "--setenv", "LANG", "C.UTF-8"]
    for system in SYSTEM_DIRS:
        if os.path.exists(system):
            argv += ["--ro-bind", system, system]
    for source, target in shadowed:
        argv += ["--ro-bind", source, target]
    if not (root / "tmp").is_dir():
        argv += ["--tmpfs", "/tmp"]
    return argv + ["--ro-bind", str(kit_dir), KIT_DIR, "--chdir", home, "--", *inner]


def bwrap_mount_points(root: Path) -> None:
    """The directories bwrap mounts over in the workspace's root/ (the system's, /dev, /proc, /run/kit), made by the
    kit before the code's user runs bwrap; empty, so they hold nothing the checker measures."""
    for d in [*SYSTEM_DIRS, "/dev", "/proc", KIT_DIR]:
        if d == KIT_DIR or os.path.exists(d):
            (root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)


def shadows(root: Path, first: str, names: tuple) -> list[tuple[str, str]]:
    """(the workspace's file, the machine's path) for each command in `names` that the machine has in its system
    directories: bound read-only over it (bwrap and unshare modes), so that the code calling it by absolute path
    (`/usr/bin/npm`) gets what `first` (a directory on its PATH, as the code sees it) holds under that name, not the
    machine's own. The machine's path is resolved (a symlink's target is what is bound over)."""
    out, seen = [], set()
    for name in names:
        source = root / first.lstrip("/") / name
        if not source.exists():
            continue
        for d in COMMAND_DIRS:
            target = os.path.realpath(os.path.join(d, name))
            if os.path.isfile(target) and target not in seen and target.startswith(tuple(s + "/" for s in SYSTEM_DIRS)):
                seen.add(target)
                out.append((str(source.resolve()), target))
    return out


def _confine_spec(mode: str, root: Path, kit_dir: Path, writable: tuple | None, append: tuple = ()) -> dict:
    """confine.py's spec, in the paths the code sees (its workspace at / in bwrap and unshare, at its real path in
    limits)."""
    def seen(p: str) -> str:
        return p if mode != "limits" else str(root) + p

    kit_seen = KIT_DIR if mode != "limits" else str(kit_dir)
    tops = ["/" + p.name for p in root.iterdir() if p.is_dir() and p.name not in RESERVED]
    write = [seen(w) for w in writable] if writable is not None else [seen(t) for t in tops]
    read = [*SYSTEM_DIRS, kit_seen, *(seen(t) for t in tops)] + (["/proc"] if mode != "limits" else [])
    return {"read": read, "write": write, "files": [f"/dev/{d}" for d in DEVICES], "append": list(append),
            "deny_tcp": True, "scope": True, "deny_sockets": True, "require": landlock_abi() > 0}


def _own(root: Path, uid: int, writable: tuple | None) -> None:
    """As root: the run's user owns what the host's user may change (everything when writable is None; else those
    directories' contents, and each directory itself unless it is sticky, like /tmp); the rest stays root's."""
    targets = [root] if writable is None else [root / w.lstrip("/") for w in writable]
    for top in targets:
        if not top.exists():
            continue
        if writable is None or not top.stat().st_mode & stat.S_ISVTX:
            os.lchown(top, uid, uid)
        for entry in top.rglob("*"):
            os.lchown(entry, uid, uid)


def _run(code: str, mode: str, workspace: Path | None, home: str, limits: Limits, path: tuple,
         writable: tuple | None, shadow: tuple = (), watch: bool = False) -> Result:
    own = workspace is None
    workspace = Path(tempfile.mkdtemp(prefix="dpo-kit-sandbox-")) if own else Path(workspace)
    cgroup = None
    try:
        root, kit_dir = workspace / "root", workspace / "kit"
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        (root / home.lstrip("/")).mkdir(parents=True, exist_ok=True)
        kit_dir.mkdir()
        shutil.copyfile(Path(__file__).with_name("confine.py"), kit_dir / "confine.py")
        (kit_dir / "answer.py").write_text(code, encoding="utf-8", errors="surrogatepass")
        for p in (kit_dir, kit_dir / "confine.py", kit_dir / "answer.py"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        os.chmod(workspace, 0o755)
        uid = draw_uid()
        if uid is not None:
            _own(root, uid, writable)
        watched = watch and mode == "limits"
        marker = _watch_files(kit_dir, uid) if watched else None
        python, search = python_binary(), ":".join([*path, SYSTEM_PATH])
        kit_seen = KIT_DIR if mode != "limits" else str(kit_dir)
        inner = [python, "-I", f"{kit_seen}/confine.py",
                 json.dumps(_confine_spec(mode, root, kit_dir, writable, (str(marker),) if marker else ())),
                 "--", python, "-I", *([f"{kit_seen}/watch.py"] if watched else []), f"{kit_seen}/answer.py"]
        cgroup = make_cgroup(limits.memory_mb << 20, limits.processes)
        rlimits, how = bounds(limits, uid if uid is not None else os.getuid(), cgroup is not None)
        spec = {"cgroup": cgroup.procs if cgroup else [], "rlimits": rlimits, "uid": uid, "chroot": None}
        prefix, shadowed = (), shadows(root, path[0], shadow) if path and mode != "limits" else []
        if mode == "bwrap":
            bwrap_mount_points(root)
            spec |= {"argv": _bwrap_argv(root, kit_dir, home, search, inner, shadowed), "env": {}, "cwd": str(root)}
        elif mode == "unshare":
            prefix = ("unshare", "--mount", "--ipc", "--net", "--pid", "--uts", "--fork", "--kill-child")
            spec |= {"argv": inner, "cwd": home, "env": {"HOME": home, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
                                                         "PATH": search},
                     "chroot": {"root": str(root), "system": [d for d in SYSTEM_DIRS if os.path.exists(d)],
                                "devices": list(DEVICES), "kit": str(kit_dir), "kit_at": KIT_DIR, "shadow": shadowed,
                                "shm_kb": limits.file_mb << 10}}
        else:
            outside = ":".join(str(root / p.lstrip("/")) for p in path)  # no namespace: the workspace's real paths
            spec |= {"argv": inner, "cwd": str(root / home.lstrip("/")),
                     "env": {"HOME": str(root / home.lstrip("/")), "TMPDIR": str(root / "tmp"), "LANG": "C.UTF-8",
                             "PATH": ":".join(x for x in (outside, SYSTEM_PATH) if x)}}
            if watched:  # every Python process the answer starts loads the hook too (kit/site/sitecustomize.py)
                spec["env"] |= {"PYTHONPATH": str(kit_dir / "site"), watch_module.ENV: json.dumps(
                    {"allow": [str(root.resolve()), str(kit_dir.resolve())], "marker": str(marker), "tools": list(shadow)})}
        result = _launch(spec, prefix, limits, uid, workspace)
        if marker is not None:
            result.unseen = _unseen(marker)
            if result.unseen:
                result.reason = f"it reached {result.unseen}, which {mode} mode cannot show it (no mount namespace)"
        if cgroup and result.returncode not in (0, None) and cgroup.oom_killed():
            result.reason = f"memory limit ({limits.memory_mb} MB for the whole answer)"
        result.isolation, result.landlock = mode, landlock_abi()
        result.bounds = cgroup.kind if cgroup else how
        return result
    finally:
        if cgroup:
            cgroup.remove()
        if own:
            remove_tree(workspace)


def _watch_files(kit_dir: Path, uid: int | None) -> Path:
    """watch.py beside the answer, the same as sitecustomize for the Python processes it starts, and the empty
    marker the hook appends to (the run's user may write it; Landlock lets it append only). Returns the marker."""
    site = kit_dir / "site"
    site.mkdir()
    source = Path(__file__).with_name("watch.py")
    shutil.copyfile(source, kit_dir / "watch.py")
    shutil.copyfile(source, site / "_dpo_kit_watch.py")
    (site / "sitecustomize.py").write_text("import _dpo_kit_watch\n_dpo_kit_watch.install_from_env()\n")
    marker = kit_dir / "unseen"
    marker.touch()
    for p in (site, kit_dir / "watch.py", site / "_dpo_kit_watch.py", site / "sitecustomize.py", marker):
        p.chmod(0o755 if p.is_dir() else 0o666 if p == marker else 0o644)
    if uid is not None:
        os.chown(marker, uid, uid)
    return marker


def _unseen(marker: Path) -> str:
    """What the watched answer reached outside (the marker's first line), '' when nothing."""
    try:
        first = marker.read_bytes()[:4096].decode("utf-8", "replace").splitlines()
    except OSError:
        return "(the watch's marker is gone)"
    if not first:
        return ""
    try:
        return str(json.loads(first[0])["reached"])
    except (ValueError, KeyError, TypeError):
        return "(the watch's marker was written over)"


def _launch(spec: dict, prefix: tuple, limits: Limits, uid: int | None, workspace: Path) -> Result:
    """The spec through LAUNCH, stdout and stderr to capped files; afterwards every process of the run's user (and
    of its cgroup) is gone."""
    out_dir = Path(tempfile.mkdtemp(prefix="dpo-kit-sandbox-out-"))
    started = time.monotonic()
    try:
        with open(out_dir / "stdout", "wb") as out, open(out_dir / "stderr", "wb") as err:
            proc = subprocess.Popen([*prefix, python_binary(), "-I", "-c", LAUNCH, json.dumps(spec)],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                    cwd="/", env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"})
            timed_out, disk_full = False, False
            try:
                disk_full = _wait_watching_disk(proc, workspace, limits)
            except subprocess.TimeoutExpired:
                timed_out = True
            if timed_out or disk_full:
                _signal(proc.pid, signal.SIGTERM)  # LAUNCH kills every descendant, then exits
                try:
                    proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    pass
            _kill_group(proc.pid)
            proc.wait()
            if uid is not None:
                kill_uid(uid)
        cap = limits.output_kb << 10
        stdout, stderr = ((out_dir / name).open("rb").read(cap).decode("utf-8", "replace")
                          for name in ("stdout", "stderr"))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    rc = proc.returncode
    reason = f"disk limit ({limits.disk_mb} MB written in all)" if disk_full else _reason(rc, timed_out, stderr, limits)
    return Result(None if timed_out else rc if not disk_full else 124, stdout, stderr, reason, "",
                  round(time.monotonic() - started, 3))


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _wait_watching_disk(proc, workspace: Path, limits: Limits) -> bool:
    """Wait for proc up to the wall clock (TimeoutExpired past it), looking at the workspace's file system every
    0.2 s: True as soon as it has lost more than disk_mb since the start (the code is filling the disk)."""
    deadline, start = time.monotonic() + limits.wall_seconds, _free_bytes(workspace)
    while True:
        try:
            proc.wait(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            return False
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                raise
        if start - _free_bytes(workspace) > limits.disk_mb << 20:
            return True


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


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
    if rc == 126 and last and last[-1].startswith("landlock:"):
        return last[-1]
    return f"exit status {rc}" + (f": {last[-1][:200]}" if last else "")


def run_code(code: str, workspace: Path | None = None, home: str = "/tmp", limits: Limits | None = None,
             path: tuple = (), writable: tuple | None = None, shadow: tuple = (), watch: bool = False) -> Result:
    """Run `code` (Python) in the sandbox. workspace: a directory whose root/ holds what the code may see (absolute
    paths in bwrap and unshare modes; see the module docstring); a fresh one, removed after, when None. home: HOME
    inside it. path: directories (as the code sees them) put first on its PATH. writable: the directories under
    root/ (as the code sees them) that the host's user may change; None: all of root/. The rest is the system's:
    Landlock keeps the code from writing there, and as root the run's user does not own it. shadow: command names
    whose copies in the machine's system directories the code sees replaced by path[0]'s (bwrap and unshare modes;
    `limits` has no mount namespace to do it in). watch: in limits mode, the code is not run when its text names an
    absolute path outside the system's directories, and is stopped when it reaches one (watch.py): `unseen` then
    says which, for a caller whose result depends on what the code finds at such paths (the checker)."""
    limits = limits or Limits()
    mode = isolation()
    _warn_once()
    if watch and mode == "limits":
        named = watch_module.named_paths(code, tuple(shadow))
        if named:
            return Result(None, "", "", f"it names {named[0]}, which {mode} mode cannot show it (no mount namespace)",
                          mode, 0.0, landlock_abi(), "", unseen=named[0])
    return _run(code, mode, workspace, home, limits, path, writable, shadow, watch)


# ---------------------------------------------------------------------------------------------
# Trees an answer left behind: measured and removed whatever their depth, names or permissions.
# ---------------------------------------------------------------------------------------------

MAX_DEPTH = 64  # open directories at once while walking; deeper subtrees are moved up to the top and walked there


def walk(top: str | os.PathLike, remove: bool = False):
    """Yield (path relative to top, lstat) for every entry beneath top, never following a symlink, and (remove)
    delete each after it is seen, then top itself. No recursion and at most MAX_DEPTH directories open: a subtree
    deeper than that is renamed up to top and walked from there, so a tree of any depth is fine, as are names of any
    bytes and directories the code made unreadable (each is given back its owner's rwx first; the kit owns them or
    is root). A directory on another file system (a mount point) is reported, never entered or removed."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    top_fd = os.open(top, flags)
    device = os.fstat(top_fd).st_dev
    queue = [(None, b"")]  # (name under top of a subtree moved up, or None for top itself; its path as reported)
    moved = 0
    try:
        while queue:
            name, prefix = queue.pop()
            fd = top_fd if name is None else _open_dir(top_fd, name, flags)
            if fd is None:
                continue
            stack = [(fd, prefix, _entries(fd), None)]
            while stack:
                dir_fd, rel, entries, name_in_parent = stack[-1]
                if not entries:
                    stack.pop()
                    if dir_fd != top_fd:
                        os.close(dir_fd)
                    if remove and stack:
                        _unlink(stack[-1][0], name_in_parent, dir_=True)
                    elif remove and name is not None:
                        _unlink(top_fd, name, dir_=True)
                    continue
                entry = entries.pop()
                path = rel + b"/" + entry if rel else entry
                try:
                    st = os.lstat(entry, dir_fd=dir_fd)
                except OSError:
                    continue
                yield os.fsdecode(path), st
                if stat.S_ISDIR(st.st_mode) and st.st_dev != device:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    if remove:
                        _unlink(dir_fd, entry, dir_=False)
                    continue
                if len(stack) >= MAX_DEPTH:
                    moved += 1
                    new = b".dpo-kit-deep-%d" % moved
                    while _exists(top_fd, new):
                        moved += 1
                        new = b".dpo-kit-deep-%d" % moved
                    try:
                        os.rename(entry, new, src_dir_fd=dir_fd, dst_dir_fd=top_fd)
                        queue.append((new, path))
                    except OSError:
                        pass
                    continue
                child = _open_dir(dir_fd, entry, flags)
                if child is not None:
                    stack.append((child, path, _entries(child), entry))
        if remove:
            os.close(top_fd)
            top_fd = -1
            try:
                os.rmdir(top)
            except OSError:
                pass
    finally:
        if top_fd >= 0:
            os.close(top_fd)


def _exists(dir_fd: int, name: bytes) -> bool:
    try:
        os.lstat(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False


def _open_dir(parent_fd: int, name: bytes, flags: int) -> int | None:
    for _ in range(2):
        try:
            fd = os.open(name, flags, dir_fd=parent_fd)
        except PermissionError:
            try:
                os.chmod(name, 0o700, dir_fd=parent_fd, follow_symlinks=False)
            except (OSError, NotImplementedError):
                return None
            continue
        except OSError:
            return None
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) & 0o700 != 0o700:
                os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) | 0o700)
        except OSError:
            pass
        return fd
    return None


def _entries(fd: int) -> list[bytes]:
    try:
        return [os.fsencode(name) for name in os.listdir(fd)]  # on an fd: str names, surrogate-escaped
    except OSError:
        return []


def _unlink(dir_fd: int, name: bytes, dir_: bool) -> None:
    try:
        os.rmdir(name, dir_fd=dir_fd) if dir_ else os.unlink(name, dir_fd=dir_fd)
    except OSError:  # gone already, or a mount point (never entered): left as it is
        pass


def remove_tree(top: str | os.PathLike) -> None:
    """Delete top and everything beneath it (see walk): never raises for what an answer made of it."""
    try:
        for _ in walk(top, remove=True):
            pass
    except OSError:
        shutil.rmtree(top, ignore_errors=True)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", help="a Python file (what a model wrote)")
    parser.add_argument("--modes", action="store_true", help="say which modes run here (and why not), then exit")
    for f in dataclasses.fields(Limits):
        parser.add_argument(f"--{f.name}", type=type(f.default), default=f.default, help=f.metadata.get("help"))
    args = parser.parse_args(argv)
    if args.modes:
        print(json.dumps({"modes": {m: why_not(m) or "runs" for m in MODES}, "landlock_abi": landlock_abi(),
                          "default": isolation()}, indent=1))
        return 0
    if not args.file:
        raise kit.UserError("give a Python file, or --modes")
    try:
        code = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise kit.UserError(f"cannot read it: {e}", args.file) from None
    limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
    print(json.dumps(dataclasses.asdict(run_code(code, limits=limits)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
