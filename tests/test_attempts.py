"""attempts.py: the model's own attempts as run logs that build_pairs.py reads, with held-out runs never attempted."""
import json
from pathlib import Path

import pytest

from dpokit.pairs import attempts
from dpokit.data import runlogs
from dpokit.pairs import from_logs
from dpokit.scoring import checker
from dpokit.data import formats
from dpokit.core import kit
from dpokit.sandbox import sandbox

LOGS = "data/runs.jsonl"


def check(outcome, freed=0, broken=(), reason=""):
    return checker.Check(outcome, 0.0, freed, list(broken), reason, "bwrap", "")


def test_held_out_runs_are_never_attempted_and_each_strategy_and_host_once():
    runs = list(runlogs.read_runs(LOGS))
    chosen = attempts.training_runs(runs, 0.2)
    held = [r for r in runs if formats.held_out({formats.RUN_KEY: r.run_id}, 0.2)]
    assert held and not {r.run_id for r in held} & {r.run_id for r in chosen}
    keys = [(r.strategy.strip(), runlogs.host_of_run(r)) for r in chosen]
    assert len(keys) == len(set(keys)) and len(chosen) >= len(runs) - len(held) - 2
    assert len(attempts.training_runs(runs, 0.0)) > len(chosen)


def test_checked_answers_become_run_logs_that_build_pairs_reads_as_the_environment_scored_them(tmp_path):
    run = next(iter(runlogs.read_runs(LOGS)))
    tried = [attempts.attempt_record("```python\nimport shutil\n```", "import shutil\n", check("freed", 123)),
             attempts.attempt_record("x = (", "x = (", check("failed", reason="does not compile")),
             attempts.attempt_record("print(1)", "print(1)", check("no_effect")),
             attempts.attempt_record("rm", "import os", check("broke", 5, ["~/Documents/thesis.odt"]))]
    assert [(a["ran"], a["space_freed"]) for a in tried] == [(True, 123), (False, None), (True, 0), (True, 0)]
    assert tried[0]["error"] is None and "thesis.odt" in tried[3]["error"] and tried[1]["error"] == "does not compile"
    record = attempts.run_record(run, tried, 2, "artifacts/r1")
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(record) + "\n")
    [parsed] = runlogs.read_runs(str(path))
    assert parsed.run_id == run.run_id and parsed.messages == run.messages and parsed.tags == run.tags
    assert [a.succeeded for a in parsed.attempts] == [True, False, False, False]
    assert from_logs.outcome(parsed) == "mixed"
    assert [a.broke for a in parsed.attempts] == [False, False, False, True]
    assert runlogs.broke_in_log({k: v for k, v in tried[3].items() if k != "outcome"})  # by its error's words
    pairs = from_logs.pairs_for_run(parsed, from_logs.PairsConfig(runs=str(path)))
    assert {p.chosen for p in pairs} == {"import shutil\n"} and len(pairs) == 3  # each failure against the pass
    assert [p.meta.get("rejected_broke", False) for p in pairs] == [False, False, True]
    s = attempts.summary([record], empty=1)
    assert s["outcomes"] == {"freed": 1, "failed": 2, "no_effect": 1, "broke": 1} and s["attempts"] == 5
    assert s["pass_rate"] == 0.2 and s["runs_with_a_pass"] == 1


def test_a_bad_config_is_refused_in_one_go():
    problems = attempts.AttemptsConfig(samples=0, temperature=0, eval_fraction=0.9).problems()
    assert len(problems) == 5


def test_the_bundled_rounds_of_attempts_never_touch_a_held_out_run_and_log_each_outcome_as_the_checker_scored_it():
    runs = {r.run_id: r for r in runlogs.read_runs(LOGS)}
    for path, round_, samples in (("data/attempts.jsonl", 1, 4), ("data/attempts-round2.jsonl", 2, 8)):
        records = [json.loads(line) for line in Path(path).read_text().splitlines()]
        assert records and all(r["round"] == round_ and len(r["attempts"]) == samples for r in records), path
        assert not [r["run_id"] for r in records if formats.held_out({formats.RUN_KEY: r["run_id"]}, 0.2)], path
        parsed_runs = list(runlogs.read_runs(path))
        assert len(parsed_runs) == len(records), path  # every line reads as a run
        for parsed in parsed_runs:  # the run's own prompt and strategy, as the logs have them
            run = runs[parsed.run_id]
            assert (parsed.messages, parsed.tags, parsed.strategy) == (run.messages, run.tags, run.strategy), path
        for r in records:
            for a in r["attempts"]:
                logged = (a["ran"], bool(a["space_freed"]))
                assert logged == {"freed": (True, True), "no_effect": (True, False), "broke": (True, False),
                                  "failed": (a["ran"], False)}[a["outcome"]], (path, r["run_id"], a["outcome"])
                assert a["outcome"] != "broke" or a["error"]  # what it deleted is said


ROOT_RUN = {"run_id": "run-x", "round": 2, "model": "artifacts/r1", "strategy": "Remove logs older than 14 days",
            "prompt": [{"role": "user", "content": "Host web-prod-11, Debian 12, Python 3.11.2, running as root.",
                        "tag": "get_basic_env_plist"}]}
