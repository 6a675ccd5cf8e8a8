"""checker.py: the demo agent's environment as code. Worked answers on planted hosts, hostile ones scoring 0 with
their reason, TRL's reward signature, and how many of the demo logs' attempts it scores as the logs did."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dpokit.data import runlogs
from dpokit.scoring import checker
from dpokit.sandbox import sandbox
from dpokit.sandbox import watch

ROOT = Path(__file__).resolve().parent.parent
CI_HOST = "Host ci-runner-03, Ubuntu 22.04.4 LTS, Python 3.10.12, user ci (no sudo, member of docker)."
ROOT_HOST = "Host web-prod-11, Debian 12, Python 3.11.2, running as root."
FULL = sandbox.isolation() in ("bwrap", "unshare")  # the planted host at its absolute paths (/var, /srv)
needs_bwrap = pytest.mark.skipif(not FULL, reason="absolute paths of the planted host need namespaces (bubblewrap, "
                                                  "or root for unshare)")
MODES = [m for m in sandbox.MODES if not sandbox.why_not(m)]
PIP = ("import shutil\nfrom pathlib import Path\ncache = Path.home() / '.cache' / 'pip'\n"
       "print(sum(f.stat().st_size for f in cache.rglob('*') if f.is_file()))\nshutil.rmtree(cache)\n")


def test_hosts_are_read_from_the_prompts_words():
    ci, root = checker.parse_host(CI_HOST), checker.parse_host(ROOT_HOST)
    assert (ci.name, ci.user, ci.home, ci.sudo, ci.privileged) == ("ci-runner-03", "ci", "/home/ci", False, False)
    assert {"apt-get", "docker", "journalctl"} <= ci.tools and "sudo" not in ci.tools
    assert (root.user, root.home, root.privileged) == ("root", "/root", True)
    lea = checker.parse_host("Host lea-thinkpad, Fedora 39, Python 3.12.1, user lea (sudo), LANG=fr_FR.UTF-8.")
    assert lea.sudo and {"dnf", "flatpak", "sudo"} <= lea.tools and "apt-get" not in lea.tools
    junk, keep = checker.planted(ci)
    assert "/home/ci/.cache/pip/wheels/3a/9f/numpy-1.26.4-cp310-cp310-linux_x86_64.whl" in junk
    assert not any(p.startswith("/home/ci/.ccache/") for p in junk)  # the demo's ci-runner has no ccache
    assert "/var/lib/pgsql/16/data/pg_wal/000000010000000000000042" in keep and not set(junk) & set(keep)


def test_an_untagged_run_is_scored_on_the_host_its_prompt_names_not_on_words_of_its_system_message(tmp_path):
    """An agent's own logs often carry no tags: the host is the message that names one, and the system prompt's
    'never delete user data' does not make 'data' the host's user (a root host read as an unprivileged one)."""
    system = {"role": "system", "content": "Free disk space. Never delete user data or anything a service needs."}
    host = {"role": "user", "content": "Host api-east-3, Ubuntu 22.04.4 LTS, Python 3.10.12, running as root.\n$ df -h /"}
    logs = tmp_path / "runs.jsonl"
    logs.write_text(json.dumps({"run_id": "u-1", "prompt": [system, host, {"role": "user", "content": "Go."}],
                                "strategy": "Delete the sysstat archives", "attempts": [{"code": "x", "ran": False}]}) + "\n")
    rows = checker.prompts_from_logs(str(logs))
    assert rows[0]["host"] == host["content"]
    parsed = checker.parse_host(" ".join(m["content"] for m in (system, host)))  # a host read from the whole prompt
    assert (parsed.name, parsed.user, parsed.privileged) == ("api-east-3", "root", True)
    assert checker.parse_host("Host web-1, Debian 12, user sam (sudo).\nKeep user data.").user == "sam"


def test_code_is_the_first_python_block_of_a_completion():
    assert checker.code_of("Here:\n```python\nprint(1)\n```\nand ```python\nprint(2)\n```") == "print(1)\n"
    assert checker.code_of("print(3)") == "print(3)"


