"""Preference-pair file formats: detect each file's format, validate every row, normalise to TRL's shape.

Not run on its own; train_dpo.py reads pairs through `load_pairs`. Seven pair formats are accepted, one per file
(detected from the first record, then every row must match it):

  trl_standard        {"prompt": "...", "chosen": "...", "rejected": "..."}
  trl_conversational  {"prompt": [msgs], "chosen": [msgs], "rejected": [msgs]}
  implicit_prompt     {"chosen": [msgs] | "...", "rejected": [msgs] | "..."}  (shared prefix = prompt)
  openai              {"input": {"messages": [msgs]}, "preferred_output": [msgs], "non_preferred_output": [msgs]}
  hh                  {"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ...", "rejected": "..."}  (Anthropic HH-RLHF)
  ultrafeedback       {"prompt": "...", "chosen": [msgs], "rejected": [msgs]}  (whole conversations that repeat
                      the prompt, as HuggingFaceH4/ultrafeedback_binarized ships them)
  system_question     {"system": "...", "question" | "input" | "prompt": "...", "chosen": "...", "rejected": "..."}
                      (Intel/orca_dpo_pairs, argilla/distilabel-intel-orca-dpo-pairs)

and one of unpaired examples, for KTO (build_pairs.py --emit kto writes it; TRL's unpaired preference type):

  kto                 {"prompt": "..." | [msgs], "completion": "..." | [msgs], "label": true | false}

Other columns are ignored and counted; `--columns prompt=instruction,chosen=good` renames columns first
(LLaMA-Factory's dataset_info.json mapping), and `--min_score_gap` drops pairs whose scores are too close.
Inputs: .jsonl, .jsonl.gz, .json (an array, or JSON Lines), .parquet, a directory of those, or a hub dataset
id (`org/name[:split]`). Errors name FILE:LINE (the row, in a Parquet file or hub dataset).

Every record comes out as {"prompt", "chosen", "rejected"}: either all strings (trl_standard, and
implicit_prompt over strings) or all message lists, which TRL renders with the chat template.
Pairs are written here too (`PairWriter`: build_pairs.py and self_pairs.py), one canonical line each,
duplicates dropped. Also here: which pairs a run trains on (the held-out share, other files mixed in) and the record of it
(`TrainingData`, the run's data.json). Standard library only (pyarrow for Parquet, datasets for the hub).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from array import array
from collections import Counter

from dpokit.core.kit import BROKE_COLUMN, UserError

FORMATS = ("trl_standard", "trl_conversational", "implicit_prompt", "openai", "hh", "ultrafeedback",
           "system_question")
UNPAIRED = "kto"  # the one format of unpaired examples {"prompt", "completion", "label"} (KTO); FORMATS are pairs
# What each format reads; any other column is ignored (and counted in data.json).
FORMAT_COLUMNS = {"trl_standard": {"prompt", "chosen", "rejected"},
                  "trl_conversational": {"prompt", "chosen", "rejected", "tools"},
                  "implicit_prompt": {"chosen", "rejected", "tools"}, "hh": {"chosen", "rejected"},
                  "openai": {"input", "preferred_output", "non_preferred_output"},
                  "ultrafeedback": {"prompt", "chosen", "rejected"},
                  "system_question": {"system", "question", "input", "prompt", "chosen", "rejected"},
                  "kto": {"prompt", "completion", "label", "tools"}}
COLUMN_NAMES = ("prompt", "chosen", "rejected", "system", "score_chosen", "score_rejected")  # --columns targets
# Score columns of the public sets, (chosen, rejected): read by --min_score_gap, ignored otherwise.
SCORE_COLUMNS = (("score_chosen", "score_rejected"), ("chosen_score", "rejected_score"),
                 ("chosen_rating", "rejected_rating"))
SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")  # what a directory of pair files is read for
ROLES = {"system", "user", "assistant", "tool"}
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a function's name, as OpenAI takes it
_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")
GENERAL_MIX = "data/general.jsonl"  # bundled general-purpose pairs: the default co-training source
RUN_KEY = "_run"  # on a loaded record: its build_pairs meta.run_id (see held_out); `trainable` drops it
BROKE_KEY = "_broke"  # on a loaded pair: build_pairs' meta.rejected_broke; `trainable` turns it into BROKE_COLUMN
MIX_KEY = "_mix"  # on a training pair drawn from a --mix file: that file (train_dpo --mix_answers); `trainable` drops it
EXPECT_KEY = "_expect"  # on a loaded pair: its meta.expect, the words a right answer holds (--mix_answers base checks
                        # the base's answer against them); `trainable` drops it


@dataclasses.dataclass
class TrainingData:
    """What a run trained on (its data.json): the file, and what became of its pairs along the way."""
    path: str
    sha256: str
    format: str  # one of FORMATS; a directory of several: them joined by '+', each named in files
    pairs: int  # usable pairs in the file
    skipped: dict  # {reason: lines} with --skip_invalid
    ignored_columns: dict = dataclasses.field(default_factory=dict)  # {column: rows that had it}
    columns: dict = dataclasses.field(default_factory=dict)  # --columns: {kit name: the data's column}
    min_score_gap: float = 0.0
    score_gap_dropped: int = 0  # pairs whose chosen score is less than min_score_gap above the rejected
    files: list = dataclasses.field(default_factory=list)  # a directory: [{path, format, pairs, sha256, ...}]
    held_out: int = 0  # kept out of training for evaluation
    mix: list = dataclasses.field(default_factory=list)  # [{path, share, pairs_available, pairs_used, sha256}]
    mix_answers: dict = dataclasses.field(default_factory=dict)  # --mix_answers base: {prompts, base, given}
    chosen_repeats: int = 0  # training pairs left out as repeats of a (prompt, chosen) pair (--distinct_chosen)
    pairs_trained: int = 0  # what TRL kept after tokenising (a prompt that fills max_length is dropped)
    dropped_too_long: int = 0
    truncated: int = 0  # pairs the collator cuts to max_length
    tokenized: dict = dataclasses.field(default_factory=dict)  # {split: "from cache (n pairs)" | "tokenised in ..."}
    # Training pairs (KTO: examples) by where the completion's tokens start (tokenization.tokenize_pair and
    # tokenize_example): aligned (the joint tokenisation split at the prompt's end), continued (tokenised after
    # the prompt's own tokens), not_exact (TRL's split: the prompt's last tokens left out). Empty: TRL's own
    # tokenisation (another TRL version).
    boundary: dict = dataclasses.field(default_factory=dict)
    method: str = "dpo"  # or kto: unpaired examples ("pairs" and the counts above are then examples)
    labels: dict = dataclasses.field(default_factory=dict)  # kto: {"desirable": n, "undesirable": n}
    kto_weights: dict = dataclasses.field(default_factory=dict)  # kto: {"desirable": w, "undesirable": w}


def has_fact(text: str, expect: list[str] | None) -> bool | None:
    """Whether text holds any of the expected words (case-insensitive): the retention probes' check, and the check
    of a rehearsed general answer against its pair's meta.expect. None when there is nothing to check."""
    return any(e.lower() in text.lower() for e in expect) if expect else None