AGE_FILTER = ("import time\nfrom pathlib import Path\nfor f in Path('/var/log').rglob('*'):\n"
              "    if f.is_file() and time.time() - f.stat().st_mtime > 14 * 86400:\n        f.unlink()\n")


@pytest.mark.skipif(sandbox.isolation() not in ("bwrap", "unshare"), reason="the planted host's absolute paths need "
                    "namespaces")
def test_rescore_runs_each_logged_attempt_again_and_keeps_the_answers_rounds_and_models(tmp_path, capsys):
    wrong = attempts.attempt_record("answer text", AGE_FILTER, check("broke", broken=["/var/log/syslog"]))
    right = attempts.attempt_record("print(0)", "print(0)\n", check("no_effect"))
    logs, out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    logs.write_text(json.dumps({**ROOT_RUN, "attempts": [wrong, right]}) + "\n\n")
    assert attempts.main([str(logs), "--rescore", "-o", str(out), "--report", str(tmp_path / "r.json")]) == 0
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert {k: v for k, v in record.items() if k != "attempts"} == ROOT_RUN
    assert [(a["outcome"], a["answer"], a["code"]) for a in record["attempts"]] == [
        ("freed", "answer text", AGE_FILTER), ("no_effect", "print(0)", "print(0)\n")]
    assert record["attempts"][0]["space_freed"] > 0 and record["attempts"][0]["error"] is None
    assert json.loads((tmp_path / "r.json").read_text())["changed"] == {"broke -> freed": 1}
    assert "1 outcomes changed (broke -> freed 1)" in capsys.readouterr().out


@pytest.mark.skipif(sandbox.isolation() not in ("bwrap", "unshare"),
                    reason="the planted hosts at their absolute paths need bubblewrap, or root for unshare")
@pytest.mark.parametrize("path", ["data/attempts.jsonl", "data/attempts-round2.jsonl"])
def test_the_bundled_attempts_are_scored_as_the_checker_scores_them_now(path, tmp_path, capsys):
    """make train trains on these outcomes: a change to the checker that moves one must re-score the file
    (attempts.py --rescore), or the default trains on answers the checker no longer passes."""
    result = attempts.rescore(attempts.AttemptsConfig(logs=path, rescore=True, output=str(tmp_path / "o.jsonl")))
    assert result["changed"] == {}, f"{path}: run attempts.py {path} --rescore -o {path}"


def test_rescore_refuses_logs_that_are_not_attempts_and_a_model(tmp_path, capsys):
    assert attempts.AttemptsConfig(logs="a.jsonl", rescore=True, model="m").problems()
    assert kit.run_cli(attempts.main, [LOGS, "--rescore", "-o", str(tmp_path / "o.jsonl")]) == 2
    assert capsys.readouterr().err.startswith(f"{LOGS}:1: not attempts.py's output")
    assert not (tmp_path / "o.jsonl").exists()
    assert kit.run_cli(attempts.main, [str(tmp_path / "none.jsonl"), "--rescore"]) == 2  # a missing file: no traceback
    assert capsys.readouterr().err.startswith(f"{tmp_path / 'none.jsonl'}: cannot read the run logs")


# --- near misses (--widen): each passing answer aimed further up, where the checker says it deletes what must stay ---

from dpokit.pairs import widen  # noqa: E402

FIREFOX = ('import os, shutil\n'
           'cache = os.path.expanduser("~/.cache/mozilla/firefox/x7k2.default-release/cache2")  # the cache\n'
           'shutil.rmtree(cache)\nprint(1)\n')


def test_widening_changes_one_path_alone_nearest_first_and_keeps_the_rest_of_the_text():
    variants = widen.widened(FIREFOX, limit=10)
    assert [note.split(" -> ")[1] for _, note in variants] == [
        "~/.cache/mozilla/firefox/x7k2.default-release", "~/.cache/mozilla/firefox", "~/.cache/mozilla", "~/.cache",
        "~"]
    for code, note in variants:  # the comment, quotes and layout stay: the pair differs where a wipe would
        old, new = note.split(" -> ")
        assert code == FIREFOX.replace(old, new, 1)
    chain = 'from pathlib import Path\nimport shutil\nshutil.rmtree(Path.home() / ".cache" / "pip")\n'
    assert [c for c, _ in widen.widened(chain)] == [
        chain.replace(' / "pip"', ""), chain.replace(' / ".cache" / "pip"', "")]
    joined = 'import os\nos.remove(os.path.join("/var/tmp", "build", name))\nos.remove(os.path.join("/srv/app", "x.tmp"))\n'
    notes = [n for _, n in widen.widened(joined)]
    assert 'os.path.join("/srv/app", "x.tmp") -> "/srv/app"' in notes and "/var/tmp -> /var" in notes
    assert all(", name) -> " not in n for n in notes)  # a loop's variable part is never dropped: not a wipe
    assert widen.widened("x = (") == [] and widen.widened("print('hello')") == []
    assert widen.widened('open("/")') == [] and widen.widened('p = "relative/dir"') == []
    assert widen.widened(FIREFOX, limit=2) == variants[:2]


