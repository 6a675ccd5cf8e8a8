"""self_pairs.py (build_pairs.py spin / self-reward): pattern parsing, scores, pairing; then SPIN on the real model."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dpokit.pairs import from_logs
from dpokit.data import formats
from dpokit.core import kit
from dpokit.pairs import self_pairs as sp

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


# ------------------------------------------------------------------ the reward pattern

@pytest.mark.parametrize("text, expected", [
    ("Good answer. Score: 4", (4.0, "ok")),
    ("score:3", (3.0, "ok")),                      # case and spacing are forgiven
    ("Score:   2.5 points", (2.5, "ok")),
    ("Score: 1 ... on reflection, Score: 3", (3.0, "ok")),   # the conclusion counts: the last match
    ("Score: 0", (0.0, "ok")),                     # the range is inclusive at both ends
    ("Score: 5", (5.0, "ok")),
    ("I would give it four points.", (None, "unparsable")),
    ("Score: <total points>", (None, "unparsable")),
    ("", (None, "unparsable")),
    ("Score: 7", (None, "out_of_range")),
    ("Score: -1", (None, "out_of_range")),
    ("Score: 5.5", (None, "out_of_range")),
])
def test_parse_reward_good_bad_and_out_of_range(text, expected):
    assert sp.parse_reward(text, sp.compile_reward_pattern("Score: {reward}"), 0, 5) == expected


def test_pattern_text_is_literal_around_the_number():
    regex = sp.compile_reward_pattern("[[{reward}/10]]")
    assert sp.parse_reward("rating [[8/10]]", regex, 0, 10) == (8.0, "ok")
    assert sp.parse_reward("rating 8/10", regex, 0, 10) == (None, "unparsable")  # brackets are not regex syntax


@pytest.mark.parametrize("pattern", ["Score: N", "{reward} and {reward}", ""])
def test_pattern_needs_exactly_one_reward(pattern):
    with pytest.raises(ValueError, match="exactly once"):
        sp.compile_reward_pattern(pattern)


def test_bad_pattern_is_a_user_error_exit_2(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    result = subprocess.run([sys.executable, str(ROOT / "build_pairs.py"), "self-reward", str(prompts), "--model", "m",
                             "--reward_pattern", "Score: N", "--candidates", "1"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--reward_pattern" in result.stderr and "--candidates must be at least 2" in result.stderr


# ------------------------------------------------------------------ scores and pairing

def test_average_ignores_failed_judgements():
    assert sp.average([4.0, None, 2.0]) == 3.0
    assert sp.average([None, None]) is None


def test_expected_score_renormalises_over_allowed_scores():
    score, mass = sp.expected_score({0: 0.1, 1: 0.1, 5: 0.2})
    assert score == pytest.approx((0 + 0.1 + 1.0) / 0.4) and mass == pytest.approx(0.4)


def test_best_and_worst_by_hand():
    assert sp.best_and_worst(["a", "b", "c"], [2.0, 5.0, 1.0], 1.0) == (1, 2)


def test_ties_go_to_the_earliest_on_both_ends():
    assert sp.best_and_worst(["a", "b", "c", "d"], [5.0, 1.0, 5.0, 1.0], 0.5) == (0, 1)


def test_all_equal_or_too_close_gives_no_pair():
    assert sp.best_and_worst(["a", "b", "c"], [3.0, 3.0, 3.0], 0.0) == (None, "too_close")
    assert sp.best_and_worst(["a", "b"], [3.0, 3.4], 0.5) == (None, "too_close")
    assert sp.best_and_worst(["a", "b"], [3.0, 3.5], 0.5) == (1, 0)  # the margin is inclusive


def test_unscored_empty_and_duplicate_candidates_do_not_pair():
    assert sp.best_and_worst(["a", "b", "c"], [None, 4.0, None], 0.0) == (None, "too_few_scored")
    assert sp.best_and_worst(["same", " same ", ""], [5.0, 1.0, 0.0], 0.0) == (None, "too_few_scored")
    assert sp.best_and_worst(["x", "y", "x"], [1.0, 3.0, 5.0], 0.0) == (1, 0)  # the repeat of "x" counts once


# ------------------------------------------------------------------ reading examples and the template

def test_examples_in_messages_and_prompt_completion_form(tmp_path):
    f = tmp_path / "sft.jsonl"
    f.write_text(
        json.dumps({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                                 {"role": "assistant", "content": "A1"}]}) + "\n\n"
        + json.dumps({"prompt": "Q2", "completion": "A2"}) + "\n"
        + json.dumps({"prompt": [{"role": "user", "content": "Q3"}],
                      "completion": [{"role": "assistant", "content": "A3"}]}) + "\n")
    got = sp.read_examples(str(f))
    assert got == [(1, [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}], "A1"),
                   (3, [{"role": "user", "content": "Q2"}], "A2"), (4, [{"role": "user", "content": "Q3"}], "A3")]


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "user", "content": "Q"}]}', "no assistant message to train on"),
    ('{"prompt": "Q", "completion": 3}', "completion must be"),
    ('{"text": "Q"}', 'expected "messages"'),
    ('{"messages": [{"role": "bot", "content": "Q"}]}', "messages[0]: unknown role 'bot'"),
    ('not json', "malformed JSON"),
    ('{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": [{"id": "c", "function": '
     '{"name": "f", "arguments": "{}"}}]}]}', "SPIN compares the model's text answer"),
])
def test_bad_sft_lines_name_file_and_line(tmp_path, line, message):
    """SPIN reads SFT files as a supervised job does (supervised.py), and refuses what it cannot compare: tools."""
    f = tmp_path / "sft.jsonl"
    f.write_text('{"prompt": "ok", "completion": "fine"}\n' + line + "\n")
    with pytest.raises(kit.UserError) as e:
        sp.read_examples(str(f))
    assert str(e.value).startswith(f"{f}:2:") and message in str(e.value)


def test_prompts_files_keep_the_prompt_and_refuse_tool_use_naming_the_line(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"prompt": "Q1"}) + "\n" + json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Q"}, {"type": "text", "text": "2"}]},
        {"role": "assistant", "content": "dropped"}]}) + "\n")
    assert sp.read_prompts(str(f)) == [(1, [{"role": "user", "content": "Q1"}]),
                                       (2, [{"role": "user", "content": "Q2"}])]
    f.write_text(json.dumps({"prompt": [{"role": "user", "content": "Q"}, {"role": "tool", "tool_call_id": "c",
                                                                          "content": "r"}]}) + "\n")
    with pytest.raises(kit.UserError, match=r"prompts.jsonl:1: prompt: the model answers these prompts in text"):
        sp.read_prompts(str(f))


def test_bundled_template_fills_and_a_template_without_placeholders_is_refused(tmp_path):
    template = sp.read_template(str(ROOT / sp.DEFAULT_TEMPLATE))
    filled = sp.fill_template(template, [{"role": "user", "content": "What is 2+2?"}], "4")
    assert "User: What is 2+2?" in filled and "<response>4</response>" in filled and "Score: <total points>" in filled
    bad = tmp_path / "t.txt"
    bad.write_text("Rate {prompt}\n")
    with pytest.raises(kit.UserError, match="{response}"):
        sp.read_template(str(bad))


def test_run_log_mode_stays_the_default():
    result = subprocess.run([sys.executable, str(ROOT / "build_pairs.py"), "--help"], capture_output=True, text=True,
                            timeout=60)
    assert "--max_pairs_per_run" in result.stdout and "spin" in result.stdout


# ------------------------------------------------------------------ the real model

@pytest.mark.integration
@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="bundled model not converted (make model)")
def test_spin_pairs_reference_against_own_answer_and_drops_identical(tmp_path, capsys):
    model, tok, _ = sp.load_generator(str(MODEL))
    [[greedy]] = sp.sample(model, tok, [[{"role": "user", "content": "What is 2+2?"}]], 1, 12, 0.0, 1.0, 0, 8)
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"prompt": "What is 2+2?", "completion": greedy}) + "\n"   # the model's own answer
                   + json.dumps({"prompt": "Name a prime number.", "completion": "7 is prime."}) + "\n")
    out, report = tmp_path / "pairs.jsonl", tmp_path / "r.json"
    assert from_logs.main(["spin", str(sft), "--model", str(MODEL), "-o", str(out), "--report", str(report),
                             "--max_new_tokens", "12"]) == 0
    summary = json.loads(report.read_text())
    assert summary["examples"] == 2 and summary["dropped_same_as_reference"] == 1 and summary["pairs_written"] == 1
    pairs, stats = formats.load_pairs(str(out))  # a file train_dpo.py reads
    assert stats["format"] == "trl_conversational"
    assert pairs[0]["chosen"][0]["content"] == "7 is prime." and pairs[0]["rejected"][0]["content"]