def detect_format(record: dict) -> str | None:
    """The format of one record by its keys and value types, or None if it is none of FORMATS."""
    if not isinstance(record, dict):
        return None
    if "label" in record and "completion" in record:
        return "kto"
    if "preferred_output" in record or "non_preferred_output" in record:
        return "openai"
    if "question" in record or isinstance(record.get("input"), str):
        return "system_question"
    if "prompt" in record:
        if isinstance(record.get("prompt"), list):
            return "trl_conversational"
        if isinstance(record.get("chosen"), list):
            return "ultrafeedback"
        return "system_question" if "system" in record else "trl_standard"
    if "chosen" in record or "rejected" in record:
        chosen = record.get("chosen")
        if isinstance(chosen, str) and chosen.lstrip("\n").startswith("Human: ") and "\n\nAssistant: " in chosen:
            return "hh"
        return "implicit_prompt"
    return None


def short(value, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: an error message quotes a bad value, not a megabyte of it."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def decode_json(text: str):
    """json.loads, with nesting too deep for the parser (RecursionError) reported as malformed JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deep", text, 0) from None


def json_error(e: json.JSONDecodeError) -> str:
    """A line's JSON error as the kit says it: json's own words (its "Invalid control character at", for a raw NUL
    or tab inside a string, already ends in "at") and the column."""
    return f"malformed JSON: {e.msg.removesuffix(' at')} at column {e.colno}"


NOT_TEXT_PARTS = ("image_url", "input_image", "image", "input_audio", "file", "input_file")  # OpenAI's other parts


def _text(content, what: str) -> str:
    """Message content as text: a string, or OpenAI's list of {"type": "text", "text": ...} parts (an assistant's
    {"type": "refusal", "refusal": ...} too), joined. The kit trains text models: an image, audio or file part is
    refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{what}: content must be a string or a list of text parts, got {short(content)}")
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = {"text": "text", "refusal": "refusal"}.get(kind) if isinstance(kind, str) else None
        if key and isinstance(part.get(key), str):
            out.append(part[key])
        elif kind in NOT_TEXT_PARTS:
            raise ValueError(f"{what}.content[{k}] is a part of type {kind!r}: the kit trains text models, on text "
                             "parts only")
        else:
            raise ValueError(f"{what}: content must be a string or a list of text parts; content[{k}] is not "
                             f"{{\"type\": \"text\", \"text\": str}}: {short(part)}")
    return "".join(out)


def messages(value, what: str) -> list[dict]:
    """Validate a message list; keep role and content, and an agent's tool use: an assistant message's
    `tool_calls` (its content may then be null or missing: ""), a tool message's `tool_call_id` and `name`.
    A tool result must answer a call made earlier in the list when both carry ids."""
    if value is None:
        raise ValueError(f"missing field {what!r}")
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what} must be a non-empty list of messages")
    out, call_ids = [], set()
    for i, m in enumerate(value):
        where = f"{what}[{i}]"
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        if not isinstance(m["role"], str) or m["role"] not in ROLES:  # a list or object role is not hashable
            raise ValueError(f"{where}: unknown role {short(m['role'])} (expected one of {', '.join(sorted(ROLES))})")
        msg = {"role": m["role"]}
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant":
                raise ValueError(f"{where}: only an assistant message makes tool_calls (this one is {m['role']!r})")
            msg["tool_calls"] = tool_calls(calls, f"{where}.tool_calls")
            call_ids |= {c["id"] for c in msg["tool_calls"] if "id" in c}
        if m.get("content") is None and calls is not None:
            msg["content"] = ""
        elif "content" not in m:
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        else:
            msg["content"] = _text(m["content"], where)
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str) or not m[key]:
                    raise ValueError(f"{where}.{key} must be a non-empty string, got {short(m[key])}")
                msg[key] = m[key]
        if "tool_call_id" in msg and call_ids and msg["tool_call_id"] not in call_ids:
            raise ValueError(f"{where}.tool_call_id {msg['tool_call_id']!r} answers no tool call made before it "
                             f"(made: {', '.join(sorted(call_ids))})")
        out.append(msg)
    return out


def tool_calls(value, what: str) -> list[dict]:
    """An assistant's tool calls, OpenAI's shape ({"id", "type": "function", "function": {"name", "arguments"}})
    normalised to what chat templates read: arguments as an object (OpenAI sends a JSON string of one)."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what} must be a non-empty list of calls")
    out = []
    for j, call in enumerate(value):
        where = f"{what}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ValueError(f"{where} must be an object with a 'function' object ({{\"name\", \"arguments\"}})")
        if call.get("type", "function") != "function":
            raise ValueError(f"{where}.type must be 'function', got {short(call.get('type'))}")
        if not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise ValueError(f"{where}.function.name must be a non-empty string, got {short(fn.get('name'))}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = decode_json(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}.function.arguments is not valid JSON ({e.msg}): {short(args)}") from None
        if not isinstance(args, dict):
            raise ValueError(f"{where}.function.arguments must be a JSON object, got {short(args)}")
        norm = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if call.get("id") is not None:
            if not isinstance(call["id"], str) or not call["id"]:
                raise ValueError(f"{where}.id must be a non-empty string, got {short(call['id'])}")
            norm["id"] = call["id"]
        out.append(norm)
    return out


def tools_list(value, what: str = "tools") -> list[dict]:
    """The functions a conversation could call, as OpenAI and chat templates take them:
    [{"type": "function", "function": {"name", "description"?, "parameters"? (a JSON schema object)}}]."""
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list of tools, got {short(value)}")
    for j, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{what}[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise ValueError(f"{what}[{j}].function.name must be a non-empty string, got {short(fn.get('name'))}")
        if not TOOL_NAME.fullmatch(fn["name"]):
            raise ValueError(f"{what}[{j}].function.name {short(fn['name'])} must be letters, digits, _ and -, "
                             "at most 64 (OpenAI's rule)")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{what}[{j}].function.description must be a string, got {short(fn['description'])}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ValueError(f"{what}[{j}].function.parameters must be a JSON schema object")
    return [{"type": "function", **{k: v for k, v in tool.items() if k != "type"}} for tool in value]


def uses_tools(record: dict) -> bool:
    """Whether a normalised record holds tools, tool calls or tool results (its chat template must render them)."""
    sides = [record.get(k) for k in ("prompt", "chosen", "rejected", "completion")]
    return "tools" in record or any(isinstance(side, list) and any(
        "tool_calls" in m or m["role"] == "tool" for m in side) for side in sides)


def _ends_with_answer(side: list) -> bool:
    """A completion ends with the assistant's turn: words, or tool calls."""
    return side[-1]["role"] == "assistant" and (bool(side[-1]["content"].strip()) or "tool_calls" in side[-1])


