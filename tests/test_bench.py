"""bench/bench.py: the FLOP formula, the step timings, the ratios and the options on worked numbers (no model, no
training); one quick CPU run of the new modes on a random shape (integration)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench  # noqa: E402
from dpokit.pairs import from_logs as bp  # noqa: E402
from dpokit.data import runlogs
from dpokit.core import kit  # noqa: E402
from dpokit.train import methods  # noqa: E402

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


def test_step_flops_with_the_prompt_three_quarters():
    shape = {"n_base": 100, "n_head": 30, "layers": 2, "d_model": 4}
    f = bench.step_flops(shape, n_lora=10, seq_len=8, batch=1, reference=False, prompt_fraction=0.75)
    # prompt 6 tokens, completions 2 each: 6 + 4 = 10 tokens; attention over 6 * 6 + 4 * 8 = 68 query-key pairs
    # (x 32 = 2,176); the head for the 4 completion tokens: 4 * 2 * 30 = 240 per pass
    assert f["policy_forward"] == 10 * 2 * 80 + 2176 + 240
    assert f["policy_backward"] == 10 * (2 * 70 + 4 * 10) + 2 * 2176 + 240 and f["reference_forward"] == 0
    assert bench.prompt_tokens(1024, 0.75) == 768 and bench.prompt_tokens(4096, 0.25) == 1024
    assert bench.prompt_tokens(130) == 130 // 4  # the CPU bench's layout as before


def test_cases_batches_devices_and_mode_flags():
    assert bench.case_key(1024, 0.25) == "1024" and bench.case_key(1024, 0.75) == "1024p0.75"
    assert bench.batch_for(1024, 4, 0) == 4 and bench.batch_for(1024, 4, 16384) == 4
    assert bench.batch_for(4096, 4, 16384) == 2 and bench.batch_for(4096, 4, 1000) == 1  # never below one pair
    assert bench.resolve_device("auto", True) == "cuda" and bench.resolve_device("auto", False) == "cpu"
    assert bench.resolve_device("cpu", True) == "cpu"
    with pytest.raises(kit.UserError, match="--device cuda: torch sees no CUDA device"):
        bench.resolve_device("cuda", False)
    best = bench.mode_flags("trl_best", "m", liger=True)
    assert {"--precompute_ref_log_probs", "--no_fused_ops", "--no_chunked_logps", "--use_liger_kernel"} <= set(best)
    assert "--use_liger_kernel" not in bench.mode_flags("trl_best", "m", liger=False)
    assert bench.mode_flags("trl_separate_ref", "random:x", liger=True)[:2] == ["--ref_model_name_or_path", "random:x"]
    assert "--use_liger_kernel" not in bench.mode_flags("default", "m", liger=True)


def test_trl_best_flags_are_options_train_dpo_accepts():
    from dpokit.train import training

    flags = bench.mode_flags("trl_best", "m", liger=False)
    cfg = kit.parse_config(training.TrainConfig, ["--data", "x.jsonl", *flags], "")
    assert cfg.precompute_ref_log_probs and not cfg.fused_ops and not cfg.chunked_logps and not cfg.use_liger_kernel
    kwargs = methods.dpo_config_kwargs(cfg, "/tmp/ck", False, False)
    assert kwargs["precompute_ref_log_probs"] and kwargs["use_liger_kernel"] is False
    with pytest.raises(kit.UserError, match="--use_liger_kernel patches the modules --fused_ops fuses"):
        kit.parse_config(training.TrainConfig, ["--data", "x.jsonl", "--use_liger_kernel"], "")


def test_mode_dtype_follows_the_flag_else_the_auto_choice():
    assert bench.mode_dtype(bench.MODES["default"], auto="float32") == "float32"
    assert bench.mode_dtype(bench.MODES["default"], auto="bfloat16") == "bfloat16"
    assert bench.mode_dtype(bench.MODES["trl_separate_ref"], auto="bfloat16") == "bfloat16"  # TRL on a GPU: bf16
    assert bench.mode_dtype(bench.MODES["trl_separate_ref"], auto="float32") == "float32"
    assert bench.mode_dtype(bench.MODES["default_bf16"], auto="float32") == "bfloat16"
    assert bench.mode_dtype(bench.MODES["cpu_matmul_bf16"], auto="float32") == "bfloat16"


def test_summarize_steps_worked_example():
    s = bench.summarize_steps([10.0, 12.0, 15.0, 17.0], process_start=0.0, init_end=5.0, train_begin=6.0,
                              batch=4, seq_len=100)
    assert s["steps"] == 4 and s["step_s"] == 2.0  # median of the gaps 2, 3, 2; the first step is warm-up
    assert s["startup_s"] == 6.0 and s["first_step_end_s"] == 10.0 and s["first_step_s"] == 4.0 and s["precompute_s"] == 1.0
    assert s["pairs_per_s"] == 2.0 and s["tokens_per_s"] == 4 * 2 * 100 / 2.0
    assert s["pairs_per_s_with_precompute"] == pytest.approx(16 / (1.0 + 4 * 2.0))


def result(pairs_per_s, peak, mfu=0.1, startup=30.0, e2e=None):
    return {"pairs_per_s": pairs_per_s, "peak_train_mb": peak, "mfu": mfu, "startup_s": startup, "tokens_per_s": 1.0,
            "step_s": 1.0, "gflops": 1.0, "precompute_s": 0.0, "last_loss": 0.69,
            "pairs_per_s_with_precompute": pairs_per_s if e2e is None else e2e}


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


def test_ratios_per_prompt_share_and_the_gpu_goals():
    train = {"default": {"1024p0.75": result(2.2, 3000, mfu=0.4, e2e=1.9), "1024": result(1.0, 5000),
                         "4096p0.75": result(0.5, 9000)},
             "trl_separate_ref": {"1024p0.75": result(1.0, 6000), "1024": result(0.5, 7000)},
             "trl_best": {"1024p0.75": result(1.5, 4000), "4096p0.75": result(0.4, 9000, e2e=0.3)}}
    r = bench.ratios(train, [1024, 4096], (0.75, 0.25), every_memory=True)
    assert r["speed_default_vs_trl_separate_ref_L1024p0.75"] == pytest.approx(2.2)  # per step
    assert r["speed_e2e_default_vs_trl_separate_ref_L1024p0.75"] == pytest.approx(1.9)  # the reference's pass counted
    assert r["speed_default_vs_trl_separate_ref_L1024"] == pytest.approx(2.0)
    assert r["memory_default_vs_trl_separate_ref_L1024p0.75"] == pytest.approx(0.5)
    assert r["speed_e2e_default_vs_trl_best_L1024p0.75"] == pytest.approx(1.9 / 1.5)
    assert r["speed_e2e_default_vs_trl_best_L4096p0.75"] == pytest.approx(0.5 / 0.3)
    assert r["memory_default_vs_trl_separate_ref_L4096"] is None  # not run: n/a
    rows = {g.split(" [")[-1].rstrip("]"): ok for g, _, ok in bench.goal_rows(r, [], bench.GPU_GOALS)}
    assert rows == {"speed_e2e_default_vs_trl_separate_ref_L1024p0.75": "met",  # the goals read the end-to-end figure
                    "speed_e2e_default_vs_trl_best_L1024p0.75": "missed (0.97x target)",
                    "speed_e2e_default_vs_trl_best_L4096p0.75": "met",
                    "memory_default_vs_trl_separate_ref_L1024p0.75": "met", "mfu_default_L1024p0.75": "met"}
    assert "memory_default_vs_trl_separate_ref_L1024" not in bench.ratios(train, [1024, 4096], (0.75, 0.25))


def test_modes_run_in_another_order_at_each_case():
    modes = ["default", "trl_separate_ref", "trl_best"]
    orders = [bench.mode_order(modes, i) for i in range(4)]
    assert orders[0] == modes and orders[3] == modes and sorted(orders[1]) == sorted(modes)
    assert [o[0] for o in orders[:3]] == modes  # each mode runs first once, cold
    assert bench.mode_order([], 2) == []


def test_markdown_table():
    results = {"quick": True, "lengths": [128], "steps": {"128": 1}, "batch_size": 4,
               "machine": {"cpu": "cpu", "cores": 2, "torch_threads": 2, "python": "3.11", "versions": {"trl": "1"}},
               "matmul": {"size": 64, "gflops": 100.0},
               "train": {"default": {"128": result(0.5, 2000)}, "no_4bit": {"128": {"error": "exit 1: boom"}}},
               "build_pairs": [{"runs": 10_000, "runs_per_s": 5000.0, "runs_per_s_wall": 4000.0, "workers": 2,
                                "peak_mb": 69.0, "main_peak_mb": 29.0, "wall_s": 2.5, "pairs": 13}]}
    results["ratios"] = bench.ratios(results["train"], [128])
    text = bench.markdown(results)
    assert "| default | 128 | 0.25 | 4 | float32 | 0.500 | 0.500 |" in text and "failed: exit 1: boom" in text
    assert "What ran" not in text  # no child recorded counters
    results["train"]["default"]["128"] |= {"counts": {"kit_lean_batches": 6, "kit_shared_batches": 6,
                                                      "kit_broke_batches": 0},
                                           "reference": {"train": "computed once for 4 pairs in 1.0s"}}
    assert "- default, 128: 6 lean-head passes; 6 shared-prompt passes; reference (train) computed once for 4 pairs" \
        in bench.markdown(results)
    assert "| 10,000 | 2 | 5,000 | 4,000 | 69 | 29 | 2.50 | 13 |" in text and "100.0 GFLOP/s" in text


def test_the_service_measurement_becomes_the_last_section_of_results_md(tmp_path):
    assert bench.serve_section(tmp_path) == ""  # before make bench-serve has run
    (tmp_path / "results-serve.md").write_text("# serve.py: polling\n\n| p50 |\n| --- |\n| 1 ms |\n")
    assert bench.serve_section(tmp_path) == "\n## serve.py: polling\n\n| p50 |\n| --- |\n| 1 ms |\n"


def test_config_defaults_and_problems():
    quick = kit.parse_config(bench.BenchConfig, ["--quick"], "")
    assert quick.length_list() == [128, 256] and quick.run_sizes() == [10_000, 100_000]
    full = kit.parse_config(bench.BenchConfig, [], "")
    assert quick.mode_list() == ["default", "trl_separate_ref", "trl_best"] and quick.step_count(256) == 1
    assert full.length_list() == [256, 1024] and full.run_sizes()[-1] == 1_000_000
    assert full.step_count(256) == 3 and full.step_count(1024) == 1 and full.fraction_list() == [0.25]
    assert {"default", "trl_separate_ref", "ref_each_step", "no_4bit", "trl_best"} <= set(full.mode_list())  # (a)-(e)
    assert not set(bench.OPTIONAL_MODES) & set(full.mode_list())
    assert full.long_mode_list() == ["default", "trl_separate_ref"] and (full.stem(), quick.stem()) == (
        "results", "results-quick")
    with pytest.raises(kit.UserError, match="unknown fast"):
        kit.parse_config(bench.BenchConfig, ["--modes", "default,fast"], "")


def test_cuda_defaults_and_the_model_option():
    gpu = kit.parse_config(bench.BenchConfig, ["--device", "cuda", "--model", "random:llama-3-8b"], "")
    assert gpu.model_name_or_path == "random:llama-3-8b" and gpu.cuda
    assert gpu.length_list() == [1024, 4096] and gpu.fraction_list() == [0.75, 0.25] and gpu.run_sizes() == []
    assert gpu.mode_list() == ["default", "trl_separate_ref", "trl_best"] == gpu.long_mode_list()
    assert gpu.step_count(4096) == 11 and gpu.stem() == "results-gpu"  # a warm-up, then 10 timed
    assert kit.parse_config(bench.BenchConfig, ["--device", "cuda", "--quick"], "").stem() == "results-gpu-quick"
    with pytest.raises(kit.UserError) as e:
        kit.parse_config(bench.BenchConfig, ["--model", "random:gpt-5", "--prompt_fractions", "0.5,1.5",
                                             "--lengths", "1k"], "")
    assert "--model: no random model shape 'gpt-5'" in str(e.value) and "each between 0 and 1" in str(e.value)
    assert "--lengths: whole numbers" in str(e.value)


def test_generated_run_logs_are_valid_fresh_and_share_prompts(tmp_path):
    dest = tmp_path / "runs.jsonl"
    bench.write_run_logs(ROOT / "data" / "runs.jsonl", dest, 300, seed=0)
    runs = [runlogs.parse_run(json.loads(line), str(dest), i) for i, line in enumerate(dest.open(), 1)]
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


def test_gpu_script_parses_and_refuses_an_unknown_step(tmp_path):
    script = ROOT / "bench" / "gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = subprocess.run([str(script), "bench-9b"], capture_output=True, text=True, env={**os.environ, "OUT": str(tmp_path)})
    assert out.returncode == 2 and "unknown step bench-9b (tests e2e recipe bench-1b bench-8b bench-8b-4k all)" in out.stderr
    assert not list(tmp_path.iterdir())  # refused before installing or running anything


@pytest.mark.integration
def test_a_tiny_cpu_bench_of_the_default_trl_best_and_kto_on_a_random_shape(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench.py"), "--device", "cpu", "--model",
                          "random:smollm2-135m", "--lengths", "64", "--prompt_fractions", "0.75", "--modes",
                          "default,trl_best,kto", "--steps", "1", "--batch_size", "2", "--pairs_runs", "none",
                          "--matmul_size", "256", "--out_dir", str(tmp_path), "--out_stem", "r", "--grpo_steps", "2",
                          "--grpo_completion_length", "8"],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((tmp_path / "r.json").read_text())
    assert results["device"] == "cpu" and results["model"]["spec"] == "random:smollm2-135m"
    assert results["model"]["random"].startswith("random:smollm2-135m is RANDOMLY INITIALISED")
    default, best = results["train"]["default"]["64p0.75"], results["train"]["trl_best"]["64p0.75"]
    assert default["pairs_per_s"] > 0 and default["peak_train_mb"] > 0 and 0 < default["mfu"] < 1
    assert best["liger"] is False and best["precompute_s"] > 0  # the reference pass ran before training
    assert best["flops_per_step"]["reference_forward"] == 0 == default["flops_per_step"]["reference_forward"]
    assert default["reference"]["train"].startswith("computed once for 2 pairs") and default["precompute_s"] > 0
    assert default["counts"]["kit_lean_batches"] > 0  # the child's counters reach the results
    assert default["pairs_per_s_with_precompute"] < default["pairs_per_s"]  # the pass is counted end to end
    table = (tmp_path / "r.md").read_text()
    assert "| trl_best (no Liger) | 64 | 0.75 | 2 | float32 |" in table
    assert "trl_best ran without Liger: liger-kernel is not installed" in table
    assert "- default, 64p0.75: " in table and "reference (train) computed once for 2 pairs" in table
    assert (tmp_path / "r.png").exists() and "speed_default_vs_trl_best_L64p0.75" in results["ratios"]
    kto = results["train"]["kto"]["64p0.75"]  # the same pairs, unpaired, through TRL's KTOTrainer
    assert kto["pairs_per_s"] > 0 and kto["peak_train_mb"] > 0 and kto["mfu"] is None and kto["last_loss"] > 0
    assert "| kto (examples/s) | 64 | 0.75 | 2 | float32 |" in table and "| n/a | n/a |" in table
    grpo = results["grpo"]  # a GRPO step on the demo logs' prompts, split into its parts
    assert grpo["steps"] == 2 and grpo["generation_s"] > 0 and grpo["scoring_s"] > 0 and grpo["training_s"] > 0
    assert grpo["generated_tokens_per_s"] > 0 and grpo["answers_per_step"] == 8 and grpo["max_completion_length"] == 8
    assert "GRPO (`--method grpo` on the demo logs' prompts, 2 prompts x 4 answers of up to 8 tokens" in table


def test_grpo_summary_splits_a_step_and_counts_generated_tokens_on_worked_numbers():
    rows = [{"step": 1, "step_time": 90.0, "time/generation": 60.0, "time/scoring": 2.0, "completions/mean_length": 100.0},
            {"step": 2, "step_time": 40.0, "time/generation": 20.0, "time/scoring": 1.0, "completions/mean_length": 50.0,
             "reward": 0.1, "pass_rate": 0.0},
            {"step": 3, "step_time": 44.0, "time/generation": 24.0, "time/scoring": 3.0, "completions/mean_length": 60.0},
            {"step": 3, "train_runtime": 174.0}]
    g = bench.grpo_summary(rows, answers_per_step=8)
    assert (g["steps"], g["timed_steps"]) == (3, 2)  # the first step is warm-up
    assert (g["step_s"], g["generation_s"], g["scoring_s"]) == (42.0, 22.0, 2.0) and g["training_s"] == 18.0
    assert g["generated_tokens_per_s"] == pytest.approx((50 * 8 / 20 + 60 * 8 / 24) / 2)  # 20 tokens/s each
    assert "| 42.0 | 22.0 | 2.00 | 18.0 | 20.0 | 8 |" in "\n".join(bench.grpo_markdown(
        g | {"prompts_per_step": 2, "num_generations": 4, "max_completion_length": 160, "peak_train_mb": 1000.0}))


def test_method_comparison_summary_is_mean_and_spread_over_seeds():
    import compare  # bench/compare.py

    def arm(score, rate):
        return {"mean_score": score, "pass_rate": rate, "outcomes": {"failed": 3}}

    rows = [{"seed": s, "method": m, "base": arm(b, 0.0), "tuned": arm(t, r), "steps": 2, "minutes": 1.0}
            for s, b in ((1, 0.0), (2, 0.1)) for m, t, r in (("dpo", 0.2, 0.5), ("grpo", 0.4, 1.0))]
    summary = compare.summarize(rows)
    assert summary["base"]["mean_score"] == {"mean": pytest.approx(0.05), "std": pytest.approx(0.0707, abs=1e-4), "n": 2}
    assert summary["dpo"]["pass_rate"] == {"mean": 0.5, "std": 0.0, "n": 2} and summary["grpo"]["mean_score"]["mean"] == 0.4
    assert "| grpo | +0.4000 ± 0.0000 | 1.000 ± 0.000 | 0 | 2 | ? |" in compare.table(rows, summary)
    for r in rows:  # scored in limits mode, where some answers could not be: left out of the rates, counted, named
        r["tuned"] |= {"isolation": "limits", "outcomes": {"failed": 3, "unscorable": 5}}
    rows[-1]["tuned"] |= {"mean_score": None, "pass_rate": None}  # a run none of whose answers could be scored
    summary = compare.summarize(rows)
    assert summary["grpo"]["pass_rate"] == {"mean": 1.0, "std": 0.0, "n": 1}
    text = compare.table(rows, summary)
    assert "| grpo | +0.4000 ± 0.0000 | 1.000 ± 0.000 | 0 | 1 | limits (10 unscorable) |" in text
    assert "| 2 | grpo | limits | +0.1000 | n/a | 0.000 | n/a |" in text


def test_the_comparison_shows_the_unseen_logs_beside_the_held_out_runs_per_seed_and_over_seeds():
    import compare  # bench/compare.py

    def arm(score, rate, broke=0):
        return {"mean_score": score, "pass_rate": rate, "outcomes": {"failed": 3, "broke": broke},
                "isolation": "bwrap"}

    rows = [{"seed": s, "method": "rounds", "base": arm(0.0, 0.0), "tuned": arm(0.01, 0.4), "steps": 2,
             "minutes": 1.0, "unseen": {"file": "bench/unseen-runs.jsonl", "base": arm(0.0, 0.0, b),
                                        "tuned": arm(u, r, k), "prompts": 10, "samples": 8}}
            for s, u, r, k, b in ((1, 0.02, 0.3, 0, 0), (2, -0.01, 0.2, 2, 1))]
    summary = compare.summarize(rows)
    assert summary["rounds"]["unseen"]["pass_rate"] == {"mean": pytest.approx(0.25), "std": pytest.approx(0.0707, abs=1e-4),
                                                        "n": 2}
    assert summary["rounds"]["unseen"]["broke"] == 2 and summary["base"]["unseen"]["broke"] == 1
    text = compare.table(rows, summary)
    assert "On the unseen logs (bench/unseen-runs.jsonl: no arm trained on or attempted them):" in text
    assert "| rounds | +0.0050 ± 0.0212 | 0.250 ± 0.071 | 2 | 2 |" in text
    assert "| 2 | rounds | bwrap | +0.0000 | +0.0100 | 0.000 | 0.400 | broke 0, failed 3 | +0.0000 → -0.0100 | " \
           "0.000 → 0.200 | 1 → 2 | 2 | 1.0 |" in text
    header, rule = [line for line in text.splitlines() if line.startswith("| seed") or line.startswith("| --- | --- | --- | --- | --- | --- | --- |")][:2]
    assert header.count("|") == rule.count("|")  # the per-seed table's columns line up
    del rows[1]["unseen"]  # a row from before --unseen: its cells say so
    assert "| 2 | rounds | bwrap | +0.0000 | +0.0100 | 0.000 | 0.400 | broke 0, failed 3 | n/a | n/a | n/a | 2 |" \
        in compare.table(rows, compare.summarize(rows))
    assert "unseen" not in compare.table(rows[1:], compare.summarize(rows[1:]))


def test_unseen_logs_that_cannot_be_read_stop_the_comparison_before_anything_trains(tmp_path, capsys):
    import compare  # bench/compare.py

    bad = tmp_path / "unseen.jsonl"
    bad.write_text('{"run_id": "u-01", "prompt": []\n')
    for path, message in ((tmp_path / "nope.jsonl", "cannot read the run logs"), (bad, f"{bad}:1: malformed JSON")):
        argv = ["--unseen", str(path), "--work", str(tmp_path / "w"), "--out", str(tmp_path / "out")]
        assert kit.run_cli(compare.main, argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert not (tmp_path / "out.json").exists() and not list((tmp_path / "w" / "pairs").iterdir())


def test_a_compared_row_is_kept_only_for_the_same_seed_arm_and_inputs(tmp_path):
    import compare  # bench/compare.py

    logs, conf = tmp_path / "runs.jsonl", tmp_path / "demo.yaml"
    logs.write_text('{"run_id": "a"}\n')
    conf.write_text("beta: 0.1\n")
    digest = compare.inputs_digest("dpo", ["--config", "demo.yaml"], ["--eval_samples", "8"], [logs, conf])
    assert digest == compare.inputs_digest("dpo", ["--config", "demo.yaml"], ["--eval_samples", "8"], [logs, conf])
    changed = [compare.inputs_digest("kto", ["--config", "demo.yaml"], ["--eval_samples", "8"], [logs, conf]),
               compare.inputs_digest("dpo", ["--config", "demo.yaml", "--beta", "0.2"], ["--eval_samples", "8"],
                                     [logs, conf]),
               compare.inputs_digest("dpo", ["--config", "demo.yaml"], ["--eval_samples", "4"], [logs, conf])]
    conf.write_text("beta: 0.2\n")
    changed.append(compare.inputs_digest("dpo", ["--config", "demo.yaml"], ["--eval_samples", "8"], [logs, conf]))
    assert len({digest, *changed}) == 5
    old = [{"seed": 1, "method": "default", "digest": digest}, {"seed": 2, "method": "default", "digest": digest},
           {"seed": 1, "method": "kto", "digest": changed[0]}, {"seed": 3, "method": "default"}]
    assert compare.kept_row(old, 2, "default", digest) is old[1]
    assert compare.kept_row(old, 1, "kto", changed[0]) is old[2]
    assert compare.kept_row(old, 1, "default", changed[3]) is None  # its config changed since
    assert compare.kept_row(old, 3, "default", digest) is None  # an older row, without a digest
    scored = [{"seed": 1, "method": "default", "digest": digest, "tuned": {"isolation": "limits"}}]
    assert compare.kept_row(scored, 1, "default", digest, "bwrap") is None  # scored in another sandbox mode
    assert compare.kept_row(scored, 1, "default", digest, "limits") is scored[0]
    scored[0]["tuned"]["isolation"] = "unshare"  # the host planted at its real paths, as bwrap does
    assert compare.kept_row(scored, 1, "default", digest, "bwrap") is scored[0]
    files = compare.input_files(str(logs), "", ["configs/demo.yaml"])
    assert files[:2] == [logs, compare.ROOT / "configs" / "demo.yaml"] and compare.ROOT / "data" / "runs.jsonl" in files
    # an arm's inputs hold the config it names, and no other: editing the recipe keeps KTO's and GRPO's rows
    arms = {a[0]: compare.named_configs(a[1], a[2]) for a in compare.parse_arms(compare.DEFAULT_ARMS)}
    assert arms == {"recipe": ["configs/demo.yaml"], "dpo-no-sft": ["configs/demo.yaml"], "kto": [], "grpo": [],
                    "rounds": ["configs/rounds.yaml"], "sft-grpo": ["configs/sft-grpo.yaml"]}
    assert compare.named_configs("dpo", ["--beta", "0.2", "--config=c.yaml"]) == ["c.yaml"]
    for spec in ("x=dpo --config nowhere.yaml", "x=dpo --config", "x=dpo --config="):  # a user's typo, said plainly
        with pytest.raises(kit.UserError, match="no config file"):
            compare.parse_arms(spec)
    assert not any("configs" in f.parts for f in compare.input_files(str(logs), "", []))


def test_a_comparison_in_parts_trains_what_it_was_asked_and_keeps_every_matching_row():
    import compare  # bench/compare.py

    arms = compare.parse_arms("default=dpo; kto=kto; grpo=grpo")
    digests = {"default": "d", "kto": "k", "grpo": "g"}
    old = [{"seed": s, "method": "default", "digest": "d"} for s in (1, 2, 3)] + [
        {"seed": 1, "method": "grpo", "digest": "old"}, {"seed": 4, "method": "kto", "digest": "k"}]

    def did(seeds, only=(), rerun=False):
        return [(seed, arm[0], "keep" if row else "train")
                for seed, arm, row in compare.plan(old, seeds, arms, set(only), rerun, digests)]

    # one seed's KTO: the other seeds' rows stay, the changed grpo row is left out, not shown stale
    assert did([1], {"kto"}) == [(1, "default", "keep"), (1, "kto", "train"), (2, "default", "keep"),
                                 (3, "default", "keep"), (4, "kto", "keep")]
    assert did([1, 2]) == [(1, "default", "keep"), (1, "kto", "train"), (1, "grpo", "train"), (2, "default", "keep"),
                           (2, "kto", "train"), (2, "grpo", "train"), (3, "default", "keep"), (4, "kto", "keep")]
    assert did([2], {"default"}, rerun=True)[:1] == [(2, "default", "train")]  # --rerun: the arm trains again
    assert (1, "default", "keep") in did([2], {"default"}, rerun=True)  # other seeds' rows are not rerun


def test_the_comparison_counts_the_base_once_a_seed_and_the_deleting_answers():
    import compare  # bench/compare.py

    def arm(score, broke):
        return {"mean_score": score, "pass_rate": 0.0, "outcomes": {"failed": 3, **({"broke": broke} if broke else {})}}

    rows = [{"seed": 1, "method": "kto", "base": arm(0.0, 1), "tuned": arm(0.1, 2), "steps": 1, "minutes": 1.0},
            {"seed": 1, "method": "default", "base": arm(0.0, 1), "tuned": arm(0.2, 0), "steps": 1, "minutes": 1.0},
            {"seed": 2, "method": "default", "base": arm(-0.5, 0), "tuned": arm(0.2, 1), "steps": 1, "minutes": 1.0,
             "commit": "0123456789", "date": "2026-11-28", "device": "cpu"}]
    summary = compare.summarize(rows)
    assert summary["base"]["mean_score"]["n"] == 2 and summary["base"]["mean_score"]["mean"] == -0.25
    assert (summary["base"]["broke"], summary["kto"]["broke"], summary["default"]["broke"]) == (1, 2, 1)
    text = compare.table(rows, summary)
    assert "| base | -0.2500 ± 0.3536 | 0.000 ± 0.000 | 1 | 2 |" in text and "| 0123456 2026-11-28 cpu |" in text


def test_compare_arms_name_a_method_and_its_flags_and_a_bad_arm_is_a_user_error():
    import compare  # bench/compare.py

    assert compare.parse_arms("default=dpo; dpo-no-sft=dpo --sft_weight 0;kto=kto --beta '0.2'") == [
        ("default", "dpo", []), ("dpo-no-sft", "dpo", ["--sft_weight", "0"]), ("kto", "kto", ["--beta", "0.2"])]
    arms = compare.parse_arms(compare.DEFAULT_ARMS)
    assert [a[0] for a in arms] == ["rounds", "recipe", "dpo-no-sft", "kto", "grpo", "sft-grpo"]
    # rounds is what make train runs on the bundled model, recipe its first stage alone, then the recipe + GRPO
    assert arms[0][1:] == ("rounds", ["configs/rounds.yaml"]) and arms[1][2] == ["--config", "configs/demo.yaml"]
    assert arms[-1][1:] == ("rounds", ["configs/sft-grpo.yaml"])
    # the table's header names the make command of each default arm as it is, and of no arm changed or added
    assert compare.arm_line(*arms[0]) == \
        "- `rounds` (make train, the default): `iterate.py configs/rounds.yaml --logs LOGS --seed SEED`\n"
    assert compare.arm_line(*arms[1]).startswith("- `recipe` (make train ROUNDS=0): `train_dpo.py --method dpo --config")
    assert compare.arm_line("recipe", "dpo", ["--config", "configs/demo.yaml", "--beta", "0.2"]) == \
        "- `recipe`: `train_dpo.py --method dpo --config configs/demo.yaml --beta 0.2`\n"
    assert compare.arm_line("grpo", "grpo", []) == "- `grpo` (make train METHOD=grpo): `train_dpo.py --method grpo`\n"
    assert "make" not in compare.arm_line("dpo-no-sft", *arms[2][1:])
    for bad in ("dpo", "x=", "=dpo", "a=dpo; a=kto", "a=sft", "r=rounds", "r=rounds a.yaml b.yaml", "r=rounds no.yaml"):
        with pytest.raises(kit.UserError, match="--arms"):
            compare.parse_arms(bad)


def test_grpo_signal_counts_steps_with_no_advantage_and_the_findings_say_so():
    import compare  # bench/compare.py

    metrics = [{"step": 1, "reward": 0.0, "reward_std": 0.0, "ran_rate": 0.0, "pass_rate": 0.0},
               {"step": 2, "reward": 0.1, "reward_std": 0.2, "ran_rate": 0.25, "pass_rate": 0.0},
               {"step": 2, "train_runtime": 9.0}]
    g = compare.grpo_signal(metrics)
    assert (g["steps"], g["flat_steps"]) == (2, 1) and g["ran_rate"] == 0.125 and g["reward"] == pytest.approx(0.05)
    nothing = {"mean_score": 0.0, "pass_rate": 0.0, "outcomes": {"failed": 4}}
    rows = [{"seed": 1, "method": "grpo", "base": nothing, "tuned": nothing, "grpo": g}]
    said = compare.findings(rows)
    assert said[0].startswith("No held-out answer") and said[1].startswith("grpo seed 1: in 1 of its 2 GRPO steps")
    rows[0]["tuned"] = {"mean_score": 0.2, "pass_rate": 0.25, "outcomes": {"freed": 1}}
    assert not compare.findings(rows)[0].startswith("No held-out answer")


def test_the_grpo_runs_behind_a_row_include_a_plans_grpo_stage(tmp_path):
    import compare  # bench/compare.py

    final = tmp_path / "p-2-grpo"
    final.mkdir()
    (final / "lineage.json").write_text(json.dumps([{"run_name": "p-1-dpo", "kind": "dpo"},
                                                    {"run_name": "p-2-grpo", "kind": "grpo"}]))
    assert compare.grpo_runs(tmp_path, final, "rounds") == [tmp_path / "p-2-grpo"]  # sft-grpo: the recipe, then GRPO
    assert compare.grpo_runs(tmp_path, final, "grpo") == [final] and compare.grpo_runs(tmp_path, final, "dpo") == []
    (final / "lineage.json").write_text(json.dumps([{"run_name": "r-1-dpo", "kind": "dpo"},
                                                    {"run_name": "r-2-attempts", "kind": "attempts"}]))
    assert compare.grpo_runs(tmp_path, final, "rounds") == []  # a round of attempts has no GRPO step


def test_the_sampling_speed_up_pairs_each_run_with_the_one_before_it():
    """A machine that slows down halfway (both paths at half speed in the second pair) still gives 3x a pair;
    the ratio of the two paths' medians would mix runs from different halves."""
    import sampling

    generate = [(100.0, 5000), (200.0, 5000), (100.0, 5000)]  # 50, 25, 50 tokens/s
    ours = [(40.0, 6000), (80.0, 6000), (40.0, 6000)]  # 150, 75, 150 tokens/s
    assert sampling.paired_speedups(generate, ours) == pytest.approx([3.0, 3.0, 3.0])
    assert sampling.paired_speedups(generate, [(40.0, 6000), (40.0, 6000)]) == pytest.approx([3.0, 6.0])


