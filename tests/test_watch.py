"""watch.py: what `limits` mode cannot show an answer. The paths code names (worked examples), what an audit event
reaches, and, where this machine runs limits mode, answers that reach the host by every route Python has: each
stopped and reported unscorable, never scored as though the host were empty. As root, the same as an unprivileged
user (the kit's image under Docker's defaults)."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dpokit.scoring import checker
from dpokit.sandbox import sandbox
from dpokit.sandbox import watch

ROOT = Path(__file__).resolve().parent.parent
HOME = "/work/ws/root/home/ci"
ALLOW = ("/work/ws/root", "/work/ws/kit")
CI_HOST = "Host ci-runner-03, Ubuntu 22.04.4 LTS, Python 3.10.12, user ci (no sudo, member of docker)."
ROOT_HOST = "Host web-prod-11, Debian 12, Python 3.11.2, running as root."
LIMITS = not sandbox.why_not("limits")
AS_USER = os.getuid() == 0 and shutil.which("setpriv") and LIMITS


@pytest.mark.parametrize("code, named", [
    ('shutil.rmtree("/home/mlops/runs")', ["/home/mlops/runs"]),
    ('os.system("find /var/log -name \'*.gz\' -delete")', ["/var/log"]),
    ('os.system("du -sh /")', ["/"]),
    ('subprocess.run(["find", "/", "-xdev", "-size", "+1G"])', ["/"]),
    ('p = f"/srv/{app}/cache"', ["/srv/"]),
    ('p = Path("/tmp") / "pip-build"', ["/tmp"]),  # limits mode's /tmp is the machine's, not the host's
    ('p = Path(home) / "/opt/x"', ["/opt/x"]),  # pathlib: an absolute right side replaces the left
    ('os.path.join(home, "/var/tmp")', ["/var/tmp"]),  # so does os.path.join
    ('re.compile(r"^/var/log/.*\\.gz$")', ["/var/log/"]),
    ('b = b"/root/.cache"', ["/root/.cache"]),
    ('os.system("/usr/bin/apt-get clean")', ["/usr/bin/apt-get"]),  # bwrap shows the host's apt-get there
    ('open("/proc/mounts").read()', ["/proc/mounts"]),  # limits mode's Landlock closes /proc
    # What every mode shows alike:
    ('shutil.rmtree(os.path.expanduser("~/.cache/pip"))', []),
    ('p = home + "/.npm/_cacache"', []),
    ('p = f"{home}/Downloads"', []),
    ('open("/dev/null", "w"); open("/etc/os-release").read(); os.system("/usr/bin/find . -name x")', []),
    ('print("freed %.1f MB / %.1f MB" % (a, b))', []),
    ('print("a / b")', []),
    ("this is not Python (", []),
])
def test_the_paths_code_names_that_limits_mode_cannot_show(code, named):
    assert watch.named_paths(code, ("apt-get", "npm")) == named


@pytest.mark.parametrize("event, args, reached", [
    ("open", ("/home/mlops/runs/a", "r", 0), "/home/mlops/runs/a"),
    ("os.listdir", ("../../..",), "/work/ws"),  # above the planted root: bwrap's / has no parent
    ("os.scandir", ("../../var/log",), ""),  # the planted /var/log, reached from the home
    ("shutil.rmtree", (HOME + "/.cache",), ""),
    ("os.rename", (HOME + "/a", "/srv/a", None, None), "/srv/a"),
    ("os.chdir", ("/",), "/"),
    ("subprocess.Popen", ("find", ["find", "/var", "-delete"], None, None), "/var"),
    ("subprocess.Popen", (None, "rm -rf ../../../../srv", None, None), "/work/srv"),
    ("subprocess.Popen", (None, ["rm", "-rf", "x"], "/srv", None), "/srv"),
    ("subprocess.Popen", ("/usr/bin/find", ["/usr/bin/find", ".", "-delete"], None, None), ""),
    ("os.system", ("cd / && rm -rf home",), "/"),
    ("os.exec", ("/usr/bin/python3", ["python3", "-c", "import os; os.remove('/var/x')"], {}), "/var/x"),
    ("ctypes.dlopen", ("libc.so.6",), "a C function through ctypes (ctypes.dlopen)"),
    ("open", (3, "r", 0), ""),  # a file descriptor: opened before, its path was seen then
    ("os.getxattr", ("/usr/lib/x", "user.a"), ""),
])
def test_what_an_audit_event_reaches_outside_the_planted_host(event, args, reached):
    assert watch.reached(event, args, HOME, ALLOW) == reached


# Routes to the host's paths that no string constant names: each must be stopped, in limits mode, as it is taken.
ROUTES = {
    "os.sep": "import os\nprint(os.listdir(os.sep + 'srv'))\n",
    "climbing from the home": "import os\nh = os.path.expanduser('~')\nprint(os.listdir(os.path.join(h, *(['..'] * 4))))\n",
    "chdir to the top, then relative": "import os\nos.chdir(os.path.expanduser('~'))\nfor _ in range(6):\n"
                                       "    os.chdir('..')\nprint(os.listdir('.'))\n",
    "a child Python building the path": "import subprocess, sys\nsubprocess.run([sys.executable, '-c', \"import os; "
                                        "print(os.listdir(os.sep + chr(118) + 'ar'))\"])\n",
    "a child Python whose output is captured": "import subprocess, sys\nsubprocess.run([sys.executable, '-c', "
                                               "\"import os; os.listdir(os.sep + 'srv')\"], capture_output=True)\n",
    "ctypes": "import ctypes\nctypes.CDLL(None).unlink(b'x')\n",
    "glob from the top": "import glob, os\nprint(glob.glob(os.sep + '*'))\n",
}


@pytest.mark.skipif(not LIMITS, reason="limits mode does not run here")
@pytest.mark.parametrize("route", list(ROUTES))
def test_in_limits_mode_an_answer_reaching_the_host_is_unscorable_not_harmless(route, monkeypatch):
    monkeypatch.setenv(sandbox.ENV, "limits")
    result = checker.check(ROUTES[route], CI_HOST)
    assert (result.outcome, result.score, result.isolation) == ("unscorable", None, "limits"), result
    assert "limits mode cannot show it" in result.reason


@pytest.mark.skipif(not LIMITS, reason="limits mode does not run here")
def test_the_marker_cannot_be_emptied_by_the_answer_that_reached_out(monkeypatch):
    monkeypatch.setenv(sandbox.ENV, "limits")
    code = ("import json, os, subprocess, sys\n"
            "subprocess.run([sys.executable, '-c', \"import os; os.listdir(os.sep + 'srv')\"])\n"
            "marker = json.loads(os.environ['DPO_KIT_WATCH'])['marker']\n"
            "for how in (lambda: os.truncate(marker, 0), lambda: open(marker, 'w').close(), lambda: os.remove(marker)):\n"
            "    try:\n        how()\n    except OSError as e:\n        print(type(e).__name__)\n")
    result = checker.check(code, CI_HOST)
    assert result.outcome == "unscorable", result
    if sandbox.landlock_abi() >= 3:  # truncation is Landlock's from ABI 3
        assert result.stdout.split() == ["PermissionError"] * 3


@pytest.mark.skipif(not LIMITS, reason="limits mode does not run here")
def test_in_limits_mode_the_hosts_tools_free_the_planted_host(monkeypatch):
    """The stand-ins delete the host's system files (apt's cache) at the workspace's paths in limits mode."""
    monkeypatch.setenv(sandbox.ENV, "limits")
    apt = "import subprocess\nsubprocess.run(['apt-get', 'clean'], check=True)\n"
    assert checker.check(apt, ROOT_HOST).outcome == "freed"
    assert checker.check(apt, CI_HOST).outcome == "failed"  # no sudo: apt-get refuses, as on the host