def _nonempty_str(value, what: str) -> str:
    if value is None:
        raise ValueError(f"missing field {what!r}")
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{what} is empty")
    return value


def split_hh(text: str, what: str) -> list[dict]:
    """'\\n\\nHuman: a\\n\\nAssistant: b' -> [{"role": "user", ...}, {"role": "assistant", ...}]."""
    text = text if text.startswith("\n\n") else "\n\n" + text
    parts = _HH_TURN.split(text)
    if parts[0].strip() or len(parts) < 3:
        raise ValueError(f"{what} is not in '\\n\\nHuman: ... \\n\\nAssistant: ...' form")
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[parts[i]], "content": parts[i + 1].strip()} for i in range(1, len(parts), 2)]


def split_shared_prefix(chosen, rejected):
    """Implicit prompt: the longest shared prefix (whole messages, or characters up to the last
    whitespace for text) is the prompt; the rest of each side is its completion."""
    if isinstance(chosen, list):
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        return chosen[:n], chosen[n:], rejected[n:]
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    cut = max(chosen.rfind(" ", 0, n), chosen.rfind("\n", 0, n)) + 1 if n < len(chosen) else n
    return chosen[:cut], chosen[cut:], rejected[cut:]


def _from_conversations(record: dict) -> tuple[list, list, list]:
    """UltraFeedback: chosen and rejected are whole conversations that repeat the prompt. The prompt is their
    shared leading messages, checked against the prompt string (its last user turn must be that string); when
    they hold the answers alone, the string is the prompt."""
    text = _nonempty_str(record.get("prompt"), "prompt")
    sides = [messages(record.get(k), k) for k in ("chosen", "rejected")]
    prompt, chosen, rejected = split_shared_prefix(*sides)
    if not prompt:
        if sides[0][0]["role"] != "assistant" or sides[1][0]["role"] != "assistant":
            raise ValueError("chosen and rejected share no leading messages, and do not start with the answer")
        return [{"role": "user", "content": text}], chosen, rejected
    user = [m["content"] for m in prompt if m["role"] == "user"]
    if not user or user[-1].strip() != text.strip():
        raise ValueError("prompt differs from the conversations' last user turn before the answers "
                         f"({short(user[-1] if user else None)})")
    return prompt, chosen, rejected


def normalise_example(record: dict) -> dict:
    """One unpaired (KTO) record -> {"prompt", "completion", "label"}: text and text, or messages and
    messages (the completion ending with a non-empty assistant message); label true (desirable) or false."""
    label = record.get("label")
    if label is not True and label is not False:
        raise ValueError(f"label must be true (desirable) or false (undesirable), got {short(label)}")
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, list) or isinstance(completion, list):
        prompt, completion = messages(prompt, "prompt"), messages(completion, "completion")
        if not _ends_with_answer(completion):
            raise ValueError("completion must end with a non-empty assistant message (or its tool calls)")
    else:
        prompt, completion = _nonempty_str(prompt, "prompt"), _nonempty_str(completion, "completion")
    return with_tools({"prompt": prompt, "completion": completion, "label": label}, record.get("tools"), "tools")


def normalise(record: dict, fmt: str) -> dict:
    """One record in format `fmt` -> {"prompt", "chosen", "rejected"} ({"prompt", "completion", "label"} for
    kto); ValueError says what is wrong."""
    if fmt == UNPAIRED:
        return normalise_example(record)
    if fmt == "trl_standard":
        prompt, chosen, rejected = (_nonempty_str(record.get(k), k) for k in ("prompt", "chosen", "rejected"))
    elif fmt == "trl_conversational":
        prompt, chosen, rejected = (messages(record.get(k), k) for k in ("prompt", "chosen", "rejected"))
    elif fmt == "openai":
        inp = record.get("input")
        if not isinstance(inp, dict):
            raise ValueError("input must be an object with 'messages'")
        prompt = messages(inp.get("messages"), "input.messages")
        chosen = messages(record.get("preferred_output"), "preferred_output")
        rejected = messages(record.get("non_preferred_output"), "non_preferred_output")
    elif fmt == "ultrafeedback":
        prompt, chosen, rejected = _from_conversations(record)
    elif fmt == "system_question":
        key = next(k for k in ("question", "input", "prompt") if k in record)
        system = record.get("system")
        if system is not None and not isinstance(system, str):
            raise ValueError(f"system must be a string, got {type(system).__name__}")
        prompt = [{"role": "system", "content": system}] if system and system.strip() else []
        prompt.append({"role": "user", "content": _nonempty_str(record.get(key), key)})
        chosen, rejected = ([{"role": "assistant", "content": _nonempty_str(record.get(k), k)}]
                            for k in ("chosen", "rejected"))
    elif fmt in ("implicit_prompt", "hh"):
        sides = []
        for k in ("chosen", "rejected"):
            v = record.get(k)
            if fmt == "hh":
                v = split_hh(_nonempty_str(v, k), k)
            sides.append(messages(v, k) if isinstance(v, list) else _nonempty_str(v, k))
        if type(sides[0]) is not type(sides[1]):
            raise ValueError("chosen and rejected must both be strings or both be message lists")
        prompt, chosen, rejected = split_shared_prefix(*sides)
        if not prompt:
            raise ValueError("chosen and rejected share no prompt (no common leading messages or text)")
    else:
        raise ValueError(f"unknown format {fmt!r}")
    if isinstance(chosen, list):
        for side, name in ((chosen, "chosen"), (rejected, "rejected")):
            if not _ends_with_answer(side):
                raise ValueError(f"{name} must end with a non-empty assistant message (or its tool calls)")
    elif not chosen.strip() or not rejected.strip():
        raise ValueError("chosen or rejected completion is empty after the shared prompt")
    if chosen == rejected:
        raise ValueError("chosen is identical to rejected")
    tools, where = (record["input"].get("tools"), "input.tools") if fmt == "openai" else (record.get("tools"), "tools")
    return with_tools({"prompt": prompt, "chosen": chosen, "rejected": rejected}, tools, where)


def with_tools(record: dict, tools, what: str) -> dict:
    """record with its `tools` (validated) when the row gives some (OpenAI's files often carry an empty list:
    none); tools go with messages, not plain text."""
    if tools is None or tools == []:
        return record
    if not isinstance(record["prompt"], list):
        raise ValueError(f"{what} needs the conversation as message lists (a chat template renders the tools)")
    return record | {"tools": tools_list(tools, what)}


def parse_columns(spec: str) -> dict:
    """'prompt=instruction,chosen=good' -> {"prompt": "instruction", "chosen": "good"}; ValueError if malformed."""
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, eq, column = (x.strip() for x in item.partition("="))
        if not eq or not column:
            raise ValueError(f"{item!r} is not NAME=COLUMN (e.g. prompt=instruction)")
        if name not in COLUMN_NAMES:
            raise ValueError(f"{name!r} is not one of {', '.join(COLUMN_NAMES)}")
        if name in out:
            raise ValueError(f"{name} is mapped twice")
        out[name] = column
    return out


