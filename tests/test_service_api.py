"""The jobs service as its clients may call it, beyond the happy path: every value the openai SDK's types allow
("auto" for each hyperparameter), the refusals naming their field, the OpenAPI schema behind the API key, and a
schema-driven fuzzer (schemathesis, from the service's own /openapi.json) that must meet no server error.

A keyed service of its own (tests/test_serve.py's Service). Its jobs train nothing: they are given a file whose
line fails validation, so each is created (what these tests check) and then fails before a trainer starts."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpokit.service import api_openai
from test_serve import MODEL, Service, wait_for

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BUNDLED = "SmolLM2-135M-Instruct"
ALL_AUTO = {"batch_size": "auto", "learning_rate_multiplier": "auto", "n_epochs": "auto"}


TOOLS_MODEL = "SmolLM2-tools"  # the bundled weights with the kit's chatml-tools template (a base by directory name)


def tool_template_base(models_dir: Path) -> None:
    """models_dir/SmolLM2-tools: the bundled model's weights (linked) and its tokenizer with templates/chatml-tools."""
    if not (MODEL / "config.json").exists():
        return
    from transformers import AutoTokenizer

    from dpokit.model import models

    target = models_dir / TOOLS_MODEL
    target.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (target / name).symlink_to(MODEL / name)
    tok = AutoTokenizer.from_pretrained(MODEL)
    tok.chat_template = models.chat_template_text("chatml-tools")
    tok.save_pretrained(target)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    models_dir = tmp_path_factory.mktemp("models")
    tool_template_base(models_dir)
    svc = Service(tmp_path_factory.mktemp("api") / "art", None, "--max_file_mb", "1", "--models_dir", str(models_dir),
                  key=KEY)
    yield svc
    svc.stop()
    assert "Traceback" not in svc.tail(), svc.tail()  # the service's own log: no request ended in a server error


@pytest.fixture(scope="module")
def sdk(keyed):
    from openai import OpenAI

    return OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def bad_file(sdk, tmp_path_factory) -> str:
    """A fine-tune file whose only line is not a pair: a job on it is created, then fails its validation."""
    path = tmp_path_factory.mktemp("files") / "not-pairs.jsonl"
    path.write_text(json.dumps({"prompt": "only a prompt"}) + "\n")
    return sdk.files.create(file=open(path, "rb"), purpose="fine-tune").id


