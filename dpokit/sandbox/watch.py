"""What `limits` mode cannot show an answer: the absolute paths outside its workspace that the answer names or
reaches, so that the sandbox says it could not score it rather than guess.

    python -I watch.py ANSWER.py      # sandbox.py runs the answer so in limits mode, DPO_KIT_WATCH in its environment
    python watch.py --scan ANSWER.py  # the paths its code names that limits mode cannot show it (JSON)

In bwrap and unshare modes the checker's planted host sits at its absolute paths (/home/<user>, /var/log, /srv), so
code that names them finds them. `limits` mode has no mount namespace: the host is planted in a workspace at its real
path, the answer's HOME and TMPDIR point there, and /home/<user> on the machine is empty or absent. An answer that
names such a path would read as harmless there (`no_effect`), where on the host it would have freed space or deleted
what must be kept. So in limits mode an answer is scored only when, as far as this can tell, it stayed where the mode can show it:

  named     before it runs, every string constant of its code is read (`named_paths`): an absolute path whose top
            directory is not the system's (/usr, /bin, /lib, /etc, /sbin; /dev/null and the like), or / itself, or a
            host tool by its system path (/usr/bin/apt-get: bwrap shows the host's there), means the answer cannot
            be scored here (`/tmp/x` and /proc included: limits mode shows neither as the others do)
  reached   while it runs, an audit hook (sys.addaudithook: it cannot be removed) sees every path the answer's Python
            opens, lists, removes, renames, changes or globs, every directory it changes to, every command it starts
            (the command's words are read as above) and any C function it loads through ctypes. The first one outside
            the workspace and the system's directories is appended to a marker file (Landlock lets the answer append
            to it, never truncate or remove it) and the process ends at once, before the call runs. Every Python
            process the answer starts loads the same hook (sitecustomize on PYTHONPATH), unless it clears its
            environment or runs isolated (-I); its command line was read when it started.

What this cannot see: a path a non-Python program builds for itself at run time (`sh -c "cd $(printf /%s var)"`),
and os.stat-like calls Python does not audit (os.path.exists(os.sep + "var")). Bubblewrap or unshare mode see the
host as it is planted and need none of this: the kit's image gets bubblewrap under Docker with docker/seccomp.json.
Standard library only: the answer's interpreter runs it as it is.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys

ENV = "DPO_KIT_WATCH"  # JSON: {"allow": [directories it may reach], "marker": the file to append to, "tools": [names]}
EXIT = 86  # the exit status of a process that reached outside (its marker line is the evidence)
SYSTEM_TOPS = ("usr", "bin", "lib", "lib64", "etc", "sbin")  # the machine's, read-only, the same in every mode
# The devices every mode gives the code (/proc, /sys and the rest of /dev differ: limits mode's Landlock closes them)
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
# Where an absolute path can start inside a string: its start, or after a space, a quote, `=`, `:`, a shell operator.
PATH_IN_TEXT = re.compile(r"(?:^|(?<=[\s'\"=:;(,|&<>`^]))(/[^\s'\";|&<>()`,*?\[]*)")
BARE_ROOT = re.compile(r"(?:^|\s)/(?=\s*$|\s+-|\s*[|;&>])")  # `/` as a command's argument: `du -sh /`, `find / -x`

# Audit events (https://docs.python.org/3/library/audit_events.html) whose arguments at these positions are paths.
PATH_EVENTS = {
    "open": (0,), "os.listdir": (0,), "os.scandir": (0,), "os.chdir": (0,), "os.chmod": (0,), "os.chown": (0,),
    "os.chflags": (0,), "os.mkdir": (0,), "os.remove": (0,), "os.rmdir": (0,), "os.truncate": (0,),
    "os.utime": (0,), "os.listxattr": (0,), "os.getxattr": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
    "os.fwalk": (0,), "shutil.rmtree": (0,), "shutil.chown": (0,), "os.rename": (0, 1), "os.link": (0, 1),
    "os.symlink": (0, 1), "shutil.copyfile": (0, 1), "shutil.copymode": (0, 1), "shutil.copystat": (0, 1),
    "shutil.copytree": (0, 1), "shutil.move": (0, 1), "shutil.make_archive": (0, 2), "shutil.unpack_archive": (0, 1),
    "glob.glob": (0,), "glob.glob/2": (0, 2), "pathlib.Path.glob": (0,), "pathlib.Path.rglob": (0,),
    "tempfile.mkstemp": (0,), "tempfile.mkdtemp": (0,),
}
COMMAND_EVENTS = {"os.system": (0,), "os.exec": (0, 1), "os.posix_spawn": (0, 1), "os.spawn": (1, 2),
                  "subprocess.Popen": (0, 1, 2)}
C_EVENTS = ("ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function")


COMMAND_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def system_path(path: str, tools: tuple = ()) -> bool:
    """An absolute path the same machine shows alike in every mode: the system's directories (read-only), but for
    the host's tools by their system path (`/usr/bin/apt-get`), which bwrap and unshare replace by the host's and
    limits cannot."""
    parts = [p for p in path.split("/") if p]
    if parts and parts[-1] in tools and os.path.dirname(os.path.normpath(path)) in COMMAND_DIRS:
        return False
    return bool(parts) and parts[0] in SYSTEM_TOPS or os.path.normpath(path) in DEVICES


def absolute_paths(text: str, start: bool = True, tools: tuple = ()) -> list[str]:
    """The absolute paths a string names outside the system's directories: `/var/log/syslog.1` in
    "find /var/log -delete", `/` in "du -sh /". start=False: a path at the string's very start is not one (the
    right side of `home + "/runs"`, a later piece of an f-string)."""
    found = []
    for m in PATH_IN_TEXT.finditer(text):
        if not start and m.start(1) == 0:
            continue
        path = m.group(1).rstrip(".:")
        if path and path != "/" and not system_path(path, tools):
            found.append(path)
    if BARE_ROOT.search(text) and (start or not text.startswith("/")):
        found.append("/")
    return found


def named_paths(code: str, tools: tuple = ()) -> list[str]:
    """Every absolute path outside the system's directories (or to one of `tools` there) that the code's string (and
    bytes) constants name, in order, once each; [] for code that does not parse (it fails alike in every mode)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return []
    not_first = set()  # constants a path cannot start at: they are appended to something
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            not_first.update(id(v) for v in node.values[1:])
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            not_first.add(id(node.right))  # home + "/runs" (Path(home) / "/runs" is absolute: pathlib says so)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            text = node.value if isinstance(node.value, str) else node.value.decode("utf-8", "replace")
            found += absolute_paths(text, start=id(node) not in not_first, tools=tools)
    return list(dict.fromkeys(found))