def remap(record: dict, columns: dict) -> dict:
    """The record with the mapped columns under the kit's names (the others as they were); ValueError when a
    mapped column is missing."""
    if not columns:
        return record
    missing = [f"{column!r} (--columns {name}={column})" for name, column in columns.items() if column not in record]
    if missing:
        raise ValueError(f"no column {', '.join(missing)}; the row has {short(sorted(record), 200)}")
    out = {k: v for k, v in record.items() if k not in columns.values()}
    return out | {name: record[column] for name, column in columns.items()}


def score_gap(record: dict) -> float | None:
    """chosen score - rejected score from the first SCORE_COLUMNS pair the record has; None without one."""
    for chosen, rejected in SCORE_COLUMNS:
        if chosen in record and rejected in record:
            a, b = record[chosen], record[rejected]
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x == x for x in (a, b)):
                raise ValueError(f"{chosen} and {rejected} must be numbers, got {short(a)} and {short(b)}")
            return a - b
    return None


class BadRow(Exception):
    """A row that could not be read at all (not UTF-8, not JSON): `reason` is its --skip_invalid count; a fatal
    one (a JSON array broken there) stops the file even when skipping."""

    def __init__(self, message: str, reason: str, fatal: bool = False):
        super().__init__(message)
        self.reason, self.fatal = reason, fatal


def jsonl_rows(raw: bytes):
    """(line number, record or BadRow) for each non-blank line of JSON Lines bytes."""
    for line_no, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield line_no, BadRow(f"not UTF-8 (byte {line[e.start]:#04x} at column {e.start + 1})", "not_utf8")
            continue
        if line_no == 1:
            text = text.removeprefix("\ufeff")  # a byte-order mark, as Windows tools write
        try:
            yield line_no, decode_json(text)
        except json.JSONDecodeError as e:
            yield line_no, BadRow(json_error(e), "malformed_json")


_WS = re.compile(r"[ \t\n\r]*")


def json_array_rows(text: str):
    """(line number where the element starts, element) for each element of a JSON array. A syntax error ends
    the array (nothing after it can be found again), so it is a BadRow that stops the file even when skipping."""
    decoder, i, line, counted = json.JSONDecoder(), _WS.match(text, _WS.match(text).end() + 1).end(), 1, 0
    if text[i:i + 1] == "]":
        return
    while True:
        line += text.count("\n", counted, i)
        counted = i
        try:
            obj, end = decoder.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError) as e:
            msg = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deep"
            line += text.count("\n", counted, getattr(e, "pos", i))
            yield line, BadRow(f"malformed JSON: {msg} (the array cannot be read past it)", "malformed_json", fatal=True)
            return
        yield line, obj
        i = _WS.match(text, end).end()
        if text[i:i + 1] == ",":
            i = _WS.match(text, i + 1).end()
            continue
        rest = _WS.match(text, i + 1).end() if text[i:i + 1] == "]" else i
        if rest < len(text) or text[i:i + 1] != "]":
            line += text.count("\n", counted, i)
            yield line, BadRow("malformed JSON: expected ',' or ']' after an array element, or the end after ']'",
                               "malformed_json", fatal=True)
        return


