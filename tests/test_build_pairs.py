"""build_pairs.py: the pair rules on small hand-written runs, the CLI's I/O contract, and the demo logs."""

import io
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dpokit.pairs import from_logs as bp
from dpokit.data import runlogs
from dpokit.data import formats
from dpokit.core import kit

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "data" / "runs.jsonl"
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"

PROMPT = [{"role": "system", "content": "You free disk space.", "tag": "get_system_plist"},
          {"role": "user", "content": "df: 96% used", "tag": "get_basic_env_plist"}]
GOOD, ZERO, BROKEN = "print(1)\n", "print(0)\n", "print(1\n"


def ok(code=GOOD, score=100):
    return {"code": code, "ran": True, "space_freed": score}


def failed(code=BROKEN):
    return {"code": code, "ran": False, "error": "SyntaxError"}


def run(strategy="Clear the pip cache", attempts=(), prompt=PROMPT, run_id="r1", **extra):
    attempts = None if attempts is None else list(attempts)
    obj = {"run_id": run_id, "prompt": prompt, "strategy": strategy, "attempts": attempts, **extra}
    return {k: v for k, v in obj.items() if v is not None}


def parsed(obj, score_key="space_freed"):
    return runlogs.parse_run(obj, "runs.jsonl", 1, score_key)


def write(tmp_path, rows, name="runs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def build(tmp_path, rows_or_path, *flags):
    """Run the CLI in-process; returns (exit code, output lines as dicts, report dict)."""
    src = rows_or_path if isinstance(rows_or_path, Path) else write(tmp_path, rows_or_path)
    out, report = tmp_path / "pairs.jsonl", tmp_path / "report.json"
    code = kit.run_cli(bp.main, [str(src), "-o", str(out), "--report", str(report), *flags])
    pairs = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] if out.exists() else []
    return code, pairs, json.loads(report.read_text()) if report.exists() else None


def contents(messages):
    return [m["content"] for m in messages]


# ---------------------------------------------------------------------------------------------
# Rules, one run at a time
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("attempts, expected", [
    ([], "never_ran"),
    ([failed(), failed()], "never_ran"),
    ([failed(), ok(score=0)], "never_succeeded"),
    ([ok(score=-5)], "never_succeeded"),
    ([{"code": GOOD, "ran": True}], "never_succeeded"),  # ran, but no score recorded
    ([failed(), ok()], "mixed"),
    ([ok(), ok(score=3)], "first_try"),
])
def test_outcome(attempts, expected):
    assert bp.outcome(parsed(run(attempts=attempts))) == expected


def test_never_succeeded_and_never_ran_give_no_pair_and_are_counted(tmp_path):
    rows = [run(attempts=[failed()], run_id="a", prompt=[{"role": "user", "content": "p1"}]),
            run(attempts=[ok(score=0)], run_id="b", prompt=[{"role": "user", "content": "p2"}]),
            run(attempts=[ok(score=0), failed()], run_id="c", prompt=[{"role": "user", "content": "p3"}]),
            run(attempts=[ok()], run_id="d", prompt=[{"role": "user", "content": "p4"}])]
    code, pairs, report = build(tmp_path, rows)
    assert code == 0
    assert report["runs_by_outcome"] == {"first_try": 1, "mixed": 0, "never_succeeded": 2, "never_ran": 1}
    assert report["runs_dropped"] == {"never_ran": 1, "never_succeeded": 2, "only_same_code": 0}
    assert report["runs_used"] == 1 and report["emit"] == "dpo"
    assert {p["meta"]["run_id"] for p in pairs} == {"d"}


def test_mixed_best_code_wins_and_earliest_wins_ties():
    r = parsed(run(attempts=[failed("a("), ok("b = 1", 100), ok("c = 1", 100), ok("d = 1", 50), ok("e = 1", 0)]))
    pairs = bp.pairs_for_run(r, bp.PairsConfig(runs="x"))
    assert [(p.chosen, p.rejected) for p in pairs] == [("b = 1", "a("), ("b = 1", "e = 1")]
    assert pairs[0].prompt == [{"role": "user", "content": "Clear the pip cache"}]
    assert pairs[0].meta == {"run_id": "r1", "rule": "mixed", "chosen_score": 100, "rejected_score": None}
    assert pairs[1].meta["rejected_score"] == 0


def test_a_mixed_pair_whose_rejected_attempt_broke_what_must_be_kept_is_marked():
    wipe = {"code": "import shutil\nshutil.rmtree('/srv/app')", "ran": True, "space_freed": 0, "outcome": "broke"}
    said = {"code": "import os\nos.remove('/var/log/syslog')", "ran": True, "space_freed": 0,
            "error": f"{runlogs.BROKE_ERROR}: /var/log/syslog"}  # a log without outcomes, in attempts.py's words
    late = {"code": "x = (", "ran": False, "error": f"SyntaxError, not {runlogs.BROKE_ERROR}"}
    pairs = bp.pairs_for_run(parsed(run(attempts=[wipe, said, late, ok(ZERO, 0), ok()])), bp.PairsConfig(runs="x"))
    assert [p.meta.get("rejected_broke", False) for p in pairs] == [True, True, False, False]
    assert runlogs.broke_in_log({"outcome": "broke"}) and not runlogs.broke_in_log({"outcome": "failed", "error": None})


def test_the_demo_logs_mark_each_keep_part_runs_wipe_and_nothing_else():
    pairs = [p for r in runlogs.read_runs(str(DEMO)) for p in bp.pairs_for_run(r, bp.PairsConfig(runs="x"))]
    marked = sorted(p.meta["run_id"] for p in pairs if p.meta.get("rejected_broke"))
    assert marked == ["run-0153", "run-0156", "run-0157", "run-0158", "run-0160", "run-0163", "run-0164",
                      "run-0165"]  # the runs that keep part


def test_mixed_cap_keeps_the_earliest_failures():
    attempts = [failed(f"x{i} = (") for i in range(6)] + [ok()]
    stats = Counter()
    pairs = bp.pairs_for_run(parsed(run(attempts=attempts)), bp.PairsConfig(runs="x", max_pairs_per_run=4), stats=stats)
    assert [p.rejected for p in pairs] == ["x0 = (", "x1 = (", "x2 = (", "x3 = ("]
    assert stats["pairs_capped"] == 2


def test_rejected_code_identical_to_chosen_or_repeated_is_skipped():
    # a transient failure retried with the same code, then a real failure twice
    attempts = [failed(GOOD + "  \n"), ok(GOOD), ok(ZERO, 0), ok(ZERO, 0)]
    stats = Counter()
    pairs = bp.pairs_for_run(parsed(run(attempts=attempts)), bp.PairsConfig(runs="x"), stats=stats)
    assert [p.rejected for p in pairs] == [ZERO]
    assert stats["same_code_skipped"] == 2