def test_a_near_miss_is_the_nearest_variant_the_checker_scored_broke_and_build_pairs_pairs_it_apart(tmp_path, capsys):
    run = next(r for r in runlogs.read_runs(LOGS) if not formats.held_out({formats.RUN_KEY: r.run_id}, 0.2))
    other = 'import shutil\nshutil.rmtree("/var/tmp/build-8812.tmp")\n'
    tried = [attempts.attempt_record("x", "x = (", check("failed")),
             attempts.attempt_record(FIREFOX, FIREFOX, check("freed", 9000)),
             attempts.attempt_record(FIREFOX, FIREFOX, check("freed", 9000)),  # the same code: widened once
             attempts.attempt_record(other, other, check("freed", 10))]
    records = [attempts.run_record(run, tried, 1, "m"),
               attempts.run_record(run, [attempts.attempt_record("print(0)", "print(0)", check("no_effect"))], 1, "m")]
    misses = attempts.near_misses(records)
    assert {(i, j) for i, j, _, _ in misses} == {(0, 1), (0, 3)}  # each distinct passing answer; none elsewhere
    firefox = [m for m in misses if m[1] == 1]
    checks = {id(m): check("freed", 5) for m in misses}
    checks[id(firefox[1])] = check("broke", 0, ["~/Documents/thesis.odt"])
    checks[id(firefox[2])] = check("broke", 0, ["~/.ssh/x"])
    out, gained = attempts.with_near_misses(records, misses, [checks[id(m)] for m in misses])
    assert gained == 1 and out[1] == records[1] and out[0]["attempts"][:4] == tried
    made = out[0]["attempts"][4]
    assert made["code"] == firefox[1][2] and made["outcome"] == "broke" and "thesis.odt" in made["error"]
    assert made["made"].startswith("widened: ") and made["from"] == 1
    assert attempts.summary(out) == attempts.summary(records)  # never counted as the model's attempt
    # build_pairs: the run keeps its kind and its pairs, and gains the near miss against the answer it came from
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(out[0]) + "\n")
    parsed = next(iter(runlogs.read_runs(str(path))))
    assert from_logs.outcome(parsed) == "mixed" and from_logs.best_attempt(parsed).code == FIREFOX
    pairs = from_logs.pairs_for_run(parsed, from_logs.PairsConfig())
    near = [p for p in pairs if p.meta["rule"] == "near_miss"]
    assert len(near) == 1 and near[0].chosen == FIREFOX and near[0].rejected == made["code"]
    assert near[0].meta["rejected_broke"] is True
    assert [p.meta["rule"] for p in pairs] == ["mixed", "near_miss"]
    # --rescore keeps what marks it made (and the checker, not the stand-in above, now says what it does)
    again = tmp_path / "again.jsonl"
    attempts.rescore(attempts.AttemptsConfig(logs=str(path), rescore=True, output=str(again)))
    rescored = json.loads(again.read_text())["attempts"][4]
    assert rescored["made"] == made["made"] and rescored["from"] == 1 and rescored["code"] == made["code"]
    # every attempt passed but the made one: still first_try, the near miss beside its pairs
    path.write_text(json.dumps({**out[0], "attempts": out[0]["attempts"][1:4] + [{**made, "from": 0}]}) + "\n")
    parsed = next(iter(runlogs.read_runs(str(path))))
    assert from_logs.outcome(parsed) == "first_try"
    assert [p.meta["rule"] for p in from_logs.pairs_for_run(parsed, from_logs.PairsConfig())] == [
        "first_try_strategy", "first_try_code", "near_miss"]
    kto = from_logs.examples_for_run(parsed, from_logs.PairsConfig())  # KTO labels the agent's own tries alone
    assert made["code"] not in [e.completion for e in kto] and all(e.label for e in kto)
    # a made attempt whose `from` names no earlier attempt is the file's error, at its line
    capsys.readouterr()
    path.write_text(json.dumps({**out[0], "attempts": out[0]["attempts"][:4] + [{**made, "from": 4}]}) + "\n")
    assert kit.run_cli(from_logs.main, [str(path), "-o", str(tmp_path / "p.jsonl")]) == 2
    assert capsys.readouterr().err.startswith(f"{path}:1: attempts[4]: a made attempt's `from` must be the index of ")


def test_the_checker_scores_a_widened_cache_answer_as_deleting_kept_files():
    """The real checker on a planted host: the cache answer frees space, its widening up to the home deletes kept
    files, the levels between (all junk) do not."""
    host = "Host lea-thinkpad, Ubuntu 22.04, Python 3.10, user lea (sudo)."
    variants = widen.widened(FIREFOX, limit=10)
    found = checker.check_many([(FIREFOX, host)] + [(c, host) for c, _ in variants])
    if found[0].outcome == checker.UNSCORABLE:
        pytest.skip("this machine's sandbox mode cannot plant the host")
    assert found[0].outcome == "freed"
    assert [c.outcome for c in found[1:]] == ["freed", "freed", "freed", "freed", "broke"]