def file_rows(path: str) -> tuple[object, str]:
    """(rows, sha256 of the file) for one pair file: its (line or row number, record or BadRow), by suffix.
    Raises UserError when the file as a whole cannot be read."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise UserError(f"cannot read pairs file: {e.strerror or e}", path) from None
    digest = hashlib.sha256(raw).hexdigest()
    if path.endswith(".parquet"):
        return parquet_rows(path), digest
    if path.endswith(".gz"):
        import gzip
        import zlib

        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:  # not gzip, cut off, a damaged stream
            raise UserError(f"not a readable gzip file: {e}", path) from None
    if path.endswith(".json") and raw.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"[":
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            raise UserError(f"not UTF-8 (byte {raw[e.start]:#04x})", path, line) from None
        return json_array_rows(text), digest
    return jsonl_rows(raw), digest  # .jsonl, .jsonl.gz, a .json of JSON Lines (datasets' to_json), anything else


def parquet_rows(path: str):
    """(row number from 1, record) for each row of a Parquet file (nested columns come out as lists and dicts)."""
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a file that is not Parquet vary by version
        raise UserError(f"not a readable Parquet file: {str(e)[:300]}", path) from None
    for start in range(0, table.num_rows, 1000):
        for i, row in enumerate(table.slice(start, 1000).to_pylist(), start=start + 1):
            yield i, row


def hub_rows(spec: str):
    """(row number from 1, record) for a hub dataset `org/name[:split]` (split defaults to train), read with
    datasets when the hub is reachable."""
    name, _, split = spec.partition(":")
    try:
        from datasets import load_dataset

        ds = load_dataset(name, split=split or "train")
    except Exception as e:  # noqa: BLE001 - offline, no such dataset or split, a gated one
        raise UserError(f"cannot load the hub dataset {name!r} (split {split or 'train'}): {str(e)[:300]}",
                        spec) from None
    for i, row in enumerate(ds, start=1):
        yield i, row


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.\[\]%:+-]+)?$")


def is_hub_id(path: str) -> bool:
    """org/name[:split] that is not a local path: a mistyped file name (one with a pair file's suffix) stays a
    missing file, not a trip to the hub."""
    return not os.path.exists(path) and bool(HUB_ID.match(path)) and not path.partition(":")[0].endswith(
        (*SUFFIXES, ".gz"))


def pair_files(path: str) -> list[str]:
    """The pair files a path names: itself, or a directory's files with SUFFIXES (recursively, sorted)."""
    if not os.path.isdir(path):
        return [path]
    found = sorted(os.path.join(root, name) for root, dirs, names in os.walk(path)
                   for name in names if name.endswith(SUFFIXES) and not name.startswith("."))
    if not found:
        raise UserError(f"no pair files ({', '.join(SUFFIXES)}) in the directory", path)
    return found


def load_pairs(path: str, skip_invalid: bool = False, columns: dict | None = None,
               min_score_gap: float = 0.0) -> tuple[list[dict], dict]:
    """Read and validate a whole pairs file (or a directory of them, or a hub dataset) before any model loads.

    Returns (records, stats); stats = {"format", "lines", "pairs", "skipped": {reason: n}, "sha256",
    "ignored_columns": {column: rows}, "score_gap_dropped", "files"}. Raises UserError(FILE:LINE) on the
    first bad row, unless skip_invalid (then counts it). A file of mixed formats, an input with no usable
    pair, or one that mixes text and message-list pairs, is an error either way.
    """
    columns = columns or {}
    if is_hub_id(path):
        digest = hashlib.sha256(path.encode()).hexdigest()  # of the id: the hub's data can change under it
        per_file = [load_rows(path, hub_rows(path), digest, skip_invalid, columns, min_score_gap)]
    else:
        per_file = [load_rows(name, *file_rows(name), skip_invalid, columns, min_score_gap)
                    for name in pair_files(path)]
    records = [r for file_records, _ in per_file for r in file_records]
    stats = [s for _, s in per_file]
    kinds = {isinstance(r["prompt"], list) for r in records}
    if len(kinds) > 1:
        raise UserError("mixes text and message-list pairs; use one shape (text pairs have no chat template)", path)
    if len({is_example(r) for r in records}) > 1:
        raise UserError("mixes preference pairs and unpaired (prompt/completion/label) examples; train them "
                        "apart, or turn the pairs into examples with --method kto", path)
    if len(stats) == 1:
        return records, stats[0] | {"files": []}
    total = {"format": "+".join(sorted({s["format"] for s in stats})), "lines": sum(s["lines"] for s in stats),
             "pairs": len(records), "skipped": dict(sum((Counter(s["skipped"]) for s in stats), Counter())),
             "ignored_columns": dict(sum((Counter(s["ignored_columns"]) for s in stats), Counter())),
             "score_gap_dropped": sum(s["score_gap_dropped"] for s in stats),
             "sha256": hashlib.sha256("".join(f"{s['sha256']}  {os.path.relpath(s['path'], path)}\n"
                                              for s in stats).encode()).hexdigest(),
             "files": [s | {"path": os.path.relpath(s["path"], path)} for s in stats]}
    return records, total


def load_rows(path: str, rows, sha256: str, skip_invalid: bool, columns: dict,
              min_score_gap: float) -> tuple[list[dict], dict]:
    """load_pairs for one file's rows: (line or row number, record or BadRow)."""
    records, skipped, ignored, fmt, fmt_line, n_rows, gap_dropped = [], Counter(), Counter(), None, None, 0, 0

    def bad(line_no: int, message: str, reason: str):
        if not skip_invalid:
            raise UserError(message, path, line_no)
        skipped[reason] += 1

    for line_no, record in rows:
        n_rows += 1
        if isinstance(record, BadRow):
            if record.fatal:
                raise UserError(str(record), path, line_no)
            bad(line_no, str(record), record.reason)
            continue
        try:
            record = remap(record, columns) if isinstance(record, dict) else record
        except ValueError as e:
            bad(line_no, str(e), "missing_column")
            continue
        this = detect_format(record)
        if this is None:
            keys = short(sorted(record), 200)[1:-1] if isinstance(record, dict) else type(record).__name__
            bad(line_no, f"unknown format (keys: {keys}); expected one of: {', '.join(FORMATS)}, {UNPAIRED} "
                "(or name the columns with --columns)", "unknown_format")
            continue
        if fmt is None:
            fmt, fmt_line = this, line_no
        elif this != fmt:
            raise UserError(f"format {this} differs from the file's format {fmt} (detected at line {fmt_line})",
                            path, line_no)
        try:
            pair = normalise(record, fmt)
            gap = score_gap(record) if min_score_gap else None
            if min_score_gap and fmt == UNPAIRED:
                raise UserError("--min_score_gap compares a pair's two scores; unpaired examples have none", path)
            if min_score_gap and gap is None:
                raise ValueError("--min_score_gap needs scores: no " + " / ".join(
                    f"{a}, {b}" for a, b in SCORE_COLUMNS) + " columns (or map them with --columns)")
        except ValueError as e:
            reason = "identical" if "identical" in str(e) else "no_scores" if "needs scores" in str(e) \
                else "invalid_pair"
            bad(line_no, str(e), reason)
            continue
        run_id = record.get("meta", {}).get("run_id") if isinstance(record.get("meta"), dict) else None
        if isinstance(run_id, (str, int)) and not isinstance(run_id, bool):
            pair[RUN_KEY] = str(run_id)  # build_pairs' meta: the held-out share is drawn by run
        meta = record.get("meta")
        if "rejected" in pair and isinstance(meta, dict) and meta.get("rejected_broke") is True:
            pair[BROKE_KEY] = True  # train_dpo --broke_weight's preference term reads this pair
        if isinstance(meta, dict) and "expect" in meta:
            expect = meta["expect"]
            if not isinstance(expect, list) or not all(isinstance(e, str) and e.strip() for e in expect):
                bad(line_no, 'meta.expect is a list of words a right answer holds (["paris"])', "invalid_pair")
                continue
            pair[EXPECT_KEY] = expect  # --mix_answers base keeps the base's answer only if it holds one of them
        used = FORMAT_COLUMNS[fmt] | ({c for pair_ in SCORE_COLUMNS for c in pair_} if min_score_gap else set())
        ignored.update(k for k in record if k not in used)
        if gap is not None and gap < min_score_gap:
            gap_dropped += 1
            continue
        records.append(pair)
    if not records:
        why = (f"every pair's score gap is below --min_score_gap {min_score_gap} ({gap_dropped} pairs)"
               if gap_dropped else "no usable preference pair in the file" if n_rows else "the file is empty")
        raise UserError(why, path)
    kinds = {isinstance(r["prompt"], list) for r in records}
    if len(kinds) > 1:
        raise UserError("mixes text and message-list pairs; use one shape per file", path)
    return records, {"path": path, "format": fmt, "lines": n_rows, "pairs": len(records), "skipped": dict(skipped),
                     "sha256": sha256, "ignored_columns": dict(sorted(ignored.items())),
                     "score_gap_dropped": gap_dropped}


MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def dataset_rows(records: list[dict]) -> list[dict]:
    """Records as an Arrow table (datasets.Dataset) can hold them. Arrow gives every message of a column the
    same keys and merges objects' keys across rows, which would change tool calls' arguments and tools' schemas;
    so where any record uses tools, each message carries all MESSAGE_KEYS (None where absent) with tool_calls as
    a JSON string, and tools is a JSON string ('' where none). record_from_row undoes it; records without tools
    pass unchanged."""
    if not any(uses_tools(r) for r in records):
        return records

    def side(value):
        if not isinstance(value, list):
            return value
        return [{k: json.dumps(m[k], ensure_ascii=False) if k == "tool_calls" and k in m else m.get(k)
                 for k in MESSAGE_KEYS} for m in value]

    return [{k: side(v) for k, v in r.items() if k != "tools"} | {"tools": json.dumps(r["tools"], ensure_ascii=False)
                                                                   if r.get("tools") else ""} for r in records]


def record_from_row(row: dict) -> dict:
    """A dataset row back as the record dataset_rows was given (a record that was never encoded: unchanged)."""
    def side(value):
        if not isinstance(value, list):
            return value
        return [{k: json.loads(v) if k == "tool_calls" and isinstance(v, str) else v for k, v in m.items()
                 if v is not None} for m in value]

    out = {k: side(v) for k, v in row.items() if k != "tools"}
    tools = row.get("tools")
    if tools:
        out["tools"] = json.loads(tools) if isinstance(tools, str) else tools
    return out


def is_example(record: dict) -> bool:
    """An unpaired (KTO) example rather than a preference pair."""
    return "label" in record


def unpair(pairs: list[dict]) -> list[dict]:
    """Pairs -> KTO examples: each chosen desirable, each rejected undesirable, the same example once (a
    chosen answer in four pairs is one desirable example). The run key stays with each."""
    out, seen = [], set()
    for pair in pairs:
        for side, label in (("chosen", True), ("rejected", False)):
            example = {"prompt": pair["prompt"], "completion": pair[side], "label": label} | (
                {"tools": pair["tools"]} if "tools" in pair else {})
            key = json.dumps(example, sort_keys=True, ensure_ascii=False)
            if key in seen:
                continue
            seen.add(key)
            out.append(example | ({RUN_KEY: pair[RUN_KEY]} if RUN_KEY in pair else {}))
    return out


def trainable(records: list[dict]) -> list[dict]:
    """The records as the trainer sees them: without the kit's own keys (the run key); where any pair's rejected
    answer broke what must be kept (BROKE_KEY), every record carries BROKE_COLUMN, true or false (the kit's DPO
    trainer hands it to its loss; TRL's own drops the column as one its model does not take)."""
    column = any(BROKE_KEY in r for r in records)
    return [{k: v for k, v in r.items() if k not in (RUN_KEY, BROKE_KEY, MIX_KEY, EXPECT_KEY)}
            | ({BROKE_COLUMN: r.get(BROKE_KEY, False)} if column else {}) for r in records]


def preference_pairs(examples: list[dict], per_prompt: int = 4) -> list[dict]:
    """KTO examples -> the DPO pairs they hold: for each prompt, its desirable completions against its
    undesirable ones (at most per_prompt pairs a prompt, in file order). What lets a KTO run report the same
    held-out preference accuracy as a DPO run."""
    groups: dict[str, tuple[list, list]] = {}
    for e in examples:
        key = json.dumps(e["prompt"], sort_keys=True, ensure_ascii=False)
        groups.setdefault(key, ([], []))[0 if e["label"] else 1].append(e)
    out = []
    for good, bad in groups.values():
        made = [{"prompt": g["prompt"], "chosen": g["completion"], "rejected": b["completion"]}
                for g in good for b in bad if g["completion"] != b["completion"]]
        out += made[:per_prompt]
    return out


# ---------------------------------------------------------------------------------------------
# Which pairs a run trains on: a stable held-out share, other files mixed in.
# ---------------------------------------------------------------------------------------------


def held_out(record: dict, fraction: float) -> bool:
    """Whether a pair (or example) is in the held-out share: the sha256 of its run id (build_pairs' meta.run_id:
    a run's pairs and examples all fall on one side, the same runs for DPO and KTO on the same logs) or else of
    its canonical JSON, read as a number in [0, 1), below `fraction`. Stable as a file grows."""
    key = f"run\0{record[RUN_KEY]}" if RUN_KEY in record else json.dumps(record, sort_keys=True, ensure_ascii=False)
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < fraction


def held_out_prompt(row: dict, fraction: float) -> bool:
    """An --eval_prompts row ({prompt, host, run_id?}) scored as held out: one without a run always, one with a run
    when that run's pairs are held out (so the tuned model is scored on prompts it never trained on)."""
    return "run_id" not in row or held_out({RUN_KEY: row["run_id"]}, fraction)


def parse_mix(spec: str) -> list[tuple[str, float]]:
    """'a.jsonl:0.2,b.jsonl:0.1' -> [('a.jsonl', 0.2), ('b.jsonl', 0.1)]; '0.2' -> the bundled general file."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        path, _, weight = item.rpartition(":") if ":" in item else (GENERAL_MIX, "", item)
        try:
            w = float(weight)
        except ValueError:
            raise ValueError(f"{item!r} is not FILE:SHARE (e.g. data/general.jsonl:0.2)") from None
        if not 0 < w < 1:
            raise ValueError(f"share {w} for {path} must be between 0 and 1")
        out.append((path or GENERAL_MIX, w))
    if sum(w for _, w in out) >= 1:
        raise ValueError("the shares add up to 1 or more, leaving nothing for the main data")
    return out


def mix_counts(n_main: int, shares: list[float]) -> list[int]:
    """Pairs to draw from each mix source so each is its share of the whole mixture: with 80 main
    pairs and shares [0.2], the mixture is 100 pairs of which 20 are mixed in (the deck's 4:1)."""
    total = n_main / (1 - sum(shares))
    return [round(share * total) for share in shares]


def draw(records: list, n: int, seed: int) -> list:
    """n records in a seeded order, cycling through the file again when it is smaller than n."""
    import random

    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    return [records[order[i % len(order)]] for i in range(n)]


def prompt_text(prompt, tools: list | None = None) -> str:
    """A loaded record's prompt (text or messages) and tools as canonical JSON: equal exactly when the model reads
    the same prompt (roles, contents, tool use and tools; a message's tags are gone once loaded)."""
    return _canon_prompt(prompt, tools) if isinstance(prompt, list) else _canon([prompt, tools])


def distinct_chosen(pairs: list[dict], keep_broke: bool = False) -> list[dict]:
    """The first pair of each (prompt, chosen answer), in file order: what a loss that reads only the chosen
    side trains on. build_pairs pairs a run's best answer with each worse one, so a run with seven failed attempts
    repeats its chosen answer seven times, and the SFT loss would train it seven times an epoch. keep_broke: a
    pair whose rejected answer broke what must be kept (BROKE_KEY) stays, as --broke_weight's preference term reads
    that side (its chosen answer is then trained once more)."""
    seen, out = set(), []
    for r in pairs:
        key = (prompt_text(r["prompt"], r.get("tools")), _canon(r["chosen"]))
        if key not in seen or (keep_broke and r.get(BROKE_KEY)):
            seen.add(key)
            out.append(r)
    return out


def in_shape(record: dict, messages_: bool) -> dict | None:
    """A loaded pair in the other shape, where nothing is lost: text -> one user turn and one assistant answer each;
    one user turn and plain assistant answers -> text (the prompt's words and a newline, the answers' words). None
    when it cannot be (a system message, several turns, tool use, unpaired examples)."""
    if is_example(record) or uses_tools(record):
        return None
    if messages_:
        if isinstance(record["prompt"], list):
            return record
        return {**record, "prompt": [{"role": "user", "content": record["prompt"]}],
                "chosen": [{"role": "assistant", "content": record["chosen"]}],
                "rejected": [{"role": "assistant", "content": record["rejected"]}]}
    if not isinstance(record["prompt"], list):
        return record
    sides = [record[k] for k in ("chosen", "rejected")]
    if [m["role"] for m in record["prompt"]] != ["user"] or any(
            not isinstance(s, list) or [m["role"] for m in s] != ["assistant"] for s in sides):
        return None
    return {**record, "prompt": record["prompt"][0]["content"] + "\n", "chosen": sides[0][0]["content"],
            "rejected": sides[1][0]["content"]}


def split_and_mix(pairs: list[dict], data: TrainingData, eval_fraction: float, mix_spec: str, seed: int,
                  skip_invalid: bool, distinct: bool = False, keep_broke: bool = False,
                  rehearse: bool = False) -> tuple[list[dict], list[dict]]:
    """Hold out a stable share of the pairs; with `distinct`, train each (prompt, chosen) once (distinct_chosen,
    keep_broke as there);
    mix further files into the rest in their stated shares. Records all three in data. Returns (training pairs,
    held-out pairs). `rehearse` (--mix_answers base): the mix files must hold message lists, which the model answers
    through its chat template; refused here, before the model loads."""
    held = [r for r in pairs if held_out(r, eval_fraction)]
    train_pairs = [r for r in pairs if not held_out(r, eval_fraction)]
    if distinct:
        n, train_pairs = len(train_pairs), distinct_chosen(train_pairs, keep_broke)
        data.chosen_repeats = n - len(train_pairs)
    if not train_pairs:
        raise UserError(f"every pair fell in the held-out share (--eval_fraction {eval_fraction}); "
                        "lower it or add pairs", data.path)
    mix = parse_mix(mix_spec)
    counts = mix_counts(len(train_pairs), [share for _, share in mix])
    data.held_out, data.mix = len(held), []
    for (path, share), n in zip(mix, counts):
        records, stats = load_pairs(path, skip_invalid)
        if isinstance(records[0]["prompt"], list) != isinstance(pairs[0]["prompt"], list):
            if rehearse:
                raise UserError("--mix_answers base needs message-list data and mix pairs (a prompt the chat "
                                "template renders); the data has text pairs", path)
            shaped = [p for p in (in_shape(r, isinstance(pairs[0]["prompt"], list)) for r in records) if p]
            print(f"[data] {path}: {len(shaped)} of its {len(records)} "
                  f"{'message-list' if isinstance(records[0]['prompt'], list) else 'text'} pairs brought to the "
                  f"data's {'message-list' if isinstance(pairs[0]['prompt'], list) else 'text'} shape"
                  + (" (the others have more than one turn or a system message: left out)"
                     if len(shaped) < len(records) else ""), flush=True)
            if not shaped:
                print(f"[data] {path}: not mixed in (none of its pairs has the data's shape)", flush=True)
                continue
            records = shaped
        if rehearse and not isinstance(records[0]["prompt"], list):
            raise UserError("--mix_answers base needs message-list pairs (a prompt the chat template renders); "
                            "this mix file has text pairs", path)
        train_pairs += [r | {MIX_KEY: path} for r in draw(records, n, seed)]
        data.mix.append({"path": path, "share": share, "pairs_available": len(records), "pairs_used": n,
                         "sha256": stats["sha256"]})
    return train_pairs, held


# ---------------------------------------------------------------------------------------------
# Writing pairs: canonical lines, duplicates dropped, streamed to a file renamed into place at the end.
# ---------------------------------------------------------------------------------------------

# json.dumps(obj, **options) builds a new JSONEncoder at every call; these are the same encoders built
# once (the same bytes, ~10% less time per run: three encodings per run on the demo mix).
_canon = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_quote = json.encoder.encode_basestring  # one string as either encoder writes it, quotes included
_line = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": ")).encode
# Even so, JSONEncoder.encode builds a C encoder at every call: 2.5 us for a pair's meta, against 0.9 for this
# one built once (the same bytes; no circular-reference check, so a cyclic meta raises RecursionError instead).
_c_line = json.encoder.c_make_encoder and json.encoder.c_make_encoder(
    None, json.JSONEncoder().default, _quote, None, ": ", ", ", False, False, True)


