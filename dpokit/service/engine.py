"""The serving engine behind the jobs service's answers, where there is one: a `vllm serve` of one base on this
machine's GPU, started and stopped with the service (its log: <output_dir>/serve/engine-vllm.log), or an
OpenAI-compatible server already running (--engine_url; another kit service started with --runtime_lora is one).

    python serve.py --engine vllm [--engine_model SmolLM2-135M-Instruct] [--max_loras 4] [--max_lora_rank 64]
    python serve.py --engine_url http://127.0.0.1:8001      # an engine someone else started

The service checks every request itself first (api_chat.py, api_responses.py: its refusals and 400s are the same on
both paths), then forwards the request as it was validated to the engine: the same endpoints and model names, a
stream passed through as server-sent events, the engine's errors in OpenAI's shape, and an engine that does not
answer a 503 (engine_unavailable) rather than a 500.

Each fine-tuned model of the engine's base is a LoRA adapter loaded at run time through vLLM's documented endpoints
(VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): POST /v1/load_lora_adapter {"lora_name": <fine_tuned_model>, "lora_path":
<the job's run directory>} once its job succeeds (or when a request asks for it first), and POST
/v1/unload_lora_adapter {"lora_name"} once the service no longer lists it (DELETE /v1/models/{model}). The time
from a job's success to its adapter answering is a job event (data: seconds_since_success, load_seconds) and a line
of the service's log. An adapter the engine refuses (a rank above --max_lora_rank, a module vLLM has no LoRA for)
is answered by the service's own sampler instead, and the job's events say why.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time

import httpx
from fastapi.responses import JSONResponse, StreamingResponse

from dpokit.core import kit
from dpokit.model import models
from dpokit.service.service import BUNDLED_NAMES, ApiError

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices (its LoRAConfig)
LOG_NAME = "engine-vllm.log"  # under <output_dir>/serve/
STOP_SECONDS = 30.0  # SIGTERM, then SIGKILL: vLLM frees the GPU's memory on SIGTERM


def config_problems(cfg) -> list[str]:
    """What is wrong with serve.py's engine options (ServeConfig.problems reports them with the rest)."""
    p = []
    if cfg.engine == "kit" and cfg.engine_url:
        p.append("--engine_url is for --engine auto or vllm (kit: the service's own sampler answers)")
    if cfg.engine_url and not cfg.engine_url.startswith(("http://", "https://")):
        p.append(f"--engine_url is an http(s) URL of an OpenAI-compatible server (got {cfg.engine_url!r})")
    if cfg.engine == "vllm" and not cfg.engine_url and not shutil.which("vllm"):
        p.append("--engine vllm: `vllm` is not on the PATH (make vllm installs it into .venv-vllm; the image built "
                 "with EXTRAS=vllm has it), or give --engine_url of one already running")
    if not 0 < cfg.engine_port < 65536 or cfg.engine_port == cfg.port:
        p.append(f"--engine_port must be in 1..65535 and not --port (got {cfg.engine_port})")
    if cfg.max_lora_rank not in VLLM_RANKS:
        p.append(f"--max_lora_rank must be one of vLLM's {', '.join(map(str, VLLM_RANKS))} (got {cfg.max_lora_rank})")
    if cfg.max_loras < 1 or not 0 < cfg.engine_gpu_memory <= 1:
        p.append("--max_loras must be at least 1 and --engine_gpu_memory in (0, 1]")
    try:
        shlex.split(cfg.engine_args)
    except ValueError as e:
        p.append(f"--engine_args: {e}")
    return p


def engine_kind(cfg, vllm: str | None, has_gpu) -> str:
    """'url' (answers go to --engine_url), 'vllm' (the service starts `vllm serve`) or 'kit' (its own sampler).
    auto: vLLM where `vllm` is on the PATH and a GPU is here. has_gpu: called only then (it runs nvidia-smi)."""
    if cfg.engine == "kit":
        return "kit"
    if cfg.engine_url:
        return "url"
    return "vllm" if cfg.engine == "vllm" or (vllm and has_gpu()) else "kit"


