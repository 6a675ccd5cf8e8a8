"""make export (export.py): the refusal rule and the Ollama Modelfile without a model; then a real run exported
as a GGUF by llama.cpp's converter, checked in llama.cpp's runtime (held-out answers scored by the checker, greedy
probe tokens against the merged model), answering a chat with its template, kept with checksums that make verify
reads, and refused by it once corrupted."""
import gzip
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from dpokit.train import export
from dpokit.core import kit
from dpokit.core import runs
from test_serve import MODEL, free_port, needs_model

ROOT = Path(__file__).resolve().parent.parent


def test_an_export_is_refused_for_a_pass_rate_below_the_tolerance_or_too_little_agreement_and_says_which():
    adapter = {"pass_rate": 0.40, "mean_score": 0.01}
    assert export.verdict(adapter, {"pass_rate": 0.36}, 0.99, 0.05, 0.95) is None  # within 0.05
    assert export.verdict(adapter, {"pass_rate": 0.35}, 0.99, 0.05, 0.95) is None  # exactly at the edge
    low = export.verdict(adapter, {"pass_rate": 0.30}, 0.99, 0.05, 0.95)
    assert "0.300" in low and "0.400" in low and "agreement" not in low and "top-1" not in low
    disagree = export.verdict(adapter, {"pass_rate": 0.40}, 0.90, 0.05, 0.95)
    assert "90.0%" in disagree and "pass rate" not in disagree
    both = export.verdict(adapter, {"pass_rate": 0.0}, 0.5, 0.05, 0.95)
    assert "pass rate" in both and "top-1" in both
    assert export.verdict(None, None, 0.97, 0.05, 0.95) is None  # no held-out prompts: agreement only
    assert export.ExportConfig(run="r", quant="q4_k_m").tolerance() == 0.10
    assert export.ExportConfig(run="r", format="merged").tolerance() == 0.05
    assert export.ExportConfig(run="r", pass_tolerance=0.2).tolerance() == 0.2
    assert export.ExportConfig(run="r", quant="q4_k_m").agreement() == 0.90
    assert export.ExportConfig(run="r").agreement() == 0.95
    assert export.ExportConfig().problems() and export.ExportConfig(run="r", min_agreement=2).problems()


def test_agreement_counts_the_answer_tokens_only():
    # sequences of 5 tokens whose answer starts at 3: positions 2..3 predict tokens 3..4
    reference, other = [[9, 9, 1, 2, 0]], [[7, 7, 1, 5, 0]]
    assert export.agreement(reference, other, [3]) == 0.5
    assert export.agreement(reference, reference, [3]) == 1.0