def test_mixed_run_with_only_same_code_is_counted_as_dropped(tmp_path):
    rows = [run(attempts=[failed(GOOD), ok(GOOD)], run_id="same"),
            run("Other", attempts=[ok()], run_id="other", prompt=[{"role": "user", "content": "q"}])]
    code, pairs, report = build(tmp_path, rows)
    assert report["runs_dropped"]["only_same_code"] == 1
    assert report["same_code_skipped"] == 1
    assert {p["meta"]["run_id"] for p in pairs} == {"other"}


def test_missing_score_counts_as_not_succeeded(tmp_path):
    code, pairs, report = build(tmp_path, [run(attempts=[{"code": ZERO, "ran": True}, ok(GOOD, 7)])])
    assert code == 0 and report["attempts_missing_score"] == 1
    assert [(p["meta"]["rule"], p["meta"]["rejected_score"]) for p in pairs] == [("mixed", None)]


def test_custom_score_key(tmp_path):
    attempts = [{"code": ZERO, "ran": True, "tests_passed": 0, "space_freed": 999},
                {"code": GOOD, "ran": True, "tests_passed": 3}]
    code, pairs, report = build(tmp_path, [run(attempts=attempts)], "--score_key", "tests_passed")
    assert report["attempts_missing_score"] == 0
    assert [(p["chosen"][0]["content"], p["rejected"][0]["content"], p["meta"]["chosen_score"]) for p in pairs] \
        == [(GOOD, ZERO, 3)]


def test_first_try_gives_a_strategy_pair_and_a_code_pair():
    r = parsed(run(attempts=[ok(GOOD, 10), ok("print(2)\n", 30)]))
    strategy_pair, code_pair = bp.pairs_for_run(r, bp.PairsConfig(runs="x", seed=7))
    assert strategy_pair.prompt == [{"role": m["role"], "content": m["content"]} for m in PROMPT]
    assert strategy_pair.chosen == "Clear the pip cache" and strategy_pair.rejected != strategy_pair.chosen
    assert strategy_pair.meta == {"run_id": "r1", "rule": "first_try_strategy", "chosen_score": 30,
                                  "rejected_score": None, "tags": ["get_system_plist", "get_basic_env_plist"]}
    assert code_pair.prompt == [{"role": "user", "content": "Clear the pip cache"}]
    assert code_pair.chosen == "print(2)\n" and not bp.compiles(code_pair.rejected)
    assert code_pair.meta["rule"] == "first_try_code" and "tags" not in code_pair.meta


# ---------------------------------------------------------------------------------------------
# --emit kto: every strategy and distinct code, labelled
# ---------------------------------------------------------------------------------------------

TAGS = ["get_system_plist", "get_basic_env_plist"]
ASK = [{"role": "user", "content": "Clear the pip cache"}]


def kto(attempts, stats=None, **cfg):
    examples = bp.examples_for_run(parsed(run(attempts=attempts)), bp.PairsConfig(runs="x", emit="kto", **cfg), stats)
    return [(e.completion, e.label, e.meta["score"]) for e in examples], examples


def test_kto_mixed_run_strategy_and_best_code_desirable_failed_codes_not():
    got, examples = kto([failed("a("), ok("b = 1", 100), ok("c = 1", 50), ok("e = 1", 0)])
    assert got == [("Clear the pip cache", True, 100),  # the strategy, scored by the run's best code
                   ("a(", False, None), ("b = 1", True, 100), ("c = 1", True, 50), ("e = 1", False, 0)]
    strategy, *codes = examples
    assert strategy.prompt == [{"role": m["role"], "content": m["content"]} for m in PROMPT]
    assert strategy.meta == {"run_id": "r1", "rule": "kto_strategy", "score": 100, "outcome": "mixed", "tags": TAGS}
    assert all(e.prompt == ASK for e in codes)
    assert codes[0].meta == {"run_id": "r1", "rule": "kto_code", "score": None, "outcome": "mixed"}


def test_kto_uses_the_runs_dpo_drops_all_undesirable(tmp_path):
    got, examples = kto([ok(ZERO, 0), failed(), ok(ZERO, -3)])
    assert got == [("Clear the pip cache", False, 0),  # the run's highest score, though nothing succeeded
                   (ZERO, False, 0), (BROKEN, False, None)]
    assert examples[0].meta["outcome"] == "never_succeeded" and examples[0].meta["tags"] == TAGS
    assert kto([])[0] == [("Clear the pip cache", False, None)]  # never_ran: its strategy alone
    rows = [run(attempts=[ok(ZERO, 0), failed()])]
    assert build(tmp_path, rows)[0] == 1  # DPO: nothing to pair, nothing written
    code, lines, report = build(tmp_path, rows, "--emit", "kto")
    assert code == 0 and [line["label"] for line in lines] == [False, False, False]
    assert report["runs_used"] == 1 and report["examples_by_label"] == {"desirable": 0, "undesirable": 3}


def test_kto_first_try_run_has_no_garbled_text():
    got, examples = kto([ok(GOOD, 10), ok("print(2)\n", 30)])
    assert got == [("Clear the pip cache", True, 30), (GOOD, True, 10), ("print(2)\n", True, 30)]
    assert {e.meta["outcome"] for e in examples} == {"first_try"}


def test_kto_repeated_code_is_one_example_desirable_if_it_ever_succeeded():
    stats = Counter()
    got, _ = kto([failed(GOOD + "  \n"), ok(ZERO, 0), ok(GOOD, 7), ok(ZERO, 0), ok(GOOD, 9)], stats)
    # GOOD failed once (a transient error), then succeeded twice: its best try stands for it
    assert got == [("Clear the pip cache", True, 9), (GOOD, True, 9), (ZERO, False, 0)]
    assert stats["same_code_skipped"] == 3
    got, _ = kto([ok(ZERO, 0), failed(ZERO + "\n")])
    assert got[1:] == [(ZERO, False, 0)]  # never succeeded: its first try stands for it


def test_kto_caps_undesirable_codes_per_run_not_desirable_ones():
    stats = Counter()
    attempts = [failed(f"x{i} = (") for i in range(6)] + [ok(f"y{i} = 1", i + 1) for i in range(6)]
    got, _ = kto(attempts, stats, max_pairs_per_run=4)
    assert [c for c, label, _ in got[1:] if not label] == ["x0 = (", "x1 = (", "x2 = (", "x3 = ("]
    assert [c for c, label, _ in got[1:] if label] == [f"y{i} = 1" for i in range(6)]
    assert stats["pairs_capped"] == 2