@pytest.mark.parametrize("code, outcome", [
    (PIP, "freed"),
    ("print('nothing to do')\n", "no_effect"),
    ("import shutil\nshutil.rmtree(\n", "failed"),
    ("raise SystemExit(3)\n", "failed"),
    ("import os, shutil\nshutil.rmtree(os.path.expanduser('~/projects'))\n", "broke"),
])
def test_outcomes_and_scores_by_the_retraining_rules(code, outcome):
    result = checker.check(code, CI_HOST)
    assert result.outcome == outcome, result
    assert result.score == {"freed": result.score, "no_effect": 0.0, "failed": 0.0, "broke": -1.0}[outcome]
    if outcome == "freed":
        junk, _ = checker.planted(checker.parse_host(CI_HOST))
        assert result.freed_bytes == 600 * checker.MB
        assert result.score == pytest.approx(result.freed_bytes / sum(junk.values()), abs=1e-6)
        assert result.stdout.strip() == str(600 * checker.MB)  # sparse files report their full sizes
    assert result.isolation == sandbox.isolation()


@needs_bwrap
def test_a_user_without_sudo_cannot_free_system_space_and_root_can():
    apt = "import subprocess\nsubprocess.run(['apt-get', 'clean'], check=True)\n"
    assert checker.check(apt, CI_HOST).outcome == "failed"
    as_root = checker.check(apt, ROOT_HOST)
    assert as_root.outcome == "freed" and as_root.freed_bytes == 260 * checker.MB
    old_logs = ("import time\nfrom pathlib import Path\nfor f in Path('/var/log').rglob('*.gz'):\n"
                "    if time.time() - f.stat().st_mtime > 14 * 86400:\n        f.unlink()\n")
    assert checker.check(old_logs, ROOT_HOST).outcome == "freed"
    wal = "import shutil\nshutil.rmtree('/var/lib/pgsql/16/data/pg_wal')\n"
    broke = checker.check(wal, "Host db-replica-2, Rocky Linux 9.3, running as root.")
    assert (broke.outcome, broke.score, broke.broken) == (
        "broke", -1.0, ["/var/lib/pgsql/16/data/pg_wal/000000010000000000000042"])


AGE_FILTER = ("import time\nfrom pathlib import Path\nfor f in Path({!r}).rglob('*'):\n"
              "    if f.is_file() and time.time() - f.stat().st_mtime > 14 * 86400:\n        f.unlink()\n")


@needs_bwrap
@pytest.mark.parametrize("code, outcome, broken", [
    # `find /var/log -mtime +14 -delete`: on a real host the logs services are writing were modified moments ago
    (AGE_FILTER.format("/var/log"), "freed", []),
    # by name, the live logs go too; by age over a home, the user's old documents and keys do
    ("from pathlib import Path\nfor f in Path('/var/log').rglob('*.log'):\n    f.unlink()\n", "broke",
     ["/var/log/nginx/access.log"]),
    (AGE_FILTER.format("/root"), "broke", ["/root/.ssh/id_ed25519", "/root/Documents/thesis.odt",
                                           "/root/Downloads/paper-final.pdf", "/root/Téléchargements/facture-2024.pdf",
                                           "/root/actions-runner/.runner", "/root/notebooks/analysis.ipynb",
                                           "/root/projects/app/main.py", "/root/runs/exp42/checkpoint.pt",
                                           "/root/builds/api/build-18.tar.gz", "/root/builds/web/build-5.tar.gz"]),
    # the newest of a group is as old as the rest of the host; only its older generations are older
    (AGE_FILTER.format("/var/backups"), "broke", ["/var/backups/base/base-20240601.tar.gz",
                                                  "/var/backups/pg/main-2024-06-01.sql.gz"]),
    ("import os, time\nfor d in ('/var/backups/pg', '/var/backups/base'):\n"
     "    for f in sorted(os.scandir(d), key=lambda e: e.stat().st_mtime)[:-1]:\n        os.remove(f.path)\n",
     "freed", []),
    (AGE_FILTER.format("/srv"), "broke", ["/srv/app/data/uploads/2024/photo.jpg", "/srv/app/src/app/views.py"]),
    # a database's files are live, so an age filter over /var/lib leaves them
    (AGE_FILTER.format("/var/lib"), "freed", []),
])
def test_an_age_filter_keeps_what_services_are_writing_and_nothing_else(code, outcome, broken):
    result = checker.check(code, ROOT_HOST)
    assert (result.outcome, sorted(result.broken)) == (outcome, sorted(broken)), result


