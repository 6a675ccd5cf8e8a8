"""bench/bench.py: the FLOP formula, the step timings and the ratios on worked numbers (no model, no training)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench  # noqa: E402
import build_pairs as bp  # noqa: E402
import kit  # noqa: E402

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152}


def test_model_shape_of_smollm2_135m():
    shape = bench.model_shape(SMOLLM2)
    # per layer: q, o 576x576; k, v 576x192 (3 KV heads of 64); gate, up, down 576x1536
    assert shape["n_blocks"] == 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) == 106_168_320
    assert shape["n_head"] == 576 * 49152 == 28_311_552  # tied to the embeddings, still a matmul
    assert shape["n_base"] == 134_479_872
    assert bench.lora_params(SMOLLM2, r=16) == 30 * 16 * (2 * 1152 + 2 * 768 + 3 * 2112) == 4_884_480


def test_step_flops_worked_example():
    shape = {"n_base": 100, "n_head": 30, "layers": 2, "d_model": 4}
    f = bench.step_flops(shape, n_lora=10, seq_len=8, batch=1, reference=True)
    # prompt 2 tokens, completions 6 each: 2 + 12 = 14 tokens through the 70 block parameters (+ 10 LoRA);
    # attention 4 * 2 layers * 4 = 32 per query-key pair, over 2 * 2 (prompt) + 12 * 8 (completions) = 100
    # pairs = 3,200; the head (30) for the 12 completion tokens: 12 * 2 * 30 = 720 per pass
    assert f["policy_forward"] == 14 * 2 * 80 + 3200 + 720 == 6160
    assert f["policy_backward"] == 14 * (2 * 70 + 4 * 10) + 2 * 3200 + 720 == 9640
    assert f["reference_forward"] == 14 * 2 * 70 + 3200 + 720 == 5880
    assert f["total"] == 21680
    assert bench.step_flops(shape, 10, 8, 1, reference=False)["total"] == 21680 - 5880


def test_mode_dtype_follows_the_flag_else_the_auto_choice():
    assert bench.mode_dtype(bench.MODES["default"], auto="float32") == "float32"
    assert bench.mode_dtype(bench.MODES["default"], auto="bfloat16") == "bfloat16"
    assert bench.mode_dtype(bench.MODES["trl_separate_ref"], auto="bfloat16") == "float32"
    assert bench.mode_dtype(bench.MODES["default_bf16"], auto="float32") == "bfloat16"
    assert bench.mode_dtype(bench.MODES["cpu_matmul_bf16"], auto="float32") == "bfloat16"


def test_summarize_steps_worked_example():
    s = bench.summarize_steps([10.0, 12.0, 15.0, 17.0], process_start=0.0, init_end=5.0, train_begin=6.0,
                              batch=4, seq_len=100)
    assert s["steps"] == 4 and s["step_s"] == 2.0  # median of the gaps 2, 3, 2; the first step is warm-up
    assert s["startup_s"] == 6.0 and s["first_step_end_s"] == 10.0 and s["first_step_s"] == 4.0 and s["precompute_s"] == 1.0
    assert s["pairs_per_s"] == 2.0 and s["tokens_per_s"] == 4 * 2 * 100 / 2.0
    assert s["pairs_per_s_with_precompute"] == pytest.approx(16 / (1.0 + 4 * 2.0))


def result(pairs_per_s, peak, mfu=0.1, startup=30.0):
    return {"pairs_per_s": pairs_per_s, "peak_train_mb": peak, "mfu": mfu, "startup_s": startup, "tokens_per_s": 1.0,
            "step_s": 1.0, "gflops": 1.0, "precompute_s": 0.0, "last_loss": 0.69}


def test_ratios_and_goals():
    train = {"default": {"256": result(0.75, 3000, mfu=0.2, startup=15.0), "1024": result(0.3, 4000)},
             "trl_separate_ref": {"256": result(0.5, 4000), "1024": result(0.2, 8000)}}
    r = bench.ratios(train, [256, 1024])
    assert r["speed_default_vs_trl_separate_ref_L256"] == pytest.approx(1.5)
    assert r["speed_default_vs_trl_separate_ref_L1024"] == pytest.approx(1.5)
    assert r["memory_default_vs_trl_separate_ref_L1024"] == pytest.approx(0.5)
    assert r["mfu_default_L256"] == 0.2 and r["startup_default_s"] == 15.0
    assert "speed_default_vs_bnb_kernels_L256" not in r  # not run: no ratio, no goal row
    rows = {g.split(" [")[-1].rstrip("]"): ok for g, _, ok in bench.goal_rows(r, [])}
    assert rows["speed_default_vs_trl_separate_ref_L256"] == "met"
    assert rows["memory_default_vs_trl_separate_ref_L1024"] == "met"
    assert rows["mfu_default_L256"].startswith("missed (0.40x")
    assert rows["startup_default_s"] == "met"
    pairs = [{"runs": 10_000, "runs_per_s": 25_000.0, "peak_mb": 30.0},
             {"runs": 1_000_000, "runs_per_s": 10_000.0, "peak_mb": 130.0}]
    goal, measured, ok = bench.goal_rows({}, pairs)[0]
    assert measured == "10,000" and ok == "missed (0.50x target)"
    assert bench.goal_rows({}, pairs)[1][1:] == ("100 MB", "missed (2.00x target)")


def test_markdown_table():
    results = {"quick": True, "lengths": [128], "steps": {"128": 1}, "batch_size": 4,
               "machine": {"cpu": "cpu", "cores": 2, "torch_threads": 2, "python": "3.11", "versions": {"trl": "1"}},
               "matmul": {"size": 64, "gflops": 100.0},
               "train": {"default": {"128": result(0.5, 2000)}, "no_4bit": {"128": {"error": "exit 1: boom"}}},
               "build_pairs": [{"runs": 10_000, "runs_per_s": 5000.0, "runs_per_s_wall": 4000.0, "workers": 2,
                                "peak_mb": 69.0, "main_peak_mb": 29.0, "wall_s": 2.5, "pairs": 13}]}
    results["ratios"] = bench.ratios(results["train"], [128])
    text = bench.markdown(results)
    assert "| default | 128 | float32 | 0.500 |" in text and "failed: exit 1: boom" in text
    assert "| 10,000 | 2 | 5,000 | 4,000 | 69 | 29 | 2.50 | 13 |" in text and "100.0 GFLOP/s" in text


def test_config_defaults_and_problems():
    quick = kit.parse_config(bench.BenchConfig, ["--quick"], "")
    assert quick.length_list() == [128, 256] and quick.run_sizes() == [10_000, 100_000]
    full = kit.parse_config(bench.BenchConfig, [], "")
    assert quick.mode_list() == ["default", "trl_separate_ref"] and quick.step_count(256) == 1
    assert full.length_list() == [256, 1024] and full.run_sizes()[-1] == 1_000_000
    assert full.step_count(256) == 3 and full.step_count(1024) == 1
    assert {"default", "trl_separate_ref", "precompute_ref", "no_4bit"} <= set(full.mode_list())  # (a)-(d)
    assert not set(bench.OPTIONAL_MODES) & set(full.mode_list())
    with pytest.raises(kit.UserError, match="unknown fast"):
        kit.parse_config(bench.BenchConfig, ["--modes", "default,fast"], "")


def test_generated_run_logs_are_valid_fresh_and_share_prompts(tmp_path):
    dest = tmp_path / "runs.jsonl"
    bench.write_run_logs(ROOT / "data" / "runs.jsonl", dest, 300, seed=0)
    runs = [bp.parse_run(json.loads(line), str(dest), i) for i, line in enumerate(dest.open(), 1)]
    assert len(runs) == 300 and len({r.run_id for r in runs}) == 300
    assert len({r.strategy for r in runs}) == 300  # every run's own strategy: its pairs are not duplicates
    assert len({bp.prompt_key(r.messages) for r in runs}) < 300  # some runs share a prompt (cross_run)


def test_precision_verdict_compares_with_the_seed_to_seed_spread():
    import precision

    def row(dtype, acc, margin):
        return {"dtype": dtype, "tuned": {"accuracy": acc, "margin": margin}}

    base = [row("float32", a, m) for a, m in ((0.80, 2.0), (0.86, 2.4), (0.83, 2.2))]
    close = base + [row("bfloat16", a, m) for a, m in ((0.83, 2.1), (0.80, 2.3), (0.86, 2.2))]
    v = precision.verdict(close, "float32", "bfloat16", held=35)
    assert v["same"] and abs(v["accuracy"]["difference"]) < 1e-9
    assert v["accuracy"]["allowance"] == pytest.approx(max(2 * 0.03, 1 / 35))
    worse = base + [row("bfloat16", a, m) for a, m in ((0.60, 0.9), (0.63, 1.0), (0.57, 1.1))]
    v = precision.verdict(worse, "float32", "bfloat16", held=35)
    assert not v["same"] and not v["accuracy"]["same"] and not v["margin"]["same"]