@pytest.mark.skipif(not AS_USER, reason="needs root (to drop to an unprivileged user) and limits mode")
def test_as_an_unprivileged_user_as_in_the_image_limits_mode_says_unscorable():
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(prefix="dpo-kit-test-"))  # pytest's own is root's alone
    tmp_path.chmod(0o755)
    for name, code in (("host", ROUTES["os.sep"]), ("home", "import shutil, os\nshutil.rmtree("
                                                             "os.path.expanduser('~/.cache/pip'))\n")):
        answer = tmp_path / f"{name}.py"
        answer.write_text(code)
        answer.chmod(0o644)
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                               sandbox.python_binary(), str(ROOT / "checker.py"), str(answer), "--host", CI_HOST],
                              capture_output=True, text=True, cwd="/", timeout=120,
                              env={"PATH": os.environ["PATH"], sandbox.ENV: "limits"})
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert (result["outcome"], result["isolation"]) == (("unscorable" if name == "host" else "freed"), "limits")
    shutil.rmtree(tmp_path)


# The hosts' own tools on five hosts: what they free sits at the host's absolute paths, so in limits mode the
# stand-ins free the workspace's copy; every mode must give the same outcome and score.
TOOLS = [
    ("Host ci-runner-03, Ubuntu 22.04.4 LTS, user ci (no sudo, member of docker).", ["docker", "system", "prune", "-f"]),
    ("Host ci-runner-03, Ubuntu 22.04.4 LTS, user ci (no sudo, member of docker).", ["npm", "cache", "clean", "--force"]),
    ("Host gpu-ws-02, Ubuntu 22.04, user lea", ["conda", "clean", "--all", "-y"]),
    ("Host web-prod-11, Debian 12, running as root.", ["journalctl", "--vacuum-size=100M"]),
    ("Host web-prod-11, Debian 12, running as root.", ["apt-get", "autoremove", "-y"]),
    ("Host lea-thinkpad, Fedora 39, user lea (sudo)", ["sudo", "dnf", "clean", "all"]),
    ("Host lea-thinkpad, Fedora 39, user lea (sudo)", ["flatpak", "uninstall", "--unused", "-y"]),
    ("Host build-7, Rocky Linux 9, user dev (no sudo)", ["dnf", "clean", "all"]),  # refused: no root
]


@pytest.mark.parametrize("host, command", TOOLS)
def test_the_hosts_tools_score_alike_in_every_mode(host, command, monkeypatch):
    code = f"import subprocess\nsubprocess.run({command!r}, check=True)\n"
    found = {}
    for mode in [m for m in sandbox.MODES if not sandbox.why_not(m)]:
        monkeypatch.setenv(sandbox.ENV, mode)
        c = checker.check(code, host)
        found[mode] = (c.outcome, c.score, c.freed_bytes)
    assert len(set(found.values())) == 1, found
    assert next(iter(found.values()))[0] == ("failed" if host.startswith("Host build-7") else "freed")
