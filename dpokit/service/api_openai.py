"""OpenAI's files and fine-tuning jobs API for the jobs service (service.py assembles it): the request shapes
the openai SDK's types allow, each value accepted or refused with a 400 naming the field, and the mapping of
a job's method and hyperparameters onto train_dpo.py's flags. "auto", which the SDK documents for every
hyperparameter, means the kit's own default (or the service's --train_args)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from fastapi import APIRouter, File, Form, Request, UploadFile  # module level: the routes' annotations resolve here
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field, create_model

from dpokit.core import runs
from dpokit.sandbox import sandbox
from dpokit.scoring import graders
from dpokit.service.jobs import new_id, now, public_status
from dpokit.service.service import ApiError, SUFFIX, Svc, job_defaults, page


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# "auto" or a value; the bound applies to the number only (a bound on the whole union compared "auto" with 0).
AutoFloat = Union[Literal["auto"], Annotated[float, Field(gt=0, allow_inf_nan=False)], None]
AutoInt = Union[Literal["auto"], Annotated[int, Field(ge=1, le=10_000)], None]


class SupervisedHyper(Strict):
    batch_size: AutoInt = None
    learning_rate_multiplier: AutoFloat = None
    n_epochs: AutoInt = None


class DpoHyper(SupervisedHyper):
    beta: AutoFloat = None


class ReinforcementHyper(SupervisedHyper):
    compute_multiplier: AutoFloat = None
    eval_interval: AutoInt = None
    eval_samples: AutoInt = None
    reasoning_effort: Optional[Literal["default", "low", "medium", "high"]] = None


class DpoBody(Strict):
    hyperparameters: Optional[DpoHyper] = None


class SupervisedBody(Strict):
    hyperparameters: Optional[SupervisedHyper] = None


# The graders as the openai SDK types them (openai.types.graders), pass_threshold as its evals take it; the
# checks the types cannot make (a formula, labels, a judge to ask) are graders.check's, through checked_grader.
Threshold = Optional[Annotated[float, Field(allow_inf_nan=False)]]


class TextPart(Strict):
    type: Literal["input_text", "output_text"]
    text: str


class ImagePart(Strict):  # allowed by the SDK's types; graders.check refuses it, naming it (judges read text)
    type: Literal["input_image"]
    image_url: str
    detail: Optional[str] = None


class AudioPart(Strict):  # likewise
    type: Literal["input_audio"]
    input_audio: dict


Part = Annotated[Union[TextPart, ImagePart, AudioPart], Field(discriminator="type")]


class JudgeMessage(Strict):
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, Part, list[Part]]
    type: Optional[Literal["message"]] = None


class SamplingParams(Strict):
    max_completions_tokens: Optional[Annotated[int, Field(ge=1, le=4096)]] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None  # recorded, not used
    seed: Optional[Annotated[int, Field(ge=-2 ** 63, lt=2 ** 64)]] = None
    temperature: Optional[Annotated[float, Field(ge=0, le=2)]] = None
    top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None


def grader_schema(kind: str, spec: graders.GraderType) -> type:
    """A grader type's request body, from its entry in graders.REGISTRY (type, name and the entry's fields, whose
    annotations are written in this module's names): OpenAI's shape, each value the SDK's types allow accepted
    and the rest a 400 naming the field."""
    fields = {"type": (Literal[kind], ...), "name": (str, ...)}
    for key, annotation in spec.fields.items():
        annotation, default = (annotation, ...) if isinstance(annotation, str) else annotation
        fields[key] = (eval(annotation, globals()), default)  # noqa: S307 - the registry's own annotations
    return create_model("".join(w.title() for w in kind.split("_")) + "Grader", __base__=Strict, __module__=__name__,
                        **fields)


SubGrader = Annotated[Union[tuple(grader_schema(k, g) for k, g in graders.REGISTRY.items() if g.nestable)],
                      Field(discriminator="type")]
Grader = Annotated[Union[tuple(grader_schema(k, g) for k, g in graders.REGISTRY.items())], Field(discriminator="type")]


class ReinforcementBody(Strict):
    grader: Grader
    hyperparameters: Optional[ReinforcementHyper] = None


class Method(Strict):
    type: Literal["dpo", "supervised", "reinforcement"]
    dpo: Optional[DpoBody] = None
    supervised: Optional[SupervisedBody] = None
    reinforcement: Optional[ReinforcementBody] = None


class Wandb(Strict):
    project: str
    entity: Optional[str] = None
    name: Optional[str] = None
    tags: Optional[list[str]] = None


class Integration(Strict):
    type: Literal["wandb"]
    wandb: Wandb


class JobCreate(Strict):
    model: str = Field(min_length=1)
    training_file: str = Field(min_length=1)
    validation_file: Optional[str] = None
    method: Optional[Method] = None
    hyperparameters: Optional[DpoHyper] = None  # OpenAI's older place for them (beta only with a DPO method)
    suffix: Optional[str] = Field(None, pattern=SUFFIX.pattern)
    seed: Optional[Annotated[int, Field(ge=0, le=2 ** 32 - 1)]] = None
    metadata: Optional[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]] = Field(
        None, max_length=16)
    integrations: Optional[list[Integration]] = None


def kit_defaults() -> dict:
    """The kit's own values for OpenAI's "auto" hyperparameters (service.job_defaults)."""
    return job_defaults()


GRPO_GENERATIONS = 4  # answers per prompt at compute_multiplier 1 (train_dpo.py's --num_generations default)


def checked_grader(grader: dict, svc, param: str) -> None:
    """A grader the kit can evaluate here, or a 400 naming the field under param: graders.check against the
    service's judge and embeddings, then each judge model against what the service's own chat serves (when it
    is the judge)."""
    ends = svc.grader_endpoints() if svc is not None else graders.Endpoints()
    try:
        graders.check(grader, ends)
    except graders.GraderError as e:
        raise ApiError(400, str(e), f"{param}.{e.field}" if e.field else param,
                       "unsupported_grader" if e.field.endswith("type") else None) from None
    if svc is None or svc.cfg.judge_base_url:
        return
    for where, g in graders.walk(grader):
        if graders.REGISTRY[g["type"]].judged and not svc.serves(g["model"]):
            raise ApiError(400, f"judge model {g['model']!r} is not served here: name a model GET /v1/models lists "
                           "(the service's own chat judges), or start serve.py with --judge_base_url",
                           f"{param}.{where}model", "model_not_found")


def grader_flags(grader: dict, svc=None) -> list[str]:
    """A reinforcement job's grader as train_dpo.py flags: GRPO, rewarded by the grader alone (graders.py evaluates
    it; a python grader's source runs in the sandbox; one named checker or ran with no source is the kit's own),
    with the judge and embeddings endpoints its training asks (svc: the service; None checks the grader alone)."""
    checked_grader(grader, svc, "method.reinforcement.grader")
    flags = ["--method", "grpo", "--reward", "", "--reward_grader", json.dumps(grader, ensure_ascii=False)]
    if any(graders.REGISTRY[g["type"]].judged for _, g in graders.walk(grader)):
        if svc.cfg.runner != "local" and not svc.cfg.judge_base_url:
            raise ApiError(400, f"a {svc.cfg.runner} job's training cannot reach this service's own chat at "
                           f"{svc.own_url()} to judge: start serve.py with --judge_base_url at an address the "
                           "training reaches", "method.reinforcement.grader", "judge_unreachable")
        flags += ["--judge_base_url", svc.grader_endpoints().judge_base_url]
    if any(graders.REGISTRY[g["type"]].embeddings(g) for _, g in graders.walk(grader)):
        flags += ["--embeddings_base_url", svc.cfg.embeddings_base_url, "--embeddings_model", svc.cfg.embeddings_model]
    return flags


def sandbox_problem(grader: dict, cfg, param: str = "method.reinforcement.grader") -> None:
    """A user's python grader (or one inside a multi grader) runs only where the sandbox has namespaces (bwrap or
    unshare), unless the operator allowed the `limits` mode (serve.py --limits_graders): there the grader's code
    runs as the service's user, kept in by Landlock and limits alone. Checked on this machine, where a local job
    trains and /graders/run runs it."""
    users = [g for _, g in graders.walk(grader) if g["type"] == "python" and str(g.get("source", "")).strip()]
    if not users or cfg.limits_graders:
        return
    if cfg.runner == "local" and sandbox.isolation() == "limits":
        raise ApiError(400, "this service's sandbox has only its `limits` mode (no bubblewrap, no namespaces), and a "
                       "python grader's code would run as the service's user: its operator can install bubblewrap, "
                       "or allow it with serve.py --limits_graders", param, "sandbox_too_weak")


def hyperparameter_flags(method_type: str, hyper: dict) -> list[str]:
    """OpenAI's method hyperparameters as train_dpo.py flags; "auto" and missing ones add no flag (the kit's
    default, or the service's --train_args, applies). learning_rate_multiplier scales the kit's learning rate;
    reinforcement: compute_multiplier scales the answers sampled per prompt, eval_samples the checker's samples
    per held-out prompt (eval_interval and reasoning_effort have no counterpart: recorded, not used)."""
    flags = []
    if method_type == "supervised":
        flags += ["--loss_type", "sft"]
    if hyper.get("compute_multiplier") not in (None, "auto"):
        flags += ["--num_generations", str(max(2, round(GRPO_GENERATIONS * float(hyper["compute_multiplier"]))))]
    if hyper.get("eval_samples") not in (None, "auto"):
        flags += ["--eval_samples", str(hyper["eval_samples"])]
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
    if method_type == "reinforcement":
        d |= {"compute_multiplier": 1.0, "eval_samples": d["eval_samples"], "eval_interval": "auto",
              "reasoning_effort": "default"}
        keys += ("compute_multiplier", "eval_interval", "eval_samples", "reasoning_effort")
    return {k: d[k] if hyper.get(k) in (None, "auto") else hyper[k] for k in keys}


def job_hyperparameters(body: JobCreate) -> tuple[str, dict]:
    """(method type, the hyperparameters given): the method's own, else the top-level ones; what the kit cannot
    train is refused naming the field."""
    method = body.method or Method(type="dpo")
    t = method.type
    if t == "reinforcement" and method.reinforcement is None:
        raise ApiError(400, "a reinforcement job needs method.reinforcement.grader", "method.reinforcement")
    if body.integrations:
        raise ApiError(400, "integrations: this service does not report jobs to Weights & Biases; train with "
                       "train_dpo.py --report_to wandb, or read the job's events and metrics", "integrations",
                       "unsupported_integration")
    for other in ("dpo", "supervised", "reinforcement"):
        if other != t and getattr(method, other) is not None:
            raise ApiError(400, f"method.{other} is given but method.type is {t!r}", f"method.{other}")
    own = getattr(method, t)
    if own is not None and own.hyperparameters is not None and body.hyperparameters is not None:
        raise ApiError(400, f"hyperparameters are given twice: in method.{t}.hyperparameters and at the top level "
                       "(give them in the method)", "hyperparameters")
    given = own.hyperparameters if own is not None and own.hyperparameters is not None else body.hyperparameters
    hyper = given.model_dump(exclude_none=True) if given is not None else {}
    if t != "dpo" and hyper.get("beta") is not None:
        raise ApiError(400, f"hyperparameters.beta is DPO's; a {t} job has none", "hyperparameters.beta")
    return t, hyper


def file_view(f: dict) -> dict:
    return {"object": "file", "id": f["id"], "bytes": f["bytes"], "created_at": f["created_at"],
            "filename": f["filename"], "purpose": f["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


def job_view(job: dict) -> dict:
    t = job["method"]["type"]
    return {"object": "fine_tuning.job", "id": job["id"], "created_at": job["created_at"], "model": job["model"],
            "status": public_status(job), "error": job["error"],
            "fine_tuned_model": job["fine_tuned_model"] if job["status"] == "succeeded" else None,
            "finished_at": job["finished_at"], "trained_tokens": job["trained_tokens"],
            "training_file": job["training_file"], "validation_file": job["validation_file"],
            "result_files": job["result_files"] or [], "seed": job["seed"], "metadata": job["metadata"],
            "hyperparameters": job["hyperparameters"], "organization_id": "org-dpo-kit", "integrations": [],
            "estimated_finish": job.get("estimated_finish") if job["status"] == "running" else None,
            "suffix": job["suffix"],
            "method": {"type": t, t: {"hyperparameters": job["hyperparameters"]}
                       | ({"grader": job["method"]["grader"]} if "grader" in job["method"] else {})}}


ANY_METADATA = object()  # no metadata filter given


def metadata_filter(params) -> dict | None | object:
    """OpenAI's jobs.list(metadata=...) from the query (the SDK sends metadata[k]=v; metadata=null asks for jobs
    without metadata): {k: v} to match, None for no metadata, ANY_METADATA for no filter."""
    wanted, null = {}, False
    for key, value in params:
        if key.startswith("metadata[") and key.endswith("]"):
            wanted[key[len("metadata["):-1]] = value
        elif key == "metadata":
            if value not in ("null", ""):
                raise ApiError(400, "metadata: filter with metadata[key]=value, or metadata=null for jobs without "
                               "metadata", "metadata", "invalid_metadata_filter")
            null = True
    if null and wanted:
        raise ApiError(400, "metadata: metadata=null and metadata[key]=value together", "metadata",
                       "invalid_metadata_filter")
    return None if null else wanted if wanted else ANY_METADATA


def metadata_matches(metadata: dict | None, wanted: dict | None) -> bool:
    if wanted is None:
        return not metadata
    return all((metadata or {}).get(k) == v for k, v in wanted.items())


# ---------------------------------------------------------------------------------------------
# The routes: /v1/files and /v1/fine_tuning/jobs, each given the service (service.Service) by FastAPI's Depends.
# ---------------------------------------------------------------------------------------------

router = APIRouter(prefix="/v1")


@router.post("/files", tags=["files"])
def upload(svc: Svc, file: UploadFile = File(...), purpose: str = Form(...)):
    if purpose != "fine-tune":
        raise ApiError(400, f"purpose must be 'fine-tune' (got {purpose!r})", "purpose")
    file_id = new_id("file")
    dest = svc.store.files_dir / file_id
    tmp = dest.with_suffix(".tmp")
    size = 0
    with open(tmp, "wb") as f:
        while chunk := file.file.read(1 << 20):
            size += len(chunk)
            if size > int(svc.cfg.max_file_mb * 1e6):
                f.close()
                tmp.unlink()
                raise ApiError(413, f"the file is over the service's limit of {svc.cfg.max_file_mb:g} MB "
                               "(--max_file_mb)", "file", "file_too_large")
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dest)
    name = Path(file.filename or "upload.jsonl").name[:255] or "upload.jsonl"
    return file_view(svc.store.add_file(name, purpose, dest, size, file_id))

@router.get("/files", tags=["files"])
def list_files(svc: Svc, purpose: Optional[str] = None, limit: Annotated[int, Field(ge=1, le=10_000)] = 10_000,
               after: Optional[str] = None, order: Literal["asc", "desc"] = "desc"):
    rows = svc.store.query(f"SELECT * FROM files ORDER BY created_at {order.upper()}, id")
    rows = [f for f in rows if purpose in (None, f["purpose"])]
    ids = [f["id"] for f in rows]
    rows = rows[ids.index(after) + 1:] if after in ids else rows
    return page([file_view(f) for f in rows], limit)

@router.get("/files/{file_id}", tags=["files"])
def get_file(svc: Svc, file_id: str):
    return file_view(svc.file_or_404(file_id))

@router.get("/files/{file_id}/content", tags=["files"])
def file_content(svc: Svc, file_id: str):
    f = svc.file_or_404(file_id)
    return FileResponse(f["path"], media_type="application/octet-stream", filename=f["filename"])

@router.delete("/files/{file_id}", tags=["files"])
def delete_file(svc: Svc, file_id: str):
    f = svc.file_or_404(file_id)
    users = svc.store.query("SELECT id FROM jobs WHERE (training_file = ? OR validation_file = ?) AND status IN "
                        "('validating_files', 'queued', 'running', 'paused')", file_id, file_id)
    if users:
        raise ApiError(400, f"file {file_id} is in use by job {users[0]['id']} (it resumes from it)", "file_id")
    svc.store.execute("DELETE FROM files WHERE id = ?", file_id)
    if f["purpose"] == "fine-tune":  # result files belong to their run directory
        Path(f["path"]).unlink(missing_ok=True)
    return {"object": "file", "id": file_id, "deleted": True}

@router.post("/fine_tuning/jobs", tags=["fine-tuning"])
def create_job(svc: Svc, body: JobCreate):
    t, given = job_hyperparameters(body)
    flags = hyperparameter_flags(t, given) + (["--seed", str(body.seed)] if body.seed is not None else [])
    method = {"type": t}
    if t == "reinforcement":
        grader = body.method.reinforcement.grader.model_dump(exclude_none=True)
        flags = grader_flags(grader, svc) + flags
        sandbox_problem(grader, svc.cfg)
        method["grader"] = grader
    seed = body.seed if body.seed is not None else 42
    return job_view(svc.new_job("openai", body.model, body.training_file, body.validation_file, method,
                                resolved_hyperparameters(t, given), flags, body.suffix, seed, body.metadata))

@router.get("/fine_tuning/jobs", tags=["fine-tuning"])
def list_jobs(svc: Svc, request: Request, after: Optional[str] = None,
              limit: Annotated[int, Field(ge=1, le=100)] = 20):
    """OpenAI's filter: metadata[k]=v for each pair a job's metadata must hold; metadata=null: jobs without."""
    wanted = metadata_filter(request.query_params.multi_items())
    job = svc.store.job(after) if after else None
    cursor = job["seq"] if job else None
    if wanted is ANY_METADATA:  # the common call: one page from the database
        rows = svc.store.query("SELECT * FROM jobs WHERE (? IS NULL OR seq < ?) ORDER BY seq DESC LIMIT ?",
                           cursor, cursor, limit + 1)
    else:
        rows = [j for j in svc.store.query("SELECT * FROM jobs WHERE (? IS NULL OR seq < ?) ORDER BY seq DESC",
                                       cursor, cursor) if metadata_matches(j["metadata"], wanted)]
    return page([job_view(j) for j in rows[:limit + 1]], limit)

@router.get("/fine_tuning/jobs/{job_id}", tags=["fine-tuning"])
def get_job(svc: Svc, job_id: str):
    return job_view(svc.job_or_404(job_id))

@router.post("/fine_tuning/jobs/{job_id}/cancel", tags=["fine-tuning"])
def cancel_job(svc: Svc, job_id: str):
    return job_view(svc.request_stop(svc.job_or_404(job_id), "cancel"))

@router.post("/fine_tuning/jobs/{job_id}/pause", tags=["fine-tuning"])
def pause_job(svc: Svc, job_id: str):
    return job_view(svc.request_stop(svc.job_or_404(job_id), "pause"))

@router.post("/fine_tuning/jobs/{job_id}/resume", tags=["fine-tuning"])
def resume_job(svc: Svc, job_id: str):
    job = svc.job_or_404(job_id)
    if job["status"] != "paused":
        raise ApiError(400, f"only a paused job resumes; this one is {job['status']}", "fine_tuning_job_id")
    if not svc.store.move(job_id, ("paused",), status="queued" if job["data"] else "validating_files"):
        raise ApiError(400, "the job is no longer paused", "fine_tuning_job_id")
    svc.store.event(job_id, "Job resumed; it continues from its checkpoint")
    return job_view(svc.store.job(job_id))

@router.get("/fine_tuning/jobs/{job_id}/events", tags=["fine-tuning"])
def list_events(svc: Svc, job_id: str, after: Optional[str] = None,
                limit: Annotated[int, Field(ge=1, le=10_000)] = 20):
    svc.job_or_404(job_id)
    cursor = svc.store.query("SELECT seq FROM events WHERE id = ?", after) if after else []
    rows = svc.store.query("SELECT * FROM events WHERE job_id = ? AND (? IS NULL OR seq < ?) ORDER BY seq DESC "
                       "LIMIT ?", job_id, *(2 * [cursor[0]["seq"] if cursor else None]), limit + 1)
    return page([{"object": "fine_tuning.job.event", "id": e["id"], "created_at": e["created_at"],
                  "level": e["level"], "message": e["message"], "type": e["type"],
                  "data": json.loads(e["data"]) if e["data"] else {}} for e in rows], limit)

@router.get("/fine_tuning/jobs/{job_id}/checkpoints", tags=["fine-tuning"])
def list_checkpoints(svc: Svc, job_id: str, after: Optional[str] = None,
                     limit: Annotated[int, Field(ge=1, le=100)] = 10):
    """The final adapter of a succeeded job; the saved checkpoints of one still in progress (or cancelled)."""
    job = svc.job_or_404(job_id)
    run = runs.Run(svc.out, job_id)
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
    return page(rows, limit)
