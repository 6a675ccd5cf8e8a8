"""Constrained decoding for the service's answers: structured outputs (response_format json_object / json_schema,
the Responses API's text.format) and forced tool calls (tool_choice "required", a named function, allowed_tools
"required") as llguidance grammars, applied to transformers' generate as a logits processor. llguidance builds the
grammar and computes each step's token mask; this module only says which grammar, and lays the mask on the logits.

JSON is written in one canonical layout (", " and ": ", no free whitespace), so a small model cannot loop on
newlines inside a constrained object. A forced call is written as the kit's chatml-tools template (and Hermes-style
templates) write one: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one or more, which
api_chat.tool_calls_in reads back. Not a script: imported by api_chat.py and api_responses.py."""

from __future__ import annotations

import json
import re
import threading

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CALL_OPEN, CALL_CLOSE, CALL_GAP = "<tool_call>\n", "\n</tool_call>", "\n"  # templates/chatml-tools.jinja's layout


def problem(grammar: str) -> str | None:
    """Why llguidance cannot build this grammar (an unsupported or malformed schema), or None."""
    from llguidance import LLMatcher

    try:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    except Exception as e:  # noqa: BLE001 - whatever the library raises on a grammar it cannot take: the schema's fault
        return f"{type(e).__name__}: {str(e)[:200]}"
    if not is_error:
        return None
    first = messages[0].splitlines()[0] if messages and messages[0].strip() else "invalid grammar"
    return re.sub(r"^at \d+\(\d+\): ", "", first)[:300]  # llguidance's position is in the kit's Lark text


SAFE_INTEGER = 2 ** 53 - 1  # RFC 8259 section 6: the integers JSON's parsers agree on
LEFT_AS_DATA = {"const", "enum", "default", "examples"}  # values, not schemas: never bounded


def bounded(schema):
    """The schema with each integer left unbounded held to +-SAFE_INTEGER, so a small model cannot write digits
    until max_tokens cuts it (SmolLM2 at temperature 0 did: "population": 1111...). Nothing else changes."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in LEFT_AS_DATA else bounded(v) for k, v in schema.items()}
    kinds = out.get("type")
    if kinds == "integer" or (isinstance(kinds, list) and "integer" in kinds):
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
    return out


def json_lark(schema: dict | None, strict: bool) -> str:
    """A Lark rule body for a JSON value valid against `schema` (None: any JSON object, json_object's contract). Not
    strict: keywords llguidance does not enforce are ignored (lenient), as OpenAI's best effort is; strict: they
    make the grammar fail, as OpenAI's strict mode refuses them."""
    schema = {"type": "object"} if schema is None else bounded(schema)
    schema["x-guidance"] = JSON_LAYOUT | ({} if strict else {"lenient": True})
    return "%json " + json.dumps(schema)


def call_schema(function: dict) -> dict:
    """The JSON a call to this function is: {"name": its name, "arguments": valid against its parameters}."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def built(lark: str) -> str:
    """llguidance's grammar for this Lark text; a ValueError saying why where it cannot be built."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_lark(lark)
    why = problem(grammar)
    if why:
        raise ValueError(why)
    return grammar


def grammar(schema: dict | None = None, strict: bool = False, *, json_answer: bool = False,
            functions: list[dict] = (), calls_only: bool = False, parallel: bool = True) -> str:
    """The grammar of an answer: JSON valid against `schema` (json_answer), or tool calls to `functions`
    ({"name", "parameters", "strict"}: one call, or with `parallel` one or more), or either when both are given
    (an agent with tools and a structured final answer). calls_only: the calls, and nothing else. A schema or a
    function's parameters llguidance cannot enforce is a ValueError naming which (a strict one's unknown keywords
    too; others' are ignored)."""
    for function in functions:  # each checked alone, so the error names the function
        try:
            built("start: " + json_lark(call_schema(function), bool(function.get("strict"))))
        except ValueError as e:
            raise ValueError(f"function {function['name']!r}: {e}") from None
    rules = []
    if functions:
        strict_calls = all(f.get("strict") for f in functions)
        calls = [call_schema(f) for f in functions]
        rules += [f"calls: call{' (' + json.dumps(CALL_GAP) + ' call)*' if parallel else ''}",
                  f"call: {json.dumps(CALL_OPEN)} call_body {json.dumps(CALL_CLOSE)}",
                  "call_body: " + json_lark(calls[0] if len(calls) == 1 else {"anyOf": calls}, strict_calls)]
    if json_answer:
        rules.append("answer: " + json_lark(schema, strict))
    choices = ([] if not functions else ["calls"]) + ([] if not json_answer or calls_only else ["answer"])
    if not choices:
        raise ValueError("nothing to constrain")
    return built("\n".join(["start: " + " | ".join(choices), *rules]) + "\n")


_tokenizers: dict = {}  # (id(tokenizer), vocabulary size, end token) -> (tokenizer, llguidance's): ~0.3 s each
_tokenizers_lock = threading.Lock()


def ll_tokenizer(tokenizer, n_vocab: int, end: int):
    """llguidance's view of a transformers tokenizer, built once per tokenizer, logits width (the model's vocabulary
    may be padded past the tokenizer's) and end token."""
    import llguidance.hf

    key = (id(tokenizer), n_vocab, end)
    with _tokenizers_lock:
        if key not in _tokenizers:
            if len(_tokenizers) >= 8:
                _tokenizers.pop(next(iter(_tokenizers)))
            _tokenizers[key] = (tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=end))
        return _tokenizers[key][1]