def vllm_command(vllm: str, base: str, name: str, port: int, cfg, chat_template: str | None) -> list[str]:
    """`vllm serve` of a base as the service names it, on loopback, with run-time LoRA adapters; tool calls parsed
    from the <tool_call> blocks the kit's templates teach (Hermes' format); chat_template: a file the engine renders
    every chat with (the kit's chatml-tools for a ChatML base whose own template has no tools, as api_chat.render
    chooses: a conversation without tools renders as the base's own template does)."""
    cmd = [vllm, "serve", base, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name,
           "--enable-lora", "--max-loras", str(cfg.max_loras), "--max-lora-rank", str(cfg.max_lora_rank),
           "--gpu-memory-utilization", str(cfg.engine_gpu_memory),
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    return cmd + (["--chat-template", chat_template] if chat_template else []) + shlex.split(cfg.engine_args)


def engine_template(tokenizer) -> str | None:
    """The kit's template the engine renders with instead of the base's own, as api_chat.render would: chatml-tools
    for a ChatML template that cannot render tool use; None keeps the base's."""
    problem = models.tool_template_problem(tokenizer)
    return "chatml-tools" if problem and "<|im_start|>" in (tokenizer.chat_template or "") else None


def same_base(a: str, b: str) -> bool:
    """Whether two bases as the service records them (a path, relative to the kit or not, or a hub id) are one."""
    return a == b or (kit.ROOT / a).resolve() == (kit.ROOT / b).resolve()


def engine_error(status: int, body: bytes) -> ApiError:
    """An engine's error response as the service's: its 4xx as the client's (422, a body it could not read, as 400),
    with its message and param; a 5xx as a 502 saying the engine failed."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    inner = data.get("error", data) if isinstance(data, dict) else None
    inner = inner if isinstance(inner, dict) else {}
    message = inner.get("message") if isinstance(inner.get("message"), str) else body.decode(errors="replace")[:500]
    param = inner.get("param") if isinstance(inner.get("param"), str) else None
    code = inner.get("code") if isinstance(inner.get("code"), str) else None
    if 400 <= status < 500:
        return ApiError(400 if status == 422 else status, message or f"the engine refused the request ({status})",
                        param, code)
    return ApiError(502, f"the serving engine failed on this request ({status}: {message})", param,
                    "engine_error", "server_error")


def relabel(event, shown: str) -> None:
    """The model name the client asked for, in place of the engine's, in a response or a streamed event (a chunk's
    `model`, a Responses event's `response.model`)."""
    if isinstance(event, dict):
        if isinstance(event.get("model"), str):
            event["model"] = shown
        if isinstance(event.get("response"), dict) and isinstance(event["response"].get("model"), str):
            event["response"]["model"] = shown


def relabeled_line(line: str, shown: str) -> str:
    """One line of a server-sent event stream with relabel applied to its JSON data; other lines as they are."""
    if not line.startswith("data: {"):
        return line
    try:
        event = json.loads(line[6:])
    except ValueError:
        return line
    relabel(event, shown)
    return "data: " + json.dumps(event)


def _engine_child() -> None:  # pragma: no cover - runs in the child between fork and exec
    """vLLM gets SIGTERM when the service dies, even by kill -9 (Linux), so a restarted service does not find the
    GPU's memory and the port still held by the last one's engine."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def has_gpu() -> bool:
    """Whether an NVIDIA GPU answers `nvidia-smi -L` (as the Makefile asks): the service's process loads no torch to
    find out."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def make(cfg, svc) -> Engine | None:
    """The engine serve.create_app gives the service, or None (the service's own sampler answers)."""
    vllm = shutil.which("vllm")
    kind = engine_kind(cfg, vllm, has_gpu)
    if kind == "kit":
        return None
    name = cfg.engine_model or BUNDLED_NAMES[0]
    base = svc.base_path(name)
    if base is None:
        raise kit.UserError(f"--engine_model {name!r} is not a base of this service ({', '.join(svc.base_models())})")
    if kind == "url":
        url = cfg.engine_url.rstrip("/").removesuffix("/v1")
        return Engine(svc, url, name, base, key=os.environ.get("DPO_KIT_ENGINE_API_KEY", ""))
    return Engine(svc, f"http://127.0.0.1:{cfg.engine_port}", name, base, vllm=vllm)


class Engine(threading.Thread):
    """One engine and the adapters loaded into it. The thread keeps them in step with the service's models
    (every --poll_seconds: what the engine lists against the succeeded jobs of its base); request threads ask
    target() which name to send, and forward() the request."""

    def __init__(self, svc, url: str, name: str, base: str, vllm: str | None = None, key: str = ""):
        super().__init__(name="engine-sync", daemon=True)
        self.svc, self.url, self.name, self.base, self.vllm = svc, url, name, base, vllm
        self.log_path = svc.out / "serve" / LOG_NAME
        self.http = httpx.Client(base_url=url, timeout=httpx.Timeout(600.0, connect=5.0),
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
        self.process = None
        self.loaded: set[str] = set()  # what the engine listed at the last look, and loaded since
        self.refused: dict[str, str] = {}  # adapters the engine would not load: their reason
        self.lock = threading.Lock()  # one load or unload at a time
        self.stopping = threading.Event()
        self.started_at = time.time()
        self._tokenizer, self._tokenizer_lock = None, threading.Lock()

    def tokenizer(self):
        """The base's tokenizer: the service renders a request with it to refuse what the kit's path refuses."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(models.resolve_model_path(self.base))
            return self._tokenizer

    def begin(self) -> None:
        """Start `vllm serve` (when the service runs it) and the thread that keeps the adapters in step."""
        if self.vllm:
            template = engine_template(self.tokenizer())
            template_file = str(models.TEMPLATES_DIR / f"{template}.jinja") if template else None
            port = int(self.url.rsplit(":", 1)[1])
            cmd = vllm_command(self.vllm, models.resolve_model_path(self.base), self.name, port, self.svc.cfg,
                               template_file)
            log = open(self.log_path, "ab")
            log.write(f"\n[serve] {shlex.join(cmd)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=_engine_child,
                                            env={**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
            log.close()
        print(f"[serve] answers for {self.name} and its fine-tuned models go to the engine at {self.url}"
              + (f" (vllm serve, pid {self.process.pid}, log {self.log_path})" if self.process else ""), flush=True)
        self.start()

    def end(self) -> None:
        """Stop the thread, then the vLLM server the service started (SIGTERM to its group, SIGKILL after
        STOP_SECONDS)."""
        self.stopping.set()
        if self.is_alive():
            self.join(timeout=10)
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        self.http.close()

    def run(self) -> None:
        while not self.stopping.wait(self.svc.cfg.poll_seconds):
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - the next tick tries again; the service goes on
                print(f"[serve] engine: {type(e).__name__}: {e}", flush=True)

    def listed(self) -> set[str] | None:
        """The model names the engine lists, or None when it does not answer (not yet started, or gone)."""
        try:
            r = self.http.get("/v1/models", timeout=5.0)
            return {m["id"] for m in r.json()["data"]} if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def wanted(self) -> dict[str, dict]:
        """The service's fine-tuned models of the engine's base (succeeded, not deleted): name -> job."""
        rows = self.svc.store.query("SELECT * FROM jobs WHERE status = 'succeeded' AND model_deleted IS NULL")
        return {j["fine_tuned_model"]: j for j in rows if same_base(j["base"], self.base)}

    def tick(self) -> None:
        """Load each wanted adapter the engine does not list; unload each it lists that the service no longer does
        (only names of this service's jobs: an engine may serve others' adapters too)."""
        listed = self.listed()
        if listed is None:
            return
        with self.lock:
            self.loaded = set(listed)
        wanted = self.wanted()
        for name, job in wanted.items():
            if name not in listed and name not in self.refused:
                self.load(job)
        ours = {r["fine_tuned_model"] for r in self.svc.store.query("SELECT fine_tuned_model FROM jobs")}
        for name in (listed & ours) - wanted.keys():
            self.unload(name)

    def load(self, job: dict) -> None:
        """POST /v1/load_lora_adapter for a job's adapter (its run directory); the time since the job succeeded
        becomes a job event. A refusal is remembered (and said): the service's sampler answers for it instead."""
        name = job["fine_tuned_model"]
        with self.lock:
            if name in self.loaded or name in self.refused:
                return
            t0 = time.time()
            try:
                r = self.http.post("/v1/load_lora_adapter", json={"lora_name": name,
                                                                 "lora_path": str(self.svc.out / job["id"])})
            except httpx.HTTPError:
                return  # the engine is down or starting: the next tick tries again
            done = time.time()
            if r.status_code != 200 and "already" not in r.text:
                self.refused[name] = engine_error(r.status_code, r.content).message
                self.svc.store.event(job["id"], f"The serving engine ({self.url}) did not load {name}: "
                                     f"{self.refused[name]}; the service's own sampler answers for it", "warn")
                print(f"[serve] engine: {name} refused: {self.refused[name]}", flush=True)
                return
            self.loaded.add(name)
        since = done - (job["finished_at"] or done)
        print(f"[serve] engine: loaded {name} ({done - t0:.2f} s), {since:.1f} s after its job succeeded", flush=True)
        if (job["finished_at"] or 0) >= self.started_at - 1:  # not again for older jobs at each restart
            self.svc.store.event(job["id"], f"Loaded into the serving engine ({self.url}) {since:.1f} s after the "
                                 f"job succeeded (the load took {done - t0:.2f} s)", data={
                                     "engine_url": self.url, "seconds_since_success": round(since, 2),
                                     "load_seconds": round(done - t0, 3)})

    def unload(self, name: str) -> None:
        with self.lock:
            try:
                r = self.http.post("/v1/unload_lora_adapter", json={"lora_name": name})
            except httpx.HTTPError:
                return
            if r.status_code in (200, 404):
                self.loaded.discard(name)
                print(f"[serve] engine: unloaded {name} (no longer listed)", flush=True)

    def target(self, name: str) -> str | None:
        """The name to send the engine for model name: its base's served name, or a fine-tuned model of its base
        (loaded now if its job succeeded since the last tick); None: not the engine's (the service answers)."""
        base = self.svc.base_path(name)
        if base is not None:
            return self.name if same_base(base, self.base) else None
        job = self.svc.tuned_job(name)
        if job is None or not same_base(job["base"], self.base):
            return None
        if name not in self.loaded:
            self.load(job)
        return None if name in self.refused else name

    def unavailable(self, e: Exception) -> ApiError:
        rc = self.process.poll() if self.process is not None else None
        why = (f"vllm serve exited with {rc} (serve/{LOG_NAME} says why)" if rc is not None else
               f"vllm serve is not answering yet (it is starting: serve/{LOG_NAME})" if self.process is not None else
               f"it does not answer ({type(e).__name__})")
        return ApiError(503, f"the serving engine at {self.url} is unavailable: {why}", None, "engine_unavailable",
                        "server_error")

    def forward(self, path: str, payload: dict, shown: str, headers: dict, fields: dict | None = None):
        """The engine's answer to a validated request: JSON, or its server-sent events passed through as they come,
        each with the model name the client asked for; fields: set on a JSON answer (chat's system_fingerprint)."""
        try:
            r = self.http.send(self.http.build_request("POST", path, json=payload), stream=True)
        except httpx.TimeoutException:
            raise ApiError(504, f"the serving engine at {self.url} did not answer in time", None, "engine_timeout",
                           "server_error") from None
        except httpx.HTTPError as e:
            raise self.unavailable(e) from None
        if r.status_code != 200 or not payload.get("stream"):
            try:
                body = r.read()
            finally:
                r.close()
            if r.status_code != 200:
                raise engine_error(r.status_code, body)
            try:
                answer = json.loads(body)
            except ValueError:
                raise engine_error(502, body) from None
            relabel(answer, shown)
            return JSONResponse(answer | (fields or {}) if isinstance(answer, dict) else answer, headers=headers)

        def events():
            try:
                for line in r.iter_lines():
                    yield relabeled_line(line, shown) + "\n"
            except httpx.HTTPError as e:  # the engine went away mid-answer: said in the stream, as OpenAI's errors
                yield "data: " + json.dumps(self.unavailable(e).body()) + "\n\n"
            finally:
                r.close()

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
