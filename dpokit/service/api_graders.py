"""OpenAI's grader endpoints for the jobs service (serve.py includes this router beside the others): run a grader
on one model sample, or check one, as the openai SDK's `client.fine_tuning.alpha.graders.run(...)` and
`.validate(...)` call them. graders.py evaluates it, the same function a reinforcement job's training calls on
each answer, so the endpoint's reward is the training's.

    client.fine_tuning.alpha.graders.run(grader={"type": "string_check", "name": "same", "operation": "eq",
        "input": "{{sample.output_text}}", "reference": "{{item.answer}}"}, model_sample="4", item={"answer": "4"})

A grader the kit cannot evaluate here is a 400 naming its field, as a job's creation refuses it (api_openai's
checked_grader): a judge model the service does not serve, cosine without --embeddings_base_url, a formula
outside calculate_output's arithmetic. What an answer or a judge does wrong is no 400: the response's
metadata.errors says it, with a reward of 0, as OpenAI reports it.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from fastapi import APIRouter

from dpokit.scoring import graders
from dpokit.service.api_openai import Grader, Strict, checked_grader, sandbox_problem
from dpokit.service.service import ApiError, Svc

router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", tags=["graders"])


class RunBody(Strict):
    grader: Grader
    model_sample: str
    item: Optional[Any] = None


class ValidateBody(Strict):
    grader: Grader


@router.post("/validate")
def validate(svc: Svc, body: ValidateBody):
    """OpenAI's GraderValidateResponse: the grader back, once the kit can evaluate it here."""
    grader = body.grader.model_dump(exclude_none=True)
    checked_grader(grader, svc, "grader")
    return {"grader": grader}


@router.post("/run")
def run(svc: Svc, body: RunBody):
    """OpenAI's GraderRunResponse for the grader on model_sample (the sample namespace: output_text, and
    output_json when it parses) and item (the item namespace)."""
    grader = body.grader.model_dump(exclude_none=True)
    checked_grader(grader, svc, "grader")
    if grader["type"] == "python" and not grader["source"].strip():
        raise ApiError(400, f"the kit's {grader['name']} grader runs an answer's code on its row's host, in a "
                       "reinforcement job's training only; give a python grader its source to run it here",
                       "grader.source")
    sandbox_problem(grader, svc.cfg, "grader")
    started = time.monotonic()
    graded = graders.run(grader, graders.sample_of(body.model_sample), body.item, svc.grader_endpoints())
    return graders.response(grader, graded, time.monotonic() - started)