def test_kto_run_whose_examples_all_duplicate_earlier_ones_is_dropped_and_said_why(tmp_path, capsys):
    rows = [run(attempts=[failed(), ok()], run_id="a"), run(attempts=[failed(), ok()], run_id="again"),
            run("Other", attempts=[ok()], run_id="b")]
    code, lines, report = build(tmp_path, rows, "--emit", "kto")
    assert [line["meta"]["run_id"] for line in lines] == ["a", "a", "a", "b", "b"]
    assert report["runs_used"] == 2 and report["runs_dropped"] == {"only_duplicates": 1}
    assert report["duplicates_removed"] == 3
    assert "1 runs whose examples all duplicate earlier ones" in capsys.readouterr().err


def test_kto_with_openai_format_is_refused(tmp_path, capsys):
    assert kit.run_cli(bp.main, [str(DEMO), "-o", str(tmp_path / "k.jsonl"), "--emit", "kto", "--format", "openai"]) == 2
    assert "--emit kto writes TRL's unpaired format (prompt/completion/label); --format openai has none" \
        in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Garbling
# ---------------------------------------------------------------------------------------------

CODES = ["x = 1", "print(1)\n", "pass", "import shutil\nshutil.rmtree('/tmp/x', ignore_errors=True)\nprint(0)\n",
         "for i in range(3):\n    print(i)\n", "s = '''\nmulti\n'''\n", "# only a comment\n",
         'import re\nprint(re.findall("\\d+", "a1"))  # 数字 \n']


@pytest.mark.parametrize("code", CODES)
def test_garbled_code_differs_never_compiles_and_keeps_its_trailing_newline(code):
    for seed in range(60):
        out = bp.garble_code(code, bp.rng_for(seed, "r1", code))
        assert out.strip() != code.strip()
        assert not bp.compiles(out), out
        assert out.endswith("\n") == code.endswith("\n")


@pytest.mark.parametrize("text", ["a", "Clear the pip cache", "Vider le cache des vignettes — ~/.cache/thumbnails"])
def test_garbled_text_always_differs(text):
    for seed in range(60):
        out = bp.garble_text(text, bp.rng_for(seed, "r1", text))
        assert out and out.split() != text.split()


def test_garbling_is_deterministic_per_seed_run_and_text():
    g0, g0_again, g1 = bp.RuleGarbler(0), bp.RuleGarbler(0), bp.RuleGarbler(1)
    code = CODES[3]
    assert g0.garble(code, "code", "r1", []) == g0_again.garble(code, "code", "r1", [])
    assert g0.garble(code, "code", "r1", []) != g1.garble(code, "code", "r1", [])
    text = "Clear the pip cache now"
    assert g0.garble(text, "text", "r1", []) == g0_again.garble(text, "text", "r1", []) != text


def test_output_does_not_depend_on_python_hash_seed(tmp_path):
    """hash() of a str changes with PYTHONHASHSEED between interpreter runs; the pairs must not."""
    outputs = []
    for hash_seed in ("1", "2"):
        out = tmp_path / f"pairs{hash_seed}.jsonl"
        subprocess.run([sys.executable, str(ROOT / "build_pairs.py"), str(DEMO), "-o", str(out)], check=True,
                       capture_output=True, env={**os.environ, "PYTHONHASHSEED": hash_seed}, timeout=60)
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]


def test_strip_fences():
    assert bp.strip_fences("Here:\n```python\nx = (\n```\nbye") == "x = ("
    assert bp.strip_fences("  x = (  ") == "x = ("


# ---------------------------------------------------------------------------------------------
# Cross-run pairs
# ---------------------------------------------------------------------------------------------

def test_cross_run_best_strategy_beats_failed_ones_with_cap_and_ties():
    untagged = [{"role": m["role"], "content": m["content"]} for m in PROMPT]  # same prompt, no tags
    runs = [run("F1", [failed()], run_id="f1"),
            run("Best", [failed(), ok(score=50)], run_id="b1", prompt=untagged),
            run("F2", [ok(score=0)], run_id="f2"),
            run("Tie", [ok(score=50)], run_id="b2"),            # ties lose to the earlier run
            run("Best", [failed()], run_id="f3"),               # same text as the best: no pair
            run("F1", [failed()], run_id="f4"),                 # repeated failed strategy: once
            run("F3", [failed()], run_id="f5"),
            run("Other", [failed()], run_id="o1", prompt=[{"role": "user", "content": "elsewhere"}])]
    index = bp.CrossRunIndex(max_pairs_per_prompt=2)
    for r in runs:
        index.add(parsed(r))
    pairs = list(index.pairs())
    assert [(p.chosen, p.rejected, p.meta["run_id"]) for p in pairs] == [("Best", "F1", "f1"), ("Best", "F2", "f2")]
    assert pairs[0].prompt == untagged == pairs[1].prompt
    assert pairs[1].meta == {"run_id": "f2", "rule": "cross_run", "chosen_score": 50, "rejected_score": 0,
                             "chosen_run_id": "b1", "tags": ["get_system_plist", "get_basic_env_plist"]}
    assert index.capped == 1 and index.recovered == {"never_ran": 1, "never_succeeded": 1}


def test_cross_run_keeps_a_bounded_record_per_prompt():
    index = bp.CrossRunIndex(max_pairs_per_prompt=2)
    for i in range(100):
        index.add(parsed(run(f"F{i}", [failed()], run_id=f"f{i}")))
    group, = index.groups.values()
    assert len(group.failed) == 3 and group.overflow == 97


def test_cross_run_pairs_come_after_run_pairs_and_can_be_turned_off(tmp_path):
    rows = [run("Bad", [failed()], run_id="f"), run("Good", [ok()], run_id="g")]
    code, pairs, report = build(tmp_path, rows)
    assert [p["meta"]["rule"] for p in pairs] == ["first_try_strategy", "first_try_code", "cross_run"]
    assert report["runs_dropped"]["never_ran"] == 0 and report["failed_runs_recovered_by_cross_run"] == 1
    code, pairs, report = build(tmp_path, rows, "--no_cross_run")
    assert report["pairs_by_rule"]["cross_run"] == 0 and report["runs_dropped"]["never_ran"] == 1


# ---------------------------------------------------------------------------------------------
# Input shapes, output shapes, determinism
# ---------------------------------------------------------------------------------------------

def test_message_tag_pairs_are_accepted_and_group_with_plain_messages():
    pairs_shape = [[{"role": m["role"], "content": m["content"]}, m["tag"]] for m in PROMPT]
    a, b = parsed(run(prompt=pairs_shape)), parsed(run(prompt=PROMPT))
    assert a.messages == b.messages and a.tags == b.tags == ["get_system_plist", "get_basic_env_plist"]
    assert bp.prompt_key(a.messages) == bp.prompt_key(b.messages)