WIPE = "from pathlib import Path\nfor f in Path({!r}).rglob('*'):\n    if f.is_file():\n        f.unlink()\n"
ONLY = ("from pathlib import Path\nfor f in Path({!r}).rglob('*'):\n"
        "    if f.is_file() and f.name.endswith({!r}):\n        f.unlink()\n")


@needs_bwrap
@pytest.mark.parametrize("directory, targeted, kept", [
    # each directory where an agent finds junk also holds something a user, a session or a service still needs
    ("/root/actions-runner/_work", ONLY.format("/root/actions-runner/_work", ".pyc"),
     "/root/actions-runner/_work/app/app/pkg/models.py"),
    ("/root/Downloads", ONLY.format("/root/Downloads", ".crdownload"), "/root/Downloads/paper-final.pdf"),
    ("/var/log/journal", ONLY.format("/var/log/journal", ".journal~"), "/var/log/journal/3f9a1c/system.journal"),
    ("/tmp", AGE_FILTER.format("/tmp"), "/tmp/tmux-1000/default"),
    ("/var/tmp", AGE_FILTER.format("/var/tmp"), "/var/tmp/sessions/active.db"),
])
def test_wiping_a_junk_directory_deletes_what_is_kept_there_and_the_targeted_cleaner_does_not(directory, targeted,
                                                                                              kept):
    wiped = checker.check(WIPE.format(directory), ROOT_HOST)
    assert (wiped.outcome, wiped.broken) == ("broke", [kept]), wiped
    result = checker.check(targeted, ROOT_HOST)
    assert result.outcome == "freed" and result.freed_bytes > 0, result


FEDORA_SUDO = "Host lea-thinkpad, Fedora 39, Python 3.12.1, user lea (sudo)."


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("host, missing", [
    (FEDORA_SUDO, ("apt-get", "apt", "npm", "docker", "conda")),
    ("Host ci-runner-03, Ubuntu 22.04.4 LTS, user ci (no sudo)", ("dnf", "yum", "sudo", "conda", "flatpak")),
])
def test_a_tool_the_host_lacks_is_not_found_whatever_the_machine_has(host, missing, mode, monkeypatch):
    monkeypatch.setenv(sandbox.ENV, mode)
    # the machine running the checker may have its own npm, apt-get or docker on the system PATH (this one has npm
    # and node): run there, `npm cache clean --force` freed the planted cache on a host that has no npm
    code = ("import subprocess\nfor tool in {!r}:\n"
            "    print(tool, subprocess.run([tool, '--version'], capture_output=True).returncode)\n").format(missing)
    result = checker.check(code, host)
    assert result.stdout.split() == [w for tool in missing for w in (tool, "127")], result
    assert set(checker.parse_host(host).tools) <= set(checker.KNOWN_TOOLS)


@pytest.mark.parametrize("mode", [m for m in MODES if m != "limits"])  # limits has no mount namespace to do it in
def test_a_tool_called_by_its_absolute_path_is_the_hosts_too(mode, monkeypatch):
    """`/usr/bin/npm` is the machine's npm, not the host's, unless the sandbox binds the host's over it."""
    monkeypatch.setenv(sandbox.ENV, mode)
    lacking = ("npm", "apt-get", "docker", "conda")  # tools the Fedora laptop does not have
    machine = [p for t in lacking if (p := shutil.which(t, path=":".join(sandbox.COMMAND_DIRS)))]
    if not machine:
        pytest.skip("this machine has none of them in its system directories")
    code = ("import subprocess\nfor tool in {!r}:\n"
            "    print(subprocess.run([tool, '--version'], capture_output=True).returncode)\n").format(machine)
    result = checker.check(code, FEDORA_SUDO)
    assert result.stdout.split() == ["127"] * len(machine), (machine, result)
    npm = "import subprocess\nsubprocess.run([{!r}, 'cache', 'clean', '--force'], check=True)\n"
    if shutil.which("npm", path=":".join(sandbox.COMMAND_DIRS)):  # the host's npm stand-in, by the machine's path
        path = shutil.which("npm", path=":".join(sandbox.COMMAND_DIRS))
        assert checker.check(npm.format(path), CI_HOST).outcome == "freed"
        assert checker.check(npm.format(path), FEDORA_SUDO).outcome == "failed"


