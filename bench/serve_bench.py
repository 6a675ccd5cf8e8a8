"""Measure serve.py under load: status polling while a job trains, then answers (chat completions) to concurrent
clients on the CPU path.

    make bench-serve [ARGS="--clients 50 --seconds 30 --chat_clients 1,4,16 --chat_seconds 30"]
    .venv/bin/python bench/serve_bench.py [--clients 50] [--seconds 30] [--port 0]

Starts the service (a subprocess on a free port, its own output directory under a temporary folder), uploads
generated pairs and starts a DPO job on the bundled model long enough to outlast the measurement, waits until its
training process runs, then has --clients concurrent clients (asyncio + httpx, each with its own connection) poll
the job's status as fast as they can for --seconds. Writes bench/results-serve.md and .json: requests, requests/s,
p50 / p99 / max latency, errors (any status but 200, any transport error); then cancels the job and stops the
service. The clients share the machine with the training (and on a small CPU with each other), so the latency is
what an agent sees on a busy box, not the service alone.

Then, the job cancelled and its training stopped, each of --chat_clients concurrent clients streams chat
completions from the bundled model for --chat_seconds, as plain text and as structured output (a json_schema
response_format, constrained decoding), each answer up to --chat_tokens tokens: first-token latency (request sent to
the first chunk with content) at p50 / p99, and generated tokens per second across all clients (from each stream's
usage chunk). The service answers one request at a time (one model, one generate call), so a client's first token
waits for the answers queued before it.

With an engine (--engine vllm on a GPU, or --engine_url of one already running: dpokit/service/engine.py), a second
service is started whose answers go through it, and the same chat measurement runs there (--engine_model: the base
it serves, the bundled model by default; an 8B model placed in models/ by its directory name); then a small job
trains on that base and the time from its success (as a client polling the job every 0.2 s sees it) to the first
token streamed from its adapter is measured, beside the service's own record of when it loaded the adapter (the
job's event). Without an engine the bench is the CPU path alone, as before.

    make bench-serve ENGINE=vllm [ARGS="--engine_model Llama-3.1-8B-Instruct"]      # a GPU machine with vLLM
"""

import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dpokit.core import kit  # noqa: E402
from dpokit.core.kit import field  # noqa: E402

TRAIN_ARGS = "--max_length 64 --lora_r 4 --lora_alpha 8 --lora_target_modules q_proj,v_proj --probes= --eval_fraction 0"
BUNDLED = "SmolLM2-135M-Instruct"


@dataclasses.dataclass
class ServeBenchConfig:
    clients: int = field(50, "concurrent clients polling the job's status")
    seconds: float = field(30.0, "how long they poll")
    pairs: int = field(200, "pairs in the job (batch 1: one step each), enough to outlast the polling")
    port: int = field(0, "the service's port (0: a free one)")
    chat_clients: str = field("1,4,16", "concurrent chat clients, one measurement each (comma-separated; '' skips)")
    chat_seconds: float = field(30.0, "how long each chat measurement runs")
    chat_tokens: int = field(64, "max_tokens of each answer")
    engine: str = field("", "also measure answers through an engine the service starts: vllm (a GPU and `vllm` on the "
                        "PATH: make vllm) or auto; '' with no --engine_url: the CPU path alone",
                        choices=("", "auto", "vllm"))
    engine_url: str = field("", "also measure answers through an engine already running (serve.py --engine_url)")
    engine_model: str = field("", "the base the engine serves, by the service's name ('' = the bundled model)")
    engine_start_seconds: float = field(1200.0, "how long the engine may take to answer its first request")
    out: str = field("bench/results-serve", "results: OUT.md and OUT.json")

    def problems(self) -> list[str]:
        bad = [f"--{k} must be positive" for k in ("clients", "seconds", "pairs", "chat_seconds", "chat_tokens")
               if getattr(self, k) <= 0]
        if not all(c.strip().isdigit() and int(c) > 0 for c in self.chat_clients.split(",") if self.chat_clients):
            bad.append(f"--chat_clients: positive integers separated by commas (got {self.chat_clients!r})")
        return bad


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by the nearest rank: the smallest value with at least q% of values at or below it."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least the first
    return ordered[int(rank) - 1]


