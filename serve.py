"""A fine-tuning jobs service: agents upload pairs (or raw run logs), start DPO jobs over HTTP, poll them and chat
with the result, through the official `openai` SDK (only `base_url` changed) or nip's language-model-server client.

    make serve [ARGS="--port 8000 --max_jobs 1 --train_args='--max_length 256'"]
    python serve.py [--host 127.0.0.1] [--port 8000] [--output_dir artifacts] [--max_jobs 1] [--train_args="..."]
    DPO_KIT_API_KEY=secret python serve.py --host 0.0.0.0     # any host but loopback needs an API key (Bearer)
    docker run -p 8000:8000 -e DPO_KIT_API_KEY=secret -v $PWD/artifacts:/artifacts dpo-kit serve --host 0.0.0.0 \
        --output_dir /artifacts

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    job = client.fine_tuning.jobs.create(model="SmolLM2-135M-Instruct", method={"type": "dpo"},
                                         training_file=client.files.create(file=open("pairs.jsonl", "rb"),
                                                                           purpose="fine-tune").id)

Endpoints (README "A fine-tuning jobs service" has the table): /v1/files, /v1/fine_tuning/jobs (create, list, get,
cancel, pause, resume, events, checkpoints), /v1/models, /v1/chat/completions; nip's /version and /training/jobs.

Each job is a separate `train_dpo.py` process (or scaleout.py / launcher.py with --gpus / --runner docker), one
at a time by default, so a crashed training never takes the service down and status requests never wait on it.
Files, jobs and events live in SQLite (WAL) at <output_dir>/serve/serve.db; uploads in <output_dir>/serve/files/<id>
(never under the client's filename); each job trains the run <output_dir>/<job id>/ with the kit's run directory,
lock, resume and tarball. Stop the service (SIGTERM, or kill -9: the trainer gets SIGTERM from the kernel) and
start it again: queued jobs stay queued and the running one resumes from its last checkpoint.
"""


import contextlib
import dataclasses
import hmac
import json
import os
import re
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

import kit
import models
import runs
from jobs import TERMINAL, Scheduler, Store, new_id, now
from kit import UserError, field

ROOT = Path(__file__).resolve().parent
VERSION = "1.0.0"  # nip's client compares major versions with its own
LOOPBACK = ("127.0.0.1", "localhost", "::1")
BUNDLED_NAMES = (Path(models.BUNDLED_MODEL_DIR).name, "HuggingFaceTB/SmolLM2-135M-Instruct")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SUFFIX = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclasses.dataclass
class ServeConfig:
    host: str = field("127.0.0.1", "address to bind; anything but loopback needs DPO_KIT_API_KEY (Bearer)")
    port: int = field(8000, "TCP port")
    output_dir: str = field("artifacts", "runs go to <output_dir>/<job id>/; the service's database and uploads "
                            "to <output_dir>/serve/")
    models_dir: str = field("models", "base models a job may name by their directory name (besides the bundled "
                            "model, hub ids and fine-tuned models); a path never comes from a request")
    max_jobs: int = field(1, "jobs training at the same time (each is its own process)")
    max_file_mb: float = field(512.0, "largest upload, in MB (a larger one gets 413)")
    train_args: str = field("", "train_dpo.py flags for every job, before the job's own hyperparameters "
                            "(--train_args='--max_length 256 --probes=', with =); checked at start")
    runner: str = field("local", "how a job trains: local (train_dpo.py, or scaleout.py with --gpus N) or docker "
                        "(launcher.py: the kit's image)", choices=("local", "docker"))
    gpus: str = field("", "GPUs for each job, as make's GPUS= ('' = train_dpo.py's own choice; N or 0,1: "
                      "accelerate through scaleout.py; all)")
    poll_seconds: float = field(0.5, "how often the scheduler looks at validations, processes and metrics")
    shutdown_seconds: float = field(120.0, "on SIGTERM, how long to wait for trainings to save a checkpoint")
    warm_models: int = field(2, "models kept loaded for chat completions (least recently used goes first)")

    def problems(self) -> list[str]:
        p = []
        if not 0 < self.port < 65536:
            p.append(f"--port must be in 1..65535 (got {self.port})")
        if self.max_jobs < 1 or self.warm_models < 1:
            p.append("--max_jobs and --warm_models must be at least 1")
        if self.max_file_mb <= 0 or self.poll_seconds <= 0:
            p.append("--max_file_mb and --poll_seconds must be positive")
        if self.host not in LOOPBACK and not os.environ.get("DPO_KIT_API_KEY"):
            p.append(f"--host {self.host} reaches beyond this machine: set DPO_KIT_API_KEY (clients send it as "
                     "'Authorization: Bearer <key>', the openai SDK's api_key)")
        if flag_problem := train_args_problem(self.train_args):
            p.append(f"--train_args: {flag_problem}")
        return p


