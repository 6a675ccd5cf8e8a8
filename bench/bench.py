"""Benchmark the kit: DPO step throughput, memory, start-up and utilisation per reference mode, and build_pairs.

    make bench [QUICK=1] [DEVICE=cpu|cuda] [MODEL=random:llama-3.2-1b]
    .venv/bin/python bench/bench.py [--quick] [--device cuda] [--model random:llama-3-8b] [--lengths 256,1024]
        [--prompt_fractions 0.75,0.25] [--steps 4] [--modes default,separate_ref]
    bench/gpu.sh bench-1b | bench-8b        # on a lent GPU machine (bench/README.md)

Each training mode runs train_dpo.run in a fresh child process on generated pairs of a controlled
token length (a prompt of --prompt_fractions of L tokens, a quarter by default; completions filling the rest,
truncated to exactly L = --max_length), batch 4, no held-out pairs, no probes. The child passes one timing
callback (run's `callbacks`); its peak memory is taken at the end of training: on a CPU resident memory from
/proc (VmHWM), on CUDA torch.cuda.max_memory_allocated and max_memory_reserved (the allocator expandable, as training sets it).
The tokenised-data cache is the bench's own: the first mode at each case tokenises (a cold start-up; the default
at the first case, for the start-up goal); the modes after it find the same tokens cached, as a user's second run
would. The modes run in another order at each case (mode_order). Each child prints the kit's counters (prompt
sharing, lean head, the reference's pass) into the results.
build_pairs.py runs on generated logs of 10k, 100k and 1M runs (QUICK: 10k and 100k; not on CUDA). Writes
bench/results.json, bench/results.md (the table and the ratios against TRL as it comes) and bench/results.png
(QUICK: bench/results-quick.*, not committed; CUDA: bench/results-gpu.*, with the GPU's name), after each
measurement, so a run stopped by a time limit (--budget_s) leaves what it measured.

The model: the bundled SmolLM2-135M-Instruct, any model directory, or random:<shape> (shapes.py: a real model's
shape with random weights, built once into the cache, e.g. random:llama-3-8b; loaded like any base, 4-bit NF4).
On CUDA (--device auto finds one) the defaults change to what a GPU is for: lengths 1,024 and 4,096, prompts
three quarters and a quarter of each sequence, the modes default, trl_separate_ref and trl_best at every length,
11 steps each (the first is warm-up, with its kernels compiled; 10 timed), bfloat16 (the kit's auto dtype there), no build_pairs.

Modes ((a)-(d): the kit's default against TRL's own reference modes and without 4-bit, plus what each of the
kit's choices buys on its own):
  default           (a) the kit's default: reference = base with the adapter disabled, its log-probs computed
                    once before training (reference.py: counted in the end-to-end pairs/s), log-probs of the
                    completion tokens only through the head in chunks, float32 matmuls on a CPU (bfloat16 on a GPU;
                    LoRA weights and optimizer in float32), NF4 dequantised once (CPU), fastpath.py's fused
                    LoRA / RMSNorm / SiLU-gate / head kernels, each prompt run once for both completions, and
                    malloc keeping freed memory for reuse
  trl_separate_ref  (b) the original pipeline: TRL 1.14.2 as it comes, "the main model and a reference model":
                    a second 4-bit copy as reference, full logits, the device's auto dtype (float32 matmuls on a
                    CPU, bfloat16 on a GPU), bitsandbytes 4-bit kernels, peft's and transformers' own modules,
                    glibc's default malloc settings
  trl_best          (e) TRL with its best switches, through its public API only: precompute_ref_log_probs=True
                    (no reference pass in training) and use_liger_kernel=True (Liger's kernels in the model and
                    TRL's chunked log-probs) where liger-kernel is installed and there is a GPU; without it the
                    table says "no Liger" and TRL computes full logits
  separate_ref      the kit's fast path with a separate 4-bit reference in every step (what (a) gains from the
                    reference alone; not run by default)
  ref_each_step     (c) --no_precompute_ref_log_probs: the reference forward in every step (TRL's default), what
                    the pass before training buys
  no_4bit           (d) --no_load_in_4bit: LoRA on the unquantised weights
  default_bf16      (a) with bfloat16 autocast on the CPU: what it would buy (not the default: see README)
  full_logits       (a) with TRL's full-logits log-probs: what the chunked head buys (not run by default)
  bnb_kernels       (a) with bitsandbytes' 4-bit kernels instead of the dequantised copy (not run by default)
  no_fused          (a) with --no_fused_ops: the libraries' own modules and malloc settings (what fastpath.py buys;
                    not run by default)
  no_share          (a) with --no_share_prompts: TRL's layout, each prompt twice (not run by default)
  cpu_matmul_bf16   (a) with --cpu_matmul_precision bf16: float32 everywhere but the matmuls' inputs (not run
                    by default yet)
GRPO (--grpo_steps, not a mode of the table: its unit is a prompt's group of sampled answers, not a pair):
train_dpo.py --method grpo on the demo logs' prompts, the kit's defaults (num_generations answers per prompt, the
checker and ran rewards), seconds per step split into generation (transformers' generate, sampling), scoring
(the checker running each answer's code in the sandbox) and training (the rest: the reference's log-probs,
forward, backward, optimiser), and generated tokens per second. Its first step is warm-up.

  kto               --method kto on the same pairs, unpaired (each completion an example labelled desirable or
                    not): TRL's KTOTrainer with the kit's module kernels; its pairs/s column is examples/s (one
                    completion each, plus the KL term's mismatched completion, against DPO's two); no FLOP count
                    or MFU (the formula below is DPO's). At the shorter lengths only

FLOP count (model FLOPs per optimizer step: the work DPO needs, the same for every mode, so MFU
compares useful work; matmuls only, multiply-add = 2 FLOPs; no padding: every sequence is exactly T =
P + C tokens, prompt P = T/4, completions C). With N_blocks = the parameters of every linear layer in
the blocks, N_head = the output head (a 576 x 49,152 matmul even though its weights are tied to the
embeddings; embeddings, norms and biases are not matmuls), N_lora = the adapter's parameters, L layers
of width d:
  tokens                   P + 2C per pair: the two sequences share their prompt, and a causal model's
                           prompt states do not depend on what follows, so the prompt's work is needed
                           once (the kit's default does it once; TRL's layout does it twice: waste)
  attention, per token     4 L d x its context (QK^T and AV over all of it, as PaLM's MFU counts):
                           P for a prompt token, T for a completion token
  forward                  tokens x 2 (N_blocks + N_lora) + attention
  backward                 tokens x (2 N_blocks + 4 N_lora) + 2 x attention (activation grads only
                           through the frozen base; input and weight grads for LoRA)
  reference forward        tokens x 2 N_blocks + attention (0 when computed before training: counted in the
                           end-to-end pairs/s, not in a step)
  output head              2 N_head per completion token in each of the three passes (the prompt's
                           logits are not needed by DPO: computing them, as TRL's full-logits path
                           does, is waste, not model FLOPs)
  per step                 batch x the sum
MFU = FLOPs per step / seconds per step / the torch.matmul peak, measured in the same run, in the dtype
that mode's matmuls run in (float32 for the kit's default on a CPU). Counting TRL's layout instead (2T
tokens per pair, the prompt twice) would give 1.13x (L=256) and 1.16x (L=1024) these MFUs for the same
step times: the repeated prompt is work a mode does, not work DPO needs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dpokit.core import kit  # noqa: E402
from dpokit.model import shapes  # noqa: E402
from dpokit.core.kit import field  # noqa: E402

TRL_OWN = ["--no_dequantize_on_gpu", "--no_auto_micro_batch"]  # TRL's modes keep the 4-bit kernels and the batch
MODES = {  # mode -> extra train_dpo flags (see the docstring; mode_flags fills them in)
    "default": [],
    "trl_separate_ref": ["--ref_model_name_or_path", "{model}", "--no_precompute_ref_log_probs", "--no_chunked_logps",
                         "--no_dequantize_on_cpu", "--no_fused_ops", *TRL_OWN],
    "trl_best": ["--precompute_ref_log_probs", "--no_chunked_logps", "--no_dequantize_on_cpu", "--no_fused_ops",
                 *TRL_OWN],
    "separate_ref": ["--ref_model_name_or_path", "{model}", "--no_precompute_ref_log_probs"],
    "ref_each_step": ["--no_precompute_ref_log_probs"],
    "no_4bit": ["--no_load_in_4bit"],
    "default_bf16": ["--compute_dtype", "bfloat16"],
    "full_logits": ["--no_chunked_logps"],
    "bnb_kernels": ["--no_dequantize_on_cpu"],
    "cpu_matmul_bf16": ["--cpu_matmul_precision", "bf16"],
    "no_fused": ["--no_fused_ops"],
    "no_share": ["--no_share_prompts"],
    "kto": ["--method", "kto"],
}
OPTIONAL_MODES = ("separate_ref", "full_logits", "bnb_kernels", "cpu_matmul_bf16", "no_fused", "no_share")  # --modes: each a minute more (15-minute budget)
DEFAULT_MODES = [m for m in MODES if m not in OPTIONAL_MODES]
BASELINE = "trl_separate_ref"  # (b): the ratios are against it
QUICK_MODES = f"default,{BASELINE},trl_best"
GPU_MODES = f"default,{BASELINE},trl_best"  # (a), (b) and (e)
DEFAULT_PROMPT_FRACTION = 0.25  # the CPU bench's layout: results keyed by length alone


@dataclasses.dataclass
class BenchConfig:
    quick: bool = field(False, f"a few minutes: lengths 128,256, modes {QUICK_MODES}, 1 step each (CUDA: 3), "
                        "build_pairs up to 100k runs")
    model_name_or_path: str = field("models/SmolLM2-135M-Instruct", "base model: a directory (the bundled one) or "
                                    "random:<shape> (shapes.py, e.g. random:llama-3-8b)", short="--model")
    device: str = field("auto", "where the modes train: auto = CUDA when there is a GPU, else the CPU; the "
                        "defaults below differ on CUDA", choices=("auto", "cpu", "cuda"))
    out_dir: str = field("bench", "where the results go (relative to the repository, or absolute)")
    out_stem: str = field("", "results file name without extension; '' = results (quick: results-quick; CUDA: "
                          "results-gpu, results-gpu-quick)")
    lengths: str = field("", "sequence lengths in tokens (prompt + completion); '' = 256,1024 (quick: 128,256; "
                         "CUDA: 1024,4096)")
    prompt_fractions: str = field("", "the prompt's share of each sequence, comma-separated; '' = 0.25 (CUDA: "
                                  "0.75,0.25)")
    steps: int = field(0, "optimizer steps per mode at lengths up to 512 (CUDA: at every length): the first is "
                       "warm-up, the rest are timed (the median of their times); 0 = 3 (quick: 1, timed with its "
                       "warm-up; CUDA: 11, 10 timed, quick 3: on an H200 the default's warm-up lasted past its first step, and a median "
                       "of 3 steps read 0.64 s a step where one of 9 read 0.36)")
    long_steps: int = field(1, "optimizer steps at lengths over 512 on a CPU (one step of ~100 s at 1024 tokens on "
                            "2 cores: its warm-up is a few percent of it)")
    batch_size: int = field(4, "pairs per step (per_device_train_batch_size)")
    max_tokens: int = field(0, "at most this many tokens per step (2 x pairs x length): fewer pairs per step at "
                            "long lengths, so a big shape fits in GPU memory; 0 = no cap")
    gradient_checkpointing: bool = field(False, "train every mode with --gradient_checkpointing (less memory, "
                                         "slower steps)")
    modes: str = field("", f"training modes to measure, comma-separated; '' = {','.join(DEFAULT_MODES)} "
                       f"(quick: {QUICK_MODES}; CUDA: {GPU_MODES})")
    long_modes: str = field("", f"the modes also run at the longest length; '' = default,{BASELINE} (the ratios "
                            "the CPU goals read; the others there would take a CPU run past 15 minutes; CUDA: all)")
    pairs_runs: str = field("", "build_pairs log sizes in runs, or none; '' = 10000,100000,1000000 (quick: "
                            "10000,100000; CUDA: none)")
    matmul_size: int = field(0, "square matrix size for the matmul peaks; 0 = 2048 (CUDA: 8192)")
    grpo_steps: int = field(-1, "GRPO: optimiser steps on the demo logs' prompts (the first is warm-up); -1 = 3 "
                            "(quick: 2); 0 = skip")
    grpo_completion_length: int = field(0, "GRPO: longest sampled answer in tokens; 0 = the kit's default")
    budget_s: float = field(0.0, "stop starting measurements after this many seconds and write what was measured "
                            "(a device call's time limit); 0 = no limit")
    seed: int = field(0, "data generation seed")

    def problems(self) -> list[str]:
        p = []
        if unknown := [m for m in self.mode_list() if m not in MODES]:
            p.append(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(MODES)})")
        if self.batch_size < 1 or self.steps < 0 or self.long_steps < 1 or self.max_tokens < 0:
            p.append("--batch_size and --long_steps at least 1, --steps and --max_tokens not negative")
        if self.matmul_size and self.matmul_size < 64:
            p.append("--matmul_size: 0 or at least 64")
        try:
            if any(n < 8 for n in self.length_list()):
                p.append("--lengths: at least 8 tokens each")
        except ValueError:
            p.append(f"--lengths: whole numbers, comma-separated (got {self.lengths!r})")
        try:
            if any(not 0 < f < 1 for f in self.fraction_list()):
                p.append("--prompt_fractions: each between 0 and 1")
        except ValueError:
            p.append(f"--prompt_fractions: numbers, comma-separated (got {self.prompt_fractions!r})")
        if problem := shapes.problem(self.model_name_or_path, "--model"):
            p.append(problem)
        return p

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"  # main() resolves auto first

    def mode_list(self) -> list[str]:
        modes = self.modes or (QUICK_MODES if self.quick else GPU_MODES if self.cuda else ",".join(DEFAULT_MODES))
        return [m.strip() for m in modes.split(",") if m.strip()]

    def long_mode_list(self) -> list[str]:
        return self.mode_list() if self.cuda and not self.long_modes else \
            [m.strip() for m in (self.long_modes or f"default,{BASELINE}").split(",") if m.strip()]

    def length_list(self) -> list[int]:
        return [int(x) for x in (self.lengths or ("128,256" if self.quick else "1024,4096" if self.cuda
                                                  else "256,1024")).split(",")]

    def fraction_list(self) -> list[float]:
        return [float(x) for x in (self.prompt_fractions or ("0.75,0.25" if self.cuda else "0.25")).split(",")]

    def run_sizes(self) -> list[int]:
        sizes = self.pairs_runs or ("none" if self.cuda else "10000,100000" if self.quick else "10000,100000,1000000")
        return [] if sizes == "none" else [int(x) for x in sizes.split(",")]

    def step_count(self, seq_len: int) -> int:
        if self.cuda:
            return self.steps or (3 if self.quick else 11)
        return self.long_steps if seq_len > 512 else self.steps or (1 if self.quick else 3)

    def stem(self) -> str:
        return self.out_stem or ("results-gpu" if self.cuda else "results") + ("-quick" if self.quick else "")


# ---------------------------------------------------------------------------------------------
# Pure helpers: tested without a model (tests/test_bench.py).
# ---------------------------------------------------------------------------------------------

def model_shape(config: dict) -> dict:
    """Matmul parameter counts of a Llama-style model from its config.json (SmolLM2: 30 x 576, vocab 49,152)."""
    d, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads) * (config.get("head_dim") or d // heads)
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * inter  # q, o; k, v; gate, up, down
    return {"layers": layers, "d_model": d, "n_blocks": layers * per_layer, "n_head": d * config["vocab_size"],
            "n_base": layers * per_layer + d * config["vocab_size"]}


def lora_params(config: dict, r: int) -> int:
    """LoRA parameters on every linear layer of the blocks: r x (in + out) each."""
    d, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads) * (config.get("head_dim") or d // heads)
    return layers * r * (2 * (d + d) + 2 * (d + kv) + 3 * (d + inter))


def prompt_tokens(seq_len: int, fraction: float = DEFAULT_PROMPT_FRACTION) -> int:
    """The generated pairs' prompt length: that share of the sequence, rounded down (make_pairs and step_flops
    agree on it; a quarter is seq_len // 4)."""
    return int(seq_len * fraction)


