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
import secrets
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

import kit
import models
import runs
from kit import UserError, field

ROOT = Path(__file__).resolve().parent
VERSION = "1.0.0"  # nip's client compares major versions with its own
LOOPBACK = ("127.0.0.1", "localhost", "::1")
TERMINAL = ("succeeded", "failed", "cancelled")
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


def new_id(prefix: str) -> str:
    """A random id (96 bits): nothing about one id tells another."""
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


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


def user_error_message(e: UserError, filename: str) -> str:
    """A validation error naming the client's file and line, never the service's path."""
    return f"{filename}:{e.line}: {e.message}" if e.line else f"{filename}: {e.message}"


def input_kind(path: str | os.PathLike) -> str:
    """What a training file holds, by its first record: 'run_log' (build_pairs.py's input: a strategy and its
    attempts), 'sft' (messages ending with the assistant's answer) or 'pairs' (any pair format)."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    first = json.loads(raw)
                except ValueError:
                    return "pairs"  # formats.load_pairs reports the line
                if isinstance(first, dict) and "attempts" in first and "strategy" in first:
                    return "run_log"
                if isinstance(first, dict) and set(first) <= {"messages", "tools", "parallel_tool_calls"}:
                    return "sft"
                return "pairs"
    return "pairs"


def train_command(cfg: ServeConfig, flags: list[str], python: str = sys.executable) -> list[str]:
    """The process a job runs: train_dpo.py here, scaleout.py (accelerate) for several GPUs, launcher.py for
    the kit's container. flags: train_dpo.py's, with --data, --output_dir and --run_name."""
    if cfg.runner == "docker":
        args = dict(zip(flags[::2], flags[1::2]))  # the three the launcher takes itself come first in flags
        rest = flags[6:]
        return [python, str(ROOT / "launcher.py"), "train", "--data", args["--data"], "--output_dir",
                args["--output_dir"], "--run_name", args["--run_name"], *(["--gpus", cfg.gpus] if cfg.gpus else []),
                "--", *rest]
    if cfg.gpus and cfg.gpus not in ("all", "1"):
        return [python, str(ROOT / "scaleout.py"), "--gpus", cfg.gpus, "--", *flags]
    return [python, str(ROOT / "train_dpo.py"), *flags]


def job_flags(cfg: ServeConfig, job: dict) -> list[str]:
    """train_dpo.py's flags for a job: where its data and run are, the service's --train_args, then the job's
    base, parent adapter (a fine-tuned model continues from its adapter) and hyperparameters."""
    import shlex

    parent = job["init_adapter"] and (f"/artifacts/{job['init_adapter']}" if cfg.runner == "docker"
                                      else str(Path(cfg.output_dir) / job["init_adapter"]))
    return ["--data", job["data"], "--output_dir", cfg.output_dir, "--run_name", job["id"], *shlex.split(cfg.train_args),
            "--model_name_or_path", job["base"], *(["--init_adapter", parent] if parent else []), *job["flags"]]


def metrics_event(row: dict) -> tuple[str, dict]:
    """A metrics.jsonl row as an OpenAI metrics event: its message and data."""
    data = {"step": row["step"], "epoch": row.get("epoch")}
    names = {"loss": "train_loss", "rewards/margins": "train_reward_margin",
             "rewards/accuracies": "train_reward_accuracy", "eval_loss": "valid_loss",
             "eval_rewards/margins": "valid_reward_margin", "eval_rewards/accuracies": "valid_reward_accuracy",
             "num_tokens": "trained_tokens", "learning_rate": "learning_rate"}
    data |= {new: row[old] for old, new in names.items() if isinstance(row.get(old), (int, float))}
    words = [f"{k}={data[k]:.4g}" for k in ("train_loss", "train_reward_margin", "train_reward_accuracy",
                                           "valid_loss") if k in data]
    return f"Step {row['step']}: {', '.join(words)}", data


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
# The store: files, jobs and events in one SQLite file (WAL: readers never wait on the writer).
# ---------------------------------------------------------------------------------------------

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, bytes INTEGER, created_at INTEGER, filename TEXT,
    purpose TEXT, path TEXT);
CREATE TABLE IF NOT EXISTS jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, created_at INTEGER,
    api TEXT, status TEXT, model TEXT, base TEXT, init_adapter TEXT, training_file TEXT, validation_file TEXT,
    method TEXT, hyperparameters TEXT, flags TEXT, suffix TEXT, seed INTEGER, metadata TEXT, nip_config TEXT,
    fine_tuned_model TEXT, finished_at INTEGER, trained_tokens INTEGER, error TEXT, result_files TEXT,
    data TEXT, pid INTEGER, stop_request TEXT, metrics_step INTEGER DEFAULT 0, waiting_on INTEGER);
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, job_id TEXT,
    created_at INTEGER, level TEXT, message TEXT, type TEXT, data TEXT);
CREATE INDEX IF NOT EXISTS events_job ON events (job_id, seq);
"""
JSON_COLUMNS = ("method", "hyperparameters", "flags", "metadata", "nip_config", "error", "result_files")