def test_run_id_defaults_to_the_line_number(tmp_path):
    code, pairs, _ = build(tmp_path, [run(attempts=[failed(), ok()], run_id=None)])
    assert pairs[0]["meta"]["run_id"] == "line-1"


def test_unicode_is_written_as_is(tmp_path):
    code_text = "# téléchargements partiels — 部分\nprint('Téléchargements')\n"
    code, pairs, _ = build(tmp_path, [run("Vider ~/Téléchargements", [failed(), ok(code_text)])])
    raw = (tmp_path / "pairs.jsonl").read_text(encoding="utf-8")
    assert "Téléchargements" in raw and "部分" in raw and "\\u" not in raw
    assert pairs[0]["chosen"][0]["content"] == code_text


def test_identical_pairs_are_written_once(tmp_path):
    rows = [run(attempts=[failed(), ok()], run_id="a"), run(attempts=[failed(), ok()], run_id="b")]
    code, pairs, report = build(tmp_path, rows)
    assert len(pairs) == 1 and report["duplicates_removed"] == 1 and report["pairs_written"] == 1


def test_output_is_byte_identical_for_the_same_seed(tmp_path):
    out = [tmp_path / f"{name}.jsonl" for name in ("a", "b", "c")]
    for path, seed in zip(out, ("0", "0", "1")):
        assert kit.run_cli(bp.main, [str(DEMO), "-o", str(path), "--seed", seed]) == 0
    assert out[0].read_bytes() == out[1].read_bytes()
    assert out[0].read_bytes() != out[2].read_bytes()


def test_openai_format(tmp_path):
    code, pairs, _ = build(tmp_path, [run(attempts=[failed(), ok()])], "--format", "openai")
    assert pairs == [{"input": {"messages": [{"role": "user", "content": "Clear the pip cache"}]},
                      "preferred_output": [{"role": "assistant", "content": GOOD}],
                      "non_preferred_output": [{"role": "assistant", "content": BROKEN}]}]


def test_line_format_is_fixed():
    pair = formats.Pair([{"role": "user", "content": "é"}], "a", "b", {"run_id": "r", "rule": "mixed"})
    assert formats.to_line(formats.to_record(pair)) == (
        '{"prompt": [{"role": "user", "content": "é"}], "chosen": [{"role": "assistant", "content": "a"}], '
        '"rejected": [{"role": "assistant", "content": "b"}], "meta": {"run_id": "r", "rule": "mixed"}}\n')


def test_stdin_and_stdout(tmp_path, monkeypatch, capsys):
    data = json.dumps(run(attempts=[failed(), ok()])) + "\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data.encode("utf-8")), encoding="utf-8"))
    assert kit.run_cli(bp.main, ["-", "-o", "-"]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line)["meta"]["rule"] for line in captured.out.splitlines()] == ["mixed"]
    assert "1 runs read from - " in captured.err


# ---------------------------------------------------------------------------------------------
# Bad input and bad options
# ---------------------------------------------------------------------------------------------

BAD_LINES = {
    "malformed JSON": (b'{"run_id": "x",', "malformed JSON: Expecting property name enclosed in double quotes"),
    "not an object": (b'["a run?"]', "expected a run (a JSON object), got a list"),
    "no strategy": (json.dumps(run(strategy=None)).encode(), "strategy is missing or empty"),
    "blank strategy": (json.dumps(run(strategy="  ")).encode(), "strategy is missing or empty"),
    "attempts not a list": (json.dumps({**run(), "attempts": "x"}).encode(), "attempts must be a list"),
    "no attempts": (json.dumps(run(attempts=None)).encode(), "attempts must be a list, got nothing"),
    "attempt without code": (json.dumps(run(attempts=[{"ran": True}])).encode(), "attempts[0]: code is missing"),
    "ran not boolean": (json.dumps(run(attempts=[{"code": "x", "ran": "yes"}])).encode(),
                        "attempts[0]: ran must be true or false"),
    "score not a number": (json.dumps(run(attempts=[ok(score="5 MB")])).encode(),
                           "attempts[0]: space_freed must be a finite number"),
    "no prompt": (json.dumps(run(prompt=None)).encode(), "prompt must be a non-empty list of messages"),
    "bad role": (json.dumps(run(prompt=[{"role": "robot", "content": "x"}])).encode(),
                 "prompt[0]: role must be one of"),
    "list role": (json.dumps(run(prompt=[{"role": ["user"], "content": "x"}])).encode(),
                  "prompt[0]: role must be one of assistant, system, tool, user, got ['user']"),  # was a TypeError
    "object role": (json.dumps(run(prompt=[{"role": {"a": 1}, "content": "x"}])).encode(),
                    "prompt[0]: role must be one of assistant, system, tool, user, got {'a': 1}"),
    "nested 5,000 deep": (b"[" * 5000 + b"]" * 5000, "malformed JSON: nested too deep"),  # was a RecursionError
    "bad pair": (json.dumps(run(prompt=[[{"role": "user", "content": "x"}]])).encode(),
                 "prompt[0]: a [message, tag] pair has 2 items, not 1"),
    "not UTF-8": (b'{"run_id": "caf\xe9"}', "not valid UTF-8 (byte 0xe9 at column 16)"),
    "lone surrogate": (b'{"run_id": "x", "prompt": [{"role": "user", "content": "\\ud800"}]}',
                       "prompt[0] holds an unpaired surrogate (\\ud800)"),
}


@pytest.mark.parametrize("name", BAD_LINES)
def test_bad_input_reports_file_and_line_and_writes_nothing(tmp_path, capsys, name):
    bad, message = BAD_LINES[name]
    src = tmp_path / "runs.jsonl"
    src.write_bytes(json.dumps(run(attempts=[ok()])).encode() + b"\n\n" + bad + b"\n")
    out = tmp_path / "pairs.jsonl"
    out.write_text("previous pairs\n")
    assert kit.run_cli(bp.main, [str(src), "-o", str(out), "--report", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err.startswith(f"{src}:3: {message}")
    assert out.read_text() == "previous pairs\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl", "runs.jsonl"]  # no temp file, no report


def test_skip_invalid_skips_and_counts(tmp_path, capsys):
    src = tmp_path / "runs.jsonl"
    src.write_bytes(b"not json\n" + json.dumps(run(attempts=[failed(), ok()])).encode() + b"\n[]\n")
    code, pairs, report = build(tmp_path, src, "--skip_invalid")
    assert code == 0 and len(pairs) == 1
    assert report["invalid_lines_skipped"] == 2 and report["runs_read"] == 1
    assert f"{src}:1: malformed JSON" in capsys.readouterr().err


def test_no_usable_run_exits_1_without_output(tmp_path, capsys):
    code, pairs, report = build(tmp_path, [run(attempts=[failed()]), run(attempts=[ok(score=0)])])
    assert code == 1 and not (tmp_path / "pairs.jsonl").exists()
    assert report["pairs_written"] == 0
    assert "no usable run" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("")
    assert build(tmp_path, tmp_path / "empty.jsonl")[0] == 1


def test_missing_input_file(tmp_path, capsys):
    assert kit.run_cli(bp.main, [str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "p.jsonl")]) == 2
    assert "nope.jsonl: cannot read the run logs: No such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize("flags, problem", [
    (["--garble", "model"], "--garble model needs --model PATH"),
    (["--model", "m"], "--model is only used with --garble model"),
    (["--max_pairs_per_run", "0"], "max_pairs_per_run must be at least 1, got 0"),
    (["--max-pairs-per-prompt", "0"], "max_pairs_per_prompt must be at least 1, got 0"),
    (["--emit", "kto", "--garble", "model", "--model", "m"], "--garble model is only used with --emit dpo"),
    (["--emit", "kto", "--no_cross_run"], "--no_cross_run is only used with --emit dpo"),
    (["--emit", "kto", "--max_pairs_per_prompt", "2"], "--max_pairs_per_prompt is only used with --emit dpo"),
])
def test_bad_options_are_reported_together(tmp_path, capsys, flags, problem):
    assert kit.run_cli(bp.main, ["runs.jsonl", *flags]) == 2
    assert problem in capsys.readouterr().err


