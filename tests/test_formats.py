"""formats.py: the accepted pair formats and file types, and every way an input can be wrong."""
import json
import os
import re

import pytest

from dpokit.data import formats
from dpokit.core import kit
from dpokit.core.kit import UserError

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731

EXAMPLES = {
    "trl_standard": {"prompt": "2+2=", "chosen": " 4", "rejected": " 5"},
    "trl_conversational": {"prompt": [U("2+2?")], "chosen": [A("4")], "rejected": [A("5")]},
    "implicit_prompt": {"chosen": [U("2+2?"), A("4")], "rejected": [U("2+2?"), A("5")]},
    "openai": {"input": {"messages": [U("2+2?")]}, "preferred_output": [A("4")], "non_preferred_output": [A("5")]},
    "hh": {"chosen": "\n\nHuman: 2+2?\n\nAssistant: 4", "rejected": "\n\nHuman: 2+2?\n\nAssistant: 5"},
    # HuggingFaceH4/ultrafeedback_binarized's columns: whole conversations beside the prompt string
    "ultrafeedback": {"prompt": "2+2?", "prompt_id": "ab12", "chosen": [U("2+2?"), A("4")],
                      "rejected": [U("2+2?"), A("5")], "messages": [U("2+2?"), A("4")],
                      "score_chosen": 8.0, "score_rejected": 3.0},
    # Intel/orca_dpo_pairs's columns (an empty system prompt adds no system message)
    "system_question": {"system": "", "question": "2+2?", "chosen": "4", "rejected": "5"},
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
    ignored = {"prompt_id": 3, "messages": 3, "score_chosen": 3, "score_rejected": 3} if fmt == "ultrafeedback" else {}
    assert stats == {"format": fmt, "lines": 3, "pairs": 3, "skipped": {}, "sha256": kit.sha256_file(path),
                     "path": path, "ignored_columns": ignored, "score_gap_dropped": 0, "files": []}
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
    ({"instruction": "a", "answer": "b"}, r"unknown format \(keys: 'answer', 'instruction'\).*--columns"),
    ({"question": "a", "answer": "b"}, "missing field 'chosen'"),
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


# ---------------------------------------------------------------------------------------------
# The public preference sets' shapes, a column mapping, score gaps.
# ---------------------------------------------------------------------------------------------

ORCA = {"system": "You are an AI assistant.", "question": "2+2?", "chosen": "4", "rejected": "5"}  # Intel/orca_dpo_pairs
ARGILLA = {"system": "", "input": "2+2?", "chosen": "4", "rejected": "5", "generations": ["4", "5"],  # argilla/distilabel-
           "status": "unchanged", "chosen_score": 9.0, "in_gsm8k_train": False}                  # intel-orca-dpo-pairs


def test_orca_and_argilla_shapes_become_a_system_and_user_prompt():
    assert formats.detect_format(ORCA) == formats.detect_format(ARGILLA) == "system_question"
    assert formats.normalise(ORCA, "system_question") == {
        "prompt": [{"role": "system", "content": "You are an AI assistant."}, U("2+2?")],
        "chosen": [A("4")], "rejected": [A("5")]}
    assert formats.normalise(ARGILLA, "system_question")["prompt"] == [U("2+2?")]  # no empty system message


def test_ultrafeedback_takes_the_prompt_from_the_conversation_and_checks_it():
    row = EXAMPLES["ultrafeedback"]
    multi = {"prompt": "2+2?", "chosen": [U("hi"), A("hello"), U(" 2+2? "), A("4")],
             "rejected": [U("hi"), A("hello"), U(" 2+2? "), A("5")]}
    assert formats.normalise(multi, "ultrafeedback")["prompt"] == [U("hi"), A("hello"), U(" 2+2? ")]
    answers_only = {"prompt": "2+2?", "chosen": [A("4")], "rejected": [A("5")]}
    assert formats.normalise(answers_only, "ultrafeedback") == formats.normalise(row, "ultrafeedback")
    with pytest.raises(ValueError, match="prompt differs from the conversations' last user turn"):
        formats.normalise(row | {"prompt": "3+3?"}, "ultrafeedback")


def test_extra_columns_are_counted_per_file(tmp_path):
    _, stats = formats.load_pairs(write(tmp_path, [ARGILLA, ARGILLA | {"rationale": "x"}]))
    assert stats["format"] == "system_question"
    assert stats["ignored_columns"] == {"chosen_score": 2, "generations": 2, "in_gsm8k_train": 2, "rationale": 1,
                                        "status": 2}


@pytest.mark.parametrize("spec,expected", [
    ("", {}),
    ("prompt=instruction, chosen=good,rejected=bad,system=sys", {"prompt": "instruction", "chosen": "good",
                                                                 "rejected": "bad", "system": "sys"}),
    ("prompt", "is not NAME=COLUMN"), ("answer=x", "'answer' is not one of"), ("chosen=a,chosen=b", "mapped twice"),
])
def test_parse_columns(spec, expected):
    if isinstance(expected, dict):
        assert formats.parse_columns(spec) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            formats.parse_columns(spec)


def test_columns_map_any_shape_onto_the_formats(tmp_path):
    rows = [{"instruction": "2+2?", "good": "4", "bad": "5", "sys": "Be brief.", "id": 1}]
    columns = formats.parse_columns("prompt=instruction,chosen=good,rejected=bad,system=sys")
    records, stats = formats.load_pairs(write(tmp_path, rows), columns=columns)
    assert records == [{"prompt": [{"role": "system", "content": "Be brief."}, U("2+2?")],
                        "chosen": [A("4")], "rejected": [A("5")]}]
    assert (stats["format"], stats["ignored_columns"]) == ("system_question", {"id": 1})
    columns = formats.parse_columns("prompt=instruction,chosen=good,rejected=bad")  # no system: plain text
    records, stats = formats.load_pairs(write(tmp_path, [{k: v for k, v in rows[0].items() if k != "sys"}]),
                                        columns=columns)
    assert stats["format"] == "trl_standard" and records == [{"prompt": "2+2?", "chosen": "4", "rejected": "5"}]
    with pytest.raises(UserError, match=r"no column 'good' \(--columns chosen=good\)") as e:
        formats.load_pairs(write(tmp_path, [EXAMPLES["trl_standard"]]), columns={"chosen": "good"})
    assert e.value.line == 1


def test_min_score_gap_drops_close_pairs_and_needs_scores(tmp_path):
    uf = EXAMPLES["ultrafeedback"]
    rows = [uf, uf | {"score_chosen": 5.0, "score_rejected": 4.5}, uf | {"score_chosen": 7, "score_rejected": 6}]
    records, stats = formats.load_pairs(write(tmp_path, rows), min_score_gap=1.0)
    assert (len(records), stats["score_gap_dropped"]) == (2, 1)
    assert "score_chosen" not in stats["ignored_columns"]  # read, with --min_score_gap
    with pytest.raises(UserError, match="every pair's score gap is below --min_score_gap 9.0"):
        formats.load_pairs(write(tmp_path, rows), min_score_gap=9.0)
    with pytest.raises(UserError, match="--min_score_gap needs scores") as e:
        formats.load_pairs(write(tmp_path, [ORCA]), min_score_gap=1.0)
    assert e.value.line == 1
    mapped = {"score_chosen": "chosen_score", "score_rejected": "rejected_score"}
    rows = [ORCA | {"chosen_score": 9, "rejected_score": 2}, ORCA | {"chosen_score": 1, "rejected_score": 2}]
    assert len(formats.load_pairs(write(tmp_path, rows), columns=mapped, min_score_gap=1)[0]) == 1


# ---------------------------------------------------------------------------------------------
# File types: gzipped JSONL, JSON arrays, Parquet, directories; line and row numbers in errors.
# ---------------------------------------------------------------------------------------------

def test_gzipped_jsonl_reads_like_jsonl_and_a_cut_off_one_is_an_error(tmp_path):
    import gzip

    plain = write(tmp_path, [EXAMPLES["trl_standard"], b"{oops"])
    gz = tmp_path / "pairs.jsonl.gz"
    gz.write_bytes(gzip.compress(open(plain, "rb").read()))
    with pytest.raises(UserError, match="malformed JSON") as e:
        formats.load_pairs(str(gz))
    assert (e.value.path, e.value.line) == (str(gz), 2)
    gz.write_bytes(gzip.compress(json.dumps(EXAMPLES["trl_standard"]).encode())[:-9])
    with pytest.raises(UserError, match="not a readable gzip file") as e:
        formats.load_pairs(str(gz))


def test_json_array_reports_the_line_each_element_starts_on(tmp_path):
    path = tmp_path / "pairs.json"
    path.write_text("\ufeff[\n" + json.dumps(EXAMPLES["trl_standard"]) + ",\n\n"
                    + json.dumps(EXAMPLES["trl_standard"], indent=1) + ",\n" + json.dumps({"prompt": "a"}) + "\n]\n")
    with pytest.raises(UserError, match="missing field 'chosen'") as e:
        formats.load_pairs(str(path))
    assert e.value.line == 9  # 2: the first element, 4-8: the indented one, 9: the bad one
    path.write_text("[" + json.dumps(EXAMPLES["trl_standard"]) + "]")
    assert formats.load_pairs(str(path))[1]["pairs"] == 1
    path.write_text("[\n" + json.dumps(EXAMPLES["trl_standard"]) + ",\n{oops}\n]")
    with pytest.raises(UserError, match="malformed JSON.*cannot be read past it") as e:
        formats.load_pairs(str(path), skip_invalid=True)  # nothing after a broken element can be found again
    assert e.value.line == 3
    path.write_text(json.dumps(EXAMPLES["trl_standard"]) + "\n")  # datasets' to_json writes JSON Lines as .json
    assert formats.load_pairs(str(path))[1]["format"] == "trl_standard"


def test_parquet_rows_are_numbered_in_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [EXAMPLES["ultrafeedback"]] * 2 + [EXAMPLES["ultrafeedback"] | {"prompt": "other"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "uf.parquet")
    with pytest.raises(UserError, match="prompt differs") as e:
        formats.load_pairs(str(tmp_path / "uf.parquet"))
    assert e.value.line == 3
    records, stats = formats.load_pairs(str(tmp_path / "uf.parquet"), skip_invalid=True)
    assert (stats["format"], stats["pairs"], stats["skipped"]) == ("ultrafeedback", 2, {"invalid_pair": 1})
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(UserError, match="not a readable Parquet file"):
        formats.load_pairs(str(tmp_path / "bad.parquet"))


def test_a_directory_reads_every_pair_file_with_its_own_format(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write(d, [EXAMPLES["ultrafeedback"]], "uf.jsonl")
    write(d, [ORCA, ARGILLA], "orca.jsonl")
    (d / "notes.txt").write_text("not pairs")
    records, stats = formats.load_pairs(str(d))
    assert (stats["format"], stats["pairs"], len(records)) == ("system_question+ultrafeedback", 3, 3)
    assert [(f["path"], f["format"], f["pairs"]) for f in stats["files"]] == [
        ("orca.jsonl", "system_question", 2), ("uf.jsonl", "ultrafeedback", 1)]
    assert stats["ignored_columns"]["status"] == 1 and stats["ignored_columns"]["prompt_id"] == 1
    write(d, [EXAMPLES["trl_standard"]], "text.jsonl")
    with pytest.raises(UserError, match="mixes text and message-list pairs"):
        formats.load_pairs(str(d))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no pair files"):
        formats.load_pairs(str(tmp_path / "empty"))


def test_a_hub_id_that_cannot_be_loaded_is_a_user_error(monkeypatch):
    """The hub is not reachable from the tests: a hub id reaches datasets.load_dataset, and its failure is one line."""
    import datasets

    def offline(name, split):
        assert (name, split) == ("org/prefs", "test")
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UserError, match=r"cannot load the hub dataset 'org/prefs' \(split test\): offline"):
        formats.load_pairs("org/prefs:test")
    with pytest.raises(UserError, match="cannot read pairs file: No such file"):  # a mistyped path stays a path
        formats.load_pairs("data/pairs.jsonl.gz")


# ---------------------------------------------------------------------------------------------
# No input ends in a traceback: random and mutated records, damaged bytes, every file type (hypothesis).
# ---------------------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fuzz  # noqa: E402

VALID = [*EXAMPLES.values(), ORCA, ARGILLA]


def check_loads_or_user_error(path: str, **options):
    """load_pairs gives pairs or the kit's one error form: a UserError naming the file (and its line when a row
    is at fault); nothing else escapes."""
    try:
        records, stats = formats.load_pairs(path, **options)
    except UserError as e:
        assert str(e.path) == path or str(e.path).startswith(path + os.sep)  # a directory: the file at fault
        assert (e.line is None or e.line >= 1) and str(e).startswith(f"{e.path}:")
        return
    assert records and stats["pairs"] == len(records)
    assert all(set(r) == {"prompt", "chosen", "rejected"} for r in records)


@settings(max_examples=120)
@given(data=fuzz.lines(VALID), skip=st.booleans(), suffix=st.sampled_from([".jsonl", ".json", ".jsonl.gz"]),
       options=st.sampled_from([{}, {"min_score_gap": 1.0}, {"columns": {"prompt": "question"}},
                                {"columns": {"chosen": "good", "score_chosen": "chosen"}}]))
def test_no_pair_file_ends_in_a_traceback(data, skip, suffix, options):
    import gzip
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/pairs{suffix}"
        with open(path, "wb") as f:
            f.write(gzip.compress(data) if suffix.endswith(".gz") else data)
        check_loads_or_user_error(path, skip_invalid=skip, **options)
        assert os.listdir(tmp) == [os.path.basename(path)]  # nothing written beside it


@settings(max_examples=60)
@given(rows=st.lists(fuzz.mutated(st.sampled_from(VALID)) | st.sampled_from(VALID), min_size=1, max_size=4),
       cut=st.integers(0, 400), flip=st.integers(0, 1000), as_array=st.booleans())
def test_no_json_array_parquet_or_gzip_ends_in_a_traceback(rows, cut, flip, as_array):
    """JSON arrays of mutated records, Parquet of them (where pyarrow can hold them), and damaged copies."""
    import gzip
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        text = json.dumps(rows, indent=1).encode() if as_array else fuzz.DEEP
        gz, parquet = gzip.compress(text), parquet_bytes(rows)
        for name, data in [("a.json", text), ("b.json", text[:len(text) - cut]),
                           ("c.jsonl.gz", gz[:max(0, len(gz) - cut)]),
                           ("d.parquet", parquet), ("e.parquet", parquet and parquet[:flip])]:
            if data is None:
                continue
            path = f"{tmp}/{name}"
            with open(path, "wb") as f:
                f.write(data)
            check_loads_or_user_error(path, skip_invalid=bool(cut % 2))
        check_loads_or_user_error(tmp)  # the directory of them


def parquet_bytes(rows):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    try:
        pq.write_table(pa.Table.from_pylist([r for r in rows if isinstance(r, dict)]), buf)
    except (pa.ArrowException, OverflowError, TypeError, ValueError):  # mixed types in a column: no such file
        return None
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# Unpaired examples (KTO): {"prompt", "completion", "label"}
# ---------------------------------------------------------------------------------------------

def test_unpaired_examples_are_detected_and_validated(tmp_path):
    good = {"prompt": [U("2+2?")], "completion": [A("4")], "label": True, "meta": {"run_id": 7}}
    assert formats.detect_format(good) == formats.UNPAIRED
    records, stats = formats.load_pairs(write(tmp_path, [good, good | {"completion": [A("5")], "label": False}]))
    assert stats["format"] == "kto" and stats["pairs"] == 2 and stats["ignored_columns"] == {"meta": 2}
    assert records[1] == {"prompt": [U("2+2?")], "completion": [A("5")], "label": False, "_run": "7"}
    assert formats.trainable(records)[1] == {"prompt": [U("2+2?")], "completion": [A("5")], "label": False}
    assert formats.normalise({"prompt": "2+2=", "completion": " 4", "label": False}, "kto") == \
        {"prompt": "2+2=", "completion": " 4", "label": False}
    for bad, says in (({"label": 1}, "label must be true"), ({"completion": [U("4")]}, "assistant message"),
                      ({"completion": "4"}, "must be a non-empty list"), ({"prompt": " "}, "must be a non-empty")):
        with pytest.raises(UserError, match=says) as e:
            formats.load_pairs(write(tmp_path, [good, good | bad], "bad.jsonl"))
        assert str(e.value).startswith(f"{tmp_path / 'bad.jsonl'}:2:")


def test_pairs_and_examples_do_not_mix_in_one_input(tmp_path):
    (tmp_path / "d").mkdir()
    write(tmp_path / "d", [EXAMPLES["trl_conversational"]], "a.jsonl")
    write(tmp_path / "d", [{"prompt": [U("2+2?")], "completion": [A("4")], "label": True}], "b.jsonl")
    with pytest.raises(UserError, match="mixes preference pairs and unpaired"):
        formats.load_pairs(str(tmp_path / "d"))
    with pytest.raises(UserError, match="unpaired examples have none"):
        formats.load_pairs(str(tmp_path / "d" / "b.jsonl"), min_score_gap=1.0)


def test_a_run_falls_on_one_side_of_the_held_out_split_whatever_its_records():
    """build_pairs' meta.run_id decides: all of a run's pairs and examples are held out or none, so DPO and
    KTO on the same logs hold out the same runs."""
    runs = {f"r{i}": formats.held_out({"_run": f"r{i}", "prompt": "x", "chosen": "a", "rejected": "b"}, 0.3)
            for i in range(200)}
    assert 30 < sum(runs.values()) < 90
    for run, held in list(runs.items())[:20]:
        assert formats.held_out({"_run": run, "prompt": [U("q")], "completion": [A("c")], "label": False}, 0.3) == held
    plain = [{"prompt": f"{i}", "chosen": "a", "rejected": "b"} for i in range(200)]
    assert 30 < sum(formats.held_out(r, 0.3) for r in plain) < 90  # no run id: each record by its own content


def test_unpairing_and_re_pairing():
    pairs = [{"prompt": [U("q")], "chosen": [A("good")], "rejected": [A(f"bad{i}")], "_run": "r1"} for i in range(3)]
    examples = formats.unpair(pairs)
    assert [(e["completion"][0]["content"], e["label"]) for e in examples] == \
        [("good", True), ("bad0", False), ("bad1", False), ("bad2", False)]
    assert all(e["_run"] == "r1" for e in examples)
    assert formats.preference_pairs(examples) == formats.trainable(pairs)
    assert len(formats.preference_pairs(examples, per_prompt=2)) == 2
    assert formats.preference_pairs([e for e in examples if not e["label"]]) == []  # nothing desirable: no pair


# ------------------------------------------------------------------ tool-calling agents

CALL = {"id": "c1", "type": "function", "function": {"name": "du", "arguments": "{\"path\": \"/\"}"}}
TOOL = {"type": "function", "function": {"name": "du", "parameters": {"type": "object"}}}


def tool_pair(**change):
    row = {"input": {"messages": [U("free space"), {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                  {"role": "tool", "tool_call_id": "c1", "content": "93G"}], "tools": [TOOL]},
           "preferred_output": [A("Cleared pip's cache.")], "non_preferred_output": [A("Deleted /home.")]}
    return json.loads(json.dumps(row)) | change  # a fresh copy: the tests change it in place


def test_tool_calls_tool_results_and_tools_are_kept_as_chat_templates_take_them():
    out = formats.normalise(tool_pair(), "openai")
    call = {"id": "c1", "type": "function", "function": {"name": "du", "arguments": {"path": "/"}}}
    assert out["prompt"][1:] == [{"role": "assistant", "content": "", "tool_calls": [call]},
                                 {"role": "tool", "content": "93G", "tool_call_id": "c1"}]
    assert out["tools"] == [TOOL] and formats.uses_tools(out)
    # TRL's conversational shape: tools per row; a completion may end with the assistant's call alone
    trl = {"prompt": [U("free space")], "chosen": [{"role": "assistant", "tool_calls": [CALL]}],
           "rejected": [A("no")], "tools": [TOOL]}
    assert formats.normalise(trl, formats.detect_format(trl))["chosen"][0]["tool_calls"] == [call]
    assert not formats.uses_tools(formats.normalise(EXAMPLES["openai"], "openai"))


@pytest.mark.parametrize("where, value, message", [
    ((1, "tool_calls"), [], "input.messages[1].tool_calls must be a non-empty list of calls"),
    ((1, "tool_calls", 0, "function", "arguments"), "{path", "input.messages[1].tool_calls[0].function.arguments is "
                                                             "not valid JSON"),
    ((1, "tool_calls", 0, "function", "arguments"), "[1]", "arguments must be a JSON object"),
    ((1, "tool_calls", 0, "function", "name"), " ", "input.messages[1].tool_calls[0].function.name must be a "
                                                    "non-empty string"),
    ((1, "tool_calls", 0, "type"), "code", "input.messages[1].tool_calls[0].type must be 'function'"),
    ((1, "tool_calls", 0, "function"), "du", "must be an object with a 'function' object"),
    ((2, "tool_call_id"), "c9", "input.messages[2].tool_call_id 'c9' answers no tool call made before it (made: c1)"),
    ((2, "tool_call_id"), 7, "input.messages[2].tool_call_id must be a non-empty string"),
    ((0, "tool_calls"), [CALL], "input.messages[0]: only an assistant message makes tool_calls"),
    ((2, "content"), None, "input.messages[2]: content must be a string or a list of text parts"),
])
def test_a_malformed_tool_call_is_refused_saying_where(where, value, message):
    row = tool_pair()
    target = row["input"]["messages"]
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        formats.normalise(row, "openai")


def test_tools_are_checked_and_need_message_lists(tmp_path):
    bad = tool_pair()
    bad["input"]["tools"] = [{"type": "function", "function": {"description": "no name"}}]
    with pytest.raises(ValueError, match=r"input.tools\[0\].function.name must be a non-empty string"):
        formats.normalise(bad, "openai")
    text = {"prompt": "2+2=", "chosen": " 4", "rejected": " 5", "tools": [TOOL]}
    with pytest.raises(ValueError, match="tools needs the conversation as message lists"):
        formats.normalise(text, "trl_standard")
    path = write(tmp_path, [tool_pair(), tool_pair() | {"input": {"messages": [U("x")], "tools": "du"}}])
    with pytest.raises(UserError) as e:
        formats.load_pairs(path)
    assert str(e.value) == f"{path}:2: input.tools must be a list of tools, got 'du'"


def test_dataset_rows_survive_arrow_and_come_back_as_they_went_in():
    from datasets import Dataset

    with_tools = formats.normalise(tool_pair(), "openai")
    other = formats.normalise(tool_pair() | {"input": {"messages": [U("hi")], "tools": [
        {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {
            "all": {"type": "boolean"}}}}}]}}, "openai")
    plain = formats.normalise(EXAMPLES["trl_conversational"], "trl_conversational")
    rows = list(Dataset.from_list(formats.dataset_rows([with_tools, other, plain])))
    assert [formats.record_from_row(r) for r in rows] == [with_tools, other, plain]
    assert formats.dataset_rows([plain]) == [plain]  # no tools anywhere: nothing changes (nor the tokenised cache)