def summarize(latencies: list[float], errors: int, seconds: float, clients: int) -> dict:
    """Latencies in seconds -> milliseconds at p50 / p99 / max, requests per second, errors."""
    ms = [x * 1000 for x in latencies]
    return {"clients": clients, "seconds": round(seconds, 1), "requests": len(ms) + errors, "errors": errors,
            "requests_per_s": round((len(ms) + errors) / seconds, 1),
            "p50_ms": round(percentile(ms, 50), 1) if ms else None,
            "p99_ms": round(percentile(ms, 99), 1) if ms else None, "max_ms": round(max(ms), 1) if ms else None}


CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}


def summarize_chat(first_tokens: list[float], tokens: int, errors: int, seconds: float, clients: int,
                   kind: str) -> dict:
    """First-token latencies in seconds and generated tokens -> p50 / p99 in milliseconds, tokens per second."""
    ms = [x * 1000 for x in first_tokens]
    return {"kind": kind, "clients": clients, "seconds": round(seconds, 1), "answers": len(ms), "errors": errors,
            "first_token_p50_ms": round(percentile(ms, 50), 1) if ms else None,
            "first_token_p99_ms": round(percentile(ms, 99), 1) if ms else None,
            "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


async def chat_load(base: str, clients: int, seconds: float, max_tokens: int, structured: bool,
                    model: str = BUNDLED) -> dict:
    """--clients streams of chat completions for --seconds (each answer started before the end is counted)."""
    import httpx

    first_tokens, counted, errors = [], [0], 0
    stop_at = time.perf_counter() + seconds
    body = {"model": model, "max_tokens": max_tokens, "temperature": 1.0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Name a big city and its population."}]}
    if structured:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}

    async def client():
        nonlocal errors
        async with httpx.AsyncClient(timeout=600) as http:
            while time.perf_counter() < stop_at:
                t0, first = time.perf_counter(), None
                try:
                    async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as reply:
                        if reply.status_code != 200:
                            errors += 1
                            continue
                        async for line in reply.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            event = json.loads(line[6:])
                            if first is None and any(c["delta"].get("content") for c in event["choices"]):
                                first = time.perf_counter() - t0
                            if event.get("usage"):
                                counted[0] += event["usage"]["completion_tokens"]
                except httpx.HTTPError:
                    errors += 1
                    continue
                if first is not None:
                    first_tokens.append(first)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return summarize_chat(first_tokens, counted[0], errors, time.perf_counter() - t0, clients,
                          "json_schema" if structured else "text")


def chat_markdown(rows: list[dict], max_tokens: int, where: str = "CPU", about: str = "") -> str:
    if not rows:
        return ""
    lines = [f"\n## Answers: chat completions under concurrent clients ({where})\n",
             about or f"Each client streams answers of up to {max_tokens} tokens from the bundled model (temperature "
             "1), one request after another; `json_schema` holds each answer to a schema (constrained decoding). "
             "The service answers one request at a time, so first-token latency grows with the clients queued.\n",
             "| answer | clients | answers | first token p50 | first token p99 | generated tokens/s | errors |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['kind']} | {r['clients']} | {r['answers']} | {r['first_token_p50_ms']} ms | "
              f"{r['first_token_p99_ms']} ms | {r['tokens_per_s']} | {r['errors']} |" for r in rows]
    return "\n".join(lines) + "\n"


def markdown(r: dict) -> str:
    return (f"# serve.py: status polling while a job trains\n\n"
            f"{r['clients']} concurrent clients polled `GET /v1/fine_tuning/jobs/{{id}}` for {r['seconds']} s while "
            f"the job's training process ran (the bundled model, {r['job_state']}), on {r['machine']}.\n\n"
            "| requests | requests/s | p50 | p99 | max | errors |\n| --- | --- | --- | --- | --- | --- |\n"
            f"| {r['requests']:,} | {r['requests_per_s']} | {r['p50_ms']} ms | {r['p99_ms']} ms | {r['max_ms']} ms "
            f"| {r['errors']} |\n" + chat_markdown(r.get("chat", []), r.get("chat_tokens", 0), "CPU" if r.get(
                "sampler", "no GPU").startswith("no GPU") else "the service's own sampler on the GPU") +
            engine_markdown(r.get("engine"), r.get("chat_tokens", 0)) +
            f"\n`make bench-serve` ({time.strftime('%Y-%m-%d', time.gmtime())}); bench/serve_bench.py says how.\n")


async def poll(url: str, clients: int, seconds: float) -> tuple[list[float], int]:
    import httpx

    latencies, errors = [], 0
    stop_at = time.perf_counter() + seconds

    async def client():
        nonlocal errors
        async with httpx.AsyncClient(timeout=30) as http:
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                try:
                    ok = (await http.get(url)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def service(out: Path, port: int, *extra: str):
    """serve.py in a subprocess on port (runs and its log under out), answering /version; SIGTERM at the end (which
    stops an engine it started)."""
    import httpx

    base = f"http://127.0.0.1:{port}"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "serve.py", "--port", str(port), "--output_dir", str(out / "art"),
                                 f"--train_args={TRAIN_ARGS}", *extra], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(240):
                try:
                    httpx.get(f"{base}/version", timeout=2)
                    break
                except httpx.TransportError:
                    if proc.poll() is not None:
                        raise kit.UserError(f"serve.py {' '.join(extra)} exited: "
                                            f"{(out / 'serve.log').read_text()[-2000:]}") from None
                    time.sleep(0.5)
            yield base
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=300)


