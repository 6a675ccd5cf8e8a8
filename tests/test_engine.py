"""engine.py and api_adapters.py: the serving engine the jobs service forwards its answers to. First the pure parts
(vLLM's command, which engine, the engine's errors, relabelled events); then a real front service forwarding to a
second real kit service started with --runtime_lora as its engine (the stand-in for vLLM: the same endpoints, and
vLLM's run-time LoRA endpoints), driven by the openai SDK: chat, streaming, completions, responses, an adapter loaded
into the engine when its job succeeds and unloaded when its model is deleted, and the engine gone (a 503)."""
import json
from types import SimpleNamespace

import httpx
import pytest

from dpokit.service import engine, serve
from test_serve import MODEL, Service, needs_model, openai_pairs, wait_for

BUNDLED = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


# ------------------------------------------------------------------ pure parts

def test_vllm_serves_the_base_by_the_services_name_with_runtime_lora_adapters_on_loopback():
    cfg = serve.ServeConfig(max_loras=2, max_lora_rank=16, engine_gpu_memory=0.4, engine_args="--max-model-len 2048")
    cmd = engine.vllm_command("/v/bin/vllm", "/models/SmolLM2", BUNDLED, 8002, cfg, "/kit/templates/chatml-tools.jinja")
    assert cmd[:3] == ["/v/bin/vllm", "serve", "/models/SmolLM2"]
    flags = {flag: cmd[i + 1] for i, flag in enumerate(cmd) if flag.startswith("--") and i + 1 < len(cmd)}
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8002" and flags["--served-model-name"] == BUNDLED
    assert (flags["--max-loras"], flags["--max-lora-rank"], flags["--gpu-memory-utilization"]) == ("2", "16", "0.4")
    assert "--enable-lora" in cmd and cmd[cmd.index("--tool-call-parser") + 1] == "hermes"
    assert cmd[cmd.index("--chat-template") + 1].endswith("chatml-tools.jinja") and cmd[-2:] == ["--max-model-len",
                                                                                               "2048"]
    assert "--chat-template" not in engine.vllm_command("vllm", "b", "b", 1, cfg, None)


@pytest.mark.parametrize("choice, url, vllm, gpu, kind", [
    ("auto", "", None, True, "kit"), ("auto", "", "/bin/vllm", False, "kit"), ("auto", "", "/bin/vllm", True, "vllm"),
    ("vllm", "", None, False, "vllm"), ("auto", "http://e:1", None, False, "url"), ("vllm", "http://e:1", None, False,
                                                                                   "url"),
    ("kit", "", "/bin/vllm", True, "kit")])
def test_which_engine_answers(choice, url, vllm, gpu, kind):
    asked = []
    cfg = SimpleNamespace(engine=choice, engine_url=url)
    assert engine.engine_kind(cfg, vllm, lambda: asked.append(1) or gpu) == kind
    assert not asked or vllm  # the GPU (torch) is looked at only where vllm is there


def test_engine_options_are_checked_together(monkeypatch):
    monkeypatch.setattr(engine.shutil, "which", lambda name: None)
    problems = serve.ServeConfig(engine="vllm", max_lora_rank=48, engine_gpu_memory=1.5, engine_port=8000).problems()
    said = "\n".join(problems)
    assert "`vllm` is not on the PATH" in said and "--max_lora_rank" in said and "--engine_gpu_memory" in said
    assert "--engine_port" in said
    assert "--engine_url is for" in "\n".join(serve.ServeConfig(engine="kit", engine_url="http://e:1").problems())
    assert not serve.ServeConfig(engine="vllm", engine_url="http://127.0.0.1:8001").problems()


@pytest.mark.parametrize("status, body, expected", [
    (400, {"error": {"message": "bad n", "type": "BadRequestError", "param": "n", "code": 400}}, (400, "bad n", "n")),
    (404, {"object": "error", "message": "The model `x` does not exist.", "type": "NotFoundError", "param": None,
           "code": 404}, (404, "The model `x` does not exist.", None)),  # vLLM's older shape
    (422, {"detail": [{"msg": "field required"}]}, (400, '{"detail": [{"msg": "field required"}]}', None)),
    (500, {"error": {"message": "CUDA out of memory"}}, (502, "the serving engine failed on this request (500: CUDA "
                                                             "out of memory)", None))])
def test_the_engines_errors_come_back_in_openais_shape(status, body, expected):
    e = engine.engine_error(status, json.dumps(body).encode())
    assert (e.status, e.message, e.param) == expected
    assert e.code is None or isinstance(e.code, str)  # vLLM's integer codes are not OpenAI's
    assert engine.engine_error(503, b"<html>busy</html>").message.endswith("(503: <html>busy</html>)")