def allowed(bitmask: bytes, n_vocab: int):
    """llguidance's bitmask (one bit per token, 32 to an int32) as a bool tensor of the logits' width."""
    import torch

    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32)
    bits = (words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    out = bits.flatten()[:n_vocab].bool()
    if out.numel() < n_vocab:  # tokens past llguidance's vocabulary are never allowed
        out = torch.cat([out, torch.zeros(n_vocab - out.numel(), dtype=torch.bool)])
    return out


class GrammarProcessor:
    """A transformers logits processor: each row of the batch (the n answers) follows its own copy of the grammar.
    Each call reads the token each row drew last, advances that row's matcher, and sends every token the grammar
    does not allow next to -inf. The model's end tokens (`ends`) are allowed exactly where the grammar may end (to
    llguidance they are all one, the tokenizer's end of text); once it is complete, only they are (a row already
    ended is padded by generate, whatever its mask)."""

    def __init__(self, grammar: str, tokenizer, ends: list[int]):
        self.grammar, self.tokenizer, self.ends = grammar, tokenizer, sorted(ends)
        self.end = tokenizer.eos_token_id if tokenizer.eos_token_id in ends else self.ends[0]
        self.matchers, self.start = None, None

    def __call__(self, input_ids, scores):
        import torch
        from llguidance import LLMatcher

        n_vocab = scores.shape[-1]
        if self.matchers is None:
            lltok = ll_tokenizer(self.tokenizer, n_vocab, self.end)
            self.matchers = [LLMatcher(lltok, self.grammar, log_level=0) for _ in range(input_ids.shape[0])]
            self.start = input_ids.shape[1]
        ends = torch.tensor([e for e in self.ends if e < n_vocab], dtype=torch.long)
        masks = []
        for row, matcher in enumerate(self.matchers):
            if input_ids.shape[1] > self.start and not matcher.is_stopped():
                token = int(input_ids[row, -1])
                matcher.consume_token(self.end if token in self.ends else token)
            if matcher.is_stopped() or matcher.is_error():  # the grammar is complete (or lost): only an end
                mask = torch.zeros(n_vocab, dtype=torch.bool)
                mask[ends] = True
            else:
                mask = allowed(matcher.compute_bitmask(), n_vocab)
                if self.end < n_vocab and mask[self.end]:
                    mask[ends] = True
            masks.append(mask)
        keep = torch.stack(masks).to(scores.device)
        return scores.masked_fill(~keep, float("-inf"))
