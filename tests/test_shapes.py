"""Random bases (shapes.py, models.random_model_dir): the table against the published parameter counts, the
spec and cache rules, the weight generator against a pure-Python reference; a tiny shape built, cached and
loaded for real; two DPO steps on random:smollm2-135m (integration); the same on CUDA in 4-bit (gpu)."""
import contextlib
import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpokit.core import kit
from dpokit.model import models
from dpokit.model import shapes
from dpokit.train import training

ROOT = Path(__file__).resolve().parent.parent
needs_tokenizer = pytest.mark.skipif(not (ROOT / models.BUNDLED_MODEL_DIR / "tokenizer.json").exists(),
                                     reason="bundled model not converted (make model)")

# ------------------------------------------------------------------ pure: the table, specs, cache, shards


def test_every_shape_has_its_published_parameter_count():
    published = {  # the model cards' totals (tied embeddings once)
        "smollm2-135m": 134_515_008, "smollm2-360m": 361_821_120, "smollm2-1.7b": 1_711_376_384,
        "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3-8b": 8_030_261_248,
        "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512}
    assert {n: shapes.parameter_count(shapes.config_dict(n)) for n in shapes.SHAPES} == published


def test_the_8b_shape_is_llama_3_1_8b_and_qwen_ties_as_the_real_ones():
    c = shapes.config_dict("llama-3-8b")
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["intermediate_size"], c["vocab_size"], c["rope_parameters"]["rope_theta"]) == \
        (4096, 32, 32, 8, 14336, 128256, 500000.0)
    assert not c["tie_word_embeddings"] and shapes.SHAPES["llama-3-8b"].source == "meta-llama/Llama-3.1-8B-Instruct"
    ties = {n: shapes.config_dict(n)["tie_word_embeddings"] for n in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")}
    assert ties == {"qwen2.5-0.5b": True, "qwen2.5-1.5b": True, "qwen2.5-7b": False}
    assert shapes.config_dict("qwen2.5-7b")["vocab_size"] == 152064
    # every shape's vocabulary holds the SmolLM2 tokenizer's ids, and its token ids are that tokenizer's
    assert all(shapes.config_dict(n)["vocab_size"] >= 49152 and shapes.config_dict(n)["eos_token_id"] == 2
               for n in shapes.SHAPES)


def test_spec_parsing_and_the_one_sentence_for_an_unknown_name():
    assert shapes.parse("random:llama-3-8b") == ("llama-3-8b", 0)
    assert shapes.parse("random:qwen2.5-7b:12") == ("qwen2.5-7b", 12)
    assert shapes.is_random("random:x") and not shapes.is_random("models/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError) as e:
        shapes.parse("random:gpt-5")
    assert str(e.value).startswith("no random model shape 'gpt-5': the known ones are smollm2-135m, smollm2-360m,")
    assert "\n" not in str(e.value) and "qwen2.5-7b" in str(e.value)
    assert "whole number" in shapes.problem("random:llama-3-8b:x")
    assert shapes.problem("some/hub-id") is None and shapes.problem("random:smollm2-135m") is None


def test_unknown_shape_exits_2_before_anything_loads(tmp_path):
    t = time.time()
    out = subprocess.run([sys.executable, str(ROOT / "train_dpo.py"), "--data", "x.jsonl", "--model_name_or_path",
                          "random:gpt-5", "--output_dir", str(tmp_path / "art")], capture_output=True, text=True)
    assert out.returncode == 2 and time.time() - t < 5  # refused before torch is imported
    assert "--model_name_or_path: no random model shape 'gpt-5': the known ones are smollm2-135m" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "art").exists()


def test_cache_place_origin_and_shards():
    assert shapes.cache_dir("llama-3-8b", 0, {"DPO_KIT_CACHE": "/c"}) == Path("/c/random/llama-3-8b-seed0")
    assert shapes.cache_dir("x", 2, {}) == Path.home() / ".cache" / "dpo-kit" / "random" / "x-seed2"
    o = shapes.origin("qwen2.5-7b", 3)
    assert o["random"] and o["spec"] == "random:qwen2.5-7b:3" and o["shape_of"] == "Qwen/Qwen2.5-7B-Instruct"
    assert shapes.origin("qwen2.5-7b", 0)["spec"] == "random:qwen2.5-7b"
    assert shapes.shard_plan([("a", 3), ("b", 3), ("c", 9), ("d", 1), ("e", 2)], 6) == [["a", "b"], ["c"], ["d", "e"]]
    assert shapes.shard_names(1) == ["model.safetensors"]
    assert shapes.shard_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert shapes.tensor_key(0, "a") != shapes.tensor_key(1, "a") != shapes.tensor_key(0, "b")


# ------------------------------------------------------------------ the weight generator


def reference_values(count: int, key: int, bound: float):
    """random_uniform_'s docstring, one element at a time in Python integers and numpy float32."""
    import numpy as np

    def mix(x, c):
        x ^= x >> 16
        return (x * c) & 0xFFFFFFFF

    out = []
    for i in range(count):
        x = mix(mix(mix(i, 0x7FEB352D) ^ key, 0x68E31DA5), 0x5BD1E995)
        v = (np.float32(x >> 9) + np.float32(0.5)) * np.float32(2.0 ** -22) - np.float32(1.0)
        out.append(np.float32(v) * np.float32(bound))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("key", [0, 12345, 0xFFFFFFFF])
def test_random_values_follow_the_reference_in_any_chunking(key):
    import torch

    bound = 0.02 * 3 ** 0.5
    ref = torch.from_numpy(reference_values(300, key, bound))
    got = models.random_uniform_(torch.empty(300, dtype=torch.float32), key, bound, chunk=64)
    assert torch.equal(got, ref)
    big = models.random_uniform_(torch.empty(3, 40_000, dtype=torch.bfloat16), key, bound, chunk=1 << 22)
    small = models.random_uniform_(torch.empty(3, 40_000, dtype=torch.bfloat16), key, bound, chunk=777)
    assert torch.equal(big, small) and torch.equal(big.view(-1)[:300], ref.to(torch.bfloat16))
    assert big.abs().max() <= bound and abs(big.float().std().item() - 0.02) < 2e-4 and abs(big.float().mean()) < 5e-4


TINY = shapes.Shape("a test shape", {**shapes._QWEN2, "hidden_size": 64, "intermediate_size": 128,
                                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                     "vocab_size": 49152, "max_position_embeddings": 512,
                                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                     "tie_word_embeddings": False})


@needs_tokenizer
def test_a_tiny_shape_is_built_once_sharded_and_loads_as_written(tmp_path, monkeypatch, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setitem(shapes.SHAPES, "tiny-qwen2", TINY)
    monkeypatch.setattr(models, "SHARD_BYTES", 1 << 20)  # the 6 MB embeddings and head alone: three files
    monkeypatch.setenv("DPO_KIT_CACHE", str(tmp_path))
    monkeypatch.chdir(ROOT)  # the bundled tokenizer's path is relative to the repository
    path = Path(models.resolve_model_path("random:tiny-qwen2:3"))
    assert path == tmp_path / "random" / "tiny-qwen2-seed3"
    assert "RANDOMLY INITIALISED (seed 3) in the shape of a test shape" in capsys.readouterr().out
    assert sorted(p.name for p in path.glob("*.safetensors")) == shapes.shard_names(3)
    assert (path / "tokenizer.json").exists() and not list(tmp_path.glob("random/.*"))  # no temporary left
    assert json.loads((path / "kit_origin.json").read_text()) == shapes.origin("tiny-qwen2", 3)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    attn = model.model.layers[1].self_attn
    expected = models.random_uniform_(torch.empty_like(attn.q_proj.weight),
                                      shapes.tensor_key(3, "model.layers.1.self_attn.q_proj.weight"), 0.02 * 3 ** 0.5)
    assert torch.equal(attn.q_proj.weight, expected) and not attn.q_proj.bias.any()  # Qwen2: q, k, v biases, zero
    assert bool((model.model.norm.weight == 1).all()) and not torch.equal(model.lm_head.weight,
                                                                          model.model.embed_tokens.weight)

    stamp = (path / "model-00001-of-00003.safetensors").stat().st_mtime_ns
    assert models.random_model_dir("random:tiny-qwen2:3") == path  # found, not built again
    assert (path / "model-00001-of-00003.safetensors").stat().st_mtime_ns == stamp
    assert "built" not in capsys.readouterr().out
    (path / "kit_origin.json").write_text(json.dumps(shapes.origin("tiny-qwen2", 3) | {"format": 0}))
    models.random_model_dir("random:tiny-qwen2:3")  # an older format: built again
    assert "built" in capsys.readouterr().out and json.loads((path / "kit_origin.json").read_text())["format"] == 1

    quantized = models.load_model(str(path), models.LoadOptions(), on_gpu=False, bf16_ok=False)
    assert type(quantized.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"  # quantised like any base
    with torch.no_grad():
        logits = quantized(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 49152) and bool(torch.isfinite(logits).all())


# ------------------------------------------------------------------ integration: DPO steps on a random base

PAIRS = [{"prompt": f"Question {i}: how do I free disk space?\nAnswer:", "chosen": f" Remove cache {i}.",
          "rejected": f" Delete everything {i}."} for i in range(4)]


def random_run(tmp_path, name, *extra):
    """Two real DPO steps in-process on random:smollm2-135m; the run directory and what it printed."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    args = ["--data", data, "--output_dir", tmp_path / "art", "--run_name", name, "--model_name_or_path",
            "random:smollm2-135m", "--max_steps", 2, "--per_device_train_batch_size", 2, "--max_length", 64,
            "--lora_r", 4, "--lora_alpha", 8, "--eval_fraction", 0, "--probes", "", *extra]
    cwd, out = os.getcwd(), io.StringIO()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out):
            status = kit.run_cli(training.main, list(map(str, args)))
    finally:
        os.chdir(cwd)
    assert status == 0, out.getvalue()[-3000:]
    return tmp_path / "art" / name, out.getvalue()


def check_random_run(run_dir: Path, printed: str) -> dict:
    """The run says everywhere that its base is random; returns its data.json."""
    assert "random:smollm2-135m is RANDOMLY INITIALISED (seed 0)" in printed
    data = json.loads((run_dir / "data.json").read_text())
    assert data["random_base"].startswith("random:smollm2-135m is RANDOMLY INITIALISED")
    assert "**Random base**: random:smollm2-135m is RANDOMLY" in (run_dir / "README.md").read_text()
    base = json.loads((run_dir / "manifest.json").read_text())["base_model"]
    assert base["origin"]["random"] and base["origin"]["shape_of"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert list(base["weights_sha256"]) == ["model.safetensors"]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and abs(losses[0] - math.log(2)) < 0.02  # policy = reference at the first step
    return data


@needs_tokenizer
@pytest.mark.integration
def test_two_dpo_steps_on_a_random_base_say_it_is_random(tmp_path):
    run_dir, printed = random_run(tmp_path, "r")
    data = check_random_run(run_dir, printed)
    assert "float32" in data["compute"] and json.loads((run_dir / "config.json").read_text())[
        "model_name_or_path"] == "random:smollm2-135m"  # chat, merge and eval build the same base again


# ------------------------------------------------------------------ gpu: the same on CUDA (bench/gpu.sh)


@pytest.mark.gpu
def test_random_values_are_the_same_bits_on_cuda_and_cpu():
    import torch

    for key in (0, 7, 0xFFFFFFFF):
        cpu = models.random_uniform_(torch.empty(5_000_001, dtype=torch.bfloat16), key, 0.0346)
        cuda = models.random_uniform_(torch.empty(5_000_001, dtype=torch.bfloat16, device="cuda"), key, 0.0346,
                                      chunk=1 << 26)
        assert torch.equal(cpu, cuda.cpu())


@needs_tokenizer
@pytest.mark.gpu
@pytest.mark.parametrize("fused", ["--fused_ops", "--no_fused_ops", "--no_dequantize_on_gpu"])
def test_two_dpo_steps_on_a_random_base_in_4bit_on_cuda(tmp_path, fused):
    """The default dequantises the NF4 base once where it fits (an H100 or H200 fits it many times over) and
    says so; --no_dequantize_on_gpu keeps bitsandbytes' kernels. Either way every LoRA layer takes the kernel."""
    import torch

    import importlib.util

    run_dir, printed = random_run(tmp_path, "g", fused)
    data = check_random_run(run_dir, printed)
    if fused == "--no_dequantize_on_gpu":
        assert data["compute"].startswith("4-bit kernels") and "bfloat16" in data["compute"]
    else:
        assert data["compute"].startswith("NF4 weights dequantised once to bfloat16 (cuda)"), data["compute"]
        assert "[model] cuda: 210 NF4 layers dequantised once to bfloat16" in printed
    assert "[batch] kept from GPU memory: 2 pairs per forward x 1 accumulated" in printed
    assert json.loads((run_dir / "manifest.json").read_text())["device"] == torch.cuda.get_device_name(0)
    if fused == "--no_fused_ops":
        assert not data["fused_ops"] and "fused ops" not in printed
        return
    # Which fused parts ran: every LoRA layer (4-bit bases: peft's bitsandbytes class), the lean head, and the
    # norms and gated MLPs by Liger where it is installed, else by the kit; none kept its own forward.
    f = data["fused_ops"]
    assert f["lora_linear"] == 30 * 7 and f["own_forward"] == {} and f["chunked_head"] and f["dtype"] == "bfloat16"
    if importlib.util.find_spec("liger_kernel"):
        assert (f["rms_norm"], f["mlp"]) == (0, 0) and "Liger's Triton kernels: 91 norms and MLPs" in printed
    else:
        assert (f["rms_norm"], f["mlp"]) == (61, 30)
    assert "kept their own forward" not in printed


@needs_tokenizer
@pytest.mark.gpu
def test_trl_best_switches_with_liger_on_cuda(tmp_path):
    pytest.importorskip("liger_kernel")
    run_dir, printed = random_run(tmp_path, "l", "--no_fused_ops", "--no_chunked_logps", "--use_liger_kernel",
                                  "--precompute_ref_log_probs")
    assert check_random_run(run_dir, printed)["logps"].startswith("chunked by TRL, Liger kernels")


@needs_tokenizer
@pytest.mark.gpu
def test_pairs_per_forward_chosen_from_gpu_memory_train_what_accumulation_trains(tmp_path):
    """4 pairs a step asked as 1 pair x 4 accumulated: the GPU holds all 4 in one forward, so the kit runs them
    so; the losses at each step are those of the run held to 1 x 4 (--no_auto_micro_batch), to bfloat16 noise."""
    asked = ["--per_device_train_batch_size", 1, "--gradient_accumulation_steps", 4]
    chosen, printed = random_run(tmp_path / "a", "chosen", *asked)
    assert "[batch] chosen from GPU memory: 4 pairs per forward x 1 accumulated = 4 pairs per step" in printed
    assert json.loads((chosen / "data.json").read_text())["micro_batch"]["pairs_per_forward"] == 4
    kept, printed = random_run(tmp_path / "b", "kept", *asked, "--no_auto_micro_batch")
    assert "from GPU memory" not in printed

    def losses(run):
        return [json.loads(r)["loss"] for r in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in r]

    a, b = losses(chosen), losses(kept)
    assert len(a) == len(b) == 2 and all(abs(x - y) < 2e-2 for x, y in zip(a, b)), (a, b)