def case_key(seq_len: int, fraction: float) -> str:
    """The key of one (length, prompt share) in the results: '1024' for the CPU's quarter, else '1024p0.75'."""
    return str(seq_len) if fraction == DEFAULT_PROMPT_FRACTION else f"{seq_len}p{fraction:g}"


def batch_for(seq_len: int, batch: int, max_tokens: int) -> int:
    """Pairs per step at this length: --batch_size, fewer where 2 x pairs x length would pass --max_tokens."""
    return max(1, min(batch, max_tokens // (2 * seq_len))) if max_tokens else batch


def resolve_device(asked: str, cuda_available: bool) -> str:
    if asked == "cuda" and not cuda_available:
        raise kit.UserError("--device cuda: torch sees no CUDA device here (--device cpu, or auto)")
    return ("cuda" if cuda_available else "cpu") if asked == "auto" else asked


def mode_flags(mode: str, model: str, liger: bool) -> list[str]:
    """A mode's train_dpo flags for this model; trl_best with --use_liger_kernel when Liger can run (liger)."""
    return [a.format(model=model) for a in MODES[mode]] + (["--use_liger_kernel"] if mode == "trl_best" and liger
                                                           else [])


def step_flops(shape: dict, n_lora: int, seq_len: int, batch: int, reference: bool,
               prompt_fraction: float = DEFAULT_PROMPT_FRACTION) -> dict:
    """Model FLOPs of one DPO step (the formula in the module docstring), split by where they go."""
    layers, d, t = shape["layers"], shape["d_model"], seq_len
    blocks, head = shape["n_base"] - shape["n_head"], shape["n_head"]
    p = prompt_tokens(t, prompt_fraction)
    c = t - p
    tokens = batch * (p + 2 * c)  # each prompt once, both completions
    attention = batch * (p * p + 2 * c * t) * 4 * layers * d
    logits = batch * 2 * c * 2 * head  # completion tokens only
    parts = {"policy_forward": tokens * 2 * (blocks + n_lora) + attention + logits,
             "policy_backward": tokens * (2 * blocks + 4 * n_lora) + 2 * attention + logits,
             "reference_forward": tokens * 2 * blocks + attention + logits if reference else 0}
    return parts | {"total": sum(parts.values())}


def mode_order(modes: list[str], case_index: int) -> list[str]:
    """The modes in the order they run at a case: rotated by one at each case, so no mode always runs first (on a
    cold machine, before any kernel is compiled or cached) or last (after the others have heated it)."""
    k = case_index % len(modes) if modes else 0
    return modes[k:] + modes[:k]


def mode_dtype(flags: list[str], auto: str) -> str:
    """The dtype a mode's matmuls run in: the one --compute_dtype names, else train_dpo's auto choice."""
    if "--compute_dtype" in flags:
        return flags[flags.index("--compute_dtype") + 1]
    if "--cpu_matmul_precision" in flags and flags[flags.index("--cpu_matmul_precision") + 1] == "bf16":
        return "bfloat16"  # the matmuls run at the bfloat16 rate: that is the peak to compare with
    return auto


def summarize_steps(step_ends: list[float], process_start: float, init_end: float, train_begin: float,
                    batch: int, seq_len: int) -> dict:
    """Timings of one training child: start-up (process start -> the first optimizer step begins: imports,
    data validation and tokenisation, model load, TRL's reference precompute), the step time (median of
    the gaps between steps after the first; with one step, that step, warm-up included), and the
    one-off work between building the trainer and training (TRL's reference precompute)."""
    gaps = [b - a for a, b in zip(step_ends, step_ends[1:])]
    step_s = statistics.median(gaps) if gaps else step_ends[0] - train_begin
    precompute_s = max(0.0, train_begin - init_end)
    steps = len(step_ends)
    return {"steps": steps, "startup_s": train_begin - process_start, "first_step_end_s": step_ends[0] - process_start,
            "step_s": step_s,
            "first_step_s": step_ends[0] - train_begin, "precompute_s": precompute_s,
            "pairs_per_s": batch / step_s, "tokens_per_s": batch * 2 * seq_len / step_s,
            "pairs_per_s_with_precompute": batch * steps / (precompute_s + steps * step_s)}


def ratios(train: dict, lengths: list[int], fractions: tuple[float, ...] = (DEFAULT_PROMPT_FRACTION,),
           every_memory: bool = False) -> dict:
    """The numbers the CPU and GPU goals read, from {mode: {case_key: result}}, for every length and prompt
    share; None where a mode was not run. Memory at the longest length (each prompt share), or at every length
    (every_memory: the GPU's goals are at 1,024 tokens)."""
    def get(mode, case, key):
        return train.get(mode, {}).get(case, {}).get(key)

    def div(a, b):
        return a / b if a is not None and b else None

    cases = [case_key(n, f) for n in lengths for f in fractions]
    longest = cases if every_memory else [case_key(max(lengths), f) for f in fractions]
    out = {f"speed_default_vs_{BASELINE}_L{c}": div(get("default", c, "pairs_per_s"),
                                                     get(BASELINE, c, "pairs_per_s")) for c in cases}
    out |= {f"memory_default_vs_{BASELINE}_L{c}": div(get("default", c, "peak_train_mb"),
                                                       get(BASELINE, c, "peak_train_mb")) for c in longest}
    for other in ("trl_best", "separate_ref", "default_bf16", "cpu_matmul_bf16", "full_logits", "bnb_kernels",
                  "ref_each_step", "no_fused", "no_share"):
        out |= {f"speed_default_vs_{other}_L{c}": div(get("default", c, "pairs_per_s"), get(other, c, "pairs_per_s"))
                for c in cases if get(other, c, "pairs_per_s")}
    for other in (BASELINE, "trl_best", "ref_each_step"):  # end to end: one epoch, the reference's pass included
        out |= {f"speed_e2e_default_vs_{other}_L{c}": div(get("default", c, "pairs_per_s_with_precompute"),
                                                          get(other, c, "pairs_per_s_with_precompute"))
                for c in cases if get(other, c, "pairs_per_s_with_precompute")}
    for other in ("trl_best", "full_logits"):
        out |= {f"memory_default_vs_{other}_L{c}": div(get("default", c, "peak_train_mb"),
                                                        get(other, c, "peak_train_mb"))
                for c in longest if get(other, c, "peak_train_mb")}
    out |= {f"mfu_default_L{c}": get("default", c, "mfu") for c in cases}
    out["startup_default_s"] = get("default", cases[0], "startup_s")
    return out


GOALS = (  # (ratio key prefix, comparison, target, what)
    (f"speed_default_vs_{BASELINE}", ">=", 1.5, "default pairs/s >= 1.5x (b) separate 4-bit reference"),
    (f"speed_e2e_default_vs_{BASELINE}", ">=", 1.5, "default pairs/s end to end (an epoch, the reference's pass "
                                                    "included) >= 1.5x (b)"),
    (f"memory_default_vs_{BASELINE}", "<=", 0.7, "default peak memory <= 0.7x (b) separate reference (longest L)"),
    ("mfu_default", ">=", 0.5, "default MFU >= 50% of the measured matmul peak in its dtype"),
    ("startup_default", "<=", 20.0, "start-up (process start -> first optimizer step begins) < 20 s"),
)


GPU_CASE = "L1024p0.75"  # the GPU goals' case: 1,024 tokens, the prompt three quarters (agent data), an 8B shape
GPU_GOALS = (
    (f"speed_e2e_default_vs_{BASELINE}_{GPU_CASE}", ">=", 1.9, "default pairs/s end to end (an epoch, precompute "
                                                               "included) >= 1.9x (b) TRL as it comes"),
    (f"speed_e2e_default_vs_trl_best_{GPU_CASE}", ">=", 1.3, "default pairs/s end to end >= 1.3x (e) TRL with its "
                                                             "best switches"),
    ("speed_e2e_default_vs_trl_best_L4096", ">=", 1.5, "default pairs/s end to end at 4,096 tokens >= 1.5x (e)"),
    (f"memory_default_vs_{BASELINE}_{GPU_CASE}", "<=", 0.6, "default peak GPU memory <= 0.6x (b)"),
    (f"mfu_default_{GPU_CASE}", ">=", 0.35, "default MFU >= 35% of the measured bfloat16 peak"),
)


def goal_rows(r: dict, pairs: list[dict], goals=GOALS) -> list[tuple[str, str, str]]:
    """(goal, measured, met?) rows for the markdown report: the CPU goals (GOALS) on a CPU, GPU_GOALS on CUDA."""
    rows = []
    for prefix, op, target, what in goals:
        for key, value in r.items():
            if key.startswith(prefix) and value is not None:
                met = value >= target if op == ">=" else value <= target
                rows.append((f"{what} [{key}]", f"{value:.3g}", "met" if met else f"missed ({value / target:.2f}x target)"))
    if pairs:
        fastest = min(p["runs_per_s"] for p in pairs)
        rows.append(("build_pairs >= 20,000 runs/s (slowest size)", f"{fastest:,.0f}",
                     "met" if fastest >= 20000 else f"missed ({fastest / 20000:.2f}x target)"))
        growth = max(p["peak_mb"] for p in pairs) - min(p["peak_mb"] for p in pairs)
        rows.append((f"build_pairs peak memory growth {min(p['runs'] for p in pairs):,} -> "
                     f"{max(p['runs'] for p in pairs):,} runs < 50 MB", f"{growth:.0f} MB",
                     "met" if growth < 50 else f"missed ({growth / 50:.2f}x target)"))
    return rows


def result_cases(results: dict) -> list[dict]:
    """The (length, prompt share, batch) cases of a results record, in the order they ran (older records: lengths)."""
    return results.get("cases") or [{"key": str(n), "seq_len": n, "prompt_fraction": DEFAULT_PROMPT_FRACTION,
                                     "batch": results["batch_size"]} for n in results["lengths"]]


def markdown(results: dict) -> str:
    m, cuda = results["machine"], results.get("device") == "cuda"
    peak = "bfloat16" if cuda else "float32"  # the dtype the default mode's matmuls run in there
    model = results.get("model")
    lines = [f"# dpo-kit benchmark ({'QUICK' if results['quick'] else 'full'}{', CUDA' if cuda else ''})", "",
             (f"**{m['gpu']}** (torch CUDA {m.get('cuda_version')}); " if cuda else "")
             + f"{m['cpu']}; {m['cores']} cores, torch threads {m['torch_threads']}; python {m['python']}; "
             + ", ".join(f"{k} {v}" for k, v in m["versions"].items()), ""]
    if model:
        lines += [f"Model: {model['random']}." if model.get("random") else
                  f"Model: `{model['spec']}` ({model['parameters']:,} parameters).", ""]
    lines += [f"matmul peak ({results['matmul']['size']}^2, torch.matmul{' on the GPU' if cuda else ''}): float32 "
              f"**{results['matmul']['gflops']:.1f} GFLOP/s**"
              + (f", bfloat16 **{results['matmul_bf16']['gflops']:.1f} GFLOP/s**" if "matmul_bf16" in results else "")
              + f" (each mode's MFU is against the peak of the dtype it runs in; {peak} for the default here). "
              f"Batch {results['batch_size']} pairs"
              + (f" (at most {results['max_tokens']:,} tokens a step)" if results.get("max_tokens") else "")
              + ", steps per mode " + ", ".join(f"{v} at L={k}" for k, v in results["steps"].items())
              + " (with more than one, the first is warm-up and not timed), sequences of exactly L tokens, the prompt "
              "the given share of each" + (", gradient checkpointing" if results.get("gradient_checkpointing") else "")
              + ". Pairs/s end to end: the mode's pairs (one epoch) over its steps plus the one-off work between "
              "building the trainer and training (the reference's pass before training, where the mode has one)."
              + (f" Modes ran in a different order at each case: {'; '.join(results['orders'])}."
                 if results.get("orders") else ""), "",
              f"| mode | L | prompt | batch | matmuls | pairs/s | pairs/s end to end | tokens/s | s/step | GFLOP/s | MFU | "
              f"{'peak GPU memory, allocated / reserved' if cuda else 'peak RSS train'} (MB) | start-up (s) "
              "| precompute (s) | loss (last step) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, by_case in results["train"].items():
        for case in result_cases(results):
            r = by_case.get(case["key"])
            if not r:
                continue
            label = f"{mode} (no Liger)" if r.get("liger") is False else \
                f"{mode} (examples/s)" if mode == "kto" else mode
            head = f"| {label} | {case['seq_len']} | {case['prompt_fraction']:g} | {case['batch']} |"
            if "error" in r or "skipped" in r:
                lines.append(f"{head} {'failed: ' + r['error'][:80] if 'error' in r else r['skipped']} ||||||||||")
                continue
            lines.append(f"{head} {r.get('dtype', 'float32')} | {r['pairs_per_s']:.3f} "
                         f"| {r['pairs_per_s_with_precompute']:.3f} | {r['tokens_per_s']:.0f} "
                         f"| {r['step_s']:.2f} | {kit.num(r['gflops'], '.1f')} | {kit.num(r['mfu'], '.1%')} | {r['peak_train_mb']:,.0f}"
                         + (f" / {r['peak_gpu_reserved_mb']:,.0f}" if r.get("peak_gpu_reserved_mb") else "")
                         + f" | {r['startup_s']:.1f} | {r['precompute_s']:.1f} | {r.get('last_loss', float('nan')):.4f} |")
    lines += counter_lines(results)
    if "kto" in results["train"]:
        lines += ["", "kto: `--method kto` on the same pairs, unpaired: a step of that batch trains that many single "
                  "completions (each with the KL term's mismatched one), where DPO's trains that many pairs of two."]
    if results.get("grpo"):
        lines += grpo_markdown(results["grpo"])
    lines += [f"\n{note}" for note in results.get("notes", [])]
    if results["build_pairs"]:
        lines += ["", "| build_pairs runs | workers | runs/s | runs/s (wall, with interpreter start) | peak RSS, all "
                  "processes (MB) | main process (MB) | wall (s) | pairs written |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {p['runs']:,} | {p['workers']} | {p['runs_per_s']:,.0f} | {p['runs_per_s_wall']:,.0f} "
                  f"| {p['peak_mb']:,.0f} | {p['main_peak_mb']:,.0f} | {p['wall_s']:.2f} | {p['pairs']:,} |"
                  for p in results["build_pairs"]]
    lines += ["", "| ratio | value |", "| --- | --- |"]
    lines += [f"| {k} | {'n/a' if v is None else f'{v:.3g}'} |" for k, v in results["ratios"].items()]
    lines += ["", f"| goal ({'GPU' if cuda else 'CPU'}) | measured | |", "| --- | --- | --- |"]
    lines += [f"| {g} | {v} | {ok} |" for g, v, ok in goal_rows(results["ratios"], results["build_pairs"],
                                                                 GPU_GOALS if cuda else GOALS)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Generated inputs.
# ---------------------------------------------------------------------------------------------

def word_ids(tokenizer) -> list[int]:
    """Token ids of plain lower-case words with a leading space: decode and re-encode stay the same length."""
    out = []
    for token, i in tokenizer.get_vocab().items():
        if token.startswith("\u0120") and token[1:].isalpha() and token[1:].islower() and len(token) > 3:
            out.append(i)
    return sorted(out)


def make_pairs(tokenizer, n_pairs: int, seq_len: int, seed: int,
               prompt_fraction: float = DEFAULT_PROMPT_FRACTION) -> list[dict]:
    """Plain-text pairs: a prompt of that share of seq_len tokens, completions longer than the rest (truncated
    to seq_len)."""
    rng, vocab = random.Random(seed), word_ids(tokenizer)

    def text(n):
        return tokenizer.decode([rng.choice(vocab) for _ in range(n)])

    p = prompt_tokens(seq_len, prompt_fraction)
    return [{"prompt": text(p), "chosen": text(seq_len - p + 16), "rejected": text(seq_len - p + 16)}
            for _ in range(n_pairs)]


def write_run_logs(src: Path, dest: Path, n_runs: int, seed: int) -> None:
    """n_runs agent runs made from the demo logs: fresh run_ids, strategies and code made distinct per run
    (a comment line keeps whether the code compiles), and prompts shared by a few runs each: each demo
    prompt comes in 200 variants, so 9,800 distinct prompts whatever n_runs is."""
    templates = []
    for line in src.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        rec["run_id"] = "@RID@"
        last = rec["prompt"][-1]
        (last[0] if isinstance(last, list) else last)["content"] += " (site @SITE@)"  # [message, tag] or message
        rec["strategy"] += " (variant @RID@)"
        for a in rec["attempts"]:
            a["code"] += "# @RID@\n"
        templates.append(json.dumps(rec, ensure_ascii=False) + "\n")
    rng = random.Random(seed)
    with open(dest, "w", encoding="utf-8") as f:
        for i in range(n_runs):
            rid = f"gen-{i:07d}"
            f.write(templates[i % len(templates)].replace("@RID@", rid).replace("@SITE@", str(rng.randrange(200))))


# ---------------------------------------------------------------------------------------------
# Measurements (side effects: child processes, files).
# ---------------------------------------------------------------------------------------------

def vm_hwm_mb() -> float:
    """Peak resident memory of this process so far (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child_train(argv: list[str], timing_path: str) -> None:
    """Runs in the child process: train_dpo.run with one extra callback that records when the trainer was
    built, when training began, when each optimizer step ended and the peak memory then (resident, and on CUDA
    the GPU's). The child ends when training does: metrics.jsonl is complete by then, and what the kit does
    next (save, evaluate, tarball: ~18 s) is not what is measured."""
    import torch
    from transformers import TrainerCallback

    from dpokit.train import trainers, training

    rec = {"step_ends": [], "torch_threads": torch.get_num_threads()}

    class Timing(TrainerCallback):
        trainer = None

        def kit_bind(self, trainer):  # training.build_trainer hands the built trainer to callbacks that ask
            self.trainer = trainer

        def on_init_end(self, args, state, control, **kw):
            rec["init_end"] = time.time()

        def on_train_begin(self, args, state, control, **kw):
            rec["train_begin"] = time.time()

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the step's kernels have finished, not only been queued
            rec["step_ends"].append(time.time())

        def on_train_end(self, args, state, control, **kw):
            rec["peak_train_mb"] = vm_hwm_mb()
            if torch.cuda.is_available():
                rec["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
                rec["peak_gpu_reserved_mb"] = torch.cuda.max_memory_reserved() / 2 ** 20  # what nvidia-smi sees
                rec["alloc_conf"] = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
            if self.trainer is not None:
                trainers.print_counts(self.trainer)
                rec["counts"] = trainers.counts(self.trainer)
                rec["reference"] = getattr(self.trainer, "kit_ref_record", None)
            Path(timing_path).write_text(json.dumps(rec))
            os._exit(0)

    training.run(kit.parse_config(training.TrainConfig, argv, training.__doc__), callbacks=[Timing()])
    sys.exit(1)  # reached only when training did not end (on_train_end exits 0)


def child_build_pairs(argv: list[str], peak_path: str) -> None:
    """Runs in the child process: build_pairs.py as a script, then its peak memory. (The parent's
    getrusage/wait4 ru_maxrss would count the parent's pages the child held between fork and exec;
    VmHWM starts again at exec.)"""
    import runpy

    import resource

    sys.argv = [str(ROOT / "build_pairs.py"), *argv]
    start = time.time()
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:  # the largest worker process's peak (Linux: ru_maxrss in KB), for a whole-command upper bound
        Path(peak_path).write_text(json.dumps({"peak_mb": vm_hwm_mb(), "run_s": time.time() - start,
                                               "worker_peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))


def child_command(function: str, *args) -> list[str]:
    """A fresh interpreter that imports this file and calls function(*args)."""
    return [sys.executable, "-c", f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'bench')!r}]; "
            f"import bench; bench.{function}(*{args!r})"]


def run_child(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int, float]:
    """Run cmd with its output in log; returns (exit status, wall seconds)."""
    start = time.time()
    with open(log, "w") as out:
        try:
            status = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout,
                                    env=env).returncode
        except subprocess.TimeoutExpired:
            status = -9
    return status, time.time() - start


@dataclasses.dataclass
class Case:
    """One measured setting: sequence length, the prompt's share of it, pairs per step, steps."""
    seq_len: int
    prompt_fraction: float
    batch: int
    steps: int

    @property
    def key(self) -> str:
        return case_key(self.seq_len, self.prompt_fraction)


def child_failure(status: int, log: Path) -> dict:
    """A measurement whose child did not finish: why, in a few words, and the end of its log."""
    tail = log.read_text()[-600:]
    return {"error": "timed out (--budget_s)" if status == -9 else
            f"exit {status}: {tail.strip().splitlines()[-1] if tail.strip() else ''}", "log_tail": tail}


def bench_train(cfg: BenchConfig, mode: str, case: Case, data: Path, work: Path, shape: dict, n_lora: int,
                peaks: dict, model: str, liger: bool, timeout: float) -> dict:
    name = f"{mode}-{case.key}"
    run_dir, timing, log = work / name, work / f"{name}.timing.json", work / f"{name}.log"
    flags = mode_flags(mode, model, liger)
    argv = ["--data", str(data), "--model_name_or_path", model, "--output_dir", str(run_dir), "--run_name", "r",
            "--max_steps", str(case.steps), "--max_length", str(case.seq_len),
            "--per_device_train_batch_size", str(case.batch), "--eval_fraction", "0", "--probes", "",
            "--save_steps", "100000", "--seed", "42", "--tokenized_cache", str(work / "cache"), *flags] + \
        (["--gradient_checkpointing"] if cfg.gradient_checkpointing else [])
    dtype = mode_dtype(flags, peaks["auto"])
    env = os.environ | ({"CUDA_VISIBLE_DEVICES": ""} if not cfg.cuda else {})  # --device cpu on a GPU machine
    start = time.time()
    status, wall = run_child(child_command("child_train", argv, str(timing)), log, timeout=timeout, env=env)
    if status != 0 or not timing.exists():
        return child_failure(status, log)
    rec = json.loads(timing.read_text())
    out = summarize_steps(rec["step_ends"], start, rec["init_end"], rec["train_begin"], case.batch, case.seq_len)
    kto = "kto" in flags
    flops = None if kto else step_flops(shape, n_lora, case.seq_len, case.batch,
                                        reference="--no_precompute_ref_log_probs" in flags,
                                        prompt_fraction=case.prompt_fraction)
    metrics_file = run_dir / "r.partial" / "metrics.jsonl"  # the run stops before it is renamed to r/
    metrics = [json.loads(r) for r in metrics_file.read_text().splitlines() if r.strip()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    out |= {"wall_s": wall, "peak_train_mb": rec.get("peak_gpu_mb" if cfg.cuda else "peak_train_mb"),
            "peak_rss_mb": rec.get("peak_train_mb"), "peak_gpu_reserved_mb": rec.get("peak_gpu_reserved_mb"),
            "alloc_conf": rec.get("alloc_conf"), "batch": case.batch, "prompt_fraction": case.prompt_fraction,
            "flops_per_step": flops, "gflops": flops["total"] / out["step_s"] / 1e9 if flops else None,
            "dtype": dtype, "mfu": flops["total"] / out["step_s"] / (peaks[dtype] * 1e9) if flops else None,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "torch_threads": rec["torch_threads"],
            "train_runtime_s": next((m["train_runtime"] for m in metrics if "train_runtime" in m), None),
            "counts": rec.get("counts"), "reference": rec.get("reference")}
    if mode == "trl_best":
        out["liger"] = liger
    return out


def grpo_summary(metrics: list[dict], answers_per_step: int) -> dict:
    """GRPO's logged steps -> seconds per step (median over the steps after the first) split into generation,
    scoring and training, and generated tokens per second (answers x their mean length / generation seconds)."""
    import statistics

    rows = [m for m in metrics if "time/generation" in m and "step_time" in m]
    timed = rows[1:] or rows
    med = lambda key: statistics.median(m[key] for m in timed)  # noqa: E731
    step, gen, score = med("step_time"), med("time/generation"), med("time/scoring")
    tokens = statistics.median(m["completions/mean_length"] * answers_per_step / m["time/generation"] for m in timed)
    return {"steps": len(rows), "timed_steps": len(timed), "step_s": step, "generation_s": gen, "scoring_s": score,
            "training_s": step - gen - score, "generated_tokens_per_s": tokens, "answers_per_step": answers_per_step,
            "mean_completion_tokens": statistics.median(m["completions/mean_length"] for m in timed),
            "reward": [m.get("reward") for m in rows], "pass_rate": [m.get("pass_rate") for m in rows]}


def bench_grpo(cfg: BenchConfig, work: Path, model: str, steps: int, timeout: float) -> dict:
    """--method grpo for a few steps on the demo logs, the kit's GRPO defaults: where a step's time goes."""
    from dpokit.train import training

    d = training.TrainConfig()
    run_dir, timing, log = work / "grpo", work / "grpo.timing.json", work / "grpo.log"
    argv = ["--method", "grpo", "--data", str(ROOT / "data" / "runs.jsonl"), "--model_name_or_path", model,
            "--output_dir", str(run_dir), "--run_name", "r", "--max_steps", str(steps), "--eval_fraction", "0",
            "--probes", "", "--save_steps", "100000", "--seed", "42",
            "--max_completion_length", str(cfg.grpo_completion_length or d.max_completion_length)]
    env = os.environ | ({"CUDA_VISIBLE_DEVICES": ""} if not cfg.cuda else {})
    status, wall = run_child(child_command("child_train", argv, str(timing)), log, timeout=timeout, env=env)
    if status != 0 or not timing.exists():
        return child_failure(status, log)
    metrics = [json.loads(r) for r in (run_dir / "r.partial" / "metrics.jsonl").read_text().splitlines() if r.strip()]
    rec = json.loads(timing.read_text())
    return grpo_summary(metrics, d.per_device_train_batch_size * d.num_generations) | {
        "wall_s": wall, "peak_train_mb": rec.get("peak_gpu_mb" if cfg.cuda else "peak_train_mb"),
        "num_generations": d.num_generations, "max_completion_length": cfg.grpo_completion_length or d.max_completion_length,
        "prompts_per_step": d.per_device_train_batch_size}


def counter_lines(results: dict) -> list[str]:
    """What the kit's paths did in each measured child (trainers.counts, the reference's pass): the evidence that
    prompt sharing, the lean head and the pass before training ran where the table says they did."""
    short = {"kit_lean_batches": "lean-head passes", "kit_shared_batches": "shared-prompt passes",
             "kit_chosen_batches": "chosen-only batches", "kit_broke_batches": "broke-term batches"}
    out = []
    for mode, by_case in results["train"].items():
        for key, r in by_case.items():
            if not isinstance(r, dict) or "counts" not in r:
                continue
            done = [f"{n} {short[k]}" for k, n in (r.get("counts") or {}).items() if n]
            done += [f"reference ({split}) {what}" for split, what in (r.get("reference") or {}).items()]
            out.append(f"- {mode}, {key}: {'; '.join(done) or 'none of the kit paths'}")
    return ["", "What ran (the kit's counters, per mode and case):", "", *out] if out else []


def grpo_markdown(g: dict) -> list[str]:
    if "error" in g:
        return ["", f"GRPO: failed: {g['error']}"]
    return ["", f"GRPO (`--method grpo` on the demo logs' prompts, {g['prompts_per_step']} prompts x "
            f"{g['num_generations']} answers of up to {g['max_completion_length']} tokens a step; the median of "
            f"{g['timed_steps']} steps after a warm-up one):", "",
            "| s/step | generation (s) | scoring (s) | training (s) | generated tokens/s | answers/step | "
            "mean answer (tokens) | peak (MB) |", "| --- | --- | --- | --- | --- | --- | --- | --- |",
            f"| {g['step_s']:.1f} | {g['generation_s']:.1f} | {g['scoring_s']:.2f} | {g['training_s']:.1f} | "
            f"{g['generated_tokens_per_s']:.1f} | {g['answers_per_step']} | {g['mean_completion_tokens']:.0f} | "
            f"{g['peak_train_mb']:,.0f} |"]


def bench_build_pairs(n_runs: int, work: Path, seed: int) -> dict:
    logs, pairs = work / f"runs-{n_runs}.jsonl", work / f"pairs-{n_runs}.jsonl"
    write_run_logs(ROOT / "data" / "runs.jsonl", logs, n_runs, seed)
    argv, peak = [str(logs), "-o", str(pairs), "--report", str(work / f"report-{n_runs}.json")], work / "peak.json"
    status, wall = run_child(child_command("child_build_pairs", argv, str(peak)), work / f"build_pairs-{n_runs}.log",
                             timeout=600)
    if status != 0:
        raise RuntimeError(f"build_pairs failed on {n_runs} runs: {(work / f'build_pairs-{n_runs}.log').read_text()}")
    from dpokit.pairs import from_logs

    report, child = json.loads((work / f"report-{n_runs}.json").read_text()), json.loads(peak.read_text())
    workers = from_logs.worker_count(from_logs.PairsConfig(runs=str(logs)))
    workers = 0 if workers == 1 else workers  # 1 = this process alone, no worker processes
    # runs/s over build_pairs' own run (its imports included, not the interpreter's start and bench's import:
    # ~0.17 s, a quarter of the 10k-run wall time); peak = the main process plus each worker at the largest's peak
    out = {"runs": n_runs, "wall_s": wall, "run_s": child["run_s"], "runs_per_s": n_runs / child["run_s"],
           "runs_per_s_wall": n_runs / wall, "workers": workers, "main_peak_mb": child["peak_mb"],
           "peak_mb": child["peak_mb"] + workers * child["worker_peak_mb"],
           "pairs": report["pairs_written"], "input_mb": logs.stat().st_size / 1e6}
    logs.unlink()
    pairs.unlink()
    return out


def matmul_peak(n: int, seconds: float = 3.0, dtype: str = "float32", device: str = "cpu") -> dict:
    """Best torch.matmul rate on n x n matrices (2 n^3 FLOPs each), over about `seconds`; on CUDA each timing
    covers 10 products and waits for them."""
    import torch

    a, b = (torch.randn(n, n, dtype=getattr(torch, dtype), device=device) for _ in range(2))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    reps = 10 if device == "cuda" else 1
    torch.matmul(a, b)  # warm-up
    sync()
    best, end = float("inf"), time.time() + seconds
    while time.time() < end:
        t = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync()
        best = min(best, (time.perf_counter() - t) / reps)
    return {"size": n, "dtype": dtype, "device": device, "best_s": best, "gflops": 2 * n ** 3 / best / 1e9}


def machine(cuda: bool) -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "platform": platform.platform(),
            "versions": kit.package_versions(("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate",
                                              "datasets", "liger-kernel")),
            "cuda": torch.cuda.is_available(), "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "cuda_version": torch.version.cuda if cuda else None}


def plot(results: dict, dest: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes, cases = list(results["train"]), result_cases(results)
    memory = "peak GPU memory" if results.get("device") == "cuda" else "peak RSS in training"
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    width = 0.8 / max(len(cases), 1)
    for k, (key, title) in enumerate([("pairs_per_s", "pairs/s (higher is better)"), ("peak_train_mb", f"{memory}, MB"),
                                      ("mfu", "MFU (peak in the mode's dtype)")]):
        ax = axes[k]
        for j, case in enumerate(cases):
            vals = [results["train"][m].get(case["key"], {}).get(key) or 0 for m in modes]
            ax.bar([i + j * width for i in range(len(modes))], vals, width,
                   label=f"L={case['seq_len']}, prompt {case['prompt_fraction']:g}")
        ax.set_xticks([i + width * (len(cases) - 1) / 2 for i in range(len(modes))], modes, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend(fontsize="small")
    where = results["machine"].get("gpu") or f"{results['machine']['cores']} cores"
    fig.suptitle(f"dpo-kit, {where}, {results.get('model', {}).get('spec', '')}, batch {results['batch_size']}")
    fig.tight_layout()
    fig.savefig(dest, dpi=80)


def liger_note(cuda: bool) -> tuple[bool, str | None]:
    """(whether trl_best turns Liger on, the note for the report when it does not)."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return False, ("trl_best ran without Liger: liger-kernel is not installed, so TRL's best switch there is "
                       "precompute_ref_log_probs alone (full logits)")
    if not cuda:
        return False, "trl_best ran without Liger: its Triton kernels need a GPU (precompute_ref_log_probs alone)"
    return True, None


def serve_section(out_dir: Path) -> str:
    """The jobs service's polling measurement (results-serve.md, written by `make bench-serve`) as a section
    of results.md, so that file has every measurement; empty until that bench has run."""
    path = Path(out_dir) / "results-serve.md"
    return "\n" + path.read_text(encoding="utf-8").replace("# ", "## ", 1) if path.exists() else ""


def save(results: dict, out_dir: Path, stem: str, cfg: BenchConfig, final: bool) -> str:
    """results.json and results.md (and at the end the plot), rewritten after every measurement."""
    results["ratios"] = ratios(results["train"], cfg.length_list(), tuple(cfg.fraction_list()), every_memory=cfg.cuda)
    kit.atomic_write_json(out_dir / f"{stem}.json", results)
    table = markdown(results) + (serve_section(out_dir) if stem == "results" else "")
    kit.atomic_write_text(out_dir / f"{stem}.md", table)
    if final:
        plot(results, out_dir / f"{stem}.png")
    return table


def main(argv=None) -> int:
    began = time.time()
    cfg = kit.parse_config(BenchConfig, argv, __doc__)
    import torch
    from transformers import AutoTokenizer

    from dpokit.model import models

    cfg = dataclasses.replace(cfg, device=resolve_device(cfg.device, torch.cuda.is_available()))
    out_dir, work = ROOT / cfg.out_dir, Path(tempfile.mkdtemp(prefix="dpo-kit-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = cfg.model_name_or_path
    model_dir = Path(models.resolve_model_path(spec))  # a random shape is built here, once, not in each child
    model = spec if shapes.is_random(spec) else str(model_dir.resolve())
    model_config = json.loads((model_dir / "config.json").read_text())
    shape, n_lora = model_shape(model_config), lora_params(model_config, r=16)
    print(f"[bench] {spec} on {cfg.device}: matmul params {shape['n_base']:,} (blocks {shape['n_blocks']:,} + head "
          f"{shape['n_head']:,}); LoRA {n_lora:,}; work dir {work}", flush=True)
    cases = [Case(n, f, batch_for(n, cfg.batch_size, cfg.max_tokens), cfg.step_count(n))
             for n in cfg.length_list() for f in cfg.fraction_list()]
    liger, note = liger_note(cfg.cuda)
    results = {"quick": cfg.quick, "device": cfg.device, "lengths": cfg.length_list(),
               "prompt_fractions": cfg.fraction_list(), "cases": [dataclasses.asdict(c) | {"key": c.key} for c in cases],
               "steps": {str(n): cfg.step_count(n) for n in cfg.length_list()}, "batch_size": cfg.batch_size,
               "max_tokens": cfg.max_tokens, "gradient_checkpointing": cfg.gradient_checkpointing,
               "machine": machine(cfg.cuda), "model": {"spec": spec, "path": str(model_dir), "parameters": (
                   shapes.parameter_count(model_config) if model_config.get("model_type") in ("llama", "qwen2")
                   else shape["n_base"]), "random": shapes.describe(spec) if shapes.is_random(spec) else None},
               "shape": shape, "lora_params": n_lora, "config": dataclasses.asdict(cfg), "train": {},
               "build_pairs": [], "notes": [note] if note and "trl_best" in cfg.mode_list() else []}
    device = "cuda" if cfg.cuda else "cpu"
    size = cfg.matmul_size or (8192 if cfg.cuda else 2048)
    results["matmul"] = matmul_peak(size, device=device)
    results["matmul_bf16"] = matmul_peak(size, seconds=2.0, dtype="bfloat16", device=device)
    if cfg.cuda:
        torch.cuda.empty_cache()  # the children get the whole GPU: this process keeps no cached blocks
    peaks = {"float32": results["matmul"]["gflops"], "bfloat16": results["matmul_bf16"]["gflops"],
             "auto": models.resolve_compute_dtype("auto", cfg.cuda, cfg.cuda and torch.cuda.is_bf16_supported())}
    print(f"[bench] matmul peak on {device}: fp32 {results['matmul']['gflops']:.1f} GFLOP/s "
          f"(bf16 {results['matmul_bf16']['gflops']:.1f})" + (f"; {note}" if results["notes"] else ""), flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    longest, long_modes = max(cfg.length_list()), set(cfg.long_mode_list())
    stem = cfg.stem()  # a quick check never overwrites the measured record
    try:
        for i, case in enumerate(cases):
            data = work / f"pairs-{case.key}.jsonl"
            pairs = make_pairs(tokenizer, case.batch * case.steps, case.seq_len, cfg.seed, case.prompt_fraction)
            data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
            order = mode_order(cfg.mode_list(), i)
            results.setdefault("orders", []).append(f"{case.key}: {', '.join(order)}")
            for mode in order:
                if case.seq_len == longest != min(cfg.length_list()) and mode not in long_modes:
                    continue
                left = cfg.budget_s - (time.time() - began) if cfg.budget_s else 900.0
                r = bench_train(cfg, mode, case, data, work, shape, n_lora, peaks, model, liger, timeout=min(900.0, left)) \
                    if left > 10 else {"skipped": "skipped: past --budget_s"}
                results["train"].setdefault(mode, {})[case.key] = r
                print(f"[bench] {mode:<16} L={case.seq_len:<5} prompt {case.prompt_fraction:<4g} batch {case.batch} "
                      + (r.get("error") or r.get("skipped") or
                         f"{r['pairs_per_s']:.3f} pairs/s, {r['tokens_per_s']:,.0f} tokens/s, {r['step_s']:.2f} s/step, "
                         f"MFU {'n/a' if r['mfu'] is None else format(r['mfu'], '.1%')}, peak {r['peak_train_mb']:,.0f} MB, start-up {r['startup_s']:.1f} s, "
                         f"loss {r['last_loss']}"), flush=True)
                save(results, out_dir, stem, cfg, final=False)
        grpo_steps = cfg.grpo_steps if cfg.grpo_steps >= 0 else 2 if cfg.quick else 3
        left = cfg.budget_s - (time.time() - began) if cfg.budget_s else 900.0
        if grpo_steps and left > 10:
            g = results["grpo"] = bench_grpo(cfg, work, model, grpo_steps, timeout=min(900.0, left))
            print("[bench] grpo " + (g.get("error") or f"{g['step_s']:.1f} s/step: generation {g['generation_s']:.1f} s, "
                                     f"scoring {g['scoring_s']:.2f} s, training {g['training_s']:.1f} s; "
                                     f"{g['generated_tokens_per_s']:.1f} generated tokens/s"), flush=True)
            save(results, out_dir, stem, cfg, final=False)
        for n in cfg.run_sizes():
            r = bench_build_pairs(n, work, cfg.seed)
            results["build_pairs"].append(r)
            print(f"[bench] build_pairs {n:>9,} runs: {r['runs_per_s']:,.0f} runs/s, peak {r['peak_mb']:,.0f} MB, "
                  f"{r['pairs']:,} pairs", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(save(results, out_dir, stem, cfg, final=True))
    return 0


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