def pairs_file(n: int) -> str:
    return "".join(json.dumps({"prompt": f"What is {i} + {i}?", "chosen": f" {2 * i}.",
                               "rejected": f" I think {2 * i + 1}."}) + "\n" for i in range(n))


def start_job(base: str, model: str, pairs: int) -> str:
    """A DPO job of batch 1 on model (one step per pair): its URL."""
    import httpx

    f = httpx.post(f"{base}/v1/files", files={"file": ("pairs.jsonl", pairs_file(pairs))}, data={"purpose": "fine-tune"})
    job = httpx.post(f"{base}/v1/fine_tuning/jobs", json={
        "model": model, "training_file": f.json()["id"],
        "method": {"type": "dpo", "dpo": {"hyperparameters": {"batch_size": 1}}}}).json()
    return f"{base}/v1/fine_tuning/jobs/{job['id']}"


def first_token(base: str, model: str, timeout: float = 600) -> float:
    """Seconds until a streamed chat answer from model sends its first content (trying again while the service
    answers anything else: the model not there yet, the engine still starting)."""
    import httpx

    body = {"model": model, "max_tokens": 4, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "What is 2 + 2?"}]}
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as reply:
                for line in reply.iter_lines() if reply.status_code == 200 else ():
                    if line.startswith("data: {") and any(c["delta"].get("content")
                                                          for c in json.loads(line[6:])["choices"]):
                        return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise kit.UserError(f"no token from {model} in {timeout:g} s")


def polling_bench(base: str, cfg: ServeBenchConfig) -> dict:
    """--clients polling a training job's status for --seconds; the job cancelled at the end."""
    import httpx

    url = start_job(base, BUNDLED, cfg.pairs)
    while httpx.get(url).json()["status"] != "running":
        time.sleep(0.5)
    print(f"[bench] {cfg.clients} clients polling {url} for {cfg.seconds:g} s while it trains", flush=True)
    t0 = time.perf_counter()
    latencies, errors = asyncio.run(poll(url, cfg.clients, cfg.seconds))
    result = summarize(latencies, errors, time.perf_counter() - t0, cfg.clients)
    steps = [e["data"]["step"] for e in httpx.get(f"{url}/events?limit=1000").json()["data"] if e["type"] == "metrics"]
    result |= {"job_state": f"{len(steps)} steps trained during the run" if steps else
               "loading and starting to train", "machine": f"{os.cpu_count()} CPU cores, "
               f"{platform.processor() or platform.machine()}, Python {platform.python_version()}"}
    httpx.post(f"{url}/cancel")
    while httpx.get(url).json()["status"] not in ("cancelled", "failed", "succeeded"):
        time.sleep(0.5)  # its training process gone: the answers after it have the machine to themselves
    return result


def chat_bench(base: str, cfg: ServeBenchConfig, model: str = BUNDLED) -> list[dict]:
    """Each --chat_clients count streaming answers for --chat_seconds, text then json_schema."""
    rows = []
    for clients in (int(c) for c in cfg.chat_clients.split(",") if cfg.chat_clients):
        for structured in (False, True):
            row = asyncio.run(chat_load(base, clients, cfg.chat_seconds, cfg.chat_tokens, structured, model))
            print(f"[bench] {json.dumps(row)}", flush=True)
            rows.append(row)
    return rows