def test_streamed_events_carry_the_model_name_the_client_asked_for():
    chunk = 'data: {"object": "chat.completion.chunk", "model": "SmolLM2-135M-Instruct", "choices": []}'
    assert json.loads(engine.relabeled_line(chunk, "gpt-4o-mini")[6:])["model"] == "gpt-4o-mini"
    created = 'data: {"type": "response.created", "response": {"model": "SmolLM2-135M-Instruct"}}'
    assert json.loads(engine.relabeled_line(created, "gpt-4o-mini")[6:])["response"]["model"] == "gpt-4o-mini"
    for line in ("data: [DONE]", "event: response.created", "", "data: {not json"):
        assert engine.relabeled_line(line, "gpt-4o-mini") == line


def test_bases_are_the_same_however_the_service_wrote_them():
    assert engine.same_base("models/SmolLM2-135M-Instruct", str(engine.kit.ROOT / "models" / "SmolLM2-135M-Instruct"))
    assert not engine.same_base("models/a", "models/b") and engine.same_base("org/name", "org/name")


# ------------------------------------------------------------------ a front service and a kit engine

@pytest.fixture(scope="module")
def kit_engine(tmp_path_factory):
    """A second kit service as the engine: answers and vLLM's run-time LoRA endpoints (--runtime_lora)."""
    if not (MODEL / "config.json").exists():
        pytest.skip("bundled model not converted (make model)")
    svc = Service(tmp_path_factory.mktemp("engine") / "art", None, "--runtime_lora", "--engine", "kit")
    yield svc
    if svc.proc.poll() is None:
        svc.stop()


@pytest.fixture(scope="module")
def front(kit_engine, tmp_path_factory):
    """The service clients talk to: it trains, validates, and forwards answers to kit_engine (--engine_url)."""
    svc = Service(tmp_path_factory.mktemp("front") / "art", None, "--engine_url", f"{kit_engine.url}/v1",
                  "--model_map", "gpt-4o-mini*=SmolLM2-135M-Instruct")
    yield svc
    svc.stop()
    assert "Traceback" not in svc.tail(), svc.tail()  # no request ended in a server error


@pytest.fixture(scope="module")
def sdk(front):
    from openai import OpenAI

    return OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def direct(kit_engine):
    from openai import OpenAI

    return OpenAI(base_url=f"{kit_engine.url}/v1", api_key="unused", max_retries=0)