def test_without_the_key_every_path_is_refused_and_with_it_the_schema_and_docs_are_served(keyed):
    for path in ("/openapi.json", "/docs", "/version", "/v1/models", "/vllm/status", "/nowhere"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.get(f"{keyed.url}{path}", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
    schema = httpx.get(f"{keyed.url}/openapi.json", headers=AUTH).json()
    assert {"/v1/files", "/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/{job_id}/pause", "/v1/chat/completions",
            "/version", "/training/jobs", "/vllm/start", "/vllm/stop", "/vllm/status"} <= set(schema["paths"])
    docs = httpx.get(f"{keyed.url}/docs", headers=AUTH)
    assert docs.status_code == 200 and "swagger-ui" in docs.text and "/openapi.json" in docs.text


@pytest.mark.parametrize("shape", ["dpo method", "top level", "top level with a dpo method", "supervised method",
                                   "numbers", "reinforcement method"])
def test_every_hyperparameter_auto_as_the_sdk_types_allow_creates_the_job_with_the_kits_defaults(
        sdk, bad_file, shape):
    method, top = {
        "dpo method": ({"type": "dpo", "dpo": {"hyperparameters": {**ALL_AUTO, "beta": "auto"}}}, None),
        "top level": (None, ALL_AUTO),
        "top level with a dpo method": ({"type": "dpo"}, {**ALL_AUTO, "beta": "auto"}),
        "supervised method": ({"type": "supervised", "supervised": {"hyperparameters": ALL_AUTO}}, None),
        "numbers": ({"type": "dpo", "dpo": {"hyperparameters": {"batch_size": 3, "learning_rate_multiplier": 0.5,
                                                                "n_epochs": "auto", "beta": 0.25}}}, None),
        "reinforcement method": ({"type": "reinforcement", "reinforcement": {
            "grader": {"type": "string_check", "name": "g", "input": "{{sample.output_text}}",
                       "reference": "{{item.answer}}", "operation": "eq"},
            "hyperparameters": {**ALL_AUTO, "compute_multiplier": "auto", "eval_interval": "auto",
                                "eval_samples": "auto", "reasoning_effort": "default"}}}, None),
    }[shape]
    kwargs = {"method": method} if method else {}
    kwargs |= {"hyperparameters": top} if top else {}
    job = sdk.fine_tuning.jobs.create(model=BUNDLED, training_file=bad_file, seed=7, suffix="auto-test",
                                      metadata={"round": "1"}, **kwargs)
    defaults = api_openai.kit_defaults()
    expected = {k: defaults[k] for k in ("batch_size", "learning_rate_multiplier", "n_epochs")}
    if shape == "numbers":
        expected |= {"batch_size": 3, "learning_rate_multiplier": 0.5, "beta": 0.25}
    elif shape == "reinforcement method":
        expected |= {"compute_multiplier": 1.0, "eval_interval": "auto", "eval_samples": defaults["eval_samples"],
                     "reasoning_effort": "default"}
    elif shape != "supervised method":
        expected["beta"] = defaults["beta"]
    assert job.hyperparameters.model_dump(exclude_none=True) == expected
    assert (job.method.type, job.seed, job.metadata, job.suffix) == (
        shape.split()[0] if shape in ("supervised method", "reinforcement method") else "dpo", 7, {"round": "1"},
        "auto-test")
    failed = wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job.id), lambda j: j.status == "failed", timeout=60)
    assert failed.error.param == "training_file"  # what these tests give it; nothing trained


REFUSED = [
    ({"method": {"type": "reinforcement", "reinforcement": {"grader": {
        "type": "text_similarity", "name": "g", "input": "{{sample.output_text}}", "reference": "x",
        "evaluation_metric": "cosine"}}}}, "method.reinforcement.grader.evaluation_metric"),
    ({"method": {"type": "reinforcement", "reinforcement": {"grader": {
        "type": "multi", "name": "g", "graders": {"a": {"type": "string_check", "name": "a", "input": "x",
                                                        "reference": "x", "operation": "eq"}},
        "calculate_output": "a.__class__"}}}}, "method.reinforcement.grader.calculate_output"),
    ({"method": {"type": "reinforcement", "reinforcement": {"grader": {"type": "python", "name": "g",
                                                                       "source": "def grade(:"}}}},
     "method.reinforcement.grader.source"),
    ({"method": {"type": "reinforcement", "reinforcement": {"grader": {
        "type": "string_check", "name": "g", "input": "a", "reference": "b", "operation": "eq"},
        "hyperparameters": {"beta": 0.1}}}}, "method.reinforcement.hyperparameters.beta"),
    ({"method": {"type": "reinforcement"}}, "method.reinforcement"),
    ({"integrations": [{"type": "wandb", "wandb": {"project": "p"}}]}, "integrations"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1}}}, "hyperparameters": {"n_epochs": 1}},
     "hyperparameters"),
    ({"method": {"type": "dpo", "supervised": {}}}, "method.supervised"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"learning_rate_multiplier": 0}}}},
     "method.dpo.hyperparameters.learning_rate_multiplier"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": "high"}}}}, "method.dpo.hyperparameters.beta"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"batch_size": 0}}}},
     "method.dpo.hyperparameters.batch_size"),
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"beta": 0.1}}}},
     "method.supervised.hyperparameters.beta"),
    ({"hyperparameters": {"n_epochs": 1.5}}, "hyperparameters.n_epochs"),
    ({"seed": -1}, "seed"),
    ({"seed": 2 ** 40}, "seed"),
    ({"suffix": "has spaces"}, "suffix"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"model": "no-such-model"}, "model"),
    ({"training_file": "file-nope"}, "training_file"),
    ({"validation_file": "file-nope"}, "validation_file"),
]