def test_unknown_flag_is_an_error():
    with pytest.raises(SystemExit) as e:
        bp.main(["runs.jsonl", "--max_pairs", "3", "--bogus"])
    assert e.value.code == 2


def test_argv_spellings_reach_the_config(tmp_path):
    """-o, --dashed-names and a bare boolean flag before the input file all parse as meant."""
    out = tmp_path / "p.jsonl"
    cfg = kit.parse_config(bp.PairsConfig, ["--skip_invalid", "runs.jsonl", "-o", str(out), "--no-cross-run",
                                            "--score-key=k"], "d", positional="runs")
    assert (cfg.skip_invalid, cfg.runs, cfg.output, cfg.cross_run, cfg.score_key) == \
        (True, "runs.jsonl", str(out), False, "k")
    cfg = kit.parse_config(bp.PairsConfig, ["--skip_invalid", "false", "-"], "d", positional="runs")
    assert (cfg.skip_invalid, cfg.runs) == (False, "-")


# ---------------------------------------------------------------------------------------------
# The demo logs and the command line
# ---------------------------------------------------------------------------------------------

def test_demo_logs_exercise_every_rule_and_load_as_pairs(tmp_path):
    code, pairs, report = build(tmp_path, DEMO)
    assert code == 0 and report["invalid_lines_skipped"] == 0
    assert report["pairs_by_rule"]["near_miss"] == 0  # only attempts.py --widen logs a made attempt
    assert all(n > 0 for k, n in report["pairs_by_rule"].items() if k != "near_miss"), report["pairs_by_rule"]
    assert all(n > 0 for n in report["runs_by_outcome"].values()), report["runs_by_outcome"]
    assert 60 <= report["pairs_written"] <= 90
    assert report["duplicates_removed"] > 0 and report["pairs_capped"] > 0 and report["cross_run_capped"] > 0
    records, stats = formats.load_pairs(str(tmp_path / "pairs.jsonl"))
    assert stats["format"] == "trl_conversational" and len(records) == report["pairs_written"]
    assert kit.run_cli(bp.main, [str(DEMO), "-o", str(tmp_path / "oa.jsonl"), "--format", "openai"]) == 0
    assert formats.load_pairs(str(tmp_path / "oa.jsonl"))[1]["format"] == "openai"


def test_demo_logs_with_emit_kto_use_every_run(tmp_path, capsys):
    _, _, dpo = build(tmp_path, DEMO)
    assert dpo["emit"] == "dpo" and dpo["runs_used"] == dpo["runs_read"] - sum(dpo["runs_dropped"].values())
    capsys.readouterr()
    code, lines, report = build(tmp_path, DEMO, "--emit", "kto")
    assert code == 0 and report["emit"] == "kto" and report["runs_read"] == dpo["runs_read"]
    assert report["runs_used"] == report["runs_read"] > dpo["runs_used"]
    assert sum(report["runs_dropped"].values()) == 0 < sum(dpo["runs_dropped"].values())
    assert all(n > 0 for n in report["examples_by_label"].values()), report["examples_by_label"]
    assert report["examples_by_rule"]["kto_strategy"] == report["runs_read"]  # no duplicate strategies in the demo
    assert report["examples_by_rule"]["kto_code"] > 0 and report["undesirable_capped"] > 0
    assert report["examples_written"] == len(lines) == sum(report["examples_by_label"].values())
    assert all(list(line) == ["prompt", "completion", "label", "meta"] and line["label"] in (True, False)
               and line["completion"][0]["role"] == "assistant" for line in lines)
    records, stats = formats.load_pairs(str(tmp_path / "pairs.jsonl"))  # what train_dpo.py reads: KTO, by run
    assert stats["format"] == "kto" and len(records) == len(lines) and len({r["_run"] for r in records}) == 57
    labels = report["examples_by_label"]
    assert (f"examples written: {len(lines)} ({labels['desirable']} desirable, {labels['undesirable']} undesirable) "
            f"from {report['runs_used']} of {report['runs_read']} runs") in capsys.readouterr().err