@needs_model
@pytest.mark.integration
def test_chat_completions_and_responses_are_the_engines_under_the_names_the_client_used(sdk, direct):
    import openai

    own = direct.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=6, temperature=0)
    reply = sdk.chat.completions.create(model="gpt-4o-mini-2024-07-18", messages=ASK, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == own.choices[0].message.content  # the engine's greedy words
    assert reply.model == "gpt-4o-mini-2024-07-18" and reply.usage.completion_tokens == own.usage.completion_tokens
    chunks = list(sdk.chat.completions.create(model="gpt-4o-mini-2024-07-18", messages=ASK, max_tokens=6,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == own.choices[0].message.content
    assert {c.model for c in chunks} == {"gpt-4o-mini-2024-07-18"} and chunks[-1].usage.completion_tokens > 0

    text = sdk.completions.create(model=BUNDLED, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert text.choices[0].text == direct.completions.create(model=BUNDLED, prompt="The capital of France is",
                                                             max_tokens=4, temperature=0).choices[0].text
    answer = sdk.responses.create(model=BUNDLED, input="What is 2 + 2?", max_output_tokens=6, temperature=0)
    assert answer.output_text == own.choices[0].message.content and answer.model == BUNDLED
    events = list(sdk.responses.create(model=BUNDLED, input="What is 2 + 2?", max_output_tokens=6, temperature=0,
                                       stream=True))
    assert events[0].type == "response.created" and "".join(
        e.delta for e in events if e.type == "response.output_text.delta") == answer.output_text

    # The front's own checks come first: the same refusals as on the service's own path, naming the field.
    for kwargs, param in (({"frequency_penalty": 0.5}, "frequency_penalty"), ({"top_logprobs": 2}, "top_logprobs"),
                          ({"stream_options": {"include_usage": True}}, "stream_options")):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=2, **kwargs)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model=BUNDLED, input="Hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):  # a name neither serves
        sdk.chat.completions.create(model="ft:nope:dpo-kit::x", messages=ASK, max_tokens=2)


@needs_model
@pytest.mark.integration
def test_the_kits_runtime_lora_endpoints_answer_as_vllms(kit_engine, front, tmp_path):
    url = kit_engine.url
    missing = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "no")})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_path"
    (tmp_path / "empty").mkdir()
    not_a_run = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "empty")})
    assert not_a_run.status_code == 400 and "not a finished run" in not_a_run.json()["error"]["message"]
    unknown = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "x"})
    assert unknown.status_code == 404 and "cannot be found" in unknown.json()["error"]["message"]
    off = httpx.post(f"{front.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert off.status_code == 404 and "--runtime_lora" in off.json()["error"]["message"]  # not started with it


@needs_model
@pytest.mark.integration
def test_a_jobs_adapter_is_loaded_into_the_engine_when_it_succeeds_and_unloaded_when_its_model_is_deleted(
        front, kit_engine, sdk, tmp_path):
    import openai

    path = tmp_path / "pairs.jsonl"
    path.write_text(openai_pairs(4))
    f = sdk.files.create(file=open(path, "rb"), purpose="fine-tune")
    job = sdk.fine_tuning.jobs.create(model=BUNDLED, training_file=f.id, suffix="engine", method={
        "type": "dpo", "dpo": {"hyperparameters": {"batch_size": 2, "n_epochs": 1}}})
    job = wait_for(lambda: sdk.fine_tuning.jobs.retrieve(job.id), lambda j: j.status in ("succeeded", "failed",
                                                                                          "cancelled"))
    assert job.status == "succeeded", job.error
    name = job.fine_tuned_model

    def engine_lists() -> set:
        return {m["id"] for m in httpx.get(f"{kit_engine.url}/v1/models").json()["data"]}

    wait_for(engine_lists, lambda listed: name in listed, timeout=120, what="the adapter in the engine")
    loaded = wait_for(lambda: [e for e in sdk.fine_tuning.jobs.list_events(job.id, limit=50)
                               if "serving engine" in e.message], bool, timeout=30, what="the load's event")
    assert loaded[0].data["seconds_since_success"] >= 0 and loaded[0].data["load_seconds"] > 0
    reply = sdk.chat.completions.create(model=name, messages=ASK, max_tokens=4, temperature=0)
    assert reply.model == name and reply.choices[0].message.content
    stream = list(sdk.chat.completions.create(model=name, messages=ASK, max_tokens=4, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip() == \
        reply.choices[0].message.content

    deleted = sdk.models.delete(name)
    assert (deleted.id, deleted.deleted) == (name, True)
    wait_for(engine_lists, lambda listed: name not in listed, timeout=30, what="the adapter unloaded")
    assert name not in [m.id for m in sdk.models.list()]
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model=name, messages=ASK, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="was deleted"):  # nor continued
        sdk.fine_tuning.jobs.create(model=name, training_file=f.id)
    with pytest.raises(openai.BadRequestError, match="a base"):
        sdk.models.delete(BUNDLED)


@needs_model
@pytest.mark.integration
def test_an_engine_that_is_gone_is_a_503_the_sdk_reads_not_a_500(front, kit_engine, sdk):
    import openai

    kit_engine.stop()  # the last test of the module: the engine stays down
    for call in (lambda: sdk.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=2),
                 lambda: list(sdk.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=2, stream=True)),
                 lambda: sdk.responses.create(model=BUNDLED, input="Hi", max_output_tokens=2)):
        with pytest.raises(openai.InternalServerError) as e:
            call()
        assert e.value.status_code == 503 and e.value.body["code"] == "engine_unavailable", e.value.body
        assert "unavailable" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):  # its own refusals still come first
        sdk.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=2, frequency_penalty=1.0)


