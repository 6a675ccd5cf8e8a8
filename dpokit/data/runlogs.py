"""Agent run logs (JSONL, one run per line), read and checked: each line a Run of Attempts, a bad line a
`FILE:LINE: what is wrong` error. The pairs' rules (dpokit/pairs/from_logs.py, build_pairs.py), the checker and the
attempts read logs through here.

A run: {"run_id", "prompt": [msgs, or [msg, tag] pairs], "strategy", "attempts": [{"code", "ran", "space_freed"}],
"tools"?}; an attempt *succeeded* when it ran and scored > 0 (the score key, default space_freed)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import sys
from dataclasses import dataclass

from dpokit.core import kit
from dpokit.data import formats
from dpokit.core.kit import UserError
from dpokit.data.formats import ROLES, decode_json, json_error, short

SCORE_KEY = "space_freed"  # the attempt key holding the score, unless told otherwise (build_pairs.py --score_key)


TOOL_KEYS = {"tool_calls", "tool_call_id", "name"}  # a prompt message with any of these is an agent's tool use


@dataclass(frozen=True)
class Attempt:
    code: str
    ran: bool
    score: int | float | None  # None: did not run, or ran with no score recorded
    broke: bool = False  # it deleted or changed what must be kept (broke_in_log): its mixed pair is rejected_broke
    made: bool = False  # not the agent's answer: a variant of one that attempts.py made (`made` in the log)
    origin: int | None = None  # a made attempt's `from`: the index of the attempt it was made from

    @property
    def succeeded(self) -> bool:
        return self.ran and self.score is not None and self.score > 0


@dataclass(frozen=True)
class Run:
    run_id: str
    messages: list  # [{"role", "content"}], the prompt that asked for the strategy
    tags: list | None  # one tag (or None) per message; None when no message had one
    strategy: str
    attempts: tuple
    tools: list | None = None  # the functions the agent could call (its prompt may hold its calls and their results)


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _checked(text: str, what: str, bad) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # json.loads lets "\ud800" through; no UTF-8 writer will
        raise bad(f"{what} holds an unpaired surrogate (\\u{ord(text[e.start]):04x})") from None
    return text


def _blank(text: str) -> bool:
    """not text.strip(), without copying the text: isspace stops at the first non-space (code is ~1 KB)."""
    return not text or text.isspace()


def _parse_prompt(prompt, bad, surrogates: bool = True) -> tuple[list, list | None]:
    if not isinstance(prompt, list) or not prompt:
        raise bad("prompt must be a non-empty list of messages")
    messages, tags = [], []
    for i, item in enumerate(prompt):
        tag = item.get("tag") if isinstance(item, dict) else None
        if isinstance(item, list):  # the agent's own chat history: [message, tag]
            if len(item) != 2:
                raise bad(f"prompt[{i}]: a [message, tag] pair has 2 items, not {len(item)}")
            item, tag = item
        if not isinstance(item, dict):
            raise bad(f"prompt[{i}]: expected a message object or a [message, tag] pair, got {_kind(item)}")
        role, content = item.get("role"), item.get("content")
        if not isinstance(role, str) or role not in ROLES:  # a list or object role is not hashable
            raise bad(f"prompt[{i}]: role must be one of {', '.join(sorted(ROLES))}, got {short(role)}")
        if TOOL_KEYS & item.keys():  # an agent's tool call or a tool's result: checked as the pair formats check it
            try:
                message = formats.messages([{k: v for k, v in item.items() if k != "tag"}], "prompt")[0]
            except ValueError as e:
                raise bad(str(e).replace("prompt[0]", f"prompt[{i}]", 1)) from None
            messages.append(message)
            tags.append(tag)
            continue
        if not isinstance(content, str):
            raise bad(f"prompt[{i}]: content must be a string, got {_kind(content)}")
        if tag is not None and not isinstance(tag, str):
            raise bad(f"prompt[{i}]: tag must be a string, got {_kind(tag)}")
        if surrogates:
            _checked(content, f"prompt[{i}]", bad)
        messages.append({"role": role, "content": content})
        tags.append(tag)
    if any(len(m) > 2 for m in messages):  # a tool result answers a call made before it
        try:
            formats.messages(messages, "prompt")
        except ValueError as e:
            raise bad(str(e)) from None
    return messages, (None if tags.count(None) == len(tags) else tags)


BROKE_ERROR = "deleted or changed what must be kept"  # how attempts.attempt_record begins such an attempt's error


def broke_in_log(a: dict) -> bool:
    """An attempt's log says it deleted or changed what must be kept: the checker's outcome "broke" (attempts.py
    writes it), or an error that says so in attempts.py's words (logs without an outcome)."""
    error = a.get("error")
    return a.get("outcome") == "broke" or (isinstance(error, str) and error.startswith(BROKE_ERROR))