# ---------------------------------------------------------------------------------------------
# Pure helpers: ids, names, the mapping of API options onto train_dpo.py flags, the API's views of a job.
# ---------------------------------------------------------------------------------------------


class ApiError(Exception):
    """A request the service refuses: an OpenAI-style error body with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def train_args_problem(train_args: str) -> str | None:
    """Why train_dpo.py would refuse these flags (unknown flag, bad value), or None."""
    import io
    import shlex

    import train_dpo

    try:
        argv = shlex.split(train_args)
    except ValueError as e:
        return str(e)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            kit.parse_config(train_dpo.TrainConfig, ["--data", "x.jsonl", *argv], "")
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "not accepted"
    except UserError as e:
        return str(e)
    return None


def kit_defaults() -> dict:
    """The kit's own values for OpenAI's "auto" hyperparameters (train_dpo.TrainConfig's defaults)."""
    import train_dpo

    d = train_dpo.TrainConfig()
    return {"beta": d.beta, "batch_size": d.per_device_train_batch_size, "n_epochs": d.num_train_epochs,
            "learning_rate_multiplier": 1.0, "learning_rate": d.learning_rate}


def hyperparameter_flags(method_type: str, hyper: dict) -> list[str]:
    """OpenAI's method hyperparameters as train_dpo.py flags; "auto" and missing ones add no flag (the kit's
    default, or the service's --train_args, applies). learning_rate_multiplier scales the kit's learning rate."""
    flags = []
    if method_type == "supervised":
        flags += ["--loss_type", "sft"]
    for key, flag in (("beta", "--beta"), ("batch_size", "--per_device_train_batch_size"),
                      ("n_epochs", "--num_train_epochs")):
        if hyper.get(key) not in (None, "auto") and not (key == "beta" and method_type == "supervised"):
            flags += [flag, str(hyper[key])]
    if hyper.get("learning_rate_multiplier") not in (None, "auto"):
        flags += ["--learning_rate", repr(kit_defaults()["learning_rate"] * float(hyper["learning_rate_multiplier"]))]
    return flags


def resolved_hyperparameters(method_type: str, hyper: dict) -> dict:
    """What a job reports: its own values, the kit's defaults for "auto"."""
    d = kit_defaults()
    keys = ("batch_size", "learning_rate_multiplier", "n_epochs") + (("beta",) if method_type == "dpo" else ())
    return {k: d[k] if hyper.get(k) in (None, "auto") else hyper[k] for k in keys}


def nip_flags(config: dict) -> list[str]:
    """nip's LmTrainingConfig as train_dpo.py flags. mixed_precision fp16 / bf16 leave the kit's choice (bfloat16
    or float16 on a GPU, float32 on a CPU); "no" is float32. max_prompt_length + max_completion_length stand in for
    max_length when only they are given."""
    dpo, lora = config.get("dpo_config") or {}, config.get("training_lora_config")
    flags = ["--beta", repr(float(dpo["beta"])), "--learning_rate", repr(float(dpo["learning_rate"])),
             "--seed", str(config.get("seed", 6198)),
             "--per_device_train_batch_size", str(config.get("per_device_train_batch_size", 2)),
             "--gradient_checkpointing", str(bool(config.get("gradient_checkpointing", True))).lower()]
    max_length = dpo.get("max_length") or (
        dpo["max_prompt_length"] + dpo["max_completion_length"]
        if dpo.get("max_prompt_length") and dpo.get("max_completion_length") else None)
    if max_length:
        flags += ["--max_length", str(max_length)]
    if lora:
        flags += ["--lora_r", str(lora["r"]), "--lora_alpha", str(lora["lora_alpha"]),
                  "--lora_dropout", repr(float(lora["lora_dropout"]))]
    if config.get("mixed_precision") == "no":
        flags += ["--compute_dtype", "float32"]
    return flags


def nip_status(job: dict) -> str:
    """nip's TrainingJobStatus for a job record: pending before its process starts, starting until its first
    logged step, then running; failed is crashed; paused is interrupted."""
    status = job["status"]
    if status in ("validating_files", "queued"):
        return "pending"
    if status == "running":
        return "running" if job["metrics_step"] else "starting"
    return {"failed": "crashed", "paused": "interrupted"}.get(status, status)


def fine_tuned_name(base: str, suffix: str | None, job_id: str) -> str:
    """OpenAI's shape: ft:<base>:<suffix>:<job id without its prefix>."""
    return f"ft:{Path(base).name}:{suffix or 'dpo-kit'}:{job_id.split('-', 1)[1]}"


def page(rows: list[dict], limit: int) -> dict:
    """An OpenAI list page from up to limit + 1 rows (the extra one says there is more)."""
    return {"object": "list", "data": rows[:limit], "has_more": len(rows) > limit}


# ---------------------------------------------------------------------------------------------
# Request shapes (pydantic): the openai SDK's field names, nip's LmTrainingConfig; unknown fields are 400s.
# ---------------------------------------------------------------------------------------------


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


Auto = Union[Literal["auto"], None]


class Hyper(Strict):
    beta: Union[Auto, float] = Field(None, gt=0)
    batch_size: Union[Auto, int] = Field(None, ge=1)
    n_epochs: Union[Auto, int] = Field(None, ge=1)
    learning_rate_multiplier: Union[Auto, float] = Field(None, gt=0)


class MethodBody(Strict):
    hyperparameters: Optional[Hyper] = None


class Method(Strict):
    type: Literal["dpo", "supervised"]
    dpo: Optional[MethodBody] = None
    supervised: Optional[MethodBody] = None


class JobCreate(Strict):
    model: str
    training_file: str
    validation_file: Optional[str] = None
    method: Optional[Method] = None
    hyperparameters: Optional[Hyper] = None  # OpenAI's older place for them (supervised)
    suffix: Optional[str] = Field(None, pattern=SUFFIX.pattern)
    seed: Optional[int] = None
    metadata: Optional[dict[str, str]] = None
    integrations: Optional[list] = Field(None, max_length=0)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list, None] = None


