"""The kit's own addition beside OpenAI's fine-tuning jobs (service.py assembles it): a finished job's model
exported as a GGUF (llama.cpp, Ollama, LM Studio) or a merged model directory (transformers, vLLM), checked as
`make export` checks it (export.py), and downloaded as a tarball with checksums.

    POST /v1/fine_tuning/jobs/{job_id}/exports          {"format": "gguf", "quant": "q8_0", "force": false}
    GET  /v1/fine_tuning/jobs/{job_id}/exports          the job's exports, newest first
    GET  /v1/fine_tuning/jobs/{job_id}/exports/{id}     one export: status, the check's figures, its file
    GET  /v1/fine_tuning/jobs/{job_id}/exports/{id}/content   the tarball (also GET /v1/files/{file_id}/content)

An export runs in the background, one at a time (jobs.Scheduler.follow_exports); poll it as a job is polled. Asking
again for an export the job already has (same format and quant, not failed) returns that one.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Literal, Optional

from fastapi import APIRouter
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field

from dpokit.core import kit, runs
from dpokit.train import export
from dpokit.service.jobs import new_id, now
from dpokit.service.service import ApiError, Svc, page

router = APIRouter(prefix="/v1", tags=["exports (dpo-kit)"])


class ExportCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal["gguf", "merged"] = "gguf"
    quant: Literal["f16", "q8_0", "q4_k_m"] = "q8_0"
    force: bool = False


def export_view(e: dict, sha256: str | None = None) -> dict:
    return {"object": "fine_tuning.job.export", "id": e["id"], "fine_tuning_job_id": e["job_id"],
            "created_at": e["created_at"], "finished_at": e["finished_at"], "status": e["status"],
            "format": e["format"], "quant": e["quant"], "force": bool(e["force"]), "file_id": e["file_id"],
            "sha256": sha256, "report": e["report"], "error": e["error"]}


def tarball_sha256(svc, e: dict) -> str | None:
    """The tarball's sha256 as its .sha256 file gives it (written beside it by runs.make_tarball)."""
    f = svc.store.file(e["file_id"]) if e["file_id"] else None
    side = Path(f["path"] + ".sha256") if f else None
    return side.read_text().split()[0] if side and side.exists() else None


def gguf_problem() -> str | None:
    """Why this service cannot write a GGUF, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "this service's Python has no llama.cpp runtime: `make llama-cpp` installs it (then restart the service)"
    try:
        export.llama_cpp_tree()
    except kit.UserError as e:
        return str(e).removeprefix("error: ")
    return None


def export_or_404(svc, job_id: str, export_id: str) -> dict:
    svc.job_or_404(job_id)
    e = svc.store.export(export_id)
    if e is None or e["job_id"] != job_id:
        raise ApiError(404, f"no export {export_id} of job {job_id}", "export_id", "export_not_found")
    return e


@router.post("/fine_tuning/jobs/{job_id}/exports")
def create_export(svc: Svc, job_id: str, body: Optional[ExportCreate] = None):
    body = body or ExportCreate()
    job = svc.job_or_404(job_id)
    if job["status"] != "succeeded" or not runs.Run(svc.out, job_id).final.is_dir():
        raise ApiError(400, f"only a succeeded job's model exports; this one is {job['status']}", "fine_tuning_job_id")
    quant = body.quant if body.format == "gguf" else None
    if body.format == "gguf" and (why := gguf_problem()):
        raise ApiError(400, why, "format")
    same = svc.store.query("SELECT * FROM exports WHERE job_id = ? AND format = ? AND quant IS ? AND force = ? AND "
                           "status != 'failed' ORDER BY seq DESC LIMIT 1", job_id, body.format, quant, int(body.force))
    if same:
        return export_view(same[0], tarball_sha256(svc, same[0]))
    row = {"id": new_id("ftexport"), "job_id": job_id, "created_at": now(), "status": "queued",
           "format": body.format, "quant": quant, "force": int(body.force)}
    svc.store.insert("exports", row)
    return export_view(svc.store.export(row["id"]))


@router.get("/fine_tuning/jobs/{job_id}/exports")
def list_exports(svc: Svc, job_id: str, after: Optional[str] = None,
                 limit: Annotated[int, Field(ge=1, le=100)] = 20):
    svc.job_or_404(job_id)
    rows = svc.store.query("SELECT * FROM exports WHERE job_id = ? ORDER BY seq DESC", job_id)
    ids = [r["id"] for r in rows]
    rows = rows[ids.index(after) + 1:] if after in ids else rows
    return page([export_view(r, tarball_sha256(svc, r)) for r in rows], limit)


@router.get("/fine_tuning/jobs/{job_id}/exports/{export_id}")
def get_export(svc: Svc, job_id: str, export_id: str):
    e = export_or_404(svc, job_id, export_id)
    return export_view(e, tarball_sha256(svc, e))


@router.get("/fine_tuning/jobs/{job_id}/exports/{export_id}/content")
def export_content(svc: Svc, job_id: str, export_id: str):
    e = export_or_404(svc, job_id, export_id)
    if e["status"] != "succeeded":
        raise ApiError(400, f"the export is {e['status']}: its file is there once it has succeeded", "export_id")
    f = svc.store.file(e["file_id"])
    return FileResponse(f["path"], media_type="application/gzip", filename=f["filename"])