def _parse_attempt(a, i: int, score_key: str, bad, surrogates: bool = True) -> Attempt:
    if not isinstance(a, dict):
        raise bad(f"attempts[{i}]: expected an object, got {_kind(a)}")
    code = a.get("code")
    if not isinstance(code, str) or _blank(code):
        raise bad(f"attempts[{i}]: code is missing or empty")
    ran = a.get("ran")
    if ran is not True and ran is not False:
        raise bad(f"attempts[{i}]: ran must be true or false, got {'nothing' if ran is None else short(ran)}")
    score = a.get(score_key) if ran else None
    if score is not None and (type(score) is bool or not isinstance(score, (int, float)) or not math.isfinite(score)):
        raise bad(f"attempts[{i}]: {score_key} must be a finite number, got {short(score)}")
    if surrogates:
        _checked(code, f"attempts[{i}].code", bad)
    origin = a.get("from")
    if a.get("made") and not (type(origin) is int and 0 <= origin < i):
        raise bad(f"attempts[{i}]: a made attempt's `from` must be the index of an earlier attempt (0 to {i - 1}), "
                  f"got {'nothing' if origin is None else short(origin)}")
    return Attempt(code, ran, score, broke_in_log(a), bool(a.get("made")), origin if a.get("made") else None)


def parse_run(obj, path, line: int, score_key: str = "space_freed", surrogates: bool = True) -> Run:
    """One decoded JSON line -> Run; raises kit.UserError(`FILE:LINE: what is wrong`).

    surrogates=False skips the search for unpaired surrogates, for a caller that knows there can be none."""
    def bad(message):
        return kit.UserError(message, path, line)

    if not isinstance(obj, dict):
        raise bad(f"expected a run (a JSON object), got {_kind(obj)}")
    run_id = obj.get("run_id", f"line-{line}")
    if isinstance(run_id, bool) or not isinstance(run_id, (str, int)) or run_id == "":
        raise bad(f"run_id must be a non-empty string or an integer, got {short(run_id)}")
    messages, tags = _parse_prompt(obj.get("prompt"), bad, surrogates)
    strategy = obj.get("strategy")
    if not isinstance(strategy, str) or _blank(strategy):
        raise bad("strategy is missing or empty")
    attempts = obj.get("attempts")
    if not isinstance(attempts, list):
        raise bad(f"attempts must be a list, got {'nothing' if attempts is None else _kind(attempts)}")
    run_id = str(run_id)
    if surrogates:
        _checked(run_id, "run_id", bad)
        _checked(strategy, "strategy", bad)
    tools = obj.get("tools")
    if tools is not None:
        try:
            tools = formats.tools_list(tools) or None
        except ValueError as e:
            raise bad(str(e)) from None
    return Run(run_id, messages, tags, strategy,
               tuple([_parse_attempt(a, i, score_key, bad, surrogates) for i, a in enumerate(attempts)]), tools)


def host_of_run(run: Run) -> str:
    """The host line of a run's prompt: its message tagged get_basic_env_plist, else the first message that names a
    host ("Host web-prod-11, ..."), else every message's text. Untagged logs are the common case (an agent's own
    logs); the system message's words ("never delete user data") must not be read as the host's user."""
    for message, tag in zip(run.messages, run.tags or ()):
        if tag == "get_basic_env_plist":
            return message["content"]
    texts = [m["content"] for m in run.messages if isinstance(m.get("content"), str)]
    return next((t for t in texts if re.search(r"\bHost [\w.-]+", t)), " ".join(texts))


def read_runs(path: str, score_key: str = SCORE_KEY, skip_invalid: bool = False):
    """Each run of a run-log file, checked as the pairs are (FILE:LINE errors; with skip_invalid, a bad line is
    passed over as build_pairs passes it over)."""
    with open_runs(path) as f:
        data = f.read()
    for line_no, raw in enumerate(io.BytesIO(data), start=1):
        try:
            run = _parse_line(raw, path, line_no, score_key)
        except UserError:
            if skip_invalid:
                continue
            raise
        if run is not None:
            yield run


def prompts_from_logs(logs: str, score_key: str = SCORE_KEY, skip_invalid: bool = False) -> list[dict]:
    """Each run's code-asking turn as the agent saw it (its strategy, asking for the code: build_pairs' rule 2
    prompt) with the host its prompt describes and its run id (train_dpo.py keeps the held-out runs' ones)."""
    out, seen = [], set()
    for run in read_runs(logs, score_key, skip_invalid):
        host = host_of_run(run)
        if (run.strategy, host) not in seen:
            seen.add((run.strategy, host))
            out.append({"prompt": [{"role": "user", "content": run.strategy}], "host": host, "run_id": run.run_id})
    return out


def open_runs(path: str):
    """The run logs as a binary stream (`-`: standard input, left open at the end)."""
    if path == "-":
        return contextlib.nullcontext(sys.stdin.buffer)
    try:
        return open(path, "rb")
    except OSError as e:
        raise kit.UserError(f"cannot read the run logs: {e.strerror}", path) from None


def _parse_line(raw: bytes, name: str, line_no: int, score_key: str) -> Run | None:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"byte {raw[e.start]:#04x} at column {e.start + 1}"
        raise kit.UserError(f"not valid UTF-8 ({where})", name, line_no) from None
    text = text.lstrip("\ufeff") if line_no == 1 else text
    if _blank(text):
        return None
    try:
        obj = decode_json(text)
    except json.JSONDecodeError as e:
        raise kit.UserError(json_error(e), name, line_no) from None
    # The bytes are valid UTF-8, so an unpaired surrogate can only come from a \uDxxx escape: without one in
    # the line, parse_run need not encode every string to look for it (~1.5 KB a run, 7 calls: ~2 us).
    return parse_run(obj, name, line_no, score_key, surrogates=b"\\ud" in raw or b"\\uD" in raw)