@dataclasses.dataclass(frozen=True)
class Pair:
    """One preference pair as build_pairs and self_pairs make it: a message-list prompt, two answers, meta."""
    prompt: list
    chosen: str
    rejected: str
    meta: dict
    tools: list | None = None  # the functions the prompt's agent could call (its messages may hold tool calls)


@dataclasses.dataclass(frozen=True)
class Example:
    """One unpaired example as `build_pairs --emit kto` makes it (TRL's KTOTrainer): a message-list prompt, one
    answer, and whether that answer is desirable."""
    prompt: list
    completion: str
    label: bool
    meta: dict
    tools: list | None = None


def _canon_message(m: dict) -> list:
    """[role, content], and the message's tool use after them when it has some."""
    if len(m) == 2:
        return [m["role"], m["content"]]
    return [m["role"], m["content"], {k: v for k, v in m.items() if k not in ("role", "content")}]


def _canon_prompt(messages: list, tools: list | None = None) -> str:
    return _canon([_canon_message(m) for m in messages] + ([{"tools": tools}] if tools else []))


def pair_digest(pair: Pair) -> int:
    """64 bits of the sha256 of the canonical (prompt, chosen, rejected): what makes two pairs the same
    pair. Two different pairs among n collide with odds of about n^2 / 2^65 (1e-8 for a million)."""
    canon = f"[{_canon_prompt(pair.prompt, pair.tools)},{_quote(pair.chosen)},{_quote(pair.rejected)}]"
    return int.from_bytes(hashlib.sha256(canon.encode("utf-8")).digest()[:8], "big")


