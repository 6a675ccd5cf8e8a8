"""The DPO objective as a run logs it, on the bundled model: ln 2 at the first step, what --beta scales,
and the options that change how the loss or the reference is computed, each shown to do what its help says.

Only train_dpo.main is used (through kit.run_cli) and the files a run writes: the rest of train_dpo.py
is being reorganised. One pair per step (--per_device_train_batch_size 1), so each logged row is one
pair's loss and rewards, and the sigmoid loss must equal softplus(-rewards/margins) exactly.
"""
import contextlib
import hashlib
import io
import json
import math
import os
from pathlib import Path

import pytest

from dpokit.core import kit
from dpokit.train import training

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
LN2 = math.log(2)

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not (MODEL / "config.json").exists(),
                                                          reason="bundled model not converted (make model)")]

PAIRS = [
    ("How do I free space used by pip?", "Run `pip cache purge`; it removes cached wheels.", "Delete /usr/lib."),
    ("How do I shrink the systemd journal?", "Run `journalctl --vacuum-size=200M`.", "rm -rf /var/log/*"),
    ("How do I clear apt's cache?", "Run `apt-get clean` to empty /var/cache/apt/archives.", "Reinstall Linux."),
    ("How do I find big files?", "Use `du -ah / | sort -rh | head -20`.", "Buy a bigger disk."),
]


def conversational(q: str, good: str, bad: str) -> dict:
    return {"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": good}],
            "rejected": [{"role": "assistant", "content": bad}]}


ROWS = [conversational(*p) for p in PAIRS]


