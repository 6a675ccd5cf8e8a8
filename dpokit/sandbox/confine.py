"""A process confines itself and everything it starts, without root or namespaces: Landlock (Linux 5.13+) for the
file system, TCP and signals, and a seccomp filter that refuses every new socket.

    python confine.py                        # which Landlock ABI this kernel offers, and what each level closes
    python -I confine.py SPEC_JSON -- PROGRAM ARGS...   # confine this process as SPEC says, then exec PROGRAM

sandbox.py runs every answer through the second form, as the last step before the answer's own code, in every
isolation mode (inside bubblewrap too: a confined process can no longer mount, so bubblewrap must come first).
SPEC is JSON: {"read": [dirs], "write": [dirs], "files": [device files], "deny_tcp": bool, "scope": bool}:

  read      read and execute beneath these directories (the system's /usr, /etc, ...; the workspace)
  write     read, write, create, delete, rename and truncate beneath these (the part of the workspace the host's
            user may change)
  files     read and write these single files (/dev/null, /dev/urandom, ...)
  append    write these single files, never truncate them (watch.py's marker: what is written there stays)
  deny_tcp  no TCP bind or connect at all (ABI 4+)
  scope     no signals to processes outside the confined tree, no abstract unix sockets outside it (ABI 6+)

  sockets   (seccomp, any kernel since 3.5) socket() fails with EACCES for every family (TCP, UDP, unix sockets
            such as docker.sock, netlink, raw), and so does io_uring_setup (its requests could open sockets);
            socketpair() stays (a pipe between two of its own processes)

Everything else of the file system is closed: other users' and the kit's files, /proc (another process's
environment), /dev/shm, the machine's own /tmp. Paths that do not exist are skipped. Where the kernel lacks a level,
what that level closes stays open, and `abi()` says which level this kernel has. Standard library only (ctypes):
the kit's image and a bare Python run it as they are.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

# include/uapi/linux/landlock.h; the syscall numbers are the same on every architecture (the generic table).
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}  # rights each ABI handles
READ = EXECUTE | READ_FILE | READ_DIR
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # the only rights a rule on a file may hold
WHAT = {1: "file system reads and writes", 2: "renames and links across directories", 3: "truncation",
        4: "TCP bind and connect", 5: "device ioctls", 6: "signals and abstract unix sockets outside the tree",
        7: "audit logging"}


class RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    """The Landlock ABI level this kernel offers; 0 when it has none (older than 5.13, or Landlock not enabled at
    boot, or a seccomp filter that refuses the call)."""
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(ctypes.c_long(SYS_CREATE_RULESET), None, ctypes.c_size_t(0),
                           ctypes.c_uint32(CREATE_RULESET_VERSION))
    return max(0, int(version))


def handled(level: int) -> tuple[int, int, int]:
    """(file system rights, network rights, scopes) this ABI level lets a ruleset handle (deny by default)."""
    fs = FS_BY_ABI[max(k for k in FS_BY_ABI if k <= level)] if level >= 1 else 0
    return fs, (NET_BIND_TCP | NET_CONNECT_TCP) if level >= 4 else 0, \
        (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if level >= 6 else 0


def restrict(read=(), write=(), files=(), deny_tcp: bool = True, scope: bool = True, append=()) -> int:
    """Confine this process (and all it starts) as the module docstring says. Returns the ABI level applied;
    0 (and nothing done) where the kernel has no Landlock. Irreversible."""
    level = abi()
    if level < 1:
        return 0
    fs, net, scoped = handled(level)
    attr = RulesetAttr(fs, net if deny_tcp else 0, scoped if scope else 0)
    size = 8 if level < 4 else 16 if level < 6 else 24  # an older kernel refuses fields it does not know
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    ruleset = libc.syscall(ctypes.c_long(SYS_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(size),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        for paths, rights in ((read, READ & fs), (write, fs), (files, (READ_FILE | WRITE_FILE | TRUNCATE
                                                                       | IOCTL_DEV) & fs), (append, WRITE_FILE & fs)):
            for path in paths:
                _allow(libc, ruleset, path, rights)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(ctypes.c_long(SYS_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset)
    return level


def _allow(libc, ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # not on this machine: nothing to allow
    try:
        if not _is_dir(fd):
            rights &= FILE_RIGHTS
        rule = PathBeneathAttr(rights, fd)
        if libc.syscall(ctypes.c_long(SYS_ADD_RULE), ctypes.c_int(ruleset), ctypes.c_int(RULE_PATH_BENEATH),
                        ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def _is_dir(fd: int) -> bool:
    import stat

    return stat.S_ISDIR(os.fstat(fd).st_mode)


# seccomp: BPF over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SOCKET_NR = {"x86_64": 41, "aarch64": 198}
IO_URING_SETUP_NR = 425  # the same on both
X32_BIT = 0x40000000  # x86_64's x32 ABI: the same calls under other numbers
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


def socket_filter(machine: str) -> list[tuple[int, int, int, int]]:
    """The BPF program: a foreign architecture's calls, socket(), io_uring_setup() and x32 calls fail with EACCES;
    the rest is allowed. Pure: (code, jt, jf, k) rows."""
    deny = RET_ERRNO | 13
    return [(LD_W_ABS, 0, 0, 4),                                     # arch
            (JEQ_K, 1, 0, AUDIT_ARCH[machine]), (RET_K, 0, 0, deny),
            (LD_W_ABS, 0, 0, 0),                                     # nr
            (JGE_K, 3, 0, X32_BIT) if machine == "x86_64" else (JGE_K, 3, 0, 0xFFFFFFFF),
            (JEQ_K, 2, 0, SOCKET_NR[machine]),
            (JEQ_K, 1, 0, IO_URING_SETUP_NR),
            (RET_K, 0, 0, RET_ALLOW),
            (RET_K, 0, 0, deny)]


def deny_sockets() -> bool:
    """Install the socket filter on this process (needs no_new_privs, set by restrict or here). False where this
    machine's architecture is not one it knows or seccomp is off."""
    machine = os.uname().machine
    if machine not in AUDIT_ARCH:
        return False
    rows = socket_filter(machine)
    program = (SockFilter * len(rows))(*(SockFilter(*r) for r in rows))
    prog = SockFprog(len(rows), program)
    libc = _libc()
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0


def main(argv: list[str]) -> int:
    if not argv:
        level = abi()
        print(json.dumps({"abi": level, "closes": [WHAT[k] for k in sorted(WHAT) if k <= level]}))
        return 0
    if "--" not in argv or argv.index("--") != 1 or len(argv) < 3:
        print("usage: confine.py SPEC_JSON -- PROGRAM ARGS...", file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    level = restrict(spec.get("read", ()), spec.get("write", ()), spec.get("files", ()),
                     spec.get("deny_tcp", True), spec.get("scope", True), spec.get("append", ()))
    if spec.get("require") and level < 1:
        print("landlock: this kernel has no Landlock, and the sandbox was told to require it", file=sys.stderr)
        return 126
    if spec.get("deny_sockets", True) and not deny_sockets() and spec.get("require"):
        print("landlock: the socket filter (seccomp) could not be installed", file=sys.stderr)
        return 126
    program = argv[2:]
    os.execv(program[0], program)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