def test_a_rounds_rows_minutes_are_its_stages_own_not_the_hours_between_calls(tmp_path):
    import compare  # bench/compare.py

    def run(name, start, end):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps(
            {"started_at": f"2026-11-28T{start}:00+00:00", "finished_at": f"2026-11-28T{end}:00+00:00"}))
        return tmp_path / name

    run("r-1-dpo", "03:27", "03:31")  # stage 1, found again by a later call
    last = run("r-2-attempts", "05:30", "05:33")
    stages = [{"run_name": "r-1-dpo", "kind": "dpo", "pairs_report": None},
              {"run_name": "r-2-attempts", "kind": "attempts", "pairs_report": {"attempts": 184}}]
    (last / "lineage.json").write_text(json.dumps(stages))
    assert compare.run_minutes(tmp_path, last, "rounds") == 7.0  # attempts recorded without their time: not counted
    assert compare.run_minutes(tmp_path, last, "dpo") == 3.0
    stages[1]["pairs_report"]["seconds"] = 90.0  # the attempts' sampling and checking before stage 2 trained
    (last / "lineage.json").write_text(json.dumps(stages))
    assert compare.run_minutes(tmp_path, last, "rounds") == 8.5 and compare.run_minutes(tmp_path, last, "dpo") == 3.0