@pytest.mark.parametrize("change, param", REFUSED, ids=[p for _, p in REFUSED])
def test_what_the_kit_cannot_train_is_an_openai_400_naming_the_field(sdk, bad_file, change, param):
    import openai

    kwargs = {"model": BUNDLED, "training_file": bad_file} | change
    with pytest.raises(openai.BadRequestError) as e:
        sdk.fine_tuning.jobs.create(**kwargs)
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]


def test_a_schema_driven_fuzzer_meets_no_server_error(keyed, tmp_path):
    """schemathesis's own CLI against /openapi.json: every operation, its coverage, fuzzing and stateful phases,
    bounded in examples and time. not_a_server_error is the check; the service's log is checked at the end too."""
    schemathesis = Path(sys.executable).parent / "schemathesis"
    seed = ["--seed", "20261124"] if os.environ.get("CI") else []
    run = subprocess.run([str(schemathesis), "run", f"{keyed.url}/openapi.json", "-H", f"Authorization: Bearer {KEY}",
                          "--checks", "not_a_server_error", "--max-examples", "15", "--max-time", "30",
                          "--generation-database", "none", "--no-color", "--request-timeout", "30", *seed],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    selected = re.search(r"Selected: (\d+)/(\d+)", out)
    assert selected and selected[1] == selected[2] and int(selected[1]) >= 23, out[-2000:]
    generated = int(re.search(r"(\d+) generated", out)[1])
    assert generated > 500, out[-2000:]  # 30 s of requests, not a handful


def schema_operation(keyed, path: str, method: str):
    import schemathesis

    return schemathesis.openapi.from_url(f"{keyed.url}/openapi.json", headers=AUTH)[path][method]


def refusal_is_openai_shaped(response, seen: set) -> None:
    assert response.status_code < 500, response.text
    seen.add(response.status_code)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", error


def test_job_bodies_the_schema_allows_with_a_real_file_and_model_get_no_server_error(keyed, bad_file):
    """The fuzzer's bodies reach the service's own logic only with a file and a model that exist: half of them get
    the real ones, so the mapping onto the kit's flags, not only pydantic, meets every shape."""
    operation, seen = schema_operation(keyed, "/v1/fine_tuning/jobs", "POST"), set()

    @settings(max_examples=60, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(), real_file=st.booleans(), real_model=st.booleans())
    def check(case, real_file, real_model):
        if isinstance(case.body, dict):
            case.body |= {"training_file": bad_file} if real_file else {}
            case.body |= {"model": BUNDLED} if real_model else {}
        refusal_is_openai_shaped(case.call(headers=AUTH), seen)

    check()
    assert 200 in seen and 400 in seen, seen  # jobs were created, and refused


def test_nip_bodies_the_schema_allows_get_no_server_error(keyed):
    operation, seen = schema_operation(keyed, "/training/jobs", "POST"), set()

    @settings(max_examples=40, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(), real_model=st.booleans())
    def check(case, real_model):
        if real_model and isinstance(case.body, dict) and isinstance(case.body.get("config"), dict):
            case.body["config"]["model_name"] = BUNDLED
        refusal_is_openai_shaped(case.call(headers=AUTH), seen)

    check()
    assert 201 in seen and 400 in seen, seen


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="bundled model not converted (make model)")
def fuzz_answers_on_the_bundled_model(keyed, path: str, fix, max_examples: int) -> None:
    """Bodies the schema allows for an answering endpoint, each made to ask the bundled model for a few tokens
    (fix(body, plain, text): half the cases get plain text where the schema's would mostly be refused); every
    response is under 500, its refusals OpenAI-shaped, and the model answered at least once."""
    operation, seen = schema_operation(keyed, path, "POST"), set()

    @settings(max_examples=max_examples, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(), plain=st.booleans(),
           text=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40))
    def check(case, plain, text):
        if isinstance(case.body, dict):
            fix(case.body, plain, text)
        # not schemathesis' 10 s: the first answer loads the model, which a busy 2-core machine took longer for
        refusal_is_openai_shaped(case.call(headers=AUTH, timeout=120), seen)

    check()
    assert 200 in seen, seen  # the model answered


