"""The models the jobs service lists, changing at run time (service.py assembles it): OpenAI's DELETE
/v1/models/{model} takes a fine-tuned model off the list (the serving engine unloads its adapter: engine.py), and,
with --runtime_lora, vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter in vLLM's shapes, so that this
service is a stand-in engine for another (its --engine_url) and for the tests of the one that forwards to it.

    curl -X POST localhost:8001/v1/load_lora_adapter -H 'Content-Type: application/json' \\
      -d '{"lora_name": "ft:SmolLM2-135M-Instruct:dpo-kit::abc", "lora_path": "/abs/artifacts/ftjob-abc"}'

A loaded adapter is a finished run of the kit (runs.open_run: adapter_config.json and its config.json), read from the
path the request gives, as vLLM reads one; it is listed by GET /v1/models and answers chat, completions and
responses under its name until it is unloaded. vLLM answers these with plain text on success and an error body
otherwise (400 for a name already loaded, 404 for an unknown one): so do these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from dpokit.core import kit, runs
from dpokit.core.kit import UserError
from dpokit.service.jobs import now
from dpokit.service.service import ApiError, Svc


class LoadAdapter(BaseModel):  # vLLM's LoadLoRAAdapterRequest (extra fields ignored, as vLLM's)
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadAdapter(BaseModel):  # vLLM's UnloadLoRAAdapterRequest
    lora_name: str = Field(min_length=1)
    lora_int_id: Optional[int] = None


router = APIRouter(prefix="/v1", tags=["models and chat"])


@router.delete("/models/{model}")
def delete_model(svc: Svc, model: str):
    """OpenAI's client.models.delete: a fine-tuned model is no longer listed nor served (its job and its run
    directory stay: `make chat RUN=<job id>` still reads it); a base is not deleted."""
    job = svc.tuned_job(model)
    if job is None:
        if svc.base_path(model) is not None:
            raise ApiError(400, f"model {model!r} is a base of this service: only fine-tuned models are deleted",
                           "model")
        raise ApiError(404, f"model {model!r} does not exist here (GET /v1/models lists them)", "model",
                       "model_not_found")
    svc.store.update_job(job["id"], model_deleted=now())
    svc.store.event(job["id"], f"Model {model} deleted: no longer listed nor served (the run {job['id']} stays in "
                    "the output directory)")
    with svc.chat.lock:
        svc.chat.loaded.pop(model, None)
    return {"id": model, "object": "model", "deleted": True}


def runtime_lora_on(svc) -> None:
    if not svc.cfg.runtime_lora:
        raise ApiError(404, "no such endpoint (start the service with --runtime_lora to load adapters at run time, "
                       "as vLLM does with VLLM_ALLOW_RUNTIME_LORA_UPDATING)")


@router.post("/load_lora_adapter", response_class=PlainTextResponse)
def load_lora_adapter(svc: Svc, body: LoadAdapter):
    runtime_lora_on(svc)
    name = body.lora_name
    if name in svc.adapters and not body.load_inplace:
        raise ApiError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                       "place, set 'load_inplace' to True.", "lora_name")
    if svc.base_path(name) is not None or svc.tuned_job(name) is not None:
        raise ApiError(400, f"{name!r} is already a model of this service", "lora_name")
    path = (kit.ROOT / body.lora_path).resolve()
    if not path.is_dir():
        raise ApiError(404, f"Loading lora {name} failed: No adapter found for {body.lora_path}", "lora_path",
                       "model_not_found")
    try:
        path, config = runs.open_run(path, path.parent)
    except UserError as e:
        raise ApiError(400, f"Loading lora {name} failed: {e}", "lora_path") from None
    with svc.chat.lock:
        svc.chat.loaded.pop(name, None)  # load_inplace: read again
    svc.adapters[name] = (Path(path), config["model_name_or_path"])
    try:
        svc.chat.load(svc, name)  # loaded now, as vLLM does: a broken adapter is this request's error
    except Exception as e:  # noqa: BLE001 - the adapter's files, not the service, are at fault
        svc.adapters.pop(name, None)
        raise ApiError(400, f"Loading lora {name} failed: {type(e).__name__}: {str(e)[:300]}", "lora_path") from None
    return f"Success: LoRA adapter '{name}' added successfully."


@router.post("/unload_lora_adapter", response_class=PlainTextResponse)
def unload_lora_adapter(svc: Svc, body: UnloadAdapter):
    runtime_lora_on(svc)
    if svc.adapters.pop(body.lora_name, None) is None:
        raise ApiError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name", "model_not_found")
    with svc.chat.lock:
        svc.chat.loaded.pop(body.lora_name, None)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
