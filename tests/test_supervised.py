"""supervised.py: OpenAI's supervised rows on worked examples (every accepted shape, every refusal with its line),
and no row, however broken, ending in anything but examples or a UserError (hypothesis)."""
import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpokit.data import formats
import fuzz
from dpokit.data import supervised
from dpokit.core.kit import UserError

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text, **more: {"role": "assistant", "content": text, **more}  # noqa: E731
WEATHER = {"name": "get_current_weather", "description": "Get the current weather",
           "parameters": {"type": "object", "properties": {"location": {"type": "string"},
                                                           "format": {"type": "string", "enum": ["celsius"]}},
                          "required": ["location", "format"]}}
ARGS = '{"location": "San Francisco, USA", "format": "celsius"}'
CALL = {"id": "call_id", "type": "function", "function": {"name": "get_current_weather", "arguments": ARGS}}

# The fine-tuning guide's rows, as OpenAI documents them.
MARV = {"messages": [{"role": "system", "content": "Marv is a factual chatbot that is also sarcastic."},
                     U("What's the capital of France?"), A("Paris", weight=0), U("Can you be more sarcastic?"),
                     A("Paris, as if everyone doesn't know that already.", weight=1)]}
TOOLS_ROW = {"messages": [U("What is the weather in San Francisco?"),
                          {"role": "assistant", "tool_calls": [CALL]},
                          {"role": "tool", "tool_call_id": "call_id", "content": "21.0"},
                          A("It is 21 degrees celsius in San Francisco, CA")],
             "tools": [{"type": "function", "function": WEATHER}]}
LEGACY_ROW = {"messages": [U("What is the weather in San Francisco?"),
                           {"role": "assistant", "function_call": {"name": "get_current_weather", "arguments": ARGS}},
                           {"role": "function", "name": "get_current_weather", "content": "21.0"},
                           A("It is 21 degrees celsius in San Francisco, CA")],
              "functions": [WEATHER]}
# The cookbook's function-calling fine-tune (fine_tuning_for_function_calling): the answer is the call alone,
# no content; one call per message promised.
COOKBOOK_ROW = {"messages": [{"role": "system", "content": "You are an assistant that controls a drone."},
                             U("Take off to 10 meters"),
                             {"role": "assistant", "tool_calls": [{"id": "call_id", "type": "function", "function": {
                                 "name": "takeoff_drone", "arguments": '{"altitude": 10}'}}]}],
                "parallel_tool_calls": False,
                "tools": [{"type": "function", "function": {
                    "name": "takeoff_drone", "description": "Initiate the drone's takeoff sequence.",
                    "parameters": {"type": "object", "properties": {"altitude": {"type": "integer"}},
                                   "required": ["altitude"]}}}]}
VALID = [MARV, TOOLS_ROW, LEGACY_ROW, COOKBOOK_ROW, {"messages": [U("Hi"), A("Hello.")]},
         {"prompt": "2+2?", "completion": "4"}]


def write(tmp_path, rows, name="sft.jsonl") -> str:
    path = tmp_path / name
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return str(path)


def examples(row) -> list[tuple[list, dict]]:
    return supervised.row_examples(copy.deepcopy(row))[0]


# ------------------------------------------------------------------ what is accepted

