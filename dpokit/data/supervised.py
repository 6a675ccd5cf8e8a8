"""Supervised (SFT) training files as OpenAI's fine-tuning takes them: read, validate, and cut each conversation
into one example per assistant message it trains on.

Not run on its own: a supervised job of the service (jobs.py), an `sft` stage of iterate.py and SPIN
(self_pairs.py) read SFT files through `read`. One row per line:

  {"messages": [...], "tools": [...]?, "parallel_tool_calls": bool?, "functions": [...]? (legacy)}
  {"prompt": "..." | [msgs], "completion": "..." | [msgs]}   (the kit's and TRL's prompt-completion form)

Messages are system, developer (read as system), user, assistant, tool, and the legacy function. An assistant
message holds text content (a string, or OpenAI's text parts, joined), tool_calls (its content then null or
missing), or a legacy function_call; it may carry "weight": 1 (the default: trained on) or 0 (context only).
Every assistant message of weight 1 is an example: its prompt is every message before it, with the row's tools.
The legacy form becomes the tools form, so a chat template renders it one way: function_call -> tool_calls with a
generated id (call_<message index>), role function -> role tool answering the latest call of that name,
functions -> tools. "parallel_tool_calls": false promises one call per assistant message, so a message with more
is refused. Messages are validated by formats.messages (the same rules as tool-calling pairs), and refused rows
name FILE:LINE and what is wrong. Standard library only.
"""

from __future__ import annotations

import dataclasses

from dpokit.core import kit
from dpokit.data.formats import BadRow, jsonl_rows, messages, short, tools_list

ROW_KEYS = ("messages", "tools", "parallel_tool_calls", "functions")
TRAINED, CONTEXT = 1, 0  # an assistant message's weight


@dataclasses.dataclass
class Example:
    """One assistant message to train on, with everything before it."""
    line: int
    prompt: list[dict]  # the messages before the answer, as formats.messages normalises them
    answer: dict  # {"role": "assistant", "content": str, "tool_calls"?: [...]}
    tools: list[dict] | None = None  # the row's tools (OpenAI's shape); None when it gives none

    def text_only(self) -> bool:
        """No tools anywhere: no tools list, no call, no tool result (what a text-only reader can take)."""
        return not self.tools and not any("tool_calls" in m or m["role"] == "tool" for m in (*self.prompt, self.answer))


@dataclasses.dataclass
class SftData:
    """What a supervised file held: its examples, and how many assistant messages stayed context (weight 0)."""
    path: str
    rows: int
    examples: list[Example]
    context_only: int  # assistant messages of weight 0: in the prompts that follow them, never trained on

    def summary(self, name: str) -> str:
        """'N SFT examples read from NAME: ...', what a job's event and a stage's log say."""
        return (f"{len(self.examples)} SFT examples read from {name} (one per assistant message trained on, in "
                f"{self.rows} rows); {self.context_only} assistant message(s) of weight 0 kept as context, not "
                "trained on")


# ---------------------------------------------------------------------------------------------
# Pure logic: one row -> its examples. ValueError says what is wrong (the reader adds FILE:LINE).
# ---------------------------------------------------------------------------------------------

def row_examples(row) -> tuple[list[tuple[list, dict]], list | None, int]:
    """One row -> ([(prompt, answer)] for each trained assistant message, the row's tools or None, assistant
    messages of weight 0)."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object with \"messages\", got {short(row)}")
    if "messages" in row:
        raw, weights = openai_messages(row["messages"])
    elif "prompt" in row:
        prompt, completion = prompt_completion(row.get("prompt"), row.get("completion"))
        raw, weights = openai_messages(prompt + completion)
        weights[:len(prompt)] = [CONTEXT if w is not None else None for w in weights[:len(prompt)]]
    else:
        raise ValueError(f"expected \"messages\" (or \"prompt\" and \"completion\"); the row has "
                         f"{', '.join(map(repr, sorted(row))) or 'no keys'}")
    tools = row_tools(row)
    msgs = messages(raw, "messages")
    check_calls(msgs, row.get("parallel_tool_calls", True))
    trained = [i for i, w in enumerate(weights) if w == TRAINED]
    if not trained:
        raise ValueError("no assistant message to train on" + (" (every one has weight 0)" if CONTEXT in weights
                                                              else ""))
    for i in trained:
        m = msgs[i]
        if i == 0:
            raise ValueError("messages[0] is an assistant message to train on with nothing before it (give it "
                             "weight 0, or start with the system or user message)")
        if not m["content"].strip() and "tool_calls" not in m:
            raise ValueError(f"messages[{i}] is an assistant message to train on with no content and no tool calls")
    return [(msgs[:i], msgs[i]) for i in trained], tools, weights.count(CONTEXT)


def openai_messages(value) -> tuple[list, list]:
    """OpenAI's messages -> (messages as formats.messages reads them, each one's weight: 1 or 0 for an assistant
    message, None for the others). Weights are taken off; developer becomes system; the legacy function_call and
    role function become tool_calls and role tool."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"messages must be a non-empty list of messages, got {short(value)}")
    out, weights, legacy = [], [], []  # legacy: (call id, function name) of each function_call so far
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object with 'role' and 'content', got {short(m)}")
        m = dict(m)
        weight = m.pop("weight", None)
        if m.get("role") == "assistant":
            if weight is None:
                weight = TRAINED
            elif weight not in (TRAINED, CONTEXT) or isinstance(weight, bool) or not isinstance(weight, int):
                raise ValueError(f"{where}.weight must be 0 (context only) or 1 (trained on), got {short(weight)}")
        elif weight is not None:
            raise ValueError(f"{where}: only an assistant message has a weight (this one is {short(m.get('role'))})")
        if m.get("role") == "developer":
            m["role"] = "system"
        if m.get("function_call") is not None:
            m = from_function_call(m, i, legacy)
        elif m.get("role") == "function":
            m = from_function_message(m, i, legacy)
        out.append(m)
        weights.append(weight)
    return out, weights