def example_digest(example: Example) -> int:
    """pair_digest for an Example: 64 bits of the sha256 of the canonical (prompt, completion, label). Never equal
    to a pair's (a label is not a string)."""
    canon = _canon([[_canon_message(m) for m in example.prompt] + ([{"tools": example.tools}] if example.tools
                                                                   else []), example.completion, example.label])
    return int.from_bytes(hashlib.sha256(canon.encode("utf-8")).digest()[:8], "big")


class DigestSet:
    """The digests of the pairs written so far, in flat arrays: a million take ~11 MB, where a Python
    set of digest objects takes ~86. Buckets by the top bits, each an array('Q') scanned in C; four
    times as many buckets whenever they average 128 entries (measured: 4.7 us an add at a million,
    against 0.4 for a set: 2% of build_pairs' time per pair; smaller buckets cost memory in array headers)."""

    def __init__(self, bits: int = 8):
        self.bits, self.size = bits, 0
        self.buckets = [array("Q") for _ in range(1 << bits)]

    def add(self, digest: int) -> bool:
        """Add digest; False when it was already there."""
        bucket = self.buckets[digest >> (64 - self.bits)]
        if digest in bucket:
            return False
        bucket.append(digest)
        self.size += 1
        if self.size > 128 << self.bits:
            self._grow()
        return True

    def __len__(self) -> int:
        return self.size

    def _grow(self) -> None:
        old, self.bits = self.buckets, self.bits + 2
        self.buckets = [array("Q") for _ in range(1 << self.bits)]
        shift = 64 - self.bits
        for bucket in old:
            for digest in bucket:
                self.buckets[digest >> shift].append(digest)