def test_the_cookbooks_function_calling_rows_read_where_they_failed_at_line_10(tmp_path):
    """The issue: `sft_train.jsonl:10: messages[2] must be a message` for an answer that is a call, no content."""
    path = write(tmp_path, [{"messages": [U(f"Q{i}"), A(f"A{i}")]} for i in range(9)] + [COOKBOOK_ROW],
                 "sft_train.jsonl")
    data = supervised.read(path)
    assert (data.rows, len(data.examples), data.context_only) == (10, 10, 0)
    last = data.examples[-1]
    assert last.line == 10 and [m["role"] for m in last.prompt] == ["system", "user"]
    assert last.answer == {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_id", "type": "function", "function": {"name": "takeoff_drone", "arguments": {"altitude": 10}}}]}
    assert last.tools == COOKBOOK_ROW["tools"] and not last.text_only() and data.examples[0].text_only()


def test_every_assistant_message_of_weight_1_is_an_example_and_weight_0_stays_context():
    [(prompt, answer)] = examples(MARV)
    assert prompt == [MARV["messages"][0], U("What's the capital of France?"), A("Paris"),
                      U("Can you be more sarcastic?")]  # the weight-0 answer is in the context, its weight gone
    assert answer == A("Paris, as if everyone doesn't know that already.")
    assert supervised.row_examples(MARV)[2] == 1
    row = {"messages": [U("a"), A("1"), U("b"), A("2", weight=0), U("c"), A("3", weight=1)]}
    got = examples(row)  # weights [1 (the default), 0, 1]: two examples
    assert [(len(p), a["content"]) for p, a in got] == [(1, "1"), (5, "3")]
    assert got[1][0][3] == A("2")


def test_a_call_its_result_and_the_answer_after_it_are_two_examples_with_the_tools():
    (p1, call), (p2, answer) = examples(TOOLS_ROW)
    assert p1 == [U("What is the weather in San Francisco?")] and call["content"] == ""
    assert call["tool_calls"][0]["function"]["arguments"] == json.loads(ARGS)  # as chat templates read them
    assert p2 == p1 + [call, {"role": "tool", "tool_call_id": "call_id", "content": "21.0"}]
    assert answer == A("It is 21 degrees celsius in San Francisco, CA")
    assert supervised.row_examples(TOOLS_ROW)[1] == [{"type": "function", "function": WEATHER}]
    null = copy.deepcopy(TOOLS_ROW)
    null["messages"][1]["content"] = None  # null content, as the API returns it, is the same as none
    assert examples(null) == examples(TOOLS_ROW)


def test_the_legacy_function_call_form_becomes_the_tools_form():
    legacy, tools = json.loads(json.dumps(examples(LEGACY_ROW))), examples(TOOLS_ROW)
    renamed = json.loads(json.dumps(tools).replace('"call_id"', '"call_1"'))  # the id made for messages[1]'s call
    renamed[1][0][2]["name"] = "get_current_weather"  # a function result keeps the function's name
    assert legacy == renamed
    assert supervised.row_examples(LEGACY_ROW)[1] == supervised.row_examples(TOOLS_ROW)[1]


def test_content_parts_developer_and_prompt_completion_rows():
    row = {"messages": [{"role": "developer", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]}
    assert examples(row) == [([{"role": "system", "content": "Be brief."}, U("2+2?")], A("4"))]
    assert examples({"prompt": "2+2?", "completion": "4"}) == [([U("2+2?")], A("4"))]
    chat = {"prompt": [U("a"), A("b"), U("c")], "completion": [A("d")]}
    assert examples(chat) == [([U("a"), A("b"), U("c")], A("d"))]  # the prompt's answers are context
    assert supervised.row_examples(chat)[2] == 1


def test_parallel_calls_are_accepted_unless_the_row_says_parallel_tool_calls_false():
    two = copy.deepcopy(TOOLS_ROW)
    two["messages"][1]["tool_calls"].append(CALL | {"id": "call_2"})
    two["messages"].insert(3, {"role": "tool", "tool_call_id": "call_2", "content": "19.0"})
    assert len(examples(two)[0][1]["tool_calls"]) == 2
    assert len(examples(two | {"parallel_tool_calls": True})) == 2
    with pytest.raises(ValueError, match=r"messages\[1\] makes 2 tool calls, and the row says parallel_tool_calls: "
                                         "false"):
        examples(two | {"parallel_tool_calls": False})


# ------------------------------------------------------------------ what is refused, naming the line

def change(row, *path_and_value):
    """A copy of row with the value at path set (a path ending in '-' drops it)."""
    *path, value = path_and_value
    row = copy.deepcopy(row)
    target = row
    for key in path[:-1]:
        target = target[key]
    if value == "-":
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return row


REFUSED = [
    (change(MARV, "messages", 2, "weight", 2), "messages[2].weight must be 0 (context only) or 1 (trained on), got 2"),
    (change(MARV, "messages", 2, "weight", True), "messages[2].weight must be 0 (context only) or 1 (trained on), "
                                                 "got True"),
    (change(MARV, "messages", 2, "weight", 0.5), "got 0.5"),
    (change(MARV, "messages", 2, "weight", "0"), "got '0'"),
    (change(MARV, "messages", 1, "weight", 1), "messages[1]: only an assistant message has a weight (this one is "
                                               "'user')"),
    (change(MARV, "messages", 4, "weight", 0), "no assistant message to train on (every one has weight 0)"),
    ({"messages": [U("hi")]}, "no assistant message to train on"),
    ({"messages": [A("Hello"), U("hi")]}, "messages[0] is an assistant message to train on with nothing before it"),
    ({"messages": [U("hi"), A(" ")]}, "messages[1] is an assistant message to train on with no content and no tool "
                                      "calls"),
    ({"messages": [U("hi"), {"role": "assistant"}]}, "messages[1] must be an object with 'role' and 'content'"),
    ({"messages": []}, "messages must be a non-empty list of messages"),
    ({"messages": [U("hi"), "Hello"]}, "messages[1] must be an object with 'role' and 'content', got 'Hello'"),
    ({"messages": [{"role": "bot", "content": "x"}, A("y")]}, "messages[0]: unknown role 'bot'"),
    ({"text": "hi"}, "expected \"messages\" (or \"prompt\" and \"completion\"); the row has 'text'"),
    ([MARV], "expected a JSON object"),
    ({"prompt": "2+2?", "completion": 4}, "completion must be a string or a non-empty list of messages, got 4"),
    # content of a wrong type; parts that are not text
    (change(MARV, "messages", 1, "content", 5), "messages[1]: content must be a string or a list of text parts, "
                                               "got 5"),
    (change(MARV, "messages", 1, "content", [{"type": "text", "text": "What's "}, {"type": "image_url", "image_url": {
        "url": "https://example.com/paris.png"}}]), "messages[1].content[1] is a part of type 'image_url': the kit "
                                                    "trains text models"),
    (change(MARV, "messages", 1, "content", [{"type": "text", "text": 3}]), "content[0] is not {\"type\": \"text\""),
    # tool calls and their results
    (change(TOOLS_ROW, "messages", 2, "tool_call_id", "call_9"), "messages[2].tool_call_id 'call_9' answers no tool "
                                                                 "call made before it (made: call_id)"),
    (change(TOOLS_ROW, "messages", 2, "tool_call_id", "-"), "messages[2]: a tool message must answer a call made "
                                                            "before it by its tool_call_id (got None; made: call_id)"),
    ({"messages": [U("hi"), {"role": "tool", "tool_call_id": "c", "content": "r"}, A("ok")]},
     "messages[1]: a tool message must answer a call made before it by its tool_call_id (got 'c'; made: none)"),
    (change(TOOLS_ROW, "messages", 2, "content", None), "messages[2]: content must be a string"),
    (change(TOOLS_ROW, "messages", 1, "tool_calls", 0, "id", "-"), "messages[1].tool_calls[0].id is missing"),
    (change(TOOLS_ROW, "messages", 1, "tool_calls", [CALL, CALL]), "messages[1].tool_calls[1].id 'call_id' is used "
                                                                   "twice"),
    (change(TOOLS_ROW, "messages", 1, "tool_calls", 0, "function", "arguments", "{bad"), "messages[1].tool_calls[0]"
                                                                                       ".function.arguments is not "
                                                                                       "valid JSON"),
    (change(TOOLS_ROW, "messages", 0, "tool_calls", [CALL]), "messages[0]: only an assistant message makes "
                                                             "tool_calls"),
    (change(TOOLS_ROW, "parallel_tool_calls", "no"), "parallel_tool_calls must be true or false, got 'no'"),
    # tools
    (change(TOOLS_ROW, "tools", "get_current_weather"), "tools must be a list of tools"),
    (change(TOOLS_ROW, "tools", 0, "function", "name", "get weather"), "tools[0].function.name 'get weather' must "
                                                                       "be letters, digits, _ and -"),
    (change(TOOLS_ROW, "tools", 0, "function", "parameters", ["location"]), "tools[0].function.parameters must be "
                                                                            "a JSON schema object"),
    (change(TOOLS_ROW, "tools", 0, "function", "description", 7), "tools[0].function.description must be a string"),
    (change(TOOLS_ROW, "tools", 0, "type", "retrieval"), "tools[0] must be {\"type\": \"function\""),
    (change(TOOLS_ROW, "tools", [{"type": "function", "function": WEATHER}] * 2), "tools name 'get_current_weather' "
                                                                                  "more than once"),
    (LEGACY_ROW | {"tools": TOOLS_ROW["tools"]}, "the row gives both tools and functions"),
    # the legacy form
    (change(LEGACY_ROW, "functions", {"name": "f"}), "functions must be a list of functions"),
    (change(LEGACY_ROW, "functions", 0, "name", ""), "functions[0].function.name must be a non-empty string"),
    (change(LEGACY_ROW, "messages", 1, "function_call", "get_current_weather"), "messages[1].function_call must be "
                                                                                "{\"name\": str"),
    (change(LEGACY_ROW, "messages", 0, "function_call", {"name": "f"}), "messages[0]: only an assistant message "
                                                                        "makes a function_call"),
    (change(LEGACY_ROW, "messages", 1, "tool_calls", [CALL]), "messages[1] has both function_call and tool_calls"),
    (change(LEGACY_ROW, "messages", 2, "name", "other"), "messages[2]: a function message answers no function_call "
                                                         "of 'other' before it"),
    (change(LEGACY_ROW, "messages", 2, "name", "-"), "messages[2].name must name the function whose result this is"),
]


@pytest.mark.parametrize("row, message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_what_openai_refuses_is_refused_naming_the_file_and_line(tmp_path, row, message):
    path = write(tmp_path, [MARV, row])
    with pytest.raises(UserError) as e:
        supervised.read(path)
    assert str(e.value).startswith(f"{path}:2: ") and message in str(e.value), str(e.value)


@pytest.mark.parametrize("line, message", [(b"{\"messages\": [", "2: malformed JSON: Expecting value at column 15"),
                                           (b"\xff{}", "2: not UTF-8 (byte 0xff at column 1)")])
def test_a_line_that_is_not_json_is_named(tmp_path, line, message):
    path = write(tmp_path, [MARV, line])
    with pytest.raises(UserError) as e:
        supervised.read(path)
    assert str(e.value) == f"{path}:{message}"


def test_an_empty_file_and_a_missing_file_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no examples in the file"):
        supervised.read(write(tmp_path, []))
    with pytest.raises(UserError, match="cannot read"):
        supervised.read(str(tmp_path / "absent.jsonl"))


def test_limit_reads_the_first_examples_only(tmp_path):
    path = write(tmp_path, [TOOLS_ROW, MARV, b"not read"])
    assert [(e.line, e.answer["content"][:5]) for e in supervised.read(path, limit=3).examples] == [
        (1, ""), (1, "It is"), (2, "Paris")]


# ------------------------------------------------------------------ no row ends in a traceback

def check_row(row) -> None:
    """Examples whose prompts lead up to an assistant answer, or a ValueError; nothing else."""
    try:
        found, tools, context = supervised.row_examples(row)
    except ValueError:
        return
    assert found and context >= 0 and (tools is None or tools)
    for prompt, answer in found:
        assert prompt and answer["role"] == "assistant" and (answer["content"].strip() or answer.get("tool_calls"))
        record = {"prompt": prompt, "chosen": [answer], "rejected": [A("x")]} | ({"tools": tools} if tools else {})
        assert formats.normalise(json.loads(json.dumps(record)), "trl_conversational")  # the pairs file reads back


@settings(max_examples=300)
@given(row=fuzz.mutated(st.sampled_from(VALID)) | fuzz.JSON | fuzz.NASTY)
def test_any_json_row_gives_examples_or_a_value_error(row):
    check_row(row)


@settings(max_examples=60)
@given(rows=st.lists(fuzz.mutated(st.sampled_from(VALID)) | st.sampled_from(VALID), min_size=1, max_size=3))
def test_any_file_of_rows_gives_examples_or_a_user_error_naming_its_line(rows):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/sft.jsonl"
        with open(path, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        try:
            data = supervised.read(path)
        except UserError as e:
            assert str(e).startswith(f"{path}:") and (e.line is None or 1 <= e.line <= len(rows))
            return
        assert data.rows == len(rows) and data.examples
