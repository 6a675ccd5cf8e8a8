"""docs/migrating-from-openai.md runs as written: each of its Python blocks, in order, in one namespace, against a
real service started with the page's own `make serve` arguments (only base_url points at the test's port).

    .venv/bin/python -m pytest -q tests/test_migrating.py
"""

import contextlib
import io
import re

import pytest

from dpokit.service import service
from test_serve import ROOT, TRAIN_ARGS, Service, needs_model

DOC = ROOT / "docs" / "migrating-from-openai.md"


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def serve_args(text: str) -> list[str]:
    """The page's `make serve ARGS="..."` as serve.py arguments."""
    import shlex

    (command,) = [b for b in blocks(text, "sh") if "make serve" in b]
    return shlex.split(re.search(r'ARGS="([^"]*)"', command).group(1))


def test_the_pages_code_compiles_and_its_service_arguments_are_the_services():
    text = DOC.read_text(encoding="utf-8")
    code = blocks(text, "python")
    assert len(code) >= 5
    for block in code:
        compile(block, str(DOC), "exec")
    args = serve_args(text)
    parsed = service.parse_model_map(args[args.index("--model_map") + 1])
    assert parsed and all(name.startswith(("gpt-", "o4-")) for name, _ in parsed)  # OpenAI's names
    assert "http://127.0.0.1:8000/v1" in code[0]  # the one line the test changes, as a user changes it


@needs_model
@pytest.mark.integration
def test_the_migration_page_runs_as_written_against_the_service(tmp_path, monkeypatch):
    text = DOC.read_text(encoding="utf-8")
    # the tests' small training (test_serve.TRAIN_ARGS), with room for the supervised rows' tool schema
    svc = Service(tmp_path / "art", None, f"--train_args={TRAIN_ARGS} --max_length 256", *serve_args(text))
    monkeypatch.chdir(tmp_path)  # the page writes its data files where it runs
    namespace, printed = {}, io.StringIO()
    try:
        for n, block in enumerate(blocks(text, "python")):
            code = block.replace("http://127.0.0.1:8000/v1", f"{svc.url}/v1")
            with contextlib.redirect_stdout(printed):
                exec(compile(code, f"{DOC.name} python block {n + 1}", "exec"), namespace)
    finally:
        svc.stop()
    job = namespace["job"]
    assert job.status == "succeeded", (job.error, svc.tail())
    assert job.model == "gpt-4o-mini-2024-07-18"
    assert job.fine_tuned_model.startswith("ft:gpt-4o-mini-2024-07-18:dpo-kit:arithmetic:")
    out = printed.getvalue()
    assert f"succeeded {job.fine_tuned_model} {job.trained_tokens}" in out
    assert ":ckpt-step-" in out and namespace["steps"] and namespace["reply"].choices[0].message.content
    assert namespace["more"].status == "cancelled"
    rft = namespace["rft_job"]
    assert rft.status == "succeeded" and rft.fine_tuned_model.startswith("ft:o4-mini-2025-04-16:dpo-kit::"), rft.error
    assert "\n8 1.0 {" in out and "\n9 0.0 {" in out  # the grader's answers, as it scores them in training
    sft = namespace["sft_job"]
    assert sft.status == "succeeded", sft.error
    assert f"succeeded {sft.fine_tuned_model}" in out
    exported = namespace["export"]  # the kit's own export endpoint, as the page calls it
    assert exported["status"] == "succeeded" and exported["report"]["format"] == "gguf"
    import hashlib

    assert hashlib.sha256((tmp_path / "model-gguf.tar.gz").read_bytes()).hexdigest() == exported["sha256"]