def to_record(pair: Pair | Example, fmt: str = "trl") -> dict:
    prompt = [dict(m) for m in pair.prompt]  # role and content, and any tool calls or results: as they came
    tools = {"tools": pair.tools} if pair.tools else {}
    if isinstance(pair, Example):
        if fmt == "openai":
            raise ValueError("OpenAI's preference format has no unpaired examples")
        return {"prompt": prompt, "completion": [{"role": "assistant", "content": pair.completion}],
                "label": pair.label, **tools, "meta": pair.meta}
    chosen = [{"role": "assistant", "content": pair.chosen}]
    rejected = [{"role": "assistant", "content": pair.rejected}]
    if fmt == "openai":  # OpenAI rejects unknown keys, so no meta
        return {"input": {"messages": prompt, **tools}, "preferred_output": chosen, "non_preferred_output": rejected}
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, **tools, "meta": pair.meta}


def to_line(record: dict) -> str:
    return _line(record) + "\n"


def _meta_json(meta: dict) -> str:
    return "".join(_c_line(meta, 0)) if _c_line else _line(meta)


def _prompt_json(messages: list) -> tuple[str, str] | None:
    """The prompt as the digest's canonical JSON and as a line writes it, each string quoted once; None when a
    role or content is not a plain str, or a message holds tool use (the encoders then handle it, as before)."""
    if any(len(m) != 2 for m in messages):
        return None
    pieces = [(m["role"], m["content"]) for m in messages]
    if any(type(role) is not str or type(content) is not str for role, content in pieces):
        return None
    quoted = [(_quote(role), _quote(content)) for role, content in pieces]
    canon = ",".join(["[%s,%s]" % rc for rc in quoted])
    line = ", ".join(['{"role": %s, "content": %s}' % rc for rc in quoted])
    return f"[{canon}]", f"[{line}]"


def digest_and_line(pair: Pair | Example, fmt: str = "trl") -> tuple[int, str]:
    """pair_digest(pair) and to_line(to_record(pair, fmt)) at once, joined by hand from strings each quoted once,
    where those quote every string twice through encoders built per call (11 us a pair -> 5 on the bench mix).
    Pairs holding something other than plain strings go the plain way; a test checks both give the same bytes.
    An Example goes to example_digest_and_line."""
    if isinstance(pair, Example):
        return example_digest_and_line(pair, fmt)
    prompt = _prompt_json(pair.prompt)
    if prompt is None or type(pair.chosen) is not str or type(pair.rejected) is not str or pair.tools:
        return pair_digest(pair), to_line(to_record(pair, fmt))
    canon_prompt, line_prompt = prompt
    chosen, rejected = _quote(pair.chosen), _quote(pair.rejected)
    digest = hashlib.sha256(f"[{canon_prompt},{chosen},{rejected}]".encode("utf-8")).digest()  # = pair_digest's
    chosen = f'[{{"role": "assistant", "content": {chosen}}}]'
    rejected = f'[{{"role": "assistant", "content": {rejected}}}]'
    if fmt == "openai":
        line = f'{{"input": {{"messages": {line_prompt}}}, "preferred_output": {chosen}, "non_preferred_output": {rejected}}}'
    else:
        line = f'{{"prompt": {line_prompt}, "chosen": {chosen}, "rejected": {rejected}, "meta": {_meta_json(pair.meta)}}}'
    return int.from_bytes(digest[:8], "big"), line + "\n"


def example_digest_and_line(example: Example, fmt: str = "trl") -> tuple[int, str]:
    """example_digest(example) and to_line(to_record(example)) at once, each string quoted once, as
    digest_and_line does for a pair (the same bytes; a test checks)."""
    prompt = _prompt_json(example.prompt)
    if (prompt is None or type(example.completion) is not str or type(example.label) is not bool or fmt == "openai"
            or example.tools):
        return example_digest(example), to_line(to_record(example, fmt))
    canon_prompt, line_prompt = prompt
    completion, label = _quote(example.completion), "true" if example.label else "false"
    digest = hashlib.sha256(f"[{canon_prompt},{completion},{label}]".encode("utf-8")).digest()  # = example_digest's
    line = (f'{{"prompt": {line_prompt}, "completion": [{{"role": "assistant", "content": {completion}}}], '
            f'"label": {label}, "meta": {_meta_json(example.meta)}}}')
    return int.from_bytes(digest[:8], "big"), line + "\n"


class PairWriter:
    """Streams lines to a temporary file beside the destination; `commit` renames it into place.

    Anything that stops the run first (bad input, no pairs) leaves the destination untouched.
    kit.atomic_write_* need the whole text at once, hence this streaming variant. Writes pairs or
    Examples alike; `by_label` counts the examples written by label.
    """

    def __init__(self, dest: str, fmt: str):
        self.dest, self.fmt = dest, fmt
        self.seen, self.by_rule, self.by_label, self.duplicates = DigestSet(), Counter(), Counter(), 0
        folder = tempfile.gettempdir() if dest == "-" else os.path.dirname(os.path.abspath(dest))
        os.makedirs(folder, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{os.path.basename(dest)}.", suffix=".tmp", dir=folder)
        self.file = os.fdopen(fd, "wb")  # lines are encoded as they come (process_block's in its worker)

    def write(self, pairs) -> None:
        for pair in pairs:
            digest, line = digest_and_line(pair, self.fmt)
            if not self.seen.add(digest):
                self.duplicates += 1
                continue
            self.file.write(line.encode("utf-8"))
            self.by_rule[pair.meta["rule"]] += 1
            if isinstance(pair, Example):
                self.by_label[pair.label] += 1

    def write_block(self, block) -> list:
        """write() for the lines of a build_pairs.Block (digests, encoded text, line ends, rules, and labels: one
        per line for examples, none for pairs): one write when none is a duplicate (~350 KB on the bench).
        Returns whether each line was written (False: a duplicate)."""
        kept = [self.seen.add(digest) for digest in block.digests]
        if all(kept):
            self.file.write(block.text)
            self.by_rule.update(block.rules)
            self.by_label.update(block.labels)
            return kept
        text, start = memoryview(block.text), 0
        labels = block.labels or [None] * len(kept)
        for keep, end, rule, label in zip(kept, block.ends, block.rules, labels):
            if keep:
                self.file.write(text[start:end])
                self.by_rule[rule] += 1
                if label is not None:
                    self.by_label[label] += 1
            else:
                self.duplicates += 1
            start = end
        return kept

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if self.dest == "-":
            sys.stdout.flush()
            with open(self.tmp, "rb") as f:
                if hasattr(sys.stdout, "buffer"):
                    shutil.copyfileobj(f, sys.stdout.buffer)
                else:  # a text-only stream (some embedding or capture)
                    sys.stdout.write(f.read().decode("utf-8"))
            sys.stdout.flush()
            os.unlink(self.tmp)
        else:
            os.replace(self.tmp, self.dest)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)