class Store:
    """The service's state. One connection per call (sqlite3 connections are cheap and not shared between
    threads); autocommit, so each statement is its own transaction."""

    def __init__(self, root: Path):
        self.root = root
        self.files_dir = root / "files"
        self.jobs_dir = root / "jobs"
        for d in (self.files_dir, self.jobs_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.path = root / "serve.db"
        with self.connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)

    @contextlib.contextmanager
    def connect(self):
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.row_factory = sqlite3.Row
        try:
            yield db
        finally:
            db.close()

    def query(self, sql: str, *args) -> list[dict]:
        with self.connect() as db:
            return [self._row(r) for r in db.execute(sql, args).fetchall()]

    def execute(self, sql: str, *args) -> None:
        with self.connect() as db:
            db.execute(sql, args)

    @staticmethod
    def _row(row) -> dict:
        d = dict(row)
        for k in JSON_COLUMNS:
            if k in d and d[k] is not None:
                d[k] = json.loads(d[k])
        return d

    def insert(self, table: str, values: dict) -> None:
        values = {k: json.dumps(v) if k in JSON_COLUMNS and v is not None else v for k, v in values.items()}
        self.execute(f"INSERT INTO {table} ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
                     *values.values())

    def update_job(self, job_id: str, **values) -> None:
        values = {k: json.dumps(v) if k in JSON_COLUMNS and v is not None else v for k, v in values.items()}
        self.execute(f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in values)} WHERE id = ?", *values.values(), job_id)

    def move(self, job_id: str, from_statuses: tuple, **values) -> bool:
        """update_job only while the job is still in one of from_statuses (a cancel that came in between wins)."""
        values = {k: json.dumps(v) if k in JSON_COLUMNS and v is not None else v for k, v in values.items()}
        with self.connect() as db:
            cursor = db.execute(f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in values)} WHERE id = ? AND status IN "
                                f"({', '.join('?' * len(from_statuses))})", (*values.values(), job_id, *from_statuses))
            return cursor.rowcount == 1

    def job(self, job_id: str) -> dict | None:
        rows = self.query("SELECT * FROM jobs WHERE id = ?", job_id)
        return rows[0] if rows else None

    def file(self, file_id: str) -> dict | None:
        rows = self.query("SELECT * FROM files WHERE id = ?", file_id)
        return rows[0] if rows else None

    def event(self, job_id: str, message: str, level: str = "info", kind: str = "message", data=None) -> None:
        self.insert("events", {"id": new_id("ftevent"), "job_id": job_id, "created_at": now(), "level": level,
                               "message": message, "type": kind, "data": json.dumps(data) if data is not None else None})

    def add_file(self, filename: str, purpose: str, path: Path, size: int, file_id: str | None = None) -> dict:
        row = {"id": file_id or new_id("file"), "bytes": size, "created_at": now(), "filename": filename,
               "purpose": purpose, "path": str(path)}
        self.insert("files", row)
        return row