def train(tmp_path: Path, name: str, *extra, rows=ROWS, max_steps=2):
    """A tiny real DPO run in-process, one pair per step. Returns (run directory, stdout + stderr,
    training rows of metrics.jsonl, evaluation rows of metrics.jsonl)."""
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--data", data, "--output_dir", tmp_path / "art", "--run_name", name, "--max_steps", max_steps,
            "--per_device_train_batch_size", 1, "--max_length", 96, "--lora_r", 4, "--lora_alpha", 8,
            "--eval_fraction", 0, "--probes", "", *extra]
    cwd, out = os.getcwd(), io.StringIO()
    os.chdir(ROOT)  # the bundled model's default path is relative to the repository
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            status = kit.run_cli(training.main, list(map(str, args)))
    finally:
        os.chdir(cwd)
    assert status == 0, out.getvalue()[-3000:]
    run_dir = tmp_path / "art" / name
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, out.getvalue(), [r for r in logged if "loss" in r], [r for r in logged if "eval_loss" in r]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The default reference (base with the adapter off), beta 0.1: what the other options are compared with."""
    return train(tmp_path_factory.mktemp("baseline"), "base", "--beta", 0.1)


def softplus(x: float) -> float:
    return math.log1p(math.exp(-abs(x))) + max(x, 0.0)


def assert_sigmoid_loss(steps):
    """Batch 1, sigmoid loss: loss = -log sigmoid(margin) = softplus(-margin) at every step (float32 logs)."""
    for row in steps:
        assert row["loss"] == pytest.approx(softplus(-row["rewards/margins"]), abs=1e-6), row["step"]


def assert_same_steps(a, b, tol=1e-5):
    """Two runs of the same steps: the same loss and rewards at each step to float rounding. The reference
    log-probs of ~20-token completions are sums near -100 nats in float32 (ulp ~1e-5); a reference path
    that rounds differently moves the rewards by ~1e-6 at beta 0.1, a wrong reference by ~beta x nats."""
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert ra[key] == pytest.approx(rb[key], abs=tol), (ra["step"], key)
    assert a[1]["rewards/margins"] > 100 * tol  # step 2 saw a moved adapter: the comparison is not vacuous


def assert_same_adapter(run_a: Path, run_b: Path):
    """lora_B starts at zero, so it is all learned: the two updates agree to well under 1% (Adam divides by
    the gradient's size, so near-zero gradients amplify rounding: an element-wise bound would be noise)."""
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(run_a / "adapter_model.safetensors"), load_file(run_b / "adapter_model.safetensors")
    keys = [k for k in wa if "lora_B" in k]
    learned = torch.cat([wa[k].flatten() for k in keys])
    assert learned.norm() > 0
    assert (learned - torch.cat([wb[k].flatten() for k in keys])).norm() / learned.norm() < 1e-2


# ------------------------------------------------------------------ the objective

def test_first_step_is_ln2_and_beta_scales_the_margins_not_the_first_update(baseline, tmp_path):
    low = baseline[2]
    _, _, high, _ = train(tmp_path, "beta05", "--beta", 0.5)
    for steps in (low, high):
        # Policy = reference at step 1 (LoRA B is zero): every log-ratio is 0, the loss -log sigmoid(0) = ln 2.
        # On a CPU in float32 both sides run the same kernels on the same weights, so this holds exactly;
        # the tolerance leaves room for a reference computed through another kernel (see assert_same_steps).
        assert steps[0]["loss"] == pytest.approx(LN2, abs=1e-5)
        assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
        assert_sigmoid_loss(steps)
    # Same seed, same data order: the same pair at each step.
    assert [r["num_tokens"] for r in low] == [r["num_tokens"] for r in high]
    # The first update does not depend on beta: the step-1 gradient is -beta/2 x d(margin), and clipping
    # (max_grad_norm 1; it binds at both betas) then Adam (update ~ g / |g|) take its scale out. So at step 2
    # the log-ratios (rewards / beta) agree and the rewards scale with beta: 5x. Observed 5.0004; what is left
    # is float32 rounding of log-ratios (~0.3 nats) taken as differences of log-probs near -100 nats (~1e-5).
    # A beta that reached the rewards but not the loss fails assert_sigmoid_loss; one that did not reach
    # either gives a ratio of 1.
    b_low, b_high = low[1], high[1]
    for key in ("rewards/chosen", "rewards/rejected"):
        assert b_low[key] / 0.1 == pytest.approx(b_high[key] / 0.5, abs=2e-4), key
    assert b_high["rewards/margins"] / b_low["rewards/margins"] == pytest.approx(5.0, rel=1e-3)
    assert b_low["rewards/margins"] > 0.01  # the first update raised the pair it saw: not a ratio of noise
    assert b_high["loss"] < b_low["loss"] < LN2


def chosen_tokens_by_pair_size() -> dict:
    """{prompt + chosen + prompt + rejected tokens: chosen completion tokens} for ROWS, tokenised as TRL
    does for message lists (the chat template; a completion is what follows the generation prompt). The
    first number is what a batch-1 step adds to the logged num_tokens, so it says which pair a step saw."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)

    def ids(messages, gen=False):
        return list(tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True,
                                            return_dict=True)["input_ids"])

    sizes = {}
    for r in ROWS:
        prompt = ids(r["prompt"], gen=True)
        chosen, rejected = (ids(r["prompt"] + r[k]) for k in ("chosen", "rejected"))
        assert chosen[:len(prompt)] == prompt and rejected[:len(prompt)] == prompt
        sizes[len(chosen) + len(rejected)] = len(chosen) - len(prompt)
    assert len(sizes) == len(ROWS)  # each pair's size is distinct in this data
    return sizes


def test_sft_weight_adds_the_weighted_mean_nll_of_the_chosen_tokens(baseline, tmp_path):
    """TRL 1.14.2 (dpo_trainer.py, loss_type 'sft' on the chunked path) adds loss_weight x the mean over the
    chosen completion's tokens of -log p; logps/chosen is their sum. Batch 1, so at every step:
    loss = softplus(-margin) + w x (-logps/chosen) / chosen tokens. A weight other than 1 also catches a
    weight that is dropped."""
    weight = 0.5
    _, _, steps, _ = train(tmp_path, "sft", "--sft_weight", weight)
    sizes = chosen_tokens_by_pair_size()
    seen = 0
    for row in steps:
        n_chosen = sizes[int(row["num_tokens"]) - seen]  # num_tokens is a running total
        seen = int(row["num_tokens"])
        nll = -row["logps/chosen"] / n_chosen
        assert row["loss"] == pytest.approx(softplus(-row["rewards/margins"]) + weight * nll, abs=1e-5), row["step"]
    assert steps[0]["loss"] > LN2 + 1.0  # ~3.8 nats per token here: the term is there, and weighted
    # Step 1 is the baseline's step 1 (same pair, policy = reference) plus the SFT term alone.
    assert steps[0]["logps/chosen"] == baseline[2][0]["logps/chosen"]
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)


# ------------------------------------------------------------------ the reference, computed other ways

def test_the_reference_computed_once_trains_what_a_reference_pass_every_step_trains(tmp_path, monkeypatch):
    """The default computes the reference's log-probs once before training (reference.py, through the armed lean
    head) and keeps them on disk; --no_precompute_ref_log_probs runs the reference forward in every step, as TRL
    does by default. The same losses and rewards at every step, the same adapter; a second run on the same data
    and base reads the entry instead of computing, and trains the same again. Two pairs, two steps: every pair
    is trained, so the pass pays (a run that trains fewer pairs than the data holds keeps the per-step one)."""
    from trl.trainer import dpo_trainer

    def weights_hashed(module):  # TRL's own key for its own pass: every weight copied and hashed at start-up
        raise AssertionError("TRL hashed the model's weights")

    monkeypatch.setattr(dpo_trainer, "hash_module", weights_hashed)
    rows, cache = ROWS[:2], tmp_path / "cache"
    first = train(tmp_path, "once", "--tokenized_cache", cache, rows=rows)
    assert dpo_trainer.hash_module is weights_hashed  # skipped while the trainer was built, and put back
    entries = list((cache / "reference").glob("*.safetensors"))
    assert len(entries) == 1 and "reference log-probs (train): computed once for 2 pairs" in first[1], first[1]
    each = train(tmp_path, "each", "--no_precompute_ref_log_probs", "--tokenized_cache", cache, rows=rows)
    assert "reference log-probs" not in each[1]
    assert_same_steps(each[2], first[2])
    assert_same_adapter(each[0], first[0])
    second = train(tmp_path, "again", "--tokenized_cache", cache, "--seed", 7, rows=rows)  # another seed, same reference
    assert f"from cache (2 pairs, {entries[0]})" in second[1]
    assert json.loads((second[0] / "data.json").read_text())["reference"]["train"].startswith("from cache")
    third = train(tmp_path, "third", "--tokenized_cache", cache, rows=rows)
    assert_same_steps(third[2], first[2], tol=0.0)  # read back bit for bit
    entries[0].write_bytes(b"not a safetensors file")  # a damaged entry is computed again and replaced
    fourth = train(tmp_path, "fourth", "--tokenized_cache", cache, rows=rows)
    assert "ignoring damaged reference cache entry" in fourth[1] and "computed once" in fourth[1]
    part = train(tmp_path, "part", "--tokenized_cache", cache)  # 2 steps of 1 pair train 2 of the 4 pairs
    assert "the reference forward runs in each step: 2 steps train 2 of the 4 rows" in part[1]


def test_a_separate_reference_model_is_loaded_and_used(baseline, tmp_path):
    """A second copy of the same base as the reference trains what the adapter-off reference trains;
    a reference that computes another function (the same weights under a different rms_norm_eps) gives
    nonzero rewards at step 1, so the reference really comes from --ref_model_name_or_path."""
    run_dir, log, steps, _ = train(tmp_path, "ref", "--ref_model_name_or_path", MODEL)
    if "210 NF4 layers dequantised" in baseline[1]:  # the CPU shortcut (memory allowing) counts both copies
        assert "420 NF4 layers dequantised" in log
    assert_same_steps(steps, baseline[2])
    assert_same_adapter(run_dir, baseline[0])

    other = tmp_path / "other-ref"
    other.mkdir()
    for f in MODEL.iterdir():
        if f.name != "config.json":
            (other / f.name).symlink_to(f)
    config = json.loads((MODEL / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-2}))
    _, _, moved, _ = train(tmp_path, "other", "--ref_model_name_or_path", other, max_steps=1)
    first = moved[0]
    assert first["logps/chosen"] == baseline[2][0]["logps/chosen"]  # the policy is unchanged
    assert abs(first["rewards/chosen"]) > 1e-2 and abs(first["loss"] - LN2) > 1e-3
    assert_sigmoid_loss(moved)


def test_gradient_checkpointing_trains_the_same(baseline, tmp_path):
    run_dir, log, steps, _ = train(tmp_path, "gc", "--gradient_checkpointing")
    # Recomputing activations is invisible in the numbers; what shows that the flag reached the trainer:
    # fastpath's shared-prompt forward keeps activations across passes, so it stands down under checkpointing.
    assert "each prompt once" in baseline[1] and "each prompt once" not in log
    assert_same_steps(steps, baseline[2])
    assert_same_adapter(run_dir, baseline[0])


# ------------------------------------------------------------------ early stopping

def held_out(record: dict, fraction: float) -> bool:
    """The kit's split, restated: sha256 of the pair's canonical JSON, first 8 bytes as a fraction."""
    digest = hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=False).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < fraction


def test_early_stopping_stops_when_held_out_loss_rises_and_keeps_the_best_adapter(tmp_path):
    """Each training pair's swap (chosen <-> rejected) is held out: whatever training does for a pair it
    undoes for its swap, so the held-out loss rises from the first evaluation on. Patience 1: the second
    evaluation is worse, so training stops at step 2 of 8 and the adapter of step 1 is kept. Text pairs,
    so the final evaluation generates no example answers (those are for message-list prompts)."""
    rows = []
    for q, good, bad in PAIRS:
        for i in range(200):  # a variant of the pair that trains, whose swap is held out (1 in 4 qualify)
            pair = {"prompt": f"Question: {q} (host {i})\nAnswer:", "chosen": f" {good}", "rejected": f" {bad}"}
            swapped = pair | {"chosen": pair["rejected"], "rejected": pair["chosen"]}
            if not held_out(pair, 0.5) and held_out(swapped, 0.5):
                rows += [pair, swapped]
                break
    assert len(rows) == 2 * len(PAIRS)
    run_dir, log, steps, evals = train(tmp_path, "es", "--eval_fraction", 0.5, "--eval_steps", 1,
                                       "--early_stopping_patience", 1, "--beta", 0.1, rows=rows, max_steps=8)
    assert "4 held out; training on 4" in log
    assert [r["step"] for r in evals] == [1, 2] and [r["step"] for r in steps] == [1, 2]
    assert LN2 < evals[0]["eval_loss"] < evals[1]["eval_loss"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["steps"], manifest["adapter_step"]) == (2, 1)  # trained 2 steps, kept step 1's adapter
    assert "early stopping: the adapter is step 1's" in log
    assert json.loads((run_dir / "status.json").read_text())["state"] == "succeeded"
    # The kept adapter is step 1's: the run's own held-out evaluation of the saved model (tuned minus base
    # log-likelihood margin, nats, x beta) is TRL's eval reward margin at step 1, not step 2's (twice as big).
    held = json.loads((run_dir / "evaluation.json").read_text())["held_out"]
    kept = 0.1 * (held["tuned"]["mean_margin"] - held["base"]["mean_margin"])
    assert kept == pytest.approx(evals[0]["eval_rewards/margins"], abs=1e-4)
    assert abs(evals[1]["eval_rewards/margins"] - evals[0]["eval_rewards/margins"]) > 0.05