def outside(path: str, allow: tuple, tools: tuple = ()) -> bool:
    """Whether an absolute, normalised path lies outside the allowed directories and the system's."""
    if system_path(path, tools):
        return False
    return not any(path == a or path.startswith(a.rstrip("/") + "/") for a in allow)


def _resolve(value, cwd: str) -> str | None:
    if isinstance(value, int) or value is None:
        return None
    try:
        text = os.fsdecode(value)
    except TypeError:
        return None
    return os.path.normpath(os.path.join(cwd, text))


def _command_words(value) -> list[str]:
    if value is None or isinstance(value, int):
        return []
    if isinstance(value, (str, bytes, os.PathLike)):
        return [os.fsdecode(value)]
    try:
        return [os.fsdecode(v) for v in value if isinstance(v, (str, bytes, os.PathLike))]
    except TypeError:
        return []


def reached(event: str, args: tuple, cwd: str, allow: tuple, tools: tuple = ()) -> str:
    """What an audit event reaches outside the allowed directories ('' when nothing): a path, a command's
    absolute (or climbing) path, or a C call. Pure: the hook's decision, tested apart."""
    if event in C_EVENTS:
        return f"a C function through ctypes ({event})"
    if event in PATH_EVENTS:
        for i in PATH_EVENTS[event]:
            path = _resolve(args[i], cwd) if i < len(args) else None
            if path is not None and outside(path, allow, tools):
                return path
        return ""
    if event in COMMAND_EVENTS:
        for i in COMMAND_EVENTS[event]:
            for word in _command_words(args[i] if i < len(args) else None):
                if event == "subprocess.Popen" and i == 2:  # its cwd
                    path = _resolve(word, cwd)
                    if path and outside(path, allow, tools):
                        return path
                    continue
                for path in absolute_paths(word, tools=tools):
                    if outside(os.path.normpath(path), allow, tools):
                        return path
                for token in re.split(r"[\s'\"=:;|&<>()`]+", word):
                    if ".." in token.split("/"):
                        path = os.path.normpath(os.path.join(cwd, token))
                        if outside(path, allow, tools):
                            return path
    return ""


_STATE = {"busy": False}


def install(allow: list, marker: str, tools: list = ()) -> None:
    """The audit hook, for this process and for good: the first event that reaches outside `allow` appends what it
    reached to `marker` and ends the process (exit EXIT) before the call runs."""
    tools = tuple(tools)
    allow = tuple(os.path.normpath(a) for a in allow) + tuple(
        dict.fromkeys(os.path.normpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)))

    def hook(event, args):
        if _STATE["busy"] or not (event in PATH_EVENTS or event in COMMAND_EVENTS or event in C_EVENTS):
            return
        _STATE["busy"] = True
        try:
            try:
                cwd = os.getcwd()
            except OSError:
                cwd = "/"
            what = reached(event, args, cwd, allow, tools)
            if what:
                try:
                    fd = os.open(marker, os.O_WRONLY | os.O_APPEND)
                    os.write(fd, (json.dumps({"event": event, "reached": what}) + "\n").encode("utf-8", "replace"))
                finally:
                    os._exit(EXIT)
        finally:
            _STATE["busy"] = False

    sys.addaudithook(hook)


def install_from_env() -> None:
    """sitecustomize's call: the hook for a Python process the answer started, when DPO_KIT_WATCH reached it."""
    try:
        spec = json.loads(os.environ[ENV])
    except (KeyError, ValueError):
        return
    install(spec["allow"], spec["marker"], spec.get("tools", ()))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--scan"] and len(argv) == 2:
        try:
            with open(argv[1], encoding="utf-8") as f:
                print(json.dumps(named_paths(f.read())))
        except (OSError, UnicodeDecodeError) as e:
            print(f"{argv[1]}: cannot read it: {e}", file=sys.stderr)
            return 2
        return 0
    if len(argv) != 1:
        print("usage: watch.py ANSWER.py | watch.py --scan ANSWER.py", file=sys.stderr)
        return 2
    import runpy

    spec = json.loads(os.environ[ENV])
    install(spec["allow"], spec["marker"], spec.get("tools", ()))
    sys.argv = [argv[0]]
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