def test_chat_bodies_the_schema_allows_on_a_real_model_get_no_server_error(keyed):
    """Messages of every shape the schema allows, through the bundled model's own chat template (a few tokens)."""
    for temperature in (1e-300, 5e-324, 1e-5):  # the schema's smallest temperatures: greedy, not logits / 0 = nan
        reply = httpx.post(f"{keyed.url}/v1/chat/completions", headers=AUTH, timeout=120, json={
            "model": BUNDLED, "max_tokens": 2, "temperature": temperature,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 200, reply.text

    def fix(body, plain, text):
        body |= {"model": BUNDLED, "max_tokens": 2, "max_completion_tokens": None}
        if plain:  # the schema's messages are mostly refused (no content, image parts): half get a user turn
            body["messages"] = [{"role": "user", "content": text}]

    fuzz_answers_on_the_bundled_model(keyed, "/v1/chat/completions", fix, 40)


def test_completion_bodies_the_schema_allows_on_a_real_model_get_no_server_error(keyed):
    """Legacy completions: every body the schema allows, on the bundled model (a few tokens, a few prompts)."""
    def fix(body, plain, text):
        body |= {"model": BUNDLED, "max_tokens": 2}
        if isinstance(body.get("prompt"), list):
            body["prompt"] = body["prompt"][:3]
        elif plain:
            body["prompt"] = text

    fuzz_answers_on_the_bundled_model(keyed, "/v1/completions", fix, 30)


def test_responses_bodies_the_schema_allows_on_a_real_model_get_no_server_error(keyed):
    """The Responses API: every body the schema allows, on the bundled model (a few tokens)."""
    def fix(body, plain, text):
        body |= {"model": BUNDLED, "max_output_tokens": 2}
        if plain:  # the schema's items are mostly refused: half get a string input
            body["input"] = text

    fuzz_answers_on_the_bundled_model(keyed, "/v1/responses", fix, 30)


def test_tool_calls_in_an_answer_become_openai_tool_calls():
    from dpokit.service import api_chat

    words, calls = api_chat.tool_calls_in('Checking.\n<tool_call>\n{"name": "du", "arguments": {"path": "/"}}\n'
                                          '</tool_call>\n<tool_call>{"name": "ls"}</tool_call>')
    assert words == "Checking."
    assert [(c["type"], c["function"]) for c in calls] == [
        ("function", {"name": "du", "arguments": '{"path": "/"}'}), ("function", {"name": "ls", "arguments": "{}"})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    assert api_chat.tool_calls_in("<tool_call>{not json}</tool_call> plain") == (
        "<tool_call>{not json}</tool_call> plain", [])
    assert api_chat.tool_calls_in('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>')[0] is None
    two = '<tool_call>{"name": "du"}</tool_call><tool_call>{"name": "ls"}</tool_call>'
    sampled = [{"text": two, "tokens": [1, 2], "logprobs": None}]
    whole = api_chat.choices_of(sampled, lambda a: (a, False), True, 8)
    first = api_chat.choices_of(sampled, lambda a: (a, False), True, 8, max_calls=1)  # parallel_tool_calls false
    assert [len(c["calls"]) for c in whole + first] == [2, 1] and first[0]["calls"][0]["function"]["name"] == "du"
    assert whole[0]["finish"] == "tool_calls" and api_chat.choices_of(sampled, lambda a: (a, False), False, 2)[0][
        "finish"] == "length"  # without tools the words are the answer; two tokens of two: cut at the limit


CHAT_TOOLS = [{"type": "function", "function": {"name": "disk_usage", "description": "Bytes used under a path.",
                                                "parameters": {"type": "object", "properties": {
                                                    "path": {"type": "string"}}}}}]


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="bundled model not converted (make model)")
def test_chat_with_tools_renders_them_through_a_template_that_can_and_refuses_one_that_cannot(sdk):
    import openai

    ask = [{"role": "user", "content": "How full is /?"}]
    plain = sdk.chat.completions.create(model=TOOLS_MODEL, messages=ask, max_tokens=2, temperature=0)
    reply = sdk.chat.completions.create(model=TOOLS_MODEL, messages=ask, tools=CHAT_TOOLS, max_tokens=8,
                                        temperature=0)
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 30  # the tools list is in the prompt
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls") and (choice.message.content or
                                                                         choice.message.tool_calls)
    # A conversation that carries on after a call: the assistant's call (content null) and the tool's result.
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "disk_usage", "arguments": '{"path": "/"}'}}]}, {"role": "tool", "tool_call_id": "c1", "content": "96%"}]
    after = sdk.chat.completions.create(model=TOOLS_MODEL, messages=history, tools=CHAT_TOOLS, max_tokens=4,
                                        temperature=0)
    assert after.usage.prompt_tokens > reply.usage.prompt_tokens
    chunks = list(sdk.chat.completions.create(model=TOOLS_MODEL, messages=ask, tools=CHAT_TOOLS, max_tokens=8,
                                              temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    # The SDK does not check `object`; clients that dispatch on it (as OpenAI documents them) do.
    assert (reply.object, {c.object for c in chunks}) == ("chat.completion", {"chat.completion.chunk"})
    with pytest.raises(openai.BadRequestError) as e:  # a tool choice naming a function the request does not offer
        sdk.chat.completions.create(model=TOOLS_MODEL, messages=ask, tools=CHAT_TOOLS, max_tokens=2,
                                    tool_choice={"type": "function", "function": {"name": "rm_rf"}})
    assert e.value.body["param"] == "tool_choice" and "rm_rf" in e.value.body["message"], e.value.body
    # A ChatML base whose own template drops tools (SmolLM2's): the kit's chatml-tools renders them, as training
    # does, and the response says so (a header, and system_fingerprint); the prompt is the tools model's own.
    raw = sdk.chat.completions.with_raw_response.create(model=BUNDLED, messages=ask, tools=CHAT_TOOLS, max_tokens=8,
                                                        temperature=0)
    fallback = raw.parse()
    assert raw.headers["x-dpo-kit-chat-template"] == "chatml-tools"
    assert fallback.system_fingerprint == "dpo-kit:chatml-tools" and reply.system_fingerprint is None
    assert fallback.usage.prompt_tokens == reply.usage.prompt_tokens
    continued = sdk.chat.completions.create(model=BUNDLED, messages=history, max_tokens=2, temperature=0)
    assert continued.system_fingerprint == "dpo-kit:chatml-tools"  # a history with tool calls: the same template
    plain_again = sdk.chat.completions.with_raw_response.create(model=BUNDLED, messages=ask, max_tokens=2)
    assert "x-dpo-kit-chat-template" not in plain_again.headers  # no tools: the model's own template


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="bundled model not converted (make model)")
def test_chat_n_logprobs_and_stream_usage_as_the_sdk_reads_them(sdk):
    import openai

    ask = [{"role": "user", "content": "How full is /?"}]
    # stream_options.include_usage: a last chunk with no choices and the usage, each chunk before it usage null.
    for extra in ({"tools": CHAT_TOOLS}, {}):  # the whole-answer path (tools) and the token-by-token one
        counted = list(sdk.chat.completions.create(model=TOOLS_MODEL, messages=ask, max_tokens=8, temperature=0,
                                                   stream=True, stream_options={"include_usage": True,
                                                                                "include_obfuscation": True}, **extra))
        last, before = counted[-1], counted[:-1]
        assert last.choices == [] and last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
        assert last.usage.prompt_tokens > 0 and 0 < last.usage.completion_tokens <= 8
        assert all(c.usage is None and c.choices for c in before) and before[-1].choices[0].finish_reason
        assert all(getattr(c, "obfuscation", None) for c in counted)
    # n answers sampled in one batch; logprobs: each token's log-probability and its most likely alternatives.
    many = sdk.chat.completions.create(model=TOOLS_MODEL, messages=ask, max_tokens=6, temperature=1.0, seed=3, n=3,
                                       logprobs=True, top_logprobs=2)
    assert [c.index for c in many.choices] == [0, 1, 2] and many.usage.completion_tokens <= 18
    for c in many.choices:
        content = c.logprobs.content
        assert content and len(content) <= 6 and "".join(t.token for t in content).strip() == c.message.content
        for t in content:
            assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
            assert t.logprob <= t.top_logprobs[0].logprob + 1e-4 and t.bytes == list(t.token.encode())
    again = sdk.chat.completions.create(model=TOOLS_MODEL, messages=ask, max_tokens=6, temperature=1.0, seed=3, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in many.choices]  # seeded
    greedy = sdk.chat.completions.create(model=TOOLS_MODEL, messages=ask, max_tokens=4, temperature=0, n=2)
    assert len(greedy.choices) == 2 and greedy.choices[0].message.content == greedy.choices[1].message.content
    streamed = list(sdk.chat.completions.create(model=TOOLS_MODEL, messages=ask, max_tokens=6, temperature=1.0, seed=3,
                                                n=3, stream=True))
    assert ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices[0].index == i)
            for i in range(3)] == [c.message.content for c in many.choices]
    zero = sdk.chat.completions.create(model=TOOLS_MODEL, messages=ask, max_tokens=2, temperature=0,
                                       frequency_penalty=0, presence_penalty=0, modalities=["text"])
    assert zero.choices[0].message.content  # OpenAI's defaults, said out loud: honoured
    for kwargs, param in (({"frequency_penalty": 0.5}, "frequency_penalty"), ({"modalities": ["text", "audio"]},
                                                                               "modalities")):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.chat.completions.create(model=TOOLS_MODEL, messages=ask, max_tokens=2, **kwargs)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        sdk.chat.completions.create(model=TOOLS_MODEL, messages=ask, max_tokens=2, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        sdk.chat.completions.create(model=TOOLS_MODEL, messages=ask, max_tokens=2,
                                    stream_options={"include_usage": True})


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="bundled model not converted (make model)")
def test_legacy_completions_as_the_sdk_calls_them(sdk):
    import openai

    prompt = "The capital of France is"
    one = sdk.completions.create(model=BUNDLED, prompt=prompt, max_tokens=5, temperature=0)
    assert one.object == "text_completion" and one.choices[0].text.strip() and one.choices[0].finish_reason == "length"
    assert one.usage.completion_tokens == 5 and one.usage.prompt_tokens == 5  # five tokens of SmolLM2's vocabulary
    echoed = sdk.completions.create(model=BUNDLED, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=2)
    choice = echoed.choices[0]
    assert choice.text == prompt + one.choices[0].text  # greedy: the same words, after the prompt
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == len(prompt) and all(len(t) <= 2 for t in lp.top_logprobs)
    assert all(p <= max(top.values()) + 1e-4 for p, top in zip(lp.token_logprobs, lp.top_logprobs))
    both = sdk.completions.create(model=BUNDLED, prompt=[prompt, "1, 2, 3,"], max_tokens=3, temperature=1.0, seed=1,
                                  n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3] and both.usage.completion_tokens <= 12
    streamed = list(sdk.completions.create(model=BUNDLED, prompt=prompt, max_tokens=5, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == one.choices[0].text
    assert streamed[-1].usage.completion_tokens == 5
    for kwargs, param in (({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"), ({"presence_penalty": 1.0},
                                                                                       "presence_penalty")):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.completions.create(model=BUNDLED, prompt=prompt, max_tokens=2, **kwargs)
        assert e.value.body["param"] == param, e.value.body


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
FORCED_TOOLS = CHAT_TOOLS + [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                               "strict": True}}]


def valid(schema: dict, text: str) -> bool:
    import jsonschema_rs

    try:
        return jsonschema_rs.is_valid(schema, json.loads(text))
    except ValueError:
        return False


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="bundled model not converted (make model)")
def test_structured_outputs_and_forced_tool_calls_as_the_sdk_asks_for_them(sdk):
    """response_format (json_schema, json_object, the SDK's own parse() with a pydantic model) and tool_choice
    ("required", a named function, allowed_tools) on the bundled model: every answer that ends parses and validates
    against its schema, every forced call names an offered function with arguments valid against its parameters."""
    import openai
    from pydantic import BaseModel

    class City(BaseModel):
        city: str
        population: int

    ask = [{"role": "user", "content": "Name a big city and its population, as JSON."}]
    parsed = sdk.chat.completions.parse(model=BUNDLED, messages=ask, response_format=City, temperature=0,
                                        max_tokens=60)
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and abs(city.population) < 2 ** 53, parsed.choices[0].message.content
    schema = City.model_json_schema()
    several = sdk.chat.completions.create(model=BUNDLED, messages=ask, n=4, temperature=1.0, seed=5, max_tokens=60,
                                          response_format={"type": "json_schema", "json_schema": {
                                              "name": "city", "schema": schema, "strict": True}})
    ended = [c for c in several.choices if c.finish_reason == "stop"]
    assert len(ended) >= 2 and all(valid(schema, c.message.content) for c in ended), several.choices
    anything = sdk.chat.completions.create(model=BUNDLED, messages=ask, temperature=0, max_tokens=60,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    streamed = list(sdk.chat.completions.create(model=BUNDLED, messages=ask, temperature=0, max_tokens=60, stream=True,
                                                response_format={"type": "json_object"}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == anything.choices[0].message.content

    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice, names in (("required", set(parameters)), ({"type": "function", "function": {"name": "get_weather"}},
                                                          {"get_weather"}),
                          ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
                              {"type": "function", "function": {"name": "get_weather"}}]}}, {"get_weather"})):
        reply = sdk.chat.completions.create(model=BUNDLED, messages=weather, tools=FORCED_TOOLS, tool_choice=choice,
                                            temperature=0, max_tokens=80)
        message = reply.choices[0].message
        assert message.tool_calls and message.content is None, reply
        for call in message.tool_calls:
            assert call.function.name in names and valid(parameters[call.function.name], call.function.arguments)
        if isinstance(choice, dict) and choice["type"] == "function":  # a named function: called once, then the end
            assert len(message.tool_calls) == 1 and reply.choices[0].finish_reason == "tool_calls"
    chunks = list(sdk.chat.completions.create(model=BUNDLED, messages=weather, tools=FORCED_TOOLS, max_tokens=80,
                                              temperature=0, stream=True, tool_choice={
                                                  "type": "function", "function": {"name": "get_weather"}}))
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or ()]
    assert [c.function.name for c in calls] == ["get_weather"] and valid(WEATHER, calls[0].function.arguments)

    for kwargs, param in (
            ({"tool_choice": "required"}, "tool_choice"),  # nothing to call
            ({"tools": CHAT_TOOLS, "tool_choice": {"type": "custom", "custom": {"name": "x"}}}, "tool_choice"),
            ({"tools": CHAT_TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {  # the fuzzer's finds
                "mode": "required", "tools": [{"function": "disk_usage"}]}}}, "tool_choice"),
            ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": []}}},
             "tool_choice"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
                "type": "string", "format": "phone"}}}}, "response_format.json_schema.schema"),
            ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
                "type": "object", "properties": {"n": {"type": "string", "format": "weird"}}}}}],
              "tool_choice": "required"}, "tools")):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.chat.completions.create(model=BUNDLED, messages=ask, max_tokens=2, **kwargs)
        assert e.value.body["param"] == param, e.value.body