class ChatRequest(Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, le=4096)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=4096)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    seed: Optional[int] = None
    n: Optional[int] = Field(None, ge=1, le=1)
    stream: Optional[bool] = None
    stream_options: Optional[dict] = None
    stop: Union[str, list[str], None] = None
    user: Optional[str] = None


class NipDpo(Strict):
    beta: float = Field(gt=0)
    learning_rate: float = Field(gt=0)
    max_prompt_length: Optional[int] = Field(None, ge=1)
    max_completion_length: Optional[int] = Field(None, ge=1)
    max_length: Optional[int] = Field(None, ge=1)


class NipLora(Strict):
    r: int = Field(ge=1)
    lora_alpha: int = Field(ge=1)
    lora_dropout: float = Field(ge=0, lt=1)


class NipConfig(Strict):
    model_name: str
    method: Literal["dpo"]
    dpo_config: NipDpo
    training_lora_config: Optional[NipLora] = None
    seed: int = 6198
    per_device_train_batch_size: int = Field(2, ge=1)
    model_already_lora_strategy: Literal["reuse", "stack"] = "reuse"
    mixed_precision: Literal["fp16", "bf16", "no"] = "fp16"
    gradient_checkpointing: bool = True


class NipCreate(Strict):
    config: NipConfig
    dataset: list[dict[str, Any]] = Field(min_length=1)
    job_name: Optional[str] = Field(None, pattern=SUFFIX.pattern)
    job_id_suffix: Optional[str] = Field(None, pattern=SUFFIX.pattern)


# ---------------------------------------------------------------------------------------------
# Chat: a base or a fine-tuned model loaded as `make chat` loads it, kept warm, one generation at a time.
# ---------------------------------------------------------------------------------------------


