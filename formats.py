"""Preference-pair file formats: detect each file's format, validate every line, normalise to TRL's shape.

Not run on its own; train_dpo.py reads pairs through `load_pairs`. Five formats are accepted, one
per file (detected from the first record, then every line must match it):

  trl_standard        {"prompt": "...", "chosen": "...", "rejected": "..."}
  trl_conversational  {"prompt": [msgs], "chosen": [msgs], "rejected": [msgs]}
  implicit_prompt     {"chosen": [msgs] | "...", "rejected": [msgs] | "..."}  (shared prefix = prompt)
  openai              {"input": {"messages": [msgs]}, "preferred_output": [msgs], "non_preferred_output": [msgs]}
  hh                  {"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ...", "rejected": "..."}  (Anthropic HH-RLHF)

Every record comes out as {"prompt", "chosen", "rejected"}: either all strings (trl_standard, and
implicit_prompt over strings) or all message lists, which TRL renders with the chat template.
Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import re

from kit import UserError

FORMATS = ("trl_standard", "trl_conversational", "implicit_prompt", "openai", "hh")
ROLES = {"system", "user", "assistant", "tool"}
_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")


def detect_format(record: dict) -> str | None:
    """The format of one record by its keys and value types, or None if it is none of the five."""
    if not isinstance(record, dict):
        return None
    if "preferred_output" in record or "non_preferred_output" in record:
        return "openai"
    if "prompt" in record:
        return "trl_conversational" if isinstance(record.get("prompt"), list) else "trl_standard"
    if "chosen" in record or "rejected" in record:
        chosen = record.get("chosen")
        if isinstance(chosen, str) and chosen.lstrip("\n").startswith("Human: ") and "\n\nAssistant: " in chosen:
            return "hh"
        return "implicit_prompt"
    return None


def _text(content, what: str) -> str:
    """Message content as text: a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ValueError(f"{what}: content must be a string or a list of text parts")


def messages(value, what: str) -> list[dict]:
    """Validate a message list and keep only role and content."""
    if value is None:
        raise ValueError(f"missing field {what!r}")
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what} must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{what}[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"{what}[{i}]: unknown role {m['role']!r} (expected one of {', '.join(sorted(ROLES))})")
        out.append({"role": m["role"], "content": _text(m["content"], f"{what}[{i}]")})
    return out


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


def normalise(record: dict, fmt: str) -> dict:
    """One record in format `fmt` -> {"prompt", "chosen", "rejected"}; ValueError says what is wrong."""
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
            if side[-1]["role"] != "assistant" or not side[-1]["content"].strip():
                raise ValueError(f"{name} must end with a non-empty assistant message")
    elif not chosen.strip() or not rejected.strip():
        raise ValueError("chosen or rejected completion is empty after the shared prompt")
    if chosen == rejected:
        raise ValueError("chosen is identical to rejected")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def load_pairs(path: str, skip_invalid: bool = False) -> tuple[list[dict], dict]:
    """Read and validate a whole pairs file before any model loads.

    Returns (records, stats); stats = {"format", "lines", "pairs", "skipped": {reason: n}}.
    Raises UserError(FILE:LINE) on the first bad line, unless skip_invalid (then counts it).
    A file of mixed formats, or with no usable pair, is an error either way.
    """
    try:
        raw = open(path, "rb").read()
    except OSError as e:
        raise UserError(f"cannot read pairs file: {e.strerror}", path) from None
    records, skipped, fmt, fmt_line = [], {}, None, None

    def bad(line_no: int, message: str, reason: str):
        if not skip_invalid:
            raise UserError(message, path, line_no)
        skipped[reason] = skipped.get(reason, 0) + 1

    lines = raw.split(b"\n")
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            bad(line_no, f"not UTF-8 (byte {line[e.start]:#04x} at column {e.start + 1})", "not_utf8")
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            bad(line_no, f"malformed JSON: {e.msg} at column {e.colno}", "malformed_json")
            continue
        this = detect_format(record)
        if this is None:
            keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
            bad(line_no, f"unknown format (keys: {keys}); expected one of: {', '.join(FORMATS)}", "unknown_format")
            continue
        if fmt is None:
            fmt, fmt_line = this, line_no
        elif this != fmt:
            raise UserError(f"format {this} differs from the file's format {fmt} (detected at line {fmt_line})",
                            path, line_no)
        try:
            records.append(normalise(record, fmt))
        except ValueError as e:
            reason = "identical" if "identical" in str(e) else "invalid_pair"
            bad(line_no, str(e), reason)
    nonblank = sum(1 for x in lines if x.strip())
    if not records:
        raise UserError("no usable preference pair in the file" if nonblank else "the file is empty", path)
    kinds = {isinstance(r["prompt"], list) for r in records}
    if len(kinds) > 1:
        raise UserError("mixes text and message-list pairs; use one shape per file", path)
    return records, {"format": fmt, "lines": nonblank, "pairs": len(records), "skipped": skipped,
                     "sha256": hashlib.sha256(raw).hexdigest()}