def test_vllms_pins_are_the_locks_but_the_four_it_names_and_it_gets_an_environment_of_its_own():
    """requirements-vllm.txt holds every package it shares with requirements.txt at the lock's version (torch and
    transformers above all), but the four vLLM pins apart, which requirements-vllm.in and the Makefile name: so the
    image installs it into /opt/vllm, not into the kit's /opt/venv."""
    import re

    root = engine.kit.ROOT

    def pins(name: str) -> dict:
        return {re.sub(r"[-_.]+", "-", m[0].lower()): m[1] for m in
                re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (root / name).read_text(), re.M)}

    lock, vllm = pins("requirements.txt"), pins("requirements-vllm.txt")
    apart = {name for name in lock.keys() & vllm.keys() if lock[name] != vllm[name]}
    assert apart == set(re.search(r"^VLLM_APART := (\S+)", (root / "Makefile").read_text(), re.M)[1].split("|"))
    said = (root / "requirements-vllm.in").read_text()
    assert all(f"#   {name}" in said for name in apart) and vllm["vllm"] in said
    assert vllm["torch"] == lock["torch"] and vllm["transformers"] == lock["transformers"]
    dockerfile = (root / "Dockerfile").read_text()
    assert "/opt/vllm/bin/pip install -q --no-deps -r /tmp/kit/requirements-vllm.txt" in dockerfile
    assert "COPY --from=build /opt/vllm /opt/vllm" in dockerfile and "PATH=/opt/venv/bin:$PATH:/opt/vllm/bin" in dockerfile


def test_the_serve_bench_reports_the_engine_beside_the_cpu_path_and_leaves_it_out_without_one():
    import sys

    sys.path.insert(0, str(engine.kit.ROOT / "bench"))
    import serve_bench

    row = {"kind": "text", "clients": 4, "seconds": 10.0, "answers": 40, "errors": 0, "first_token_p50_ms": 25.0,
           "first_token_p99_ms": 60.0, "tokens": 2560, "tokens_per_s": 256.0}
    measured = {"engine": "vllm", "model": BUNDLED, "machine": "1 x NVIDIA H200", "chat": [row],
                "success_to_first_token_s": 3.4, "adapter_load": {"seconds_since_success": 2.9, "load_seconds": 0.41}}
    text = serve_bench.engine_markdown(measured, 64)
    assert "(engine)" in text and "| text | 4 | 40 | 25.0 ms | 60.0 ms | 256.0 | 0 |" in text
    assert "3.4 s later" in text and "2.9 s after the success" in text and "0.41 s" in text
    assert serve_bench.engine_markdown(None, 64) == ""  # the CPU path alone: no section
    assert serve_bench.ServeBenchConfig(engine="vllm").engine and not serve_bench.ServeBenchConfig().engine


FAKE_VLLM = """#!{python}
# `vllm` for the test: records how the service started it, then runs the kit's own server (--runtime_lora) where
# vLLM would listen, as the stand-in engine.
import json, os, sys
args = sys.argv[1:]
with open({record!r}, "w") as f:
    json.dump({{"argv": args, "lora_env": os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")}}, f)
os.chdir({root!r})
os.execv(sys.executable, [sys.executable, "serve.py", "--port", args[args.index("--port") + 1], "--engine", "kit",
                          "--runtime_lora", "--output_dir", {out!r}])
"""


@needs_model
@pytest.mark.integration
def test_with_vllm_on_the_path_the_service_starts_one_engine_logs_it_and_stops_it_with_itself(tmp_path, monkeypatch):
    import os
    import sys

    from test_serve import free_port

    bin_dir, record = tmp_path / "bin", tmp_path / "vllm-args.json"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(FAKE_VLLM.format(python=sys.executable, record=str(record), root=str(engine.kit.ROOT),
                                                   out=str(tmp_path / "engine-art")))
    (bin_dir / "vllm").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    port = free_port()
    front = Service(tmp_path / "art", None, "--engine", "vllm", "--engine_port", str(port), "--max_loras", "2")
    try:
        reply = wait_for(lambda: httpx.post(f"{front.url}/v1/chat/completions", timeout=300, json={
            "model": BUNDLED, "messages": ASK, "max_tokens": 2}), lambda r: r.status_code == 200, timeout=300,
            what="an answer through the started engine")
        assert reply.json()["model"] == BUNDLED and reply.json()["choices"][0]["message"]["content"]
        started = json.loads(record.read_text())
        argv = started["argv"]
        assert argv[0] == "serve" and argv[1].endswith("SmolLM2-135M-Instruct") and started["lora_env"] == "True"
        assert argv[argv.index("--port") + 1] == str(port) and argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("--served-model-name") + 1] == BUNDLED and "--enable-lora" in argv
        assert argv[argv.index("--max-loras") + 1] == "2"
        assert argv[argv.index("--chat-template") + 1].endswith("chatml-tools.jinja")  # SmolLM2's drops tools
        assert "--enable-lora" in (tmp_path / "art" / "serve" / engine.LOG_NAME).read_text()  # its command, logged
    finally:
        front.stop()
    with pytest.raises(httpx.TransportError):  # the engine went with the service
        httpx.get(f"http://127.0.0.1:{port}/version", timeout=5)