class Chat:
    """Models loaded on first use (torch is imported only then), the least recently used dropped beyond
    --warm_models."""

    def __init__(self, cfg: ServeConfig):
        self.cfg, self.loaded, self.lock = cfg, {}, threading.Lock()

    def model(self, name: str, run_dir: Path | None, base: str):
        if name in self.loaded:
            self.loaded[name] = self.loaded.pop(name)  # most recently used last
            return self.loaded[name]
        models.quiet_libraries(terminal=False)  # no weight-loading bars in the service's log
        if run_dir is not None:
            run_dir, config = runs.open_run(run_dir, run_dir.parent)
            pair = models.load_run(run_dir, config)
        else:
            from transformers import AutoTokenizer

            on_gpu, bf16_ok = models.device()
            path = models.resolve_model_path(base)
            model = models.load_model(path, models.LoadOptions(), on_gpu, bf16_ok).eval()
            if not on_gpu:
                models.dequantize_4bit_(model)
            pair = (model, AutoTokenizer.from_pretrained(path))
        while len(self.loaded) >= self.cfg.warm_models:
            self.loaded.pop(next(iter(self.loaded)))
        self.loaded[name] = pair
        return pair

    def generate(self, model, tokenizer, messages: list[dict], options: dict, streamer=None) -> tuple[str, int, int]:
        """(answer, prompt tokens, completion tokens): greedy at temperature 0, else sampled (seeded when asked)."""
        import torch

        text = models.prompt_texts(tokenizer, [messages])[0]
        batch = tokenizer([text], return_tensors="pt", add_special_tokens=not tokenizer.chat_template).to(model.device)
        if options.get("seed") is not None:
            torch.manual_seed(options["seed"])
        temperature = options.get("temperature", 1.0)
        sampling = {"do_sample": True, "temperature": temperature, "top_p": options.get("top_p", 1.0)} \
            if temperature and temperature > 0 else {"do_sample": False}
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=options["max_tokens"], streamer=streamer,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **sampling)
        completion = out[0, batch["input_ids"].shape[1]:]
        answer = tokenizer.decode(completion, skip_special_tokens=True).strip()
        return answer, int(batch["input_ids"].shape[1]), int(completion.shape[0])


# ---------------------------------------------------------------------------------------------
# The HTTP API (FastAPI): request shapes, the OpenAI routes, nip's routes.
# ---------------------------------------------------------------------------------------------


