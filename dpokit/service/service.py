"""What the jobs service's APIs share: the configuration, the SQLite store, the chat models (api_chat.py puts
them here), the lookups and job records both the OpenAI and the nip API make, and OpenAI-shaped errors. serve.py's
`create_app` assembles it with one router per API:

    api_openai.py   /v1/files, /v1/fine_tuning/jobs (the openai SDK's files and fine-tuning jobs)
    api_exports.py  /v1/fine_tuning/jobs/{id}/exports (the kit's own: a job's model as a checked GGUF or merged model)
    api_chat.py     /v1/models, /v1/chat/completions, /v1/completions (base and fine-tuned models, loaded on first use)
    api_responses.py /v1/responses (the same models and sampling, as the Responses API)
    api_nip.py      /version, /training/jobs, /vllm/start|stop|status (nip's language-model-server client)
    api_graders.py  /v1/fine_tuning/alpha/graders/run|validate (OpenAI's graders, evaluated by graders.py)
    api_adapters.py DELETE /v1/models/{model}, /v1/load_lora_adapter, /v1/unload_lora_adapter (models changing at run time)

engine.py is the serving engine the answers go to where there is one (vLLM on a GPU, or --engine_url).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from dpokit.core import kit
from dpokit.model import models
from dpokit.train import config
from dpokit.scoring import graders
from dpokit.service.jobs import Store, new_id, now

ROOT = kit.ROOT
VERSION = "1.1.0"  # the OpenAI-shaped API's version (openapi.json); nip's /version reports ServeConfig.nip_version
BUNDLED_NAMES = (Path(models.BUNDLED_MODEL_DIR).name, "HuggingFaceTB/SmolLM2-135M-Instruct")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SUFFIX = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def parse_model_map(spec: str) -> list[tuple[str, str]]:
    """--model_map 'NAME=BASE,PREFIX*=BASE' -> [(name or prefix*, base)], in order; ValueError saying what is wrong.
    A base is a name the service has (checked when a job or a chat asks for it: models_dir may gain one later)."""
    out = []
    for part in (x.strip() for x in spec.split(",")):
        if not part:
            continue
        name, sep, base = (x.strip() for x in part.partition("="))
        if not sep or not name or not base:
            raise ValueError(f"{part!r} is not NAME=BASE (e.g. gpt-4o-mini*=Qwen2.5-7B-Instruct)")
        if "*" in name[:-1] or name == "*":
            raise ValueError(f"{name!r}: a * may only end a name that starts with something")
        if name.startswith("ft:") or base.startswith("ft:"):
            raise ValueError(f"{part!r}: fine-tuned models keep their own names (ft:...), they are not mapped")
        out.append((name, base))
    return out


def job_defaults() -> dict:
    """What a job trains with, and reports, for OpenAI's "auto" hyperparameters (and nip's unset ones): TrainConfig's
    own defaults (dpokit/train/config.py, their one home). The service's --train_args still apply beneath a job's
    own values."""
    d = config.TrainConfig()
    return {"beta": d.beta, "batch_size": d.per_device_train_batch_size, "n_epochs": d.num_train_epochs,
            "learning_rate": d.learning_rate, "learning_rate_multiplier": 1.0, "eval_samples": d.eval_samples}


class ApiError(Exception):
    """A request the service refuses: an OpenAI-style error body with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def page(rows: list[dict], limit: int) -> dict:
    """An OpenAI list page from up to limit + 1 rows (the extra one says there is more)."""
    return {"object": "list", "data": rows[:limit], "has_more": len(rows) > limit}


ORG = "dpo-kit"  # where OpenAI's model names hold the organisation


def fine_tuned_name(base: str, suffix: str | None, job_id: str) -> str:
    """OpenAI's shape: ft:<base>:<organisation>:<suffix, may be empty>:<job id without its prefix>, so code that
    splits OpenAI's names on ':' finds each part where it was."""
    return f"ft:{Path(base).name}:{ORG}:{suffix or ''}:{job_id.split('-', 1)[1]}"


