"""nip's language-model-server API for the jobs service (service.py assembles it), in the shapes of nip's own
client (nip/language_model_server/client.py and types.py): /version, /training/jobs, and /vllm/start, /vllm/stop,
/vllm/status, which serve the model a job made.

Serving: where the service's engine (engine.py: vLLM, or --engine_url) serves the model, /vllm/start reports it
online at the service's own port, which forwards to it. Else, where vLLM is installed (`vllm` on PATH) and a GPU is
there, /vllm/start runs `vllm serve` on the base
with the job's adapter loaded at start-up (LoRA), on --vllm_port, and reports `online` once its /health
answers. Elsewhere the service loads the model into its own /v1/chat/completions (the port reported is the
service's) and reports `online` once it is loaded. Either way nip's agents then chat through an OpenAI client
at http://<host>:<port>/v1 with the model name they started."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from typing import Any, Literal, Optional

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from dpokit.core import kit
from dpokit.service import api_openai
from dpokit.service.engine import has_gpu
from dpokit.service.jobs import TERMINAL, new_id, public_status
from dpokit.service.service import ApiError, Svc

VLLM_STATUSES = ("online", "not_started", "crashed", "not_accepting_connections", "timeout", "server_error",
                 "other_error")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NipDpo(Strict):
    beta: float = Field(gt=0, allow_inf_nan=False)
    learning_rate: float = Field(gt=0, lt=1, allow_inf_nan=False)
    max_prompt_length: Optional[int] = Field(None, ge=1, le=1_000_000)
    max_completion_length: Optional[int] = Field(None, ge=1, le=1_000_000)
    max_length: Optional[int] = Field(None, ge=1, le=1_000_000)


class NipLora(Strict):
    r: int = Field(ge=1, le=4096)
    lora_alpha: int = Field(ge=1, le=1_000_000)
    lora_dropout: float = Field(ge=0, lt=1)


class NipConfig(Strict):
    model_name: str = Field(min_length=1)
    method: Literal["dpo"]
    dpo_config: NipDpo
    training_lora_config: Optional[NipLora] = None
    seed: int = Field(6198, ge=0, le=2 ** 32 - 1)
    per_device_train_batch_size: int = Field(2, ge=1, le=10_000)
    model_already_lora_strategy: Literal["reuse", "stack"] = "reuse"
    mixed_precision: Literal["fp16", "bf16", "no"] = "fp16"
    gradient_checkpointing: bool = True


class NipCreate(Strict):
    config: NipConfig
    dataset: list[dict[str, Any]] = Field(min_length=1)
    job_name: Optional[str] = Field(None, max_length=1000)  # nip's versions name it either way, free text
    job_id_suffix: Optional[str] = Field(None, max_length=1000)


class VllmStart(BaseModel):
    model_name: str = Field(min_length=1)


class VllmStop(BaseModel):
    ignore_not_running: bool = False
    terminate_timeout: float = Field(10.0, ge=0, le=600)


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


def job_suffix(name: str | None) -> str | None:
    """nip's free-text job name as the fine-tuned model's suffix (OpenAI's charset, at most 64 characters)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", name or "").strip("-")[:64] or None


def nip_status(job: dict) -> str:
    """nip's TrainingJobStatus for a job record: pending before its process starts, starting until its first
    logged step, then running; failed is crashed; paused is interrupted."""
    status = public_status(job)
    if status in ("validating_files", "queued"):
        return "pending"
    if status == "running":
        return "running" if job["metrics_step"] else "starting"
    return {"failed": "crashed", "paused": "interrupted"}.get(status, status)


def vllm_command(vllm: str, base: str, name: str, adapter_dir: str | None, host: str, port: int) -> list[str]:
    """`vllm serve` for a base model and, for a fine-tuned one, its adapter as a LoRA module named as the job's
    model (what nip's agents then ask for); the served name of a base is the name nip started."""
    cmd = [vllm, "serve", base, "--host", host, "--port", str(port)]
    if adapter_dir:
        return cmd + ["--enable-lora", "--lora-modules", json.dumps({"name": name, "path": adapter_dir}),
                      "--max-lora-rank", "64"]
    return cmd + ["--served-model-name", name]


class Serving:
    """The one model nip asked to serve: a `vllm serve` process, or the service's own chat completions."""

    def __init__(self, svc):
        self.svc, self.lock = svc, threading.Lock()
        self.name = self.process = self.thread = None
        self.status, self.error, self.port = "not_started", None, svc.cfg.port

    def start(self, name: str) -> dict:
        job = self.svc.tuned_job(name)
        base_path = job["base"] if job else self.svc.base_path(name)
        if base_path is None:
            raise ApiError(400, f"model_name {name!r} is neither a base nor a fine-tuned model of this service "
                           "(GET /v1/models lists them)", "model_name", "model_not_found")
        engine = self.svc.engine_target(name)  # the service's engine serves it: no second server on the GPU
        with self.lock:
            if self.name == name and self.status in ("online", "not_accepting_connections"):
                return {"message": f"{name} is already being served", "model_name": name, "port": self.port}
            self._stop_locked(10.0)
            if engine is not None:
                self.name, self.status = name, "online"
                return {"message": f"{name} is served by the service's engine ({self.svc.engine.url}) through this "
                        "service's /v1", "model_name": name, "port": self.port}
            self.name, self.status, self.error = name, "not_accepting_connections", None
            vllm = shutil.which("vllm")
            if vllm and self.svc.cfg.vllm_port and has_gpu():
                base = base_path
                adapter = str(self.svc.out / job["id"]) if job else None
                self.port = self.svc.cfg.vllm_port
                log = open(self.svc.out / "serve" / "vllm.log", "ab")
                self.process = subprocess.Popen(vllm_command(vllm, base, name, adapter, "127.0.0.1", self.port),
                                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                how = f"vllm serve on port {self.port}"
            else:
                self.port = self.svc.cfg.port
                self.thread = threading.Thread(target=self._load, args=(name,), daemon=True)
                self.thread.start()
                how = "the service's own /v1/chat/completions (vLLM is not installed here)"
        return {"message": f"Starting {name}: {how}", "model_name": name, "port": self.port}

    def _load(self, name: str) -> None:
        try:
            self.svc.chat.load(self.svc, name)
            with self.lock:
                if self.name == name:
                    self.status = "online"
        except Exception as e:  # noqa: BLE001 - reported through /vllm/status, as nip reads a crash
            with self.lock:
                if self.name == name:
                    self.status, self.error = "crashed", f"{type(e).__name__}: {e}"

    def state(self) -> dict:
        with self.lock:
            if self.process is not None and self.status != "not_started":
                rc = self.process.poll()
                if rc is not None:
                    self.status, self.error = "crashed", f"vllm serve exited with {rc} (see serve/vllm.log)"
                elif self.status != "online" and _answers(f"http://127.0.0.1:{self.port}/health"):
                    self.status = "online"
            return {"status": self.status, "error": self.error if self.status != "online" else None}

    def stop(self, timeout: float = 10.0, ignore_not_running: bool = True) -> dict:
        with self.lock:
            if self.status == "not_started":
                if not ignore_not_running:
                    raise ApiError(400, "no model is being served (ignore_not_running: true to ignore)",
                                   "ignore_not_running", "not_running")
                return {"message": "no model was being served"}
            name = self.name
            self._stop_locked(timeout)
        return {"message": f"stopped serving {name}"}

    def _stop_locked(self, timeout: float) -> None:
        if self.process is not None:
            _stop_group(self.process, timeout)
        self.process, self.thread, self.name = None, None, None
        self.status, self.error, self.port = "not_started", None, self.svc.cfg.port


def _stop_group(process, timeout: float) -> None:
    """SIGTERM to the vLLM server's process group, SIGKILL after timeout."""
    import os
    import signal

    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# The routes: nip's, each given the service by FastAPI's Depends (the model nip serves: svc.nip_serving, made by
# serve.create_app).
# ---------------------------------------------------------------------------------------------

router = APIRouter(tags=["nip"])


def nip_view(job: dict) -> dict:
    defaults = api_openai.kit_defaults()
    config = job["nip_config"] or {
        "model_name": job["model"], "method": "dpo",
        "dpo_config": {"beta": job["hyperparameters"].get("beta", defaults["beta"]),
                       "learning_rate": defaults["learning_rate"] * job["hyperparameters"]["learning_rate_multiplier"]},
        "seed": job["seed"], "per_device_train_batch_size": job["hyperparameters"]["batch_size"]}
    message = (job["error"] or {}).get("message", "")
    return {"job_id": job["id"], "status": nip_status(job), "config": config,
            "new_model_name": job["fine_tuned_model"], "error_message": message}

@router.get("/version")
def version(svc: Svc):
    return {"version": svc.cfg.nip_version}

@router.post("/training/jobs", status_code=201)
def nip_create(svc: Svc, body: NipCreate):
    config = body.config
    if config.model_already_lora_strategy == "stack":
        raise ApiError(400, "model_already_lora_strategy 'stack' is not supported: a fine-tuned model "
                       "continues its own adapter ('reuse')", "config.model_already_lora_strategy")
    name = job_suffix(body.job_name or body.job_id_suffix)
    file_id = new_id("file")
    dest = svc.store.files_dir / file_id
    kit.atomic_write_text(dest, "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in body.dataset))
    svc.store.add_file(f"{name or 'dataset'}.jsonl", "fine-tune", dest, dest.stat().st_size, file_id)
    defaults = api_openai.kit_defaults()
    hyper = {"beta": config.dpo_config.beta, "batch_size": config.per_device_train_batch_size,
             "n_epochs": defaults["n_epochs"],
             "learning_rate_multiplier": config.dpo_config.learning_rate / defaults["learning_rate"]}
    job = svc.new_job("nip", config.model_name, file_id, None, {"type": "dpo"}, hyper,
                      nip_flags(config.model_dump()), name, config.seed, None, config.model_dump(),
                      model_param="config.model_name")
    return nip_view(job)

@router.get("/training/jobs")
def nip_list(svc: Svc):
    return [nip_view(j) for j in svc.store.query("SELECT * FROM jobs ORDER BY seq")]

@router.get("/training/jobs/{job_id}")
def nip_get(svc: Svc, job_id: str):
    return nip_view(svc.job_or_404(job_id))

@router.delete("/training/jobs/{job_id}")
def nip_cancel(svc: Svc, job_id: str):
    job = svc.job_or_404(job_id)
    return nip_view(job if job["status"] in TERMINAL else svc.request_stop(job, "cancel"))

@router.post("/vllm/start", status_code=201)
def vllm_start(svc: Svc, body: VllmStart):
    return svc.nip_serving.start(body.model_name)

@router.post("/vllm/stop")
def vllm_stop(svc: Svc, body: Optional[VllmStop] = None):
    body = body or VllmStop()
    return svc.nip_serving.stop(body.terminate_timeout, body.ignore_not_running)

@router.get("/vllm/status")
def vllm_status(svc: Svc):
    return svc.nip_serving.state()
