"""formats.py: the five accepted pair formats, and every way a file can be wrong."""
import json

import pytest

import formats
import kit
from kit import UserError

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731

EXAMPLES = {
    "trl_standard": {"prompt": "2+2=", "chosen": " 4", "rejected": " 5"},
    "trl_conversational": {"prompt": [U("2+2?")], "chosen": [A("4")], "rejected": [A("5")]},
    "implicit_prompt": {"chosen": [U("2+2?"), A("4")], "rejected": [U("2+2?"), A("5")]},
    "openai": {"input": {"messages": [U("2+2?")]}, "preferred_output": [A("4")], "non_preferred_output": [A("5")]},
    "hh": {"chosen": "\n\nHuman: 2+2?\n\nAssistant: 4", "rejected": "\n\nHuman: 2+2?\n\nAssistant: 5"},
}


def write(tmp_path, rows, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_each_format_is_detected_and_normalised(fmt):
    record = EXAMPLES[fmt]
    assert formats.detect_format(record) == fmt
    out = formats.normalise(record, fmt)
    if fmt == "trl_standard":
        assert out == {"prompt": "2+2=", "chosen": " 4", "rejected": " 5"}
    else:
        assert out == {"prompt": [U("2+2?")], "chosen": [A("4")], "rejected": [A("5")]}


def test_implicit_prompt_over_text_cuts_at_a_word_boundary():
    out = formats.normalise({"chosen": "Q: capital of France? A: Paris", "rejected": "Q: capital of France? A: Pau"},
                            "implicit_prompt")
    assert out == {"prompt": "Q: capital of France? A: ", "chosen": "Paris", "rejected": "Pau"}


def test_multi_turn_hh_keeps_earlier_turns_in_the_prompt():
    chosen = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: 2+2?\n\nAssistant: 4"
    out = formats.normalise({"chosen": chosen, "rejected": chosen[:-1] + "5"}, "hh")
    assert out["prompt"] == [U("hi"), A("hello"), U("2+2?")]
    assert (out["chosen"], out["rejected"]) == ([A("4")], [A("5")])


def test_openai_text_parts_and_extra_keys():
    rec = {"input": {"messages": [{"role": "user", "content": [{"type": "text", "text": "2+2?"}]}], "tools": []},
           "preferred_output": [A("4")], "non_preferred_output": [A("5")]}
    assert formats.normalise(rec, "openai")["prompt"] == [U("2+2?")]


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_load_pairs_reads_a_file_in_each_format(tmp_path, fmt):
    records, stats = formats.load_pairs(write(tmp_path, [EXAMPLES[fmt]] * 3))
    path = write(tmp_path, [EXAMPLES[fmt]] * 3)
    assert stats == {"format": fmt, "lines": 3, "pairs": 3, "skipped": {}, "sha256": kit.sha256_file(path)}
    assert len(records) == 3


def conversational_rows(fmt: str) -> list[dict]:
    """The same pairs written in each message-list format: single turns, and a multi-turn prompt with a
    system message and an earlier exchange (OpenAI's content as text parts once)."""
    S = {"role": "system", "content": "Be brief."}  # noqa: N806
    pairs = [([U("How do I clear apt's cache?")], "Run `apt-get clean`.", "Reinstall Linux."),
             ([U("How do I find big files?")], "Use `du -ah / | sort -rh | head`.", "Buy a bigger disk."),
             ([S, U("hi"), A("hello"), U("2+2?")], "4", "5")]
    rows = []
    for prompt, good, bad in pairs:
        rows.append({
            "trl_conversational": {"prompt": prompt, "chosen": [A(good)], "rejected": [A(bad)]},
            "implicit_prompt": {"chosen": prompt + [A(good)], "rejected": prompt + [A(bad)]},
            "openai": {"input": {"messages": [m | {"content": [{"type": "text", "text": m["content"]}]}
                                              if m is S else m for m in prompt]},
                       "preferred_output": [A(good)], "non_preferred_output": [A(bad)]},
        }[fmt])
    return rows


def test_conversational_formats_load_to_identical_records(tmp_path):
    """What training sees is load_pairs' records: the three message-list formats give the very same ones
    (so one training run covers all three; tests/test_train_dpo.py trains the conversational one)."""
    loaded = {fmt: formats.load_pairs(write(tmp_path, conversational_rows(fmt), f"{fmt}.jsonl"))
              for fmt in ("trl_conversational", "implicit_prompt", "openai")}
    assert {fmt: stats["format"] for fmt, (_, stats) in loaded.items()} == {fmt: fmt for fmt in loaded}
    records = loaded["trl_conversational"][0]
    assert len(records) == 3 and records[2]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert records[2]["chosen"] == [A("4")]
    assert loaded["implicit_prompt"][0] == records
    assert loaded["openai"][0] == records


@pytest.mark.parametrize("line,message", [
    (b'{"prompt": "a", "chosen": "b"', "malformed JSON"),
    ({"prompt": "a", "chosen": "b"}, "missing field 'rejected'"),
    ({"prompt": "a", "chosen": 3, "rejected": "c"}, "chosen must be a string, got int"),
    ({"prompt": "a", "chosen": "  ", "rejected": "c"}, "chosen is empty"),
    ({"prompt": "a", "chosen": "same", "rejected": "same"}, "identical"),
    (b'\xff\xfe{"prompt": "a"}', "not UTF-8"),
    ({"question": "a", "answer": "b"}, "unknown format"),
    ({"prompt": [U("q")], "chosen": [A("x")], "rejected": [U("y")]}, "must end with a non-empty assistant message"),
    ({"prompt": [{"role": "robot", "content": "q"}], "chosen": [A("x")], "rejected": [A("y")]}, "unknown role"),
    ({"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "no turns here"}, "not in"),
    ({"chosen": "abc", "rejected": "xyz"}, "share no prompt"),
    ({"prompt": [{"role": ["user"], "content": "q"}], "chosen": [A("x")], "rejected": [A("y")]},
     r"unknown role \['user'\]"),  # a list or object role used to end in `TypeError: unhashable type`
    ({"prompt": [{"role": {"r": 1}, "content": "q"}], "chosen": [A("x")], "rejected": [A("y")]}, "unknown role"),
    (b"[" * 5000 + b"]" * 5000, "malformed JSON: nested too deep"),  # used to end in RecursionError
])
def test_a_bad_line_is_reported_with_file_and_line(tmp_path, line, message):
    path = write(tmp_path, [EXAMPLES["trl_standard"], line, EXAMPLES["trl_standard"]])
    if isinstance(line, dict) and formats.detect_format(line) not in (None, "trl_standard"):
        path = write(tmp_path, [line])  # a different format on line 2 would be a format mismatch instead
        expected_line = 1
    else:
        expected_line = 2
    with pytest.raises(UserError, match=message) as e:
        formats.load_pairs(path)
    assert (e.value.path, e.value.line) == (path, expected_line)


def test_a_byte_order_mark_is_read_past(tmp_path):
    """Windows tools start UTF-8 files with EF BB BF; the first line is read after it."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(EXAMPLES["trl_standard"]).encode() + b"\n")
    records, stats = formats.load_pairs(str(path))
    assert records == [EXAMPLES["trl_standard"]] and stats["format"] == "trl_standard"


def test_skip_invalid_skips_and_counts(tmp_path):
    rows = [EXAMPLES["trl_standard"], b"{oops", {"prompt": "a", "chosen": "x", "rejected": "x"},
            {"prompt": "a", "chosen": "", "rejected": "y"}, EXAMPLES["trl_standard"]]
    records, stats = formats.load_pairs(write(tmp_path, rows), skip_invalid=True)
    assert len(records) == 2
    assert stats["skipped"] == {"malformed_json": 1, "identical": 1, "invalid_pair": 1}


def test_mixed_formats_are_refused_even_when_skipping(tmp_path):
    path = write(tmp_path, [EXAMPLES["trl_standard"], EXAMPLES["openai"]])
    with pytest.raises(UserError, match="differs from the file's format trl_standard") as e:
        formats.load_pairs(path, skip_invalid=True)
    assert e.value.line == 2


def test_empty_file_and_all_bad_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(UserError, match="the file is empty"):
        formats.load_pairs(str(empty))
    with pytest.raises(UserError, match="no usable preference pair"):
        formats.load_pairs(write(tmp_path, [b"{bad"]), skip_invalid=True)


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="cannot read"):
        formats.load_pairs(str(tmp_path / "nope.jsonl"))