def engine_bench(base: str, cfg: ServeBenchConfig) -> dict:
    """Through the engine: answers under concurrent clients, then a job's success until the first token from its
    adapter (the client's view: the job polled every 0.2 s), and the service's record of the adapter's load."""
    import httpx

    model = cfg.engine_model or BUNDLED
    started = first_token(base, model, cfg.engine_start_seconds)  # the engine up (vLLM: minutes on a big model)
    print(f"[bench] the engine answers {model} ({started:.1f} s after the service)", flush=True)
    result = {"engine": cfg.engine_url or cfg.engine, "model": model, "machine": gpu_name(),
              "chat": chat_bench(base, cfg, model)}
    url = start_job(base, model, 8)
    while (job := httpx.get(url).json())["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.2)
    if job["status"] != "succeeded":
        raise kit.UserError(f"the engine bench's job {job['status']}: {job.get('error')}")
    result["success_to_first_token_s"] = round(first_token(base, job["fine_tuned_model"]), 2)
    loads = [e["data"] for e in httpx.get(f"{url}/events?limit=100").json()["data"]
             if (e.get("data") or {}).get("load_seconds") is not None]
    result["adapter_load"] = loads[0] if loads else None
    print(f"[bench] {job['fine_tuned_model']}: first token {result['success_to_first_token_s']} s after its job "
          f"succeeded; the service's record: {result['adapter_load']}", flush=True)
    return result


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    return f"{len(out)} x {out[0]}" if out else f"no GPU ({os.cpu_count()} CPU cores)"


def engine_markdown(r: dict | None, max_tokens: int) -> str:
    if not r:
        return ""
    about = (f"The same clients against a second service whose answers go through the engine ({r['engine']}: "
             f"`{r['model']}` on {r['machine']}), answers of up to {max_tokens} tokens; vLLM batches concurrent "
             "requests, where the service's own sampler answers one at a time.\n")
    load = r.get("adapter_load") or {}
    return chat_markdown(r["chat"], max_tokens, "engine", about) + (
        f"\nA job on `{r['model']}` succeeded; the first token from its adapter followed "
        f"{r['success_to_first_token_s']} s later (as a client polling the job every 0.2 s sees it). The service "
        f"loaded the adapter into the engine {load.get('seconds_since_success', '?')} s after the success (the "
        f"load itself: {load.get('load_seconds', '?')} s; the job's event, its success time in whole seconds).\n")


def warm(base: str, model: str) -> None:
    """One answer before timing any: the model loaded."""
    import httpx

    httpx.post(f"{base}/v1/chat/completions", timeout=600, json={
        "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})


def main(argv=None) -> int:
    cfg = kit.parse_config(ServeBenchConfig, argv, __doc__)
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        with service(Path(tmp) / "cpu", cfg.port or free_port(), "--engine", "kit") as base:
            result = polling_bench(base, cfg) | {"chat_tokens": cfg.chat_tokens, "sampler": gpu_name()}
            warm(base, BUNDLED)
            result["chat"] = chat_bench(base, cfg)
        if cfg.engine or cfg.engine_url:
            flags = [*(["--engine", cfg.engine] if cfg.engine else []),
                     *(["--engine_url", cfg.engine_url] if cfg.engine_url else []),
                     *(["--engine_model", cfg.engine_model] if cfg.engine_model else [])]
            with service(Path(tmp) / "engine", free_port(), *flags) as base:
                result["engine"] = engine_bench(base, cfg)
    kit.atomic_write_json(ROOT / f"{cfg.out}.json", result)
    kit.atomic_write_text(ROOT / f"{cfg.out}.md", markdown(result))
    cpu = ROOT / "bench" / "results.json"
    if ROOT / cfg.out == ROOT / "bench" / "results-serve" and cpu.exists():  # results.md: the training table + this
        sys.path.insert(0, str(ROOT / "bench"))
        import bench

        kit.atomic_write_text(cpu.with_suffix(".md"), bench.markdown(json.loads(cpu.read_text()))
                              + bench.serve_section(cpu.parent))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