def test_the_modelfile_points_at_the_gguf_and_stops_at_the_end_tokens():
    text = export.modelfile("run-q8_0.gguf", "{% for m in messages %}<|im_start|>{{ m.role }}...", ["<|im_end|>"])
    assert text.splitlines()[0] == "FROM ./run-q8_0.gguf" and 'PARAMETER stop "<|im_end|>"' in text
    assert "TEMPLATE" in text and "TEMPLATE" not in export.modelfile("x.gguf", "[INST]", ["</s>"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A two-step run on the bundled model with held-out prompts and probes, exported as a q8_0 GGUF."""
    if not (MODEL / "config.json").exists():
        pytest.skip("bundled model not converted (make model)")
    from test_train_dpo import small_run

    from dpokit.scoring import checker

    tmp = tmp_path_factory.mktemp("export")
    prompts = tmp / "prompts.jsonl"  # three of the demo's tasks on their hosts (no run: each is held out)
    prompts.write_text("".join(json.dumps({"prompt": p["prompt"], "host": p["host"]}) + "\n"
                               for p in checker.prompts_from_logs(str(ROOT / "data" / "runs.jsonl"))[:3]))
    run_dir, _ = small_run(tmp, "trl_conversational", "exp", "--probes", ROOT / "data" / "probes.jsonl",
                           "--eval_prompts", prompts, "--eval_samples", "2", "--eval_max_new_tokens", "48")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        dest = export.export(export.ExportConfig(run=str(run_dir), format="gguf", quant="q8_0", force=True))
    finally:
        os.chdir(cwd)
    return run_dir, dest


@needs_model
@pytest.mark.integration
def test_a_run_exports_to_a_gguf_checked_in_llama_cpps_runtime_against_the_adapter(exported):
    run_dir, dest = exported
    report = json.loads((dest / "export_report.json").read_text())
    evaluation = json.loads((run_dir / "evaluation.json").read_text())["execution"]
    assert report["held_out_prompts"] == evaluation["prompts"] > 0  # the report's prompts, the report's figures
    assert report["adapter"]["pass_rate"] == evaluation["tuned"]["pass_rate"]
    assert report["export"]["answers"] == evaluation["tuned"]["answers"]  # every held-out answer scored
    assert report["probe_top1_agreement"] >= 0.95 and report["probe_tokens"] > 20  # q8_0 keeps the greedy tokens
    assert report["tokens_per_s"] > 0 and report["bytes"] == (dest / "exp-q8_0.gguf").stat().st_size
    card = (dest / "README.md").read_text()
    assert "| held-out pass rate" in card and "Top-1 agreement" in card
    assert (dest / "Modelfile").read_text().startswith("FROM ./exp-q8_0.gguf")
    manifest = runs.verify_tarball(dest.parent / f"{dest.name}.tar.gz")
    assert manifest["kind"] == "export" and set(manifest["files"]) >= {"exp-q8_0.gguf", "export_report.json"}


@needs_model
@pytest.mark.integration
def test_the_exported_gguf_answers_a_chat_in_llama_cpp_with_the_template_it_trained_with(exported):
    import llama_cpp
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    run_dir, dest = exported
    gguf_file = dest / "exp-q8_0.gguf"
    field = GGUFReader(str(gguf_file)).fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode()
    assert template == AutoTokenizer.from_pretrained(run_dir).chat_template
    llm = llama_cpp.Llama(str(gguf_file), n_ctx=512, verbose=False)
    reply = llm.create_chat_completion(messages=[{"role": "user", "content": "What is 1+1?"}], max_tokens=12,
                                       temperature=0)
    assert reply["choices"][0]["message"]["content"].strip()
    prompt = llm.tokenize(b"x")  # the runtime works on the vocabulary the kit's tokenizer has
    assert llm.n_vocab() == len(AutoTokenizer.from_pretrained(run_dir)) and prompt


@needs_model
@pytest.mark.integration
def test_verify_refuses_a_corrupted_or_truncated_export(exported, tmp_path):
    _, dest = exported
    good = dest.parent / f"{dest.name}.tar.gz"
    data = good.read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(kit.UserError, match="not a readable"):
        runs.verify_tarball(cut)
    # the GGUF changed inside a well-formed archive: its sha256 no longer matches the manifest
    with tarfile.open(good) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as out:
        for m, content in members:
            if content is not None and m.name.endswith(".gguf"):
                content = content[:-4096] + bytes(4096)
            out.addfile(m, io.BytesIO(content) if content is not None else None)
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(buf.getvalue())
    with pytest.raises(kit.UserError, match="exp-q8_0.gguf: sha256 differs"):
        runs.verify_tarball(bad)
    # a GGUF cut short and its manifest rewritten to match: the checksums pass, the GGUF does not read
    unpacked = tmp_path / "unpacked"
    manifest = runs.verify_tarball(good, unpacked)
    top = unpacked / manifest["run_name"]
    (top / "exp-q8_0.gguf").write_bytes((top / "exp-q8_0.gguf").read_bytes()[:100_000])
    runs.write_export_manifest(top, manifest["run_name"], json.loads((top / "export_report.json").read_text()))
    runs.make_tarball(top, tmp_path / "short.tar.gz")
    with pytest.raises(kit.UserError, match="not a readable GGUF"):
        runs.verify_tarball(tmp_path / "short.tar.gz")


@needs_model
@pytest.mark.integration
def test_an_exported_gguf_is_a_base_to_train_from_again(exported, tmp_path, monkeypatch, capsys):
    """The round trip: the GGUF the export wrote is --model_name_or_path (make train MODEL=) for a second run,
    converted once into the cache; the base that run trains is the export's model, not the bundled one."""
    from dpokit.model import models
    from test_train_dpo import small_run
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, dest = exported
    gguf_file = dest / "exp-q8_0.gguf"
    monkeypatch.setenv("DPO_KIT_CACHE", str(tmp_path / "cache"))
    again, printed = small_run(tmp_path, "trl_conversational", "again", "--model_name_or_path", gguf_file)
    assert (again / "adapter_model.safetensors").exists()
    base = json.loads((again / "manifest.json").read_text())["base_model"]
    assert base["origin"]["gguf_sha256"] == kit.sha256_file(gguf_file)
    assert "converting exp-q8_0.gguf" in printed
    capsys.readouterr()
    converted = Path(models.resolve_model_path(str(gguf_file)))  # the cache's copy: not converted a second time
    assert converted.parent == tmp_path / "cache" / "gguf" and "converting" not in capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(run_dir).chat_template
    # the converted base is the GGUF's model: its greedy answers to the probes, token by token, are what llama.cpp's
    # runtime predicts from the same file (the export's own check, the other way round). Every probe: llama.cpp's
    # q8_0 kernels round the activations to 8 bits as well, so a near-tie may flip, and over 3 probes' 18 tokens
    # one flip (on an AVX2 CPU, after a change that moved the adapter by float rounding) read 0.944
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    probes = [json.loads(line) for line in (ROOT / "data" / "probes.jsonl").read_text().splitlines()]
    sequences, starts = export.probe_sequences(model, tokenizer, probes)
    runtime = export.GgufRuntime(gguf_file, n_ctx=512)
    assert export.agreement([export.hf_top1(model, s) for s in sequences], [runtime.top1(s) for s in sequences],
                            starts) >= 0.95
    with pytest.raises(kit.UserError, match="no such GGUF"):
        models.resolve_model_path(str(tmp_path / "missing.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(kit.UserError, match="cannot load this GGUF"):
        models.resolve_model_path(str(tmp_path / "junk.gguf"))


@needs_model
@pytest.mark.integration
def test_llama_cpps_openai_server_serves_the_export_as_docs_handoff_says(exported, tmp_path):
    """docs/handoff.md's llama.cpp line, run: `python -m llama_cpp.server --model <gguf>` (llama-cpp-python's
    server, installed by make llama-cpp) answers the openai SDK with the chat template the run trained with."""
    import subprocess
    import sys
    import time

    import openai
    from transformers import AutoTokenizer

    run_dir, dest = exported
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(dest / "exp-q8_0.gguf"),
                               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "1024"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for _ in range(120):
            try:
                models = [m.id for m in client.models.list()]
                break
            except openai.APIConnectionError:
                assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
                time.sleep(0.5)
        else:
            pytest.fail("llama_cpp.server did not answer in 60 s")
        messages = [{"role": "user", "content": "What is 1+1?"}]
        reply = client.chat.completions.create(model=models[0], messages=messages, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content.strip() and reply.choices[0].finish_reason in ("stop", "length")
        # the prompt the server built is the one the run's own tokenizer and template build
        rendered = AutoTokenizer.from_pretrained(run_dir).apply_chat_template(messages, add_generation_prompt=True,
                                                                             tokenize=False)
        tokens = AutoTokenizer.from_pretrained(run_dir).encode(rendered, add_special_tokens=False)
        assert reply.usage.prompt_tokens == len(tokens)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model=models[0], messages=messages, max_tokens=16, temperature=0, stream=True) if chunk.choices)
        assert streamed == reply.choices[0].message.content
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_the_adapters_figures_come_from_the_report_only_when_it_scored_the_same_prompts(tmp_path):
    """Otherwise None, and the export samples the adapter's side itself (never a silent skip of the pass rate)."""
    prompts = [{"prompt": [{"role": "user", "content": f"task {i}"}], "host": "h"} for i in range(2)]
    rows = [{"model": m, "prompt": f"task {i}"} for m in ("base", "tuned") for i in range(2) for _ in range(4)]
    tuned = {"pass_rate": 0.5, "mean_score": 0.1, "answers": 8}
    (tmp_path / "evaluation.json").write_text(json.dumps({"execution": {"prompts": 2, "samples": 4, "rows": rows,
                                                                        "tuned": tuned}}))
    got = export.adapter_figures(tmp_path, prompts, 4)
    assert got["pass_rate"] == 0.5 and got["source"] == "the run's report"
    assert export.adapter_figures(tmp_path, prompts, 8) is None  # other samples
    other = [{"prompt": [{"role": "user", "content": "task 0"}]}, {"prompt": [{"role": "user", "content": "task 9"}]}]
    assert export.adapter_figures(tmp_path, other, 4) is None  # as many prompts, not the same ones
    assert export.adapter_figures(tmp_path, prompts[:1], 4) is None
    assert export.adapter_figures(tmp_path / "nowhere", prompts, 4) is None


@needs_model
@pytest.mark.integration
def test_a_merged_export_is_bfloat16_checked_from_its_files_and_measures_the_adapter_when_the_report_cannot(
        exported, tmp_path):
    """FORMAT=merged: written in bfloat16 from the float32 merge, read back for the check. The run's report here
    scored other prompts (its rows renamed), so the adapter's side is sampled by the export, and says so."""
    import shutil

    from safetensors import safe_open

    run_dir, _ = exported
    copy = tmp_path / run_dir.name
    shutil.copytree(run_dir, copy)
    evaluation = json.loads((copy / "evaluation.json").read_text())
    for row in evaluation["execution"]["rows"]:
        row["prompt"] = "another task"
    (copy / "evaluation.json").write_text(json.dumps(evaluation))
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        dest = export.export(export.ExportConfig(run=str(copy), format="merged", output_dir=str(tmp_path / "out"),
                                                 force=True))
    finally:
        os.chdir(cwd)
    report = json.loads((dest / "export_report.json").read_text())
    assert report["adapter"]["source"].startswith("measured by the export")
    assert report["adapter"]["answers"] == report["export"]["answers"] > 0
    assert report["probe_top1_agreement"] >= 0.95  # bfloat16 rounding moves few greedy tokens
    assert json.loads((dest / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(dest / "model" / "model.safetensors"), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}
    assert "measured by the export" in (dest / "README.md").read_text()
    assert runs.verify_tarball(dest.parent / f"{dest.name}.tar.gz")["kind"] == "export"