UNION_TAGS = re.compile(r"^(float|int|str|bool|none|bytes|[a-z]+-[a-z-]+(\[.*\])?|(literal|list|dict|tuple|"
                        r"function-[a-z]+|nullable|union)\[.*\])$")


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic's complaints about a request: the first field's dotted path, as OpenAI's
    errors name it, with what each branch of a union ("auto" or a number) wanted said together."""
    def where(err):
        return ".".join(str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path")
                        and not (isinstance(x, str) and UNION_TAGS.match(x)))

    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON in the request body: {first.get('ctx', {}).get('error', first['msg'])}", None
    param = where(first)
    if first.get("type") == "extra_forbidden":
        return f"unknown field {param!r} (this service does not take it)", param or None
    wanted = list(dict.fromkeys(e["msg"] for e in errors if where(e) == param))
    return (f"{param}: {' or '.join(wanted)}" if param else " or ".join(wanted)), param or None


class Service:
    """What the routers share: the configuration, the store, the models loaded for chat, and the lookups and
    job records both the OpenAI and the nip API make."""

    def __init__(self, cfg):
        self.cfg, self.out = cfg, Path(cfg.output_dir)
        self.store = Store(self.out / "serve")
        self.chat = self.nip_serving = None  # api_chat.Chat and api_nip.Serving: set by serve.create_app
        self.engine = None  # engine.Engine where answers go to vLLM or --engine_url; None: the kit's own sampler
        self.adapters: dict[str, tuple[Path, str]] = {}  # --runtime_lora: name -> (run directory, its base)
        self.api_key = os.environ.get("DPO_KIT_API_KEY", "")

    def job_or_404(self, job_id: str) -> dict:
        job = self.store.job(job_id)
        if job is None:
            raise ApiError(404, f"no fine-tuning job {job_id!r}", "fine_tuning_job_id", "job_not_found")
        return job

    def file_or_404(self, file_id: str, param: str = "file_id") -> dict:
        f = self.store.file(file_id)
        if f is None:
            raise ApiError(404 if param == "file_id" else 400, f"no file {file_id!r}", param, "file_not_found")
        return f

    def base_models(self) -> dict[str, str]:
        """Model names a request may use for a base -> the path or hub id train_dpo.py gets."""
        found = {BUNDLED_NAMES[0]: models.BUNDLED_MODEL_DIR, BUNDLED_NAMES[1]: models.BUNDLED_MODEL_DIR}
        models_dir = Path(self.cfg.models_dir)
        models_dir = models_dir if models_dir.is_absolute() else ROOT / models_dir
        for d in sorted(models_dir.glob("*/config.json")) if models_dir.is_dir() else []:
            found.setdefault(d.parent.name, str(d.parent))
        return found

    def mapped(self, name: str) -> str | None:
        """The base --model_map sends a client's model name to (OpenAI's names: gpt-4o-mini-2024-07-18 ->
        Qwen2.5-7B-Instruct), or None."""
        for pattern, base in parse_model_map(getattr(self.cfg, "model_map", "")):
            if name == pattern or (pattern.endswith("*") and name.startswith(pattern[:-1])):
                return base
        return None

    def base_path(self, name: str) -> str | None:
        """What train_dpo.py gets for a base model name (a base of models_dir, the bundled model, or a name
        --model_map sends to one); None when the name is none of these."""
        bases = self.base_models()
        if name in bases:
            return bases[name]
        target = self.mapped(name)
        return bases.get(target) if target else None

    def serves(self, name: str) -> bool:
        """Whether the service's own chat answers as model name (a base, or a succeeded job's model)."""
        return self.base_path(name) is not None or self.tuned_job(name) is not None or name in self.adapters

    def engine_target(self, name: str) -> str | None:
        """The name the serving engine answers as model name by (a base or a fine-tuned model of its base), or None:
        the service's own sampler answers (no engine, another base, or an adapter the engine refused)."""
        return self.engine.target(name) if self.engine is not None else None

    def own_url(self) -> str:
        """The service's own /v1, as a process on this machine reaches it (a wildcard address: loopback)."""
        host = self.cfg.host
        host = "127.0.0.1" if host in ("0.0.0.0", "", "localhost") else "::1" if host == "::" else host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.cfg.port}/v1"

    def grader_endpoints(self):
        """Where graders' judges and cosine's embeddings are: --judge_base_url, else this service's own chat
        (its key: DPO_KIT_API_KEY); --embeddings_base_url and --embeddings_model."""
        own = not self.cfg.judge_base_url
        ends = graders.Endpoints.from_env(self.cfg.judge_base_url or self.own_url(), self.cfg.embeddings_base_url,
                                          self.cfg.embeddings_model)
        return dataclasses.replace(ends, judge_api_key=self.api_key) if own else ends

    def tuned_job(self, name: str) -> dict | None:
        """The succeeded job whose fine-tuned model is name (and not deleted since), or None."""
        rows = self.store.query("SELECT * FROM jobs WHERE fine_tuned_model = ? AND status = 'succeeded' "
                                "AND model_deleted IS NULL", name)
        return rows[0] if rows else None

    def resolve_model(self, name: str, param: str = "model") -> tuple[str, str | None]:
        """(base for train_dpo.py, the job whose adapter a new job continues from, or None)."""
        parent = self.store.query("SELECT * FROM jobs WHERE fine_tuned_model = ?", name)
        if parent:
            if parent[0]["model_deleted"]:
                raise ApiError(400, f"model {name!r} was deleted (DELETE /v1/models)", param, "model_not_found")
            if parent[0]["status"] != "succeeded":
                raise ApiError(400, f"model {name!r} is not ready: its job is {parent[0]['status']}", param)
            return parent[0]["base"], parent[0]["id"]
        path = self.base_path(name)
        if path:
            return path, None
        target = self.mapped(name)
        if target:
            raise ApiError(400, f"model {name!r} is mapped to {target!r} (--model_map), which this service does not "
                           f"have: its bases are {', '.join(self.base_models())}", param, "model_not_found")
        if name.startswith("random:") or (HUB_ID.match(name) and ".." not in name):
            return name, None
        raise ApiError(400, f"unknown model {name!r}: use {', '.join(self.base_models())}, a hub id (org/name) or a "
                       "fine-tuned model of this service (OpenAI's model names: start the service with --model_map "
                       "'gpt-4o-mini*=<a base>')", param, "model_not_found")

    def check_file(self, file_id: str, param: str) -> None:
        f = self.file_or_404(file_id, param)
        if f["purpose"] != "fine-tune":
            raise ApiError(400, f"file {file_id} has purpose {f['purpose']!r}, not 'fine-tune'", param)

    def new_job(self, api: str, model: str, training_file: str, validation_file: str | None, method: dict,
                hyper: dict, flags: list[str], suffix: str | None, seed: int, metadata, nip_config=None,
                model_param: str = "model") -> dict:
        base, parent = self.resolve_model(model, model_param)
        self.check_file(training_file, "training_file")
        if validation_file:
            self.check_file(validation_file, "validation_file")
        job_id = new_id("ftjob")
        self.store.insert("jobs", {
            "id": job_id, "created_at": now(), "api": api, "status": "validating_files", "model": model,
            "base": base, "init_adapter": parent, "training_file": training_file, "validation_file": validation_file,
            "method": method, "hyperparameters": hyper, "flags": flags, "suffix": suffix, "seed": seed,
            "metadata": metadata, "nip_config": nip_config, "result_files": [],
            "fine_tuned_model": fine_tuned_name(model if not parent else model.split(":")[1], suffix, job_id)})
        self.store.event(job_id, f"Created fine-tuning job {job_id} on {model}"
                         + (f" (continues {parent})" if parent else ""))
        return self.store.job(job_id)

    def request_stop(self, job: dict, kind: str) -> dict:
        """cancel / pause: a job with no process stops at once; a running one is signalled by the scheduler
        (its training saves a checkpoint at the end of the step)."""
        store = self.store
        waiting = ("validating_files", "queued", "paused") if kind == "cancel" else ("validating_files", "queued")
        asked = store.move(job["id"], ("running",), stop_request=kind,
                           said=f"{kind.capitalize()} requested; the training saves a checkpoint and stops")
        if not asked and not store.move(job["id"], waiting, **({"status": "cancelled", "finished_at": now()}
                                                               if kind == "cancel" else {"status": "paused"}),
                                        said="Job cancelled" if kind == "cancel" else "Job paused before it started"):
            job = store.job(job["id"])
            raise ApiError(400, f"cannot {kind} a job that is {job['status']}", "fine_tuning_job_id")
        return store.job(job["id"])


def current(request: Request) -> Service:
    """FastAPI's dependency for a route that needs the service: the one serve.create_app keeps in app.state."""
    return request.app.state.service


Svc = Annotated[Service, Depends(current)]  # a route's `svc: Svc` parameter: the service, given by Depends