def test_help_runs_as_a_script():
    result = subprocess.run([sys.executable, str(ROOT / "build_pairs.py"), "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "--max_pairs_per_run" in result.stdout and "python build_pairs.py" in result.stdout


@pytest.mark.integration
def test_model_garbler_on_a_tiny_model():
    if not MODEL.is_dir():
        pytest.skip(f"no model at {MODEL}")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    garbler = bp.ModelGarbler(str(MODEL), seed=0)  # one load for the whole test (~10 s on a CPU)
    r = parsed(run(attempts=[ok("import shutil\nshutil.rmtree('/tmp/x', ignore_errors=True)\nprint(0)\n")]))
    strategy_pair, code_pair = bp.pairs_for_run(r, bp.PairsConfig(runs="x", garble="model", model=str(MODEL)), garbler)
    assert strategy_pair.rejected.strip() and strategy_pair.rejected != strategy_pair.chosen
    assert not bp.compiles(code_pair.rejected)
    again = bp.pairs_for_run(r, bp.PairsConfig(runs="x", garble="model", model=str(MODEL)), garbler)
    assert [p.rejected for p in again] == [strategy_pair.rejected, code_pair.rejected]  # torch seed fixed per answer


def test_digest_set_finds_every_duplicate_across_growth():
    import random

    rng = random.Random(7)
    values = [rng.getrandbits(64) for _ in range(5000)]
    s = formats.DigestSet(bits=0)  # grows at 128 entries, then 512, 2048: rehashing is exercised
    assert all(s.add(v) for v in values)
    assert s.bits == 6 and len(s) == 5000
    assert not any(s.add(v) for v in values[::7])  # every one of them is still found after the rehashes
    assert s.add(values[0] ^ 1) and len(s) == 5001  # a neighbour is a different digest
    assert sorted(v for b in s.buckets for v in b) == sorted(values + [values[0] ^ 1])


# ---------------------------------------------------------------------------------------------
# The fast paths give what the plain ones do
# ---------------------------------------------------------------------------------------------

TRICKY = ["é 数字 😀", 'say "hi"\\\t\x01\u2028\u2029', "", " ", "\x00nul", "</script>", "\\ud800 as text", "a" * 3000]


@pytest.mark.parametrize("fmt", ["trl", "openai"])
def test_digest_and_line_match_the_plain_encoders(fmt):
    metas = [{"run_id": "r", "rule": "mixed", "chosen_score": 3, "rejected_score": None},
             {"run_id": "é", "rule": "cross_run", "chosen_score": 2.5, "rejected_score": -0.0, "chosen_run_id": "x",
              "tags": ["t", None]},
             {"rule": "spin", "line": 10**30, "ok": True, "nested": {"a": [1e-300, "\x7f"]}}]
    sub = type("Sub", (str,), {})  # not a plain str: the plain way
    prompts = [[{"role": "user", "content": t}] for t in TRICKY] + [
        [{"role": "system", "content": "s", "tag": "x"}, {"role": "user", "content": "u"}], [],
        [{"role": "user", "content": 5}], [{"role": "user", "content": sub("sub")}]]
    for i, prompt in enumerate(prompts):
        for chosen, rejected in [(TRICKY[i % len(TRICKY)], TRICKY[-1 - i % len(TRICKY)]), ("a", sub("b"))]:
            pair = formats.Pair(prompt, chosen, rejected, metas[i % len(metas)])
            assert formats.digest_and_line(pair, fmt) == (formats.pair_digest(pair), formats.to_line(formats.to_record(pair, fmt)))


def test_example_digest_and_line_match_the_plain_encoders():
    sub = type("Sub", (str,), {})  # not a plain str: the plain way
    metas = [{"run_id": "r", "rule": "kto_code", "score": 3, "outcome": "mixed"},
             {"run_id": "é", "rule": "kto_strategy", "score": None, "outcome": "never_ran", "tags": ["t", None]}]
    prompts = [[{"role": "user", "content": t}] for t in TRICKY] + [
        [{"role": "system", "content": "s", "tag": "x"}, {"role": "user", "content": "u"}], [],
        [{"role": "user", "content": 5}], [{"role": "user", "content": sub("sub")}]]
    for i, prompt in enumerate(prompts):
        for completion, label in [(TRICKY[i % len(TRICKY)], True), (TRICKY[-1 - i % len(TRICKY)], False),
                                  (sub("c"), True), ("c", 1)]:
            example = formats.Example(prompt, completion, label, metas[i % len(metas)])
            plain = (formats.example_digest(example), formats.to_line(formats.to_record(example)))
            assert formats.digest_and_line(example) == formats.example_digest_and_line(example) == plain
    pair = formats.Pair([{"role": "user", "content": "p"}], "c", "true", {})
    example = formats.Example([{"role": "user", "content": "p"}], "c", True, {})
    assert formats.pair_digest(pair) != formats.example_digest(example)  # a label is not a string
    with pytest.raises(ValueError, match="no unpaired"):
        formats.digest_and_line(example, "openai")


def test_example_line_format_is_fixed():
    """What the KTO trainer reads: a contract with the reading side."""
    example = formats.Example([{"role": "user", "content": "é"}], "a", True, {"run_id": "r", "rule": "kto_code"})
    assert formats.digest_and_line(example)[1] == (
        '{"prompt": [{"role": "user", "content": "é"}], "completion": [{"role": "assistant", "content": "a"}], '
        '"label": true, "meta": {"run_id": "r", "rule": "kto_code"}}\n')


def test_pair_writer_writes_examples_and_counts_rules_and_labels(tmp_path):
    ask = [{"role": "user", "content": "s"}]
    examples = [formats.Example(ask, "a", True, {"rule": "kto_code"}), formats.Example(ask, "b", False, {"rule": "kto_code"}),
                formats.Example(ask, "a", True, {"rule": "kto_code", "run_id": "again"}),  # a duplicate: meta aside
                formats.Example(ask, "a", False, {"rule": "kto_strategy"})]  # another label: another example
    with formats.PairWriter(str(tmp_path / "e.jsonl"), "trl") as writer:
        writer.write(examples)
        writer.commit()
    lines = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(r["completion"][0]["content"], r["label"]) for r in lines] == [("a", True), ("b", False), ("a", False)]
    assert writer.duplicates == 1 and writer.by_label == {True: 1, False: 2}
    assert writer.by_rule == {"kto_code": 2, "kto_strategy": 1}


def test_prompt_key_is_equal_exactly_when_the_canonical_prompt_json_is():
    def m(*pairs):
        return [{"role": r, "content": c} for r, c in pairs]
    prompts = [m(("user", "ab")), m(("user", "a"), ("user", "b")), m(("user", "a\x00b")), m(("user", "1\x00a")),
               m(("user", "")), m(("user", ""), ("user", "")), m(("system", "ab")), m(("user", "é")),
               m(("user", "ab")) + [{"role": "user", "content": "c", "tag": "t"}],
               [{"role": "user", "content": "ab", "tag": "ignored"}], m(("user", "😀"))]
    for a in prompts:
        for b in prompts:
            assert (bp.prompt_key(a) == bp.prompt_key(b)) == (formats._canon_prompt(a) == formats._canon_prompt(b)), (a, b)


def plain_main(path, cfg):
    """build_pairs as it was: one run at a time through the public functions, no blocks, no workers. Returns the
    output, the invalid lines, and the runs with a line of their own written."""
    stats, outcomes, garbler, index = Counter(), Counter(), bp.RuleGarbler(cfg.seed), bp.CrossRunIndex(cfg.max_pairs_per_prompt)
    out, used = [], 0
    seen = set()
    for line_no, raw in enumerate(io.BytesIO(path.read_bytes()), start=1):
        try:
            text = raw.decode("utf-8").lstrip("\ufeff") if line_no == 1 else raw.decode("utf-8")
            if not text.strip():
                continue
            r = runlogs.parse_run(json.loads(text), str(path), line_no, cfg.score_key)
        except (ValueError, kit.UserError):
            stats["invalid"] += 1
            continue
        outcomes[bp.outcome(r)] += 1
        lines = len(out)
        if cfg.emit == "kto":  # no cross-run index
            for example in bp.examples_for_run(r, cfg, stats):
                if formats.example_digest(example) not in seen:
                    seen.add(formats.example_digest(example))
                    out.append(formats.to_line(formats.to_record(example)))
        else:
            for pair in bp.pairs_for_run(r, cfg, garbler, stats):
                if formats.pair_digest(pair) not in seen:
                    seen.add(formats.pair_digest(pair))
                    out.append(formats.to_line(formats.to_record(pair, cfg.format)))
            index.add(r)
        used += len(out) > lines
    for pair in index.pairs():
        if formats.pair_digest(pair) not in seen:
            seen.add(formats.pair_digest(pair))
            out.append(formats.to_line(formats.to_record(pair, cfg.format)))
    return "".join(out).encode("utf-8"), stats["invalid"], used


def tricky_logs(tmp_path):
    """The demo logs made awkward: unicode, escaped surrogate pairs (valid) and lone ones (invalid), float and int
    ids and scores, [message, tag] prompts, duplicate runs, blank and bad lines, a BOM and no final newline."""
    rows = [json.loads(line) for line in DEMO.read_text(encoding="utf-8").splitlines()]
    lines = []
    for i, r in enumerate(rows * 3):
        r = json.loads(json.dumps(r))
        r["run_id"] = i if i % 5 == 0 else f"r{i % 70}é"  # ids repeat: duplicate pairs
        r["strategy"] += ["", " — 数字 😀", ' "q" \\ \u2028'][i % 3]
        for a in r["attempts"]:
            if "space_freed" in a and i % 4 == 1:
                a["space_freed"] = [0.5, -0.0, 10**20, 7][i % 4]
        line = json.dumps(r, ensure_ascii=i % 2 == 0)
        if i % 11 == 3:
            line = line.replace('"strategy": "', '"strategy": "\\ud83d\\ude00\\\\ud800 ', 1)  # valid: a pair, then text
        lines.append(line.encode("utf-8"))
    for i, bad in enumerate([b"not json", b"[1]", b"\xff", b'{"run_id": "\\udfff", "prompt": []}',
                             lines[5].replace(b'"strategy": "', b'"strategy": "\\ud800', 1), b"", b"  \t"]):
        lines.insert(7 + 19 * i, bad)
    path = tmp_path / "tricky.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines))
    return path


@pytest.mark.parametrize("emit", ["dpo", "kto"])
@pytest.mark.parametrize("workers, block_bytes", [(1, bp.BLOCK_BYTES), (1, 1000), (2, 1000), (3, 64)])
def test_blocks_and_workers_give_what_one_run_at_a_time_gives(tmp_path, monkeypatch, workers, block_bytes, emit):
    src = tricky_logs(tmp_path)
    lines = src.read_bytes().split(b"\n")
    src.write_bytes(b"\n".join(lines + lines[84:101]))  # runs logged twice, far apart (no bad line among them)
    expected, invalid, used = plain_main(src, bp.PairsConfig(runs=str(src), seed=3, emit=emit))
    monkeypatch.setattr(bp, "BLOCK_BYTES", block_bytes)  # many blocks: the workers' results interleave
    out = tmp_path / "pairs.jsonl"
    code = kit.run_cli(bp.main, [str(src), "-o", str(out), "--skip_invalid", "--seed", "3", "--workers", str(workers),
                                 "--emit", emit, "--report", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and report["invalid_lines_skipped"] == invalid == 5 and report["duplicates_removed"] > 0
    assert out.read_bytes() == expected
    if emit == "kto":
        assert report["runs_used"] == used and report["runs_dropped"]["only_duplicates"] > 0


@pytest.mark.parametrize("workers", [1, 2])
def test_first_bad_line_stops_the_run_with_workers_too(tmp_path, monkeypatch, capsys, workers):
    src = tricky_logs(tmp_path)
    monkeypatch.setattr(bp, "BLOCK_BYTES", 2000)
    assert kit.run_cli(bp.main, [str(src), "-o", str(tmp_path / "p.jsonl"), "--workers", str(workers)]) == 2
    assert capsys.readouterr().err == f"{src}:8: malformed JSON: Expecting value at column 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tricky.jsonl"]


def test_read_blocks_cuts_where_a_file_iterates(tmp_path, monkeypatch):
    data = b"a\r\nb\rc\n\n" + b"x" * 50 + b"\n\x85\x0c\nlast"
    monkeypatch.setattr(bp, "BLOCK_BYTES", 7)  # lines longer than a block, too
    blocks = list(bp.read_blocks(io.BytesIO(data)))
    assert b"".join(b for b, _ in blocks) == data
    lines = [(n, raw) for b, first in blocks for n, raw in enumerate(io.BytesIO(b), start=first)]
    assert lines == list(enumerate(io.BytesIO(data), start=1))


def test_surrogate_escapes_are_found_without_encoding_every_string():
    def parse(text):
        return runlogs._parse_line(text, "f", 1, "space_freed")
    line = json.dumps(run(attempts=[ok()]))
    assert parse(line.replace('"Clear', '"\\ud83d\\ude00 \\\\ud800 Clear').encode()).strategy.startswith("😀 \\ud800")
    for escape in ("\\ud800", "\\uDC00", "\\udBfF"):
        with pytest.raises(kit.UserError, match="strategy holds an unpaired surrogate"):
            parse(line.replace('"Clear', f'"{escape}Clear').encode())


def test_workers_option():
    assert bp.worker_count(bp.PairsConfig(runs=str(DEMO))) == 1  # the default: this process alone
    assert bp.worker_count(bp.PairsConfig(runs="-", workers=0)) == 1  # standard input: no workers
    assert bp.worker_count(bp.PairsConfig(runs=str(DEMO), workers=0)) == 1  # small: not worth starting them
    assert bp.worker_count(bp.PairsConfig(runs=str(DEMO), workers=3)) == 3
    assert bp.worker_count(bp.PairsConfig(runs=str(DEMO), workers=3, garble="model", model="m")) == 1
    assert "workers must be 0" in bp.PairsConfig(runs="x", workers=-1).problems()[0]


# ---------------------------------------------------------------------------------------------
# No run log ends in a traceback: random and mutated runs, damaged lines (hypothesis).
# ---------------------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fuzz  # noqa: E402

VALID_RUNS = [run(attempts=[ok()]), run(attempts=[failed(), ok(), ok(ZERO, 5)], run_id=7),
              run(attempts=[failed()], prompt=[[PROMPT[0], "tag"], PROMPT[1]]), run(attempts=[])]


@settings(max_examples=200)
@given(data=fuzz.lines(VALID_RUNS), skip=st.booleans(),
       fmt_emit=st.sampled_from([("trl", "dpo"), ("openai", "dpo"), ("trl", "kto")]))
def test_no_run_log_ends_in_a_traceback(data, skip, fmt_emit):
    """Exit 0 (pairs written), 1 (no usable run) or 2 with `FILE:LINE: message` first; only the output and
    report are ever written, and nothing at all when the input is refused."""
    import contextlib
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, out, report = Path(tmp, "runs.jsonl"), Path(tmp, "pairs.jsonl"), Path(tmp, "report.json")
        src.write_bytes(data)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = kit.run_cli(bp.main, [str(src), "-o", str(out), "--report", str(report), "--workers", "1",
                                         "--format", fmt_emit[0], "--emit", fmt_emit[1],
                                         *(["--skip_invalid"] if skip else [])])
        written = sorted(p.name for p in Path(tmp).iterdir())
        if code == 2:
            assert err.getvalue().startswith(f"{src}:") and written == ["runs.jsonl"], err.getvalue()[-2000:]
        else:
            assert code in (0, 1) and written == sorted(["runs.jsonl", "report.json", *(["pairs.jsonl"] * (1 - code))])
            if code == 0:
                records, stats = formats.load_pairs(str(out))  # what it wrote trains
                assert (stats["format"] == "kto") == (fmt_emit[1] == "kto")


# ---------------------------------------------------------------------------------------------
# Tool-calling agents: their calls, the tools' results and the tools list go through the rules unchanged
# ---------------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "disk_usage", "parameters": {"type": "object"}}}]
TOOL_PROMPT = PROMPT + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "disk_usage", "arguments": "{\"path\": \"~/.cache\"}"}}], "tag": "tool_call"},
    {"role": "tool", "tool_call_id": "c1", "content": "4.1G ~/.cache/pip", "tag": "tool_result"},
    {"role": "user", "content": "Reply with one strategy."}]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_tool_calls_results_and_tools_go_through_every_rule_unchanged_and_load_as_pairs(tmp_path, workers):
    rows = [run(attempts=[ok()], tools=TOOLS, run_id="first", prompt=TOOL_PROMPT),
            run("Delete /home", attempts=[failed()], tools=TOOLS, run_id="loser", prompt=TOOL_PROMPT),
            run("Same words, no tools", attempts=[failed()], run_id="plain", prompt=TOOL_PROMPT[:2]),
            run(attempts=[failed(), ok()], run_id="mixed", prompt=TOOL_PROMPT, tools=TOOLS)]
    code, pairs, report = build(tmp_path, rows, "--workers", workers)
    assert code == 0
    expected = formats.messages([{k: v for k, v in m.items() if k != "tag"} for m in TOOL_PROMPT], "prompt")
    assert expected[2]["tool_calls"][0]["function"]["arguments"] == {"path": "~/.cache"}
    by_rule = {p["meta"]["rule"]: p for p in pairs}
    for rule in ("first_try_strategy", "cross_run"):
        assert by_rule[rule]["prompt"] == expected and by_rule[rule]["tools"] == TOOLS, rule
        assert by_rule[rule]["meta"]["tags"][2:4] == ["tool_call", "tool_result"]
    assert by_rule["cross_run"]["rejected"][0]["content"] == "Delete /home"  # not the tool-less prompt's run
    assert "tools" not in by_rule["first_try_code"]  # the code's prompt is the strategy alone
    loaded, _ = formats.load_pairs(str(tmp_path / "pairs.jsonl"))
    with_tools = [p for p in loaded if "tools" in p]
    assert with_tools and all(p["prompt"] == expected and formats.uses_tools(p) for p in with_tools)
    code, examples, _ = build(tmp_path, rows, "--emit", "kto", "--workers", workers)
    assert code == 0 and any(e.get("tools") == TOOLS and e["prompt"] == expected for e in examples)