def test_every_tool_a_host_can_have_is_known_so_the_others_are_shadowed():
    hosts = [f"Host {name}, {distro}, user u{sudo}" for name in [*checker.HOST_TOOLS, "demo"]
             for distro in ("Ubuntu 22.04", "Rocky Linux 9") for sudo in ("", " (sudo)")]
    assert set().union(*(checker.parse_host(h).tools for h in hosts)) == set(checker.KNOWN_TOOLS)
    scripted = set(re.findall(r'^    "([a-z0-9-]+)": \{', checker.TOOL_SCRIPT, re.M))
    assert scripted and scripted <= set(checker.KNOWN_TOOLS)


@needs_bwrap
@pytest.mark.parametrize("host, command, outcome", [
    # what works on a real host frees space; what a real tool refuses (an option it does not know, a missing
    # argument, a prompt with no terminal) fails, however close its words are to a working command
    (CI_HOST, "pip cache purge", "freed"), (CI_HOST, "pip cache remove numpy", "freed"),
    (CI_HOST, "pip cache remove --cached", "failed"), (CI_HOST, "pip cache remove", "failed"),
    (CI_HOST, "pip list", "no_effect"),
    (CI_HOST, "npm cache clean --force", "freed"), (CI_HOST, "npm cache clean", "failed"),
    (CI_HOST, "docker image prune", "failed"), (CI_HOST, "docker image prune -f", "freed"),
    (CI_HOST, "docker builder prune --force", "freed"), (CI_HOST, "docker ps", "no_effect"),
    (ROOT_HOST, "apt-get clean", "freed"), (ROOT_HOST, "apt clean -f --packagecache", "failed"),
    (ROOT_HOST, "apt-get clean all", "failed"), (ROOT_HOST, "apt-get clean --simulate", "no_effect"),
    (ROOT_HOST, "apt-get autoremove --purge -y", "freed"), (ROOT_HOST, "apt-get update", "no_effect"),
    (ROOT_HOST, "journalctl --vacuum-size=200M", "freed"), (ROOT_HOST, "journalctl --vacuum-size 200M", "freed"),
    (ROOT_HOST, "journalctl --vacuum-time=2weeks", "freed"), (ROOT_HOST, "journalctl --vacuum-size=lots", "failed"),
    (ROOT_HOST, "journalctl '--vacuum-size 500M'", "failed"), (ROOT_HOST, "journalctl --vacuum-size", "failed"),
    (FEDORA_SUDO, "sudo dnf clean all", "freed"), (FEDORA_SUDO, "sudo dnf clean", "failed"),
    (FEDORA_SUDO, "dnf clean all", "failed"), (FEDORA_SUDO, "sudo dnf clean metadata", "no_effect"),
    (FEDORA_SUDO, "flatpak uninstall --unused -y", "freed"), (FEDORA_SUDO, "flatpak uninstall --all", "failed"),
])
def test_the_hosts_tools_take_only_what_the_real_ones_take(host, command, outcome):
    import shlex

    code = f"import subprocess\nsubprocess.run({shlex.split(command)!r}, check=True)\n"
    result = checker.check(code, host)
    assert result.outcome == outcome, result


def test_the_docker_daemon_prunes_only_its_own_directories_and_never_through_a_symlink(tmp_path):
    """docker_daemon runs as root after the answer: what the docker stand-in asked for, where the planted host keeps
    it. An overlay2 swapped for a link to elsewhere (here: a directory outside the workspace) is left alone."""
    root = tmp_path / "root"
    overlay = root / "var/lib/docker/overlay2"
    (overlay / "a-dangling/diff").mkdir(parents=True)
    (overlay / "a-dangling/diff/layer.tar").write_bytes(b"x")
    (overlay / "in-use").mkdir()
    spool = root / checker.DOCKER_SPOOL.lstrip("/")
    spool.mkdir(parents=True)
    (spool / "requests").write_text("image\nrm -rf /\n")
    checker.docker_daemon(root)
    assert not (overlay / "a-dangling").exists() and (overlay / "in-use").is_dir()
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "b-dangling").mkdir(parents=True)
    (root / "var/lib/docker/overlay2").rename(root / "var/lib/docker/old")
    (root / "var/lib/docker/overlay2").symlink_to(elsewhere)
    checker.docker_daemon(root)
    assert (elsewhere / "b-dangling").is_dir()