RESPONSE_TOOLS = [{"type": "function", "name": "disk_usage", "description": "Bytes used under a path.",
                   "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="bundled model not converted (make model)")
def test_the_responses_api_as_the_sdk_calls_it(sdk):
    """client.responses.create: text, instructions, items with a function call and its output, streaming events."""
    import openai

    plain = sdk.responses.create(model=BUNDLED, input="What is 2 + 2?", max_output_tokens=6, temperature=0)
    assert plain.object == "response" and plain.id.startswith("resp_") and plain.output_text.strip()
    used = plain.usage
    assert used.output_tokens <= 6 and used.total_tokens == used.input_tokens + used.output_tokens
    # six tokens end a longer answer: incomplete, as OpenAI says it (max_output_tokens)
    assert (plain.status, plain.incomplete_details.reason) == ("incomplete", "max_output_tokens") \
        if used.output_tokens == 6 else plain.status == "completed"
    chat = sdk.chat.completions.create(model=BUNDLED, messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                       max_tokens=6, temperature=0)
    assert plain.output_text == chat.choices[0].message.content  # the same model and prompt: the same greedy words
    told = sdk.responses.create(model=BUNDLED, instructions="Answer in French.", input="Say hello.",
                                max_output_tokens=4, temperature=0)
    as_chat = sdk.chat.completions.create(model=BUNDLED, max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Say hello."}])
    assert told.instructions == "Answer in French." and told.output_text == as_chat.choices[0].message.content
    assert told.usage.input_tokens == as_chat.usage.prompt_tokens  # instructions are the system message

    # A conversation with a function call and its output, as an agent sends it back; tools through the template.
    items = [{"role": "user", "content": "How full is /?"},
             {"type": "function_call", "call_id": "call_1", "name": "disk_usage", "arguments": '{"path": "/"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "96%"}]
    after = sdk.responses.create(model=TOOLS_MODEL, input=items, tools=RESPONSE_TOOLS, max_output_tokens=8,
                                 temperature=0)
    assert after.status in ("completed", "incomplete") and after.output
    assert all(o.type in ("message", "function_call") for o in after.output)
    assert after.tools[0].name == "disk_usage"
    raw = sdk.responses.with_raw_response.create(model=BUNDLED, input=items, tools=RESPONSE_TOOLS, max_output_tokens=8,
                                                 temperature=0)
    assert raw.headers["x-dpo-kit-chat-template"] == "chatml-tools"  # SmolLM2's own template drops tools
    assert raw.parse().usage.input_tokens == after.usage.input_tokens

    with sdk.responses.stream(model=BUNDLED, input="What is 2 + 2?", max_output_tokens=6, temperature=0) as stream:
        kinds = [e.type for e in stream]
    assert kinds[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in kinds
    # cut at max_output_tokens, OpenAI ends the stream with response.incomplete (the SDK's get_final_response wants
    # response.completed, here as there)
    assert kinds[-1] == ("response.incomplete" if plain.status == "incomplete" else "response.completed")
    events = list(sdk.responses.create(model=BUNDLED, input="What is 2 + 2?", max_output_tokens=6, temperature=0,
                                       stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text

    for kwargs, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                          ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                          ({"tool_choice": {"type": "function", "name": "rm_rf"}, "tools": RESPONSE_TOOLS},
                           "tool_choice"),
                          ({"tool_choice": {"type": "file_search"}, "tools": RESPONSE_TOOLS}, "tool_choice"),
                          ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
                          ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                           "input[0].content[0].type")):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.responses.create(model=BUNDLED, **({"input": "Hi"} | kwargs), max_output_tokens=2)
        assert e.value.body["param"] == param, e.value.body


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="bundled model not converted (make model)")
def test_the_responses_api_gives_structured_outputs_and_forced_calls_streamed_as_agents_read_them(sdk):
    """responses.parse with a pydantic model (text.format json_schema), and a named function forced while streaming:
    its arguments arrive as function_call_arguments events and validate against the function's parameters."""
    from pydantic import BaseModel

    class City(BaseModel):
        city: str
        population: int

    parsed = sdk.responses.parse(model=BUNDLED, input="Name a big city and its population.", text_format=City,
                                 temperature=0, max_output_tokens=60)
    assert isinstance(parsed.output_parsed, City) and parsed.text.format.type == "json_schema"
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}
    events = list(sdk.responses.create(model=BUNDLED, input="What is the weather in Paris?", tools=RESPONSE_TOOLS + [tool],
                                       tool_choice={"type": "function", "name": "get_weather"}, stream=True,
                                       temperature=1.0, max_output_tokens=80))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].name == "get_weather" and valid(WEATHER, done[0].arguments)
    final = events[-1].response
    assert events[-1].type == "response.completed" and [o.type for o in final.output] == ["function_call"]