# ---------------------------------------------------------------------------------------------
# The scheduler: validates files, starts trainings as processes, follows their metrics, reaps them.
# ---------------------------------------------------------------------------------------------


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The training gets SIGTERM when the service dies, even by kill -9: it saves a checkpoint and stops, and
    the service, started again, resumes it (Linux; elsewhere the training runs on to its end)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Scheduler(threading.Thread):
    """One thread owns every training process (it started them: PR_SET_PDEATHSIG follows the thread that forks).
    HTTP handlers only write requests into the store (stop_request); this thread acts on them."""

    def __init__(self, cfg: ServeConfig, store: Store):
        super().__init__(name="scheduler", daemon=True)
        self.cfg, self.store = cfg, store
        self.out = Path(cfg.output_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping = threading.Event()
        self.stopped = threading.Event()
        self.recover()

    def recover(self) -> None:
        """After a restart (however the last service ended), a job marked running has no process here: it goes
        back to the queue and resumes from its checkpoint; a stop asked for before the restart is honoured."""
        for job in self.store.query("SELECT * FROM jobs WHERE status = 'running'"):
            stop = job["stop_request"]
            status = {"cancel": "cancelled", "pause": "paused"}.get(stop, "queued")
            self.store.update_job(job["id"], status=status, pid=None, stop_request=None,
                                  finished_at=now() if status == "cancelled" else None)
            self.store.event(job["id"], "The service restarted: the job resumes from its last checkpoint"
                             if status == "queued" else f"The service restarted: job {status}")

    def run(self) -> None:
        while not self.stopping.wait(self.cfg.poll_seconds):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the scheduler must outlive any one job's surprise
                traceback.print_exc()
        self.stop_all()
        self.stopped.set()

    def tick(self) -> None:
        for job in self.store.query("SELECT * FROM jobs WHERE status = 'validating_files' ORDER BY seq"):
            self.validate(job)
        for job_id, proc in list(self.procs.items()):
            job = self.store.job(job_id)
            self.follow_metrics(job)
            if proc.poll() is not None:
                self.reap(job, proc.returncode)
            elif job["stop_request"] and not getattr(proc, "signalled", False):
                proc.send_signal(signal.SIGTERM)  # train_dpo.py saves a checkpoint at the end of the step
                proc.signalled = True
        for job in self.store.query("SELECT * FROM jobs WHERE status = 'queued' ORDER BY seq"):
            if len(self.procs) >= self.cfg.max_jobs or not self.launch(job):
                break  # first come, first trained: a job waiting on its lock keeps its place

    # -- validation: the whole file checked before the job is queued ------------------------------------
    def validate(self, job: dict) -> None:
        try:
            data = self.prepare_data(job)
        except UserError as e:
            param = getattr(e, "param", "training_file")
            self.fail(job, "invalid_file", user_error_message(e, getattr(e, "filename", "training_file")), param)
            return
        if self.store.move(job["id"], ("validating_files",), status="queued", data=data):
            self.store.event(job["id"], "Files validated; the job is queued")

    def prepare_data(self, job: dict) -> str:
        """The training file validated in full (pairs), turned into pairs by the retraining rules (run logs) or
        into SFT pairs (method supervised); the validation file checked too. Returns the pairs file to train on."""
        import formats

        work = self.store.jobs_dir / job["id"]
        work.mkdir(parents=True, exist_ok=True)
        for param in ("training_file", "validation_file"):
            if not job[param]:
                continue
            f = self.store.file(job[param])
            if f is None:
                raise _with(UserError("the file was deleted before the job started"), param, job[param])
            try:
                if param == "validation_file":
                    formats.load_pairs(f["path"])
                    self.store.event(job["id"], "validation_file checked; the kit evaluates on a held-out share "
                                     "of the training pairs (--eval_fraction), not on this file", level="warn")
                    continue
                data = self.training_pairs(job, f, work)
            except UserError as e:
                raise _with(e, param, f["filename"]) from None
        return data

    def training_pairs(self, job: dict, f: dict, work: Path) -> str:
        import formats

        kind = input_kind(f["path"])
        if job["method"]["type"] == "supervised":
            import iterate
            import self_pairs

            examples = self_pairs.read_examples(f["path"], need_answer=True)
            records = iterate.sft_pairs(examples, 0)
            out = work / "train.pairs.jsonl"
            kit.atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            self.store.event(job["id"], f"{len(records)} SFT examples read from {f['filename']}")
            return str(out)
        if kind == "run_log":
            return self.pairs_from_runs(job, f, work)
        _, stats = formats.load_pairs(f["path"])
        self.store.event(job["id"], f"{stats['pairs']} pairs in {f['filename']} (format {stats['format']})",
                         data={"pairs": stats["pairs"], "format": stats["format"]})
        return f["path"]

    def pairs_from_runs(self, job: dict, f: dict, work: Path) -> str:
        """An agent's raw run logs -> pairs by the retraining rules (build_pairs.py), with what was kept and
        dropped as an event."""
        import io

        import build_pairs

        out, report = work / "train.pairs.jsonl", work / "pairs.report.json"
        log = io.StringIO()
        with contextlib.redirect_stderr(log), contextlib.redirect_stdout(log):
            status = build_pairs.main([f["path"], "-o", str(out), "--report", str(report), "--workers", "1"])
        if status != 0:
            raise UserError("no usable run in the file (nothing succeeded, or nothing to pair)")
        s = json.loads(report.read_text())
        self.store.event(job["id"], f"{s['runs_read']} runs read from {f['filename']}: {s['pairs_written']} pairs "
                         f"({', '.join(f'{k} {v}' for k, v in s['pairs_by_rule'].items())}); dropped: "
                         f"{', '.join(f'{k} {v}' for k, v in s['runs_dropped'].items())}, "
                         f"{s['duplicates_removed']} duplicate pairs",
                         data={k: s[k] for k in ("runs_read", "runs_by_outcome", "runs_dropped", "pairs_written",
                                                 "pairs_by_rule", "duplicates_removed")})
        return str(out)

    # -- processes --------------------------------------------------------------------------------
    def launch(self, job: dict) -> bool:
        """Start the job's training; False when a process (the last service's training, still saving) holds the
        run's lock."""
        holder = runs.lock_holder(self.out, job["id"])
        if holder is not None:  # an earlier training of this run (the last service's) is still saving
            if job["waiting_on"] != holder:
                self.store.update_job(job["id"], waiting_on=holder)
                self.store.event(job["id"], f"Waiting for pid {holder}, which holds the run's lock")
            return False
        if not self.store.move(job["id"], ("queued",), status="running", waiting_on=None):
            return True  # cancelled or paused a moment ago
        last = runs.last_checkpoint(runs.Run(self.out, job["id"]).checkpoints)
        command = train_command(self.cfg, job_flags(self.cfg, job))
        log = open(self.store.jobs_dir / job["id"] / "train.log", "ab")
        log.write(f"\n[serve] {' '.join(command)}\n".encode())
        log.flush()
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        self.procs[job["id"]] = proc
        self.store.update_job(job["id"], pid=proc.pid)
        self.store.event(job["id"], f"Resuming from {last.name}" if last else "Fine-tuning job started",
                         data={"pid": proc.pid})
        return True

    def follow_metrics(self, job: dict) -> None:
        """New metrics.jsonl rows (steps not yet reported) as metrics events."""
        run = runs.Run(self.out, job["id"])
        rows = runs.read_metrics(run.partial if run.partial.exists() else run.final)
        seen = job["metrics_step"] or 0
        for row in rows:
            if row["step"] > seen and "train_runtime" not in row and "loss" in row:
                message, data = metrics_event(row)
                self.store.event(job["id"], message, kind="metrics", data=data)
                seen = row["step"]
        if seen != job["metrics_step"]:
            self.store.update_job(job["id"], metrics_step=seen)

    def reap(self, job: dict, rc: int) -> None:
        """The process ended: succeeded (the run is complete), or stopped as asked (cancel, pause, the service
        stopping), or failed with the run's own error."""
        del self.procs[job["id"]]
        run = runs.Run(self.out, job["id"])
        status = runs.read_json((run.final if run.final.exists() else run.partial) / "status.json")
        stop = job["stop_request"]
        self.store.update_job(job["id"], pid=None, stop_request=None)
        if rc == 0 and run.final.exists():
            return self.succeed(job, run)
        step = status.get("step")
        if stop == "cancel":
            self.store.update_job(job["id"], status="cancelled", finished_at=now())
            self.store.event(job["id"], f"Job cancelled; its checkpoint (step {step}) is kept")
        elif stop == "pause":
            self.store.update_job(job["id"], status="paused")
            self.store.event(job["id"], f"Job paused at step {step}; resume continues from its checkpoint")
        elif stop == "shutdown":
            self.store.update_job(job["id"], status="queued")
            self.store.event(job["id"], f"The service is stopping: checkpoint at step {step}; the job resumes "
                             "when the service starts again")
        elif rc == kit.EXIT_USAGE and "is in use by pid" in str(status.get("error", "")) + self.log_tail(job):
            self.store.update_job(job["id"], status="queued")  # another process holds the run: try again later
        else:
            message = status.get("error") or self.log_tail(job) or f"training exited with status {rc}"
            self.fail(job, "training_failed" if rc != kit.EXIT_USAGE else "invalid_training_options", message)

    def succeed(self, job: dict, run: runs.Run) -> None:
        metrics = runs.read_metrics(run.final)
        tokens = max((int(r["num_tokens"]) for r in metrics if isinstance(r.get("num_tokens"), (int, float))),
                     default=None)
        results = [self.store.add_file(f"{job['id']}-{name}", "fine-tune-results", path, path.stat().st_size)["id"]
                   for name, path in (("metrics.jsonl", run.final / "metrics.jsonl"), ("adapter.tar.gz", run.tarball))
                   if path.exists()]
        self.store.update_job(job["id"], status="succeeded", finished_at=now(), trained_tokens=tokens,
                              fine_tuned_model=job["fine_tuned_model"], result_files=results)
        self.store.event(job["id"], f"The job has successfully completed: {job['fine_tuned_model']}")

    def fail(self, job: dict, code: str, message: str, param: str | None = None) -> None:
        self.store.update_job(job["id"], status="failed", finished_at=now(),
                              error={"code": code, "message": message, "param": param})
        self.store.event(job["id"], f"Job failed: {message}", level="error")

    def log_tail(self, job: dict, lines: int = 3) -> str:
        path = self.store.jobs_dir / job["id"] / "train.log"
        text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
        return "\n".join(text[-lines:])

    def stop_all(self) -> None:
        """The service is stopping: every training saves a checkpoint and stops; its job goes back to the queue."""
        for job_id, proc in self.procs.items():
            self.store.update_job(job_id, stop_request="shutdown")
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.time() + self.cfg.shutdown_seconds
        for job_id, proc in list(self.procs.items()):
            try:
                proc.wait(timeout=max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            job = self.store.job(job_id)
            self.follow_metrics(job)
            self.reap(job, proc.returncode)


def _with(e: UserError, param: str, filename: str) -> UserError:
    e.param, e.filename = param, filename
    return e


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