def create_app(cfg: ServeConfig):
    """The FastAPI application: the store, the scheduler thread (started and stopped with the app) and routes."""
    from fastapi import FastAPI, File, Form, Request, UploadFile
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    out = Path(cfg.output_dir)
    store = Store(out / "serve")
    chat = Chat(cfg)
    api_key = os.environ.get("DPO_KIT_API_KEY", "")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler = Scheduler(cfg, store)
        scheduler.start()
        print(f"[serve] http://{cfg.host}:{cfg.port}/v1 (jobs in {store.path}; runs in {out}/<job id>/)", flush=True)
        yield
        scheduler.stopping.set()
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, scheduler.stopped.wait)

    app = FastAPI(title="dpo-kit fine-tuning jobs", version=VERSION, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)

    # -- errors: OpenAI's shape, never a traceback ----------------------------------------------
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request, e: RequestValidationError):
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            message = f"malformed JSON in the request body: {err.get('ctx', {}).get('error', err['msg'])}"
            where = ""
        elif err.get("type") == "extra_forbidden":
            message = f"unknown field {where!r}"
        else:
            message = f"{where}: {err['msg']}" if where else err["msg"]
        return JSONResponse(ApiError(400, message, where or None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        message = "no such endpoint" if e.status_code == 404 else str(e.detail)
        return JSONResponse(ApiError(e.status_code, message).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        traceback.print_exc()
        return JSONResponse(ApiError(500, "internal error; the service's log has the details", kind="server_error")
                            .body(), status_code=500)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse(ApiError(401, "missing or wrong API key (Authorization: Bearer <DPO_KIT_API_KEY>)",
                                             code="invalid_api_key").body(), status_code=401)
        return await call_next(request)

    # -- lookups -----------------------------------------------------------------------------
    def job_or_404(job_id: str) -> dict:
        job = store.job(job_id)
        if job is None:
            raise ApiError(404, f"no fine-tuning job {job_id!r}", "fine_tuning_job_id", "job_not_found")
        return job

    def file_or_404(file_id: str, param: str = "file_id") -> dict:
        f = store.file(file_id)
        if f is None:
            raise ApiError(404 if param == "file_id" else 400, f"no file {file_id!r}", param, "file_not_found")
        return f

    def base_models() -> dict[str, str]:
        """Model names a request may use for a base -> the path or hub id train_dpo.py gets."""
        found = {BUNDLED_NAMES[0]: models.BUNDLED_MODEL_DIR, BUNDLED_NAMES[1]: models.BUNDLED_MODEL_DIR}
        models_dir = Path(cfg.models_dir) if Path(cfg.models_dir).is_absolute() else ROOT / cfg.models_dir
        for d in sorted(models_dir.glob("*/config.json")) if models_dir.is_dir() else []:
            found.setdefault(d.parent.name, str(d.parent))
        return found

    def resolve_model(name: str) -> tuple[str, str | None]:
        """(base for train_dpo.py, the run whose adapter a job continues from or None)."""
        parent = store.query("SELECT * FROM jobs WHERE fine_tuned_model = ?", name)
        if parent:
            if parent[0]["status"] != "succeeded":
                raise ApiError(400, f"model {name!r} is not ready: its job is {parent[0]['status']}", "model")
            return parent[0]["base"], parent[0]["id"]
        bases = base_models()
        if name in bases:
            return bases[name], None
        if name.startswith("random:") or (HUB_ID.match(name) and ".." not in name):
            return name, None
        raise ApiError(400, f"unknown model {name!r}: use {', '.join(bases)}, a hub id (org/name) or a fine-tuned "
                       "model of this service", "model", "model_not_found")

    def check_file(file_id: str, param: str) -> None:
        f = file_or_404(file_id, param)
        if f["purpose"] != "fine-tune":
            raise ApiError(400, f"file {file_id} has purpose {f['purpose']!r}, not 'fine-tune'", param)

    def new_job(api: str, model: str, training_file: str, validation_file: str | None, method: dict,
                hyper: dict, flags: list[str], suffix: str | None, seed: int, metadata, nip_config=None) -> dict:
        base, parent = resolve_model(model)
        check_file(training_file, "training_file")
        if validation_file:
            check_file(validation_file, "validation_file")
        job_id = new_id("ftjob")
        store.insert("jobs", {
            "id": job_id, "created_at": now(), "api": api, "status": "validating_files", "model": model,
            "base": base, "init_adapter": parent, "training_file": training_file, "validation_file": validation_file,
            "method": method, "hyperparameters": hyper, "flags": flags, "suffix": suffix, "seed": seed,
            "metadata": metadata, "nip_config": nip_config, "result_files": [],
            "fine_tuned_model": fine_tuned_name(model if not parent else model.split(":")[1], suffix, job_id)})
        store.event(job_id, f"Created fine-tuning job {job_id} on {model}" + (f" (continues {parent})" if parent else ""))
        return store.job(job_id)

    def job_view(job: dict) -> dict:
        t = job["method"]["type"]
        return {"object": "fine_tuning.job", "id": job["id"], "created_at": job["created_at"], "model": job["model"],
                "status": job["status"], "error": job["error"],
                "fine_tuned_model": job["fine_tuned_model"] if job["status"] == "succeeded" else None,
                "finished_at": job["finished_at"], "trained_tokens": job["trained_tokens"],
                "training_file": job["training_file"], "validation_file": job["validation_file"],
                "result_files": job["result_files"] or [], "seed": job["seed"], "metadata": job["metadata"],
                "hyperparameters": job["hyperparameters"], "organization_id": "org-dpo-kit", "integrations": [],
                "estimated_finish": None, "suffix": job["suffix"],
                "method": {"type": t, t: {"hyperparameters": job["hyperparameters"]}}}

    def nip_view(job: dict) -> dict:
        config = job["nip_config"] or {
            "model_name": job["model"], "method": "dpo",
            "dpo_config": {"beta": job["hyperparameters"].get("beta", kit_defaults()["beta"]),
                           "learning_rate": kit_defaults()["learning_rate"]
                           * job["hyperparameters"]["learning_rate_multiplier"]},
            "seed": job["seed"], "per_device_train_batch_size": job["hyperparameters"]["batch_size"]}
        message = (job["error"] or {}).get("message", "")
        return {"job_id": job["id"], "status": nip_status(job), "config": config,
                "new_model_name": job["fine_tuned_model"], "error_message": message}

    def request_stop(job: dict, kind: str) -> dict:
        """cancel / pause: a job with no process stops at once; a running one is signalled by the scheduler
        (its training saves a checkpoint at the end of the step)."""
        waiting = ("validating_files", "queued", "paused") if kind == "cancel" else ("validating_files", "queued")
        if store.move(job["id"], ("running",), stop_request=kind):
            store.event(job["id"], f"{kind.capitalize()} requested; the training saves a checkpoint and stops")
        elif store.move(job["id"], waiting, **({"status": "cancelled", "finished_at": now()} if kind == "cancel"
                                               else {"status": "paused"})):
            store.event(job["id"], "Job cancelled" if kind == "cancel" else "Job paused before it started")
        else:
            job = store.job(job["id"])
            raise ApiError(400, f"cannot {kind} a job that is {job['status']}", "fine_tuning_job_id")
        return store.job(job["id"])

    # -- files -------------------------------------------------------------------------------
    def file_view(f: dict) -> dict:
        return {"object": "file", "id": f["id"], "bytes": f["bytes"], "created_at": f["created_at"],
                "filename": f["filename"], "purpose": f["purpose"], "status": "processed", "expires_at": None,
                "status_details": None}

    limit_bytes = int(cfg.max_file_mb * 1e6)

    @app.middleware("http")
    async def upload_limit(request: Request, call_next):
        length = request.headers.get("content-length")
        if request.url.path == "/v1/files" and length and length.isdigit() and int(length) > limit_bytes + 65536:
            return JSONResponse(ApiError(413, f"the file is over the service's limit of {cfg.max_file_mb:g} MB "
                                         "(--max_file_mb)", "file", "file_too_large").body(), status_code=413)
        return await call_next(request)

    @app.post("/v1/files")
    def upload(file: UploadFile = File(...), purpose: str = Form(...)):
        if purpose != "fine-tune":
            raise ApiError(400, f"purpose must be 'fine-tune' (got {purpose!r})", "purpose")
        file_id = new_id("file")
        dest = store.files_dir / file_id
        tmp = dest.with_suffix(".tmp")
        size = 0
        with open(tmp, "wb") as f:
            while chunk := file.file.read(1 << 20):
                size += len(chunk)
                if size > limit_bytes:
                    f.close()
                    tmp.unlink()
                    raise ApiError(413, f"the file is over the service's limit of {cfg.max_file_mb:g} MB "
                                   "(--max_file_mb)", "file", "file_too_large")
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        name = Path(file.filename or "upload.jsonl").name[:255]
        return file_view(store.add_file(name, purpose, dest, size, file_id))

    @app.get("/v1/files")
    def list_files(purpose: Optional[str] = None, limit: int = 10000, after: Optional[str] = None):
        rows = store.query("SELECT * FROM files ORDER BY created_at DESC, id")
        rows = [f for f in rows if purpose in (None, f["purpose"])]
        return page([file_view(f) for f in rows], limit)

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str):
        return file_view(file_or_404(file_id))

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str):
        f = file_or_404(file_id)
        return FileResponse(f["path"], media_type="application/octet-stream", filename=f["filename"])

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str):
        f = file_or_404(file_id)
        users = store.query("SELECT id FROM jobs WHERE (training_file = ? OR validation_file = ?) AND status IN "
                            "('validating_files', 'queued', 'running', 'paused')", file_id, file_id)
        if users:
            raise ApiError(400, f"file {file_id} is in use by job {users[0]['id']} (it resumes from it)", "file_id")
        store.execute("DELETE FROM files WHERE id = ?", file_id)
        if f["purpose"] == "fine-tune":  # result files belong to their run directory
            Path(f["path"]).unlink(missing_ok=True)
        return {"object": "file", "id": file_id, "deleted": True}

    # -- fine-tuning jobs ----------------------------------------------------------------------
    @app.post("/v1/fine_tuning/jobs")
    def create_job(body: JobCreate):
        method = body.method.model_dump() if body.method else {"type": "dpo"}
        t = method["type"]
        given = (method.get(t) or {}).get("hyperparameters") or (body.hyperparameters.model_dump()
                                                                 if body.hyperparameters else {})
        hyper = resolved_hyperparameters(t, given)
        flags = hyperparameter_flags(t, given) + (["--seed", str(body.seed)] if body.seed is not None else [])
        seed = body.seed if body.seed is not None else 42
        return job_view(new_job("openai", body.model, body.training_file, body.validation_file, {"type": t}, hyper,
                                flags, body.suffix, seed, body.metadata))

    @app.get("/v1/fine_tuning/jobs")
    def list_jobs(after: Optional[str] = None, limit: int = 20):
        limit = max(1, min(limit, 100))
        cursor = store.job(after)["seq"] if after and store.job(after) else None
        rows = store.query("SELECT * FROM jobs WHERE (? IS NULL OR seq < ?) ORDER BY seq DESC LIMIT ?",
                           cursor, cursor, limit + 1)
        return page([job_view(j) for j in rows], limit)

    @app.get("/v1/fine_tuning/jobs/{job_id}")
    def get_job(job_id: str):
        return job_view(job_or_404(job_id))

    @app.post("/v1/fine_tuning/jobs/{job_id}/cancel")
    def cancel_job(job_id: str):
        return job_view(request_stop(job_or_404(job_id), "cancel"))

    @app.post("/v1/fine_tuning/jobs/{job_id}/pause")
    def pause_job(job_id: str):
        return job_view(request_stop(job_or_404(job_id), "pause"))

    @app.post("/v1/fine_tuning/jobs/{job_id}/resume")
    def resume_job(job_id: str):
        job = job_or_404(job_id)
        if job["status"] != "paused":
            raise ApiError(400, f"only a paused job resumes; this one is {job['status']}", "fine_tuning_job_id")
        if not store.move(job_id, ("paused",), status="queued" if job["data"] else "validating_files"):
            raise ApiError(400, "the job is no longer paused", "fine_tuning_job_id")
        store.event(job_id, "Job resumed; it continues from its checkpoint")
        return job_view(store.job(job_id))

    @app.get("/v1/fine_tuning/jobs/{job_id}/events")
    def list_events(job_id: str, after: Optional[str] = None, limit: int = 20):
        job_or_404(job_id)
        limit = max(1, min(limit, 10000))
        cursor = store.query("SELECT seq FROM events WHERE id = ?", after) if after else []
        rows = store.query("SELECT * FROM events WHERE job_id = ? AND (? IS NULL OR seq < ?) ORDER BY seq DESC "
                           "LIMIT ?", job_id, *(2 * [cursor[0]["seq"] if cursor else None]), limit + 1)
        return page([{"object": "fine_tuning.job.event", "id": e["id"], "created_at": e["created_at"],
                      "level": e["level"], "message": e["message"], "type": e["type"],
                      "data": json.loads(e["data"]) if e["data"] else {}} for e in rows], limit)

    @app.get("/v1/fine_tuning/jobs/{job_id}/checkpoints")
    def list_checkpoints(job_id: str, after: Optional[str] = None, limit: int = 10):
        """The final adapter of a succeeded job; the saved checkpoints of one still in progress (or cancelled)."""
        job = job_or_404(job_id)
        run = runs.Run(out, job_id)
        metrics = {r["step"]: r for r in run.metrics() if "loss" in r}
        if job["status"] == "succeeded":
            steps = [runs.read_json(run.final / "manifest.json").get("steps", 0)]
        else:
            steps = sorted((int(p.name.split("-")[1]) for p in run.checkpoints.glob("checkpoint-*")
                            if p.name.split("-")[1].isdigit()), reverse=True)
        rows = [{"object": "fine_tuning.job.checkpoint", "id": f"ftckpt-{job_id.split('-', 1)[1]}-{s}",
                 "created_at": job["finished_at"] or now(), "fine_tuning_job_id": job_id, "step_number": s,
                 "fine_tuned_model_checkpoint": f"{job['fine_tuned_model']}:ckpt-step-{s}",
                 "metrics": {"step": s, "train_loss": metrics.get(s, {}).get("loss"),
                             "valid_loss": metrics.get(s, {}).get("eval_loss")}} for s in steps]
        if after:
            ids = [r["id"] for r in rows]
            rows = rows[ids.index(after) + 1:] if after in ids else rows
        return page(rows, max(1, limit))

    # -- models and chat -----------------------------------------------------------------------
    @app.get("/v1/models")
    def list_models():
        bases = [{"object": "model", "id": name, "created": 0, "owned_by": "dpo-kit"} for name in base_models()]
        tuned = [{"object": "model", "id": j["fine_tuned_model"], "created": j["finished_at"], "owned_by": "user"}
                 for j in store.query("SELECT * FROM jobs WHERE status = 'succeeded' ORDER BY seq")]
        return {"object": "list", "data": bases + tuned}

    @app.post("/v1/chat/completions")
    def chat_completions(body: ChatRequest):
        job = store.query("SELECT * FROM jobs WHERE fine_tuned_model = ? AND status = 'succeeded'", body.model)
        bases = base_models()
        if not job and body.model not in bases:
            raise ApiError(404, f"model {body.model!r} does not exist here (GET /v1/models lists them)", "model",
                           "model_not_found")
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.content if isinstance(m.content, str) else
                     "".join(p.get("text", "") for p in m.content or [] if isinstance(p, dict))}
                    for m in body.messages]
        options = {"max_tokens": body.max_completion_tokens or body.max_tokens or 128,
                   "temperature": 1.0 if body.temperature is None else body.temperature,
                   "top_p": body.top_p or 1.0, "seed": body.seed}
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        completion_id, created = new_id("chatcmpl"), now()
        with chat.lock:  # loading is slow: one at a time, and each model once
            model, tokenizer = chat.model(body.model, out / job[0]["id"] if job else None,
                                          job[0]["base"] if job else bases[body.model])

        def cut(text: str) -> tuple[str, bool]:
            hits = [text.index(s) for s in stops if s and s in text]
            return (text[:min(hits)], True) if hits else (text, False)

        def chunk(delta: dict, finish=None) -> str:
            return "data: " + json.dumps({"object": "chat.completion.chunk", "id": completion_id, "created": created,
                                          "model": body.model, "choices": [{"index": 0, "delta": delta,
                                                                           "finish_reason": finish}]}) + "\n\n"

        if body.stream:
            from transformers import TextIteratorStreamer

            def events():
                with chat.lock:
                    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
                    result = {}
                    worker = threading.Thread(target=lambda: result.update(zip(
                        ("text", "prompt", "completion"), chat.generate(model, tokenizer, messages, options, streamer))))
                    worker.start()
                    yield chunk({"role": "assistant", "content": ""})
                    sent, stopped = "", False
                    for piece in streamer:
                        if stopped:
                            continue
                        text, stopped = cut(sent + piece)
                        if text[len(sent):]:
                            yield chunk({"content": text[len(sent):]})
                        sent = text
                    worker.join()
                finish = "stop" if stopped or result.get("completion", 0) < options["max_tokens"] else "length"
                yield chunk({}, finish)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        with chat.lock:
            text, n_prompt, n_completion = chat.generate(model, tokenizer, messages, options)
        text, stopped = cut(text)
        return {"object": "chat.completion", "id": completion_id, "created": created, "model": body.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "stop" if stopped or n_completion < options["max_tokens"] else "length",
                             "logprobs": None}],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                          "total_tokens": n_prompt + n_completion}}

    # -- nip's language-model-server API (nip/language_model_server/types.py's shapes) ---------------
    @app.get("/version")
    def version():
        return {"version": VERSION}

    @app.post("/training/jobs")
    def nip_create(body: NipCreate):
        config = body.config
        if config.model_already_lora_strategy == "stack":
            raise ApiError(400, "model_already_lora_strategy 'stack' is not supported: a fine-tuned model "
                           "continues its own adapter ('reuse')", "config.model_already_lora_strategy")
        name = body.job_name or body.job_id_suffix
        file_id = new_id("file")
        dest = store.files_dir / file_id
        kit.atomic_write_text(dest, "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in body.dataset))
        store.add_file(f"{name or 'dataset'}.jsonl", "fine-tune", dest, dest.stat().st_size, file_id)
        lr_multiplier = config.dpo_config.learning_rate / kit_defaults()["learning_rate"]
        hyper = {"beta": config.dpo_config.beta, "batch_size": config.per_device_train_batch_size,
                 "n_epochs": kit_defaults()["n_epochs"], "learning_rate_multiplier": lr_multiplier}
        job = new_job("nip", config.model_name, file_id, None, {"type": "dpo"}, hyper,
                      nip_flags(config.model_dump()), name, config.seed, None, config.model_dump())
        return nip_view(job)

    @app.get("/training/jobs")
    def nip_list():
        return [nip_view(j) for j in store.query("SELECT * FROM jobs ORDER BY seq")]

    @app.get("/training/jobs/{job_id}")
    def nip_get(job_id: str):
        return nip_view(job_or_404(job_id))

    @app.delete("/training/jobs/{job_id}")
    def nip_cancel(job_id: str):
        job = job_or_404(job_id)
        return nip_view(job if job["status"] in TERMINAL else request_stop(job, "cancel"))

    return app


def main(argv=None) -> int:
    cfg = kit.parse_config(ServeConfig, argv, __doc__)
    import uvicorn

    # Jobs run train_dpo.py from the kit's directory (the bundled model's path is relative to it): so does this.
    cfg = dataclasses.replace(cfg, output_dir=os.path.abspath(cfg.output_dir), models_dir=os.path.abspath(
        cfg.models_dir) if os.path.isabs(cfg.models_dir) or os.path.isdir(cfg.models_dir) else cfg.models_dir)
    os.chdir(ROOT)

    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
