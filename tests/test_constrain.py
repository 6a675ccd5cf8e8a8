"""Constrained decoding (constrain.py) on the bundled model's tokenizer, no model: the grammars accept what they
promise and nothing else, the forced call is the one the kit's chatml-tools template writes, integers are bounded
and nothing else in a schema changes, and the logits processor lets through only what the grammar allows."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpokit.model import constrain
from dpokit.model import models
from test_serve import MODEL, needs_model

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
DU = {"name": "disk_usage", "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                          "required": ["path"], "additionalProperties": False}, "strict": True}
LS = {"name": "list_dir", "parameters": {"type": "object", "properties": {"dir": {"type": "string"}}}}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes the whole text, token by token as the model would write it, and may end there."""
    from llguidance import LLMatcher

    matcher = LLMatcher(constrain.ll_tokenizer(tokenizer, len(tokenizer), tokenizer.eos_token_id), grammar,
                        log_level=0)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) and \
        matcher.is_accepting()


@needs_model
def test_a_json_schema_grammar_takes_valid_answers_in_its_layout_and_nothing_that_breaks_the_schema(tokenizer):
    grammar = constrain.grammar(PERSON, True, json_answer=True)
    assert accepts(tokenizer, grammar, '{"name": "Ada", "age": 36}')
    for bad in ('{"name": "Ada"}', '{"name": "Ada", "age": "36"}', '{"name": "Ada", "age": 36, "x": 1}',
                '{"name": "Ada", "age": 36', 'Sure! {"name": "Ada", "age": 36}', '{"name":"Ada","age":36}',
                '{"name": "Ada", "age": 99999999999999999}'):  # the last: past JSON's safe integers
        assert not accepts(tokenizer, grammar, bad), bad
    any_object = constrain.grammar(None, json_answer=True)  # json_object: any object, nothing else
    assert accepts(tokenizer, any_object, '{"a": [1, 2.5, null, true], "b": {}}')
    assert not accepts(tokenizer, any_object, '[1, 2]') and not accepts(tokenizer, any_object, 'hello')


@needs_model
def test_a_forced_call_is_exactly_what_the_chatml_tools_template_writes_for_one(tokenizer):
    """The grammar and the template agree: a call as templates/chatml-tools.jinja renders it in a conversation is
    taken whole, so a model trained on that template writes its usual call under the constraint."""
    template = models.chat_template_text("chatml-tools")
    turns = [{"role": "user", "content": "How full is /?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "disk_usage", "arguments": {"path": "/"}}},
        {"id": "c2", "type": "function", "function": {"name": "list_dir", "arguments": {"dir": "/srv"}}}]}]
    text = tokenizer.apply_chat_template(turns, chat_template=template, tokenize=False)
    written = text.split("<|im_start|>assistant\n")[-1].split("<|im_end|>")[0]
    assert written.count("<tool_call>") == 2
    both = constrain.grammar(functions=[DU, LS], calls_only=True)
    assert accepts(tokenizer, both, written)
    assert not accepts(tokenizer, constrain.grammar(functions=[DU, LS], calls_only=True, parallel=False), written)
    assert not accepts(tokenizer, constrain.grammar(functions=[DU], calls_only=True), written)  # list_dir not offered
    assert not accepts(tokenizer, both, "I will check. " + written)  # calls only: no words before them
    du_only = constrain.grammar(functions=[DU], calls_only=True)
    assert not accepts(tokenizer, du_only, '<tool_call>\n{"name": "disk_usage", "arguments": {}}\n</tool_call>')
    # tools and a JSON answer format: either calls or the JSON
    either = constrain.grammar(PERSON, True, json_answer=True, functions=[DU])
    assert accepts(tokenizer, either, '{"name": "Ada", "age": 36}')
    assert accepts(tokenizer, either, '<tool_call>\n{"name": "disk_usage", "arguments": {"path": "/"}}\n</tool_call>')


def test_schemas_and_parameters_the_library_cannot_enforce_are_errors_naming_them():
    with pytest.raises(ValueError, match="Unknown format"):  # strict: unknown keywords refused, as OpenAI's strict
        constrain.grammar({"type": "string", "format": "phone"}, True, json_answer=True)
    assert constrain.grammar({"type": "string", "format": "phone"}, False, json_answer=True)  # lenient: ignored
    with pytest.raises(ValueError, match="Invalid type"):
        constrain.grammar({"type": "strin"}, json_answer=True)
    with pytest.raises(ValueError, match="function 'bad'"):
        constrain.grammar(functions=[DU, {"name": "bad", "parameters": {"type": 3}}], calls_only=True)


SCHEMAS = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "string", "number", "boolean"])},
                          optional={"maximum": st.integers(), "minimum": st.integers(), "const": st.integers()}),
    lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(st.text(max_size=5), inner,
                                                                                         max_size=3)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)}),
        st.fixed_dictionaries({"enum": st.lists(st.fixed_dictionaries({"type": st.just("integer")}), max_size=2)})),
    max_leaves=8)


def walk(schema):
    yield schema
    for key, value in schema.items():
        if key in constrain.LEFT_AS_DATA:
            continue
        for child in (value.values() if key == "properties" else value if isinstance(value, list) else [value]):
            if isinstance(child, dict):
                yield from walk(child)


@settings(max_examples=200)
@given(SCHEMAS)
def test_bounding_integers_adds_only_the_missing_bounds_of_integer_schemas(schema):
    before = json.dumps(schema, sort_keys=True)
    out = constrain.bounded(schema)
    assert json.dumps(schema, sort_keys=True) == before  # the request's schema is not changed in place
    for original, bounded in zip(walk(schema), walk(out)):
        added = {k: v for k, v in bounded.items() if k not in original}
        assert {k: v for k, v in bounded.items() if k in original and not isinstance(v, (dict, list))} == \
            {k: v for k, v in original.items() if not isinstance(v, (dict, list))}  # nothing changed
        if original.get("type") == "integer":
            assert added == {k: s * constrain.SAFE_INTEGER for k, s in (("maximum", 1), ("minimum", -1))
                             if k not in original}
        else:
            assert added == {}
    assert [v for v in walk(out) if "enum" in v] == [v for v in walk(schema) if "enum" in v]  # data left as data


@needs_model
def test_the_processor_lets_through_only_what_the_grammar_allows_and_then_only_an_end(tokenizer):
    """Random logits, greedy: every token drawn is one the grammar takes, and once the JSON is complete only the end
    tokens are left (each of the model's), so the answer is the JSON and then an end."""
    grammar = constrain.grammar({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                 "additionalProperties": False}, True, json_answer=True)
    end, other_end = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert other_end != end
    processor = constrain.GrammarProcessor(grammar, tokenizer, [end, other_end])  # a model with two end tokens
    generator = torch.Generator().manual_seed(0)
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    ids = torch.tensor([prompt] * 3)  # three rows, each its own matcher
    for _ in range(40):
        scores = processor(ids, torch.randn(3, len(tokenizer), generator=generator))
        ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=1)
        if all(set(row[len(prompt):]) & {end, other_end} for row in ids.tolist()):
            break
    after = processor(ids, torch.zeros(3, len(tokenizer)))
    assert all(set(torch.isfinite(r).nonzero().flatten().tolist()) == {end, other_end} for r in after)  # ends only
    for row in ids.tolist():
        answer = row[len(prompt):]
        stop = min(answer.index(e) for e in (end, other_end) if e in answer)
        assert json.loads(tokenizer.decode(answer[:stop])) in ({"ok": True}, {"ok": False}), answer
        assert set(answer[stop:]) <= {end, other_end}