@pytest.mark.parametrize("change, message", [
    ({"tools": "disk_usage"}, "runs.jsonl:1: tools must be a list of tools, got 'disk_usage'"),
    ({"prompt": TOOL_PROMPT[:3] + [{"role": "tool", "tool_call_id": "c7", "content": "x"}]},
     "runs.jsonl:1: prompt[3].tool_call_id 'c7' answers no tool call made before it (made: c1)"),
    ({"prompt": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "runs.jsonl:1: prompt[0]: only an assistant message makes tool_calls"),
    ({"prompt": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "runs.jsonl:1: prompt[0].tool_calls[0].function.arguments is not valid JSON"),
])
def test_a_malformed_tool_call_in_a_run_log_names_the_line_and_the_place(change, message):
    with pytest.raises(kit.UserError) as e:
        parsed(run(attempts=[ok()]) | change)
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize("emit", ["dpo", "kto"])
def test_extra_run_files_read_after_the_first_give_what_the_files_joined_give(tmp_path, emit, capsys):
    lines = (ROOT / "data" / "runs.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    first, second, third = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    first.write_text("".join(lines[:20])), second.write_text("".join(lines[20:35])), third.write_text("".join(lines[35:]))
    whole = tmp_path / "whole"
    whole.mkdir()
    code, joined, report = build(whole, ROOT / "data" / "runs.jsonl", "--emit", emit, "--prompts", str(whole / "p"))
    code2, parts, report2 = build(tmp_path, first, "--emit", emit, "--extra_runs", f"{second}, {third}",
                                  "--prompts", str(tmp_path / "p"))
    assert code == code2 == 0 and parts == joined and len(parts) > 20
    assert (tmp_path / "p").read_bytes() == (whole / "p").read_bytes()  # one prompt per (strategy, host)
    assert report2["extra_runs"] == [str(second), str(third)] and report2["runs_read"] == report["runs_read"] == 57
    assert f"57 runs read from {first} + {second} + {third}" in capsys.readouterr().err
    third.write_text("".join(lines[35:37]) + "{not json\n")
    code3, _, _ = build(tmp_path, first, "--emit", emit, "--extra_runs", f"{second},{third}")
    assert code3 == 2 and f"{third}:3:" in capsys.readouterr().err  # the file and its own line
    code4, _, _ = build(tmp_path, first, "--extra_runs", "-")
    assert code4 == 2 and "only RUNS may be -" in capsys.readouterr().err


def test_the_demo_holds_out_the_same_8_runs_the_readme_and_bench_results_were_measured_on():
    """make train's report scores these runs' prompts; a run added to data/runs.jsonl must land on the training
    side of the hash split, or every measured number in the README and bench/results-recipe.md stops comparing."""
    ids = [r.run_id for r in runlogs.read_runs(str(DEMO))]
    held = sorted(i for i in ids if formats.held_out({formats.RUN_KEY: i}, 0.2))
    assert held == ["run-0101", "run-0106", "run-0112", "run-0113", "run-0122", "run-0125", "run-0146", "run-0149"]