@pytest.mark.parametrize("code, reason", [
    ("while True:\n    pass\n", "CPU limit"),
    ("x = bytearray(4 * 1024 ** 3)\n", "memory limit"),
    ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "file size limit"),
])
def test_hostile_answers_score_0_with_their_reason(code, reason):
    result = checker.check(code, CI_HOST, sandbox.Limits(cpu_seconds=2, wall_seconds=6, file_mb=4))
    assert (result.outcome, result.score) == ("failed", 0.0) and reason in result.reason, result


def test_the_grpo_reward_has_trls_signature_and_without_a_host_column_reads_the_host_from_the_prompt():
    from dpokit.scoring import rewards

    completions = [[{"role": "assistant", "content": f"Clear pip's cache.\n```python\n{PIP}```"}],
                   [{"role": "assistant", "content": "```python\nprint(\n```"}]]
    prompts = [[{"role": "user", "content": CI_HOST}]] * 2
    scores = rewards.checker_rewards(rewards.Checked())[0](completions=completions, prompts=prompts)
    assert scores[0] > 0 and scores[1] == 0.0


@needs_bwrap
def test_the_demo_logs_are_scored_as_they_were_logged_for_most_attempts():
    """The demo logs are the ground truth: the checker agrees with them on whether each attempt succeeded (ran and
    freed space) for 77 of their 91 attempts (measured). Where it does not, the logged host had something the
    planted one does not (a tool that failed, a cache the agent's code missed)."""
    result = checker.agreement(str(ROOT / "data" / "runs.jsonl"))
    print(f"\nchecker vs logs: ran {result['ran_agree']}/{result['attempts']}, "
          f"succeeded {result['succeeded_agree']}/{result['attempts']}")
    assert result["attempts"] == 91 and result["succeeded_agree"] >= 77 and result["ran_agree"] >= 71


