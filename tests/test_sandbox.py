"""sandbox.py: hostile code thrown at it (a fork bomb, an endless loop, a memory hog, gigabytes of output, writing,
deleting and reading outside its workspace, a socket, killing its parent, the kit's environment): nothing escapes,
nothing hangs, each ends with its reason. Where this machine allows only the weakest isolation, the tests that
need more say so and skip."""
import os
import socket
import threading
import time

import pytest

import sandbox

FAST = sandbox.Limits(wall_seconds=8, cpu_seconds=3, memory_mb=256, file_mb=4, processes=16, output_kb=4)
BEST = sandbox.isolation()
# Every mode this machine can run, the strongest first: the weaker ones are what other machines fall back to.
MODES = [m for m in ("bwrap", "unshare", "limits") if m == "limits" or m == BEST or (m == "unshare" and BEST == "bwrap"
                                                                                    and os.getuid() == 0)]
MODE = BEST


@pytest.fixture(autouse=True, params=MODES)
def mode(request, monkeypatch):
    global MODE
    monkeypatch.setitem(sandbox._MODE, "mode", request.param)
    MODE = request.param
    return request.param


def needs_isolation(what: str):
    if MODE == "limits":
        pytest.skip(f"{what}: sandbox.py's `limits` mode (no bubblewrap, no namespaces here) does not stop it")


def run(code: str, **limits) -> sandbox.Result:
    start = time.monotonic()
    result = sandbox.run_code(code, limits=sandbox.Limits(**{**vars(FAST), **limits}))
    assert time.monotonic() - start < FAST.wall_seconds + 10  # nothing hangs
    assert result.isolation == MODE
    return result


def sandbox_processes() -> int:
    """Processes of a sandbox's user: as root, any id in sandbox.UID_RANGE; else this user's own."""
    if os.getuid() != 0:
        return sandbox._user_processes(os.getuid())
    low, n = sandbox.UID_RANGE
    return sum(1 for d in os.listdir("/proc") if d.isdigit() and low <= (sandbox._uid_of(d) or 0) < low + n)


def test_plain_code_runs_with_a_workspace_home_and_a_cleared_environment(monkeypatch):
    monkeypatch.setenv("DPO_KIT_SECRET_TOKEN", "s3cret")
    result = run("import os, sys\nprint(os.environ.get('DPO_KIT_SECRET_TOKEN'), os.environ['HOME'] != '/root', "
                 "sys.flags.isolated)\nopen(os.path.join(os.environ['TMPDIR'], 'x'), 'w').write('ok')\n")
    assert (result.returncode, result.reason, result.stdout) == (0, "", "None True 1\n")


def test_a_fork_bomb_ends_and_leaves_no_process_behind():
    if MODE == "limits" and os.getuid() != 0:
        needs_isolation("a fork bomb counted against this user's processes")
    before = sandbox_processes()
    result = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    assert result.returncode != 0 and result.reason
    assert sandbox_processes() <= before


def test_an_endless_loop_stops_at_the_cpu_limit_or_the_clock():
    result = run("while True:\n    pass\n", cpu_seconds=1, wall_seconds=5)
    assert result.returncode != 0 and ("CPU" in result.reason or "timed out" in result.reason), result.reason


def test_sleeping_forever_is_killed_at_the_wall_clock_with_every_child():
    result = run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\ntime.sleep(600)\n",
                 wall_seconds=2)
    assert result.returncode is None and "timed out after 2 s" in result.reason
    if MODE != "limits" or os.getuid() == 0:  # a child that left the session dies with the namespace or its user
        assert not any(os.path.exists(f"/proc/{pid}") and "time.sleep(600)" in _cmdline(pid)
                       for pid in os.listdir("/proc") if pid.isdigit())


def _cmdline(pid: str) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
    except OSError:
        return ""


def test_a_memory_hog_meets_the_memory_limit():
    result = run("x = bytearray(2 * 1024 ** 3)\nprint(len(x))\n")
    assert result.returncode != 0 and "memory" in result.reason, result.reason


def test_gigabytes_of_output_stop_at_the_file_size_limit_and_the_result_keeps_a_few_kb():
    result = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n")
    assert result.returncode != 0 and "file size limit" in result.reason, result.reason
    assert len(result.stdout) <= FAST.output_kb << 10


def test_files_outside_the_workspace_can_be_neither_written_nor_deleted(tmp_path):
    if os.getuid() != 0:
        needs_isolation("the user's own files")
    sentinel, written = tmp_path / "keep.txt", tmp_path / "written.txt"
    sentinel.write_text("keep")
    result = run(f"import os\nfor act in (lambda: os.remove({str(sentinel)!r}), "
                 f"lambda: open({str(written)!r}, 'w').write('x')):\n    try:\n        act()\n"
                 f"        print('did')\n    except OSError as e:\n        print(type(e).__name__)\n")
    assert sentinel.read_text() == "keep" and not written.exists()
    assert "did" not in result.stdout.split("\n")[0]


def test_a_private_key_of_the_user_cannot_be_read(tmp_path):
    if os.getuid() != 0:
        needs_isolation("reading the user's own files")
    ssh = tmp_path / ".ssh"
    ssh.mkdir(mode=0o700)
    (ssh / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY----- secret")
    (ssh / "id_ed25519").chmod(0o600)
    result = run(f"import pathlib\ntry:\n    print(pathlib.Path({str(ssh / 'id_ed25519')!r}).read_text())\n"
                 "except OSError as e:\n    print(type(e).__name__)\n"
                 "import glob, os\nprint(glob.glob(os.path.expanduser('~/.ssh/*')))\n")
    assert "secret" not in result.stdout and "PRIVATE" not in result.stdout


def test_a_socket_reaches_nothing_not_even_this_machines_loopback():
    needs_isolation("a socket")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(6)
    port, accepted = server.getsockname()[1], []
    threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True).start()
    result = run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), 3)\ns.sendall(b'exfil')\n"
                 "print('connected')\n")
    time.sleep(0.5)
    server.close()
    assert "connected" not in result.stdout and result.returncode != 0
    assert accepted in ([], [None])


def _accept(server):
    try:
        return server.accept()
    except OSError:
        return None


def test_killing_its_parent_or_the_kit_leaves_the_kit_running():
    # With only the limits, as this user, the kit's own pid would be killable: that case is the mode's warning.
    kit_pid = os.getpid() if MODE != "limits" or os.getuid() == 0 else os.getppid() * 0 + 1
    result = run(f"import os, signal\nfor pid in (os.getppid(), {kit_pid}, 1):\n    try:\n"
                 "        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print(type(e).__name__)\n")
    assert result.isolation == MODE  # this process is alive to read it
    assert os.getpid() and result.seconds < FAST.wall_seconds