def from_function_call(m: dict, i: int, legacy: list) -> dict:
    """A legacy assistant function_call {name, arguments} as one tool call, id call_<i>."""
    where = f"messages[{i}]"
    if m.get("role") != "assistant":
        raise ValueError(f"{where}: only an assistant message makes a function_call (this one is {short(m.get('role'))})")
    if m.get("tool_calls") is not None:
        raise ValueError(f"{where} has both function_call and tool_calls: give one (tool_calls is the current form)")
    call = m.pop("function_call")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError(f"{where}.function_call must be {{\"name\": str, \"arguments\": str}}, got {short(call)}")
    call_id = f"call_{i}"
    legacy.append((call_id, call["name"]))
    return m | {"tool_calls": [{"id": call_id, "type": "function", "function": {
        "name": call["name"], "arguments": call.get("arguments", "{}")}}]}


def from_function_message(m: dict, i: int, legacy: list) -> dict:
    """A legacy function result {role: function, name, content} as a tool message answering the latest
    function_call of that name."""
    name = m.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"messages[{i}].name must name the function whose result this is, got {short(name)}")
    ids = [call_id for call_id, called in legacy if called == name]
    if not ids:
        raise ValueError(f"messages[{i}]: a function message answers no function_call of {name!r} before it")
    content = m.get("content")
    return {"role": "tool", "tool_call_id": ids[-1], "name": name, "content": "" if content is None else content}


def prompt_completion(prompt, completion) -> tuple[list, list]:
    """{"prompt", "completion"} (each text or a message list) as two message lists: the completion's assistant
    messages are trained on, the prompt's kept as context."""
    parts = []
    for value, what in ((prompt, "prompt"), (completion, "completion")):
        if isinstance(value, str):
            if not value.strip():
                raise ValueError(f"{what} is empty")
            value = [{"role": "user" if what == "prompt" else "assistant", "content": value}]
        if not isinstance(value, list) or not value:
            raise ValueError(f"{what} must be a string or a non-empty list of messages, got {short(value)}")
        parts.append(value)
    return parts[0], parts[1]


def row_tools(row: dict) -> list | None:
    """The row's tools (OpenAI's shape), from tools or the legacy functions; None when it gives none."""
    tools, functions = row.get("tools"), row.get("functions")
    if tools not in (None, []) and functions not in (None, []):
        raise ValueError("the row gives both tools and functions: give one (tools is the current form)")
    if functions not in (None, []):
        if not isinstance(functions, list):
            raise ValueError(f"functions must be a list of functions, got {short(functions)}")
        tools = [{"type": "function", "function": f} for f in functions]
    if tools in (None, []):
        return None
    tools = tools_list(tools, "tools" if functions in (None, []) else "functions")
    names = [t["function"]["name"] for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tools name {', '.join(map(repr, twice))} more than once")
    return tools


def check_calls(msgs: list[dict], parallel) -> None:
    """What OpenAI's rows promise beyond formats.messages: every call has an id, used once; every tool result
    answers a call made before it; with parallel_tool_calls false, one call per assistant message."""
    if not isinstance(parallel, bool):
        raise ValueError(f"parallel_tool_calls must be true or false, got {short(parallel)}")
    made = set()
    for i, m in enumerate(msgs):
        for j, call in enumerate(m.get("tool_calls", ())):
            if "id" not in call:
                raise ValueError(f"messages[{i}].tool_calls[{j}].id is missing (a tool message answers it by "
                                 "tool_call_id)")
            if call["id"] in made:
                raise ValueError(f"messages[{i}].tool_calls[{j}].id {call['id']!r} is used twice in the conversation")
            made.add(call["id"])
        if not parallel and len(m.get("tool_calls", ())) > 1:
            raise ValueError(f"messages[{i}] makes {len(m['tool_calls'])} tool calls, and the row says "
                             "parallel_tool_calls: false (one call per message)")
        if m["role"] == "tool" and m.get("tool_call_id") not in made:
            raise ValueError(f"messages[{i}]: a tool message must answer a call made before it by its tool_call_id"
                             + (f" (got {short(m.get('tool_call_id'))}; made: {', '.join(sorted(made)) or 'none'})"))


# ---------------------------------------------------------------------------------------------
# The file: every row read before anything trains; a bad one stops the read with FILE:LINE.
# ---------------------------------------------------------------------------------------------

def read(path: str, limit: int = 0) -> SftData:
    """Every example of a supervised file (the first `limit` examples when limit > 0; the rows after them are
    not read). Raises kit.UserError naming the line."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise kit.UserError(f"cannot read: {e.strerror}", path) from None
    examples, rows, context = [], 0, 0
    for line, row in jsonl_rows(raw):
        if isinstance(row, BadRow):
            raise kit.UserError(str(row), path, line)
        try:
            found, tools, untrained = row_examples(row)
        except ValueError as e:
            raise kit.UserError(str(e), path, line) from None
        rows, context = rows + 1, context + untrained
        examples += [Example(line, prompt, answer, tools) for prompt, answer in found]
        if limit and len(examples) >= limit:
            examples = examples[:limit]
            break
    if not examples:
        raise kit.UserError("no examples in the file", path)
    return SftData(path, rows, examples, context)