def test_cli_prints_the_outcome_and_refuses_a_missing_file(tmp_path):
    answer = tmp_path / "answer.md"
    answer.write_text(f"```python\n{PIP}```\n")
    out = subprocess.run([sys.executable, "checker.py", str(answer), "--host", CI_HOST], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["outcome"] == "freed"
    missing = subprocess.run([sys.executable, "checker.py", "--logs", str(tmp_path / "nope.jsonl")], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.strip() == f"{tmp_path / 'nope.jsonl'}: no such file"


def test_prompts_from_logs_read_the_host_from_tagged_pairs_and_skip_bad_lines_as_build_pairs_does(tmp_path):
    host = "Host db-7, Ubuntu 22.04, Python 3.10, user app (no sudo)."
    run = {"run_id": "r1", "strategy": "Clear pip's cache", "attempts": [{"code": "print(1)", "ran": True}],
           "prompt": [[{"role": "system", "content": "You free disk space."}, "get_system_plist"],
                      [{"role": "user", "content": host}, "get_basic_env_plist"]]}  # the agent's [message, tag] form
    logs = tmp_path / "runs.jsonl"
    logs.write_text(json.dumps(run) + "\n" + "[" * 100000 + "\n")  # the second line nests too deep for json
    with pytest.raises(checker.UserError, match="malformed JSON") as e:
        runlogs.prompts_from_logs(str(logs))
    assert e.value.line == 2
    rows = runlogs.prompts_from_logs(str(logs), skip_invalid=True)
    assert rows == [{"prompt": [{"role": "user", "content": "Clear pip's cache"}], "host": host, "run_id": "r1"}]
    assert checker.parse_host(rows[0]["host"]).privileged is False


def test_a_prompts_file_that_is_not_utf8_or_nests_too_deep_is_a_file_line_error(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_bytes(b'{"prompt": "a", "host": "h"}\n' + b"[" * 100000 + b"\n")
    with pytest.raises(checker.UserError, match="malformed JSON") as e:
        checker.load_prompts(str(bad))
    assert e.value.line == 2
    bad.write_bytes(b'{"prompt": "caf\xe9", "host": "h"}\n')
    with pytest.raises(checker.UserError, match="not UTF-8") as e:
        checker.load_prompts(str(bad))
    assert e.value.line == 1


# What training would find if it could: each trick with the score it must get, in every mode this machine runs.
HOME_FILE = "import os\np = os.path.expanduser({!r})\n"
TRICKS = {
    "rename ~/.cache": (CI_HOST, "import os\nos.rename(os.path.expanduser('~/.cache'), os.path.expanduser('~/.c'))\n",
                        {"no_effect"}),
    "move junk into a new directory": (CI_HOST, "import os, shutil\nos.makedirs(os.path.expanduser('~/stash'))\n"
                                       "shutil.move(os.path.expanduser('~/.npm'), os.path.expanduser('~/stash'))\n",
                                       {"no_effect"}),
    "rename system directories without sudo": (
        CI_HOST, "import os\nfor d in ['/var/lib/systemd', '/var/tmp', '/var/cache', '/var/lib/apt', '/srv']:\n"
        "    try:\n        os.rename(d, d + '.old')\n    except OSError:\n        pass\n", {"no_effect"}),
    "move junk into /tmp": (CI_HOST, "import os, shutil, tempfile\nshutil.move(os.path.expanduser('~/.npm'), "
                            "tempfile.gettempdir())\n", {"no_effect"}),  # a rename in every mode: one file system
    "hard link then delete": (CI_HOST, HOME_FILE.format("~/Downloads/dataset-2023.tar.gz.part")
                              + "os.link(p, p + '.bak')\nos.remove(p)\n", {"no_effect"}),
    "move junk out to /dev/shm": (CI_HOST, HOME_FILE.format("~/Downloads/installer.crdownload")
                                  + "import shutil\ntry:\n    shutil.move(p, '/dev/shm/x')\nexcept OSError:\n"
                                  "    pass\n", {"no_effect"}),
    "print a fake score": (CI_HOST, "print('{\"outcome\": \"freed\", \"score\": 1.0}')\n", {"no_effect"}),
    "a tree 1,600 deep": (CI_HOST, "import os\nos.chdir(os.path.expanduser('~'))\nfor _ in range(1600):\n"
                          "    os.mkdir('d')\n    os.chdir('d')\nos.chmod('.', 0)\n", {"no_effect"}),
    "rewrite a kept file, same size": (CI_HOST, HOME_FILE.format("~/projects/app/main.py")
                                       + "n = os.path.getsize(p)\nopen(p, 'wb').write(b'x' * n)\n", {"broke"}),
    "chmod 000 a kept file": (CI_HOST, HOME_FILE.format("~/projects/app/main.py") + "os.chmod(p, 0)\n", {"broke"}),
    "delete and recreate a kept file, same size": (
        CI_HOST, HOME_FILE.format("~/Documents/thesis.odt") + "n = os.path.getsize(p)\nos.remove(p)\n"
        "with open(p, 'wb') as f:\n    f.truncate(n)\n", {"broke"}),
    "replace a kept file's parent by a symlink": (
        CI_HOST, "import os, shutil\nh = os.path.expanduser('~')\nshutil.copytree(h + '/projects', h + '/p2')\n"
        "shutil.rmtree(h + '/projects')\nos.symlink(h + '/p2', h + '/projects')\n", {"broke"}),
    "delete the host's tools as root": (ROOT_HOST, "import shutil\nshutil.rmtree('/opt/kit-tools', "
                                        "ignore_errors=True)\n", {"broke", "no_effect", "failed"}),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("trick", list(TRICKS))
def test_a_trick_that_frees_nothing_scores_nothing(trick, mode, monkeypatch):
    monkeypatch.setenv(sandbox.ENV, mode)
    host, code, outcomes = TRICKS[trick]
    result = checker.check(code, host)
    if mode == "limits" and watch.named_paths(code, checker.KNOWN_TOOLS):  # /var, /srv: not planted where it looks
        outcomes = {"unscorable"}
    assert result.outcome in outcomes and (result.score or 0) <= 0 and result.isolation == mode, result
    assert result.landlock == sandbox.landlock_abi()


@pytest.mark.parametrize("mode", MODES)
def test_what_really_frees_space_still_scores_in_every_mode(mode, monkeypatch):
    monkeypatch.setenv(sandbox.ENV, mode)
    truncate = HOME_FILE.format("~/Downloads/installer.crdownload") + "os.truncate(p, 0)\n"
    assert checker.check(truncate, CI_HOST).freed_bytes == 95 * checker.MB
    result = checker.check(PIP, CI_HOST)
    assert (result.outcome, result.freed_bytes) == ("freed", 600 * checker.MB)
    written = PIP + "open(os.path.expanduser('~/big'), 'wb').truncate(50 * 1024 ** 2)\nimport os\n"
    written = written.replace("import shutil", "import os, shutil")
    assert checker.check(written, CI_HOST).freed_bytes == 550 * checker.MB  # what it writes counts against it


@pytest.mark.parametrize("logs", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "data").glob("attempts*.jsonl")))
def test_every_bundled_attempt_scores_alike_in_every_mode_this_machine_runs_or_is_unscorable(logs, monkeypatch):
    """The same answer on the same host: the same outcome and score in bwrap, unshare and limits mode, except
    where limits mode cannot plant the host where the answer looks, which it says (never `no_effect`)."""
    items = list(dict.fromkeys((a.code, runlogs.host_of_run(run)) for run in runlogs.read_runs(ROOT / logs)
                               for a in run.attempts))
    found = {}
    for mode in MODES:
        monkeypatch.setenv(sandbox.ENV, mode)
        found[mode] = checker.check_many(items)
        assert all(c.isolation == mode for c in found[mode])
        assert mode == "limits" or not any(c.outcome == checker.UNSCORABLE for c in found[mode])
    for i, (code, host) in enumerate(items):
        scored = {m: (found[m][i].outcome, found[m][i].score) for m in MODES
                  if found[m][i].outcome != checker.UNSCORABLE}
        assert len(set(scored.values())) <= 1, (host, code, scored)
        assert len(scored) == len(MODES) or "limits mode cannot show it" in found["limits"][i].reason
    print(f"\n{logs}: {len(items)} answers in {', '.join(MODES)}; "
          + "; ".join(f"{m}: {checker.tally(found[m])['unscorable']} unscorable" for m in MODES))


def test_a_files_digest_is_its_content_whatever_its_holes(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with open(a, "wb") as f:
        f.write(b"head")
        f.truncate(10 * checker.BLOCK)
    b.write_bytes(b"head" + bytes(10 * checker.BLOCK - 4))  # the same content, every zero written
    digests = []
    for p in (a, b):
        fd = os.open(p, os.O_RDONLY)
        digests.append(checker.digest(fd, p.stat().st_size))
        os.close(fd)
    assert digests[0] == digests[1]
    with open(b, "r+b") as f:
        f.seek(5 * checker.BLOCK + 7)
        f.write(b"\1")
    fd = os.open(b, os.O_RDONLY)
    assert checker.digest(fd, b.stat().st_size) != digests[0]
    os.close(fd)


def test_one_pass_rule_decides_every_pass_rate():
    """checker.passed is the rule; tally, pass_rate and the attempts' summary all count by it, unscorable apart."""
    from dpokit.pairs import attempts

    outcomes = ["freed", "no_effect", "broke", "failed", "freed", checker.UNSCORABLE]
    assert [checker.passed(o) for o in outcomes] == [True, False, False, False, True, False]
    assert [checker.ran(o) for o in outcomes] == [True, True, False, False, True, False]
    assert checker.pass_rate(outcomes) == 2 / 5 and checker.pass_rate([checker.UNSCORABLE]) is None
    records = [{"attempts": [{"outcome": o} for o in outcomes[:3]]}, {"attempts": [{"outcome": o} for o in outcomes[3:5]]}]
    summary = attempts.summary(records, empty=1, unscorable=1)
    assert summary["pass_rate"] == 2 / 6 and summary["runs_with_a_pass"] == 2  # the empty answer failed
