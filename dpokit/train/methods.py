"""What differs between the kit's three training methods, one home for each: its checks of the options, its data,
its TRL config and its trainer. train_dpo.py's recipe (data, model, run directory, train, finish) calls these and
is the same for all three.

  dpo   preference pairs                     TRL DPOTrainer   (chosen against rejected, against a frozen reference)
  kto   unpaired examples labelled good/bad  TRL KTOTrainer   (build_pairs.py --emit kto; pairs are unpaired)
  grpo  prompts (and the host each names)    TRL GRPOTrainer  (num_generations sampled answers per prompt, each
                                                               scored by rewards.py: the checker runs its code)

Every method trains a LoRA adapter on the (4-bit) base; the reference is the base with the adapter off.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
from pathlib import Path

from dpokit.core import kit, ranks
from dpokit.data import formats, supervised
from dpokit.model import models
from dpokit.scoring import checker, graders, rewards
from dpokit.pairs import from_logs
from dpokit.train import trainers
from dpokit.core.kit import UserError

METHODS = ("dpo", "kto", "grpo")
KTO_BALANCE = 1.15  # desirable x weight / (undesirable x weight): inside the KTO paper's [1, 4/3], off its edges


TRAINERS = {"dpo": "DPOTrainer", "kto": "KTOTrainer", "grpo": "GRPOTrainer"}
UNITS = {"dpo": "pairs", "kto": "examples", "grpo": "prompts"}


# ---------------------------------------------------------------------------------------------
# Options: what each method does not take (reported with the rest of train_dpo's problems).
# ---------------------------------------------------------------------------------------------


DPO_ONLY = {"loss_type": "sigmoid", "sft_weight": 0.0, "mix": "", "distinct_chosen": False,  # option: its default
            "broke_weight": 0.0, "mix_answers": "given", "mix_answer_tokens": 160}


def dpo_only_problems(cfg, method: str) -> list[str]:
    return [f"--{name} is for DPO; --method {method} does not take it"
            for name, default in DPO_ONLY.items() if getattr(cfg, name) != default]


def distinct_applies(cfg, method: str) -> bool:
    """--distinct_chosen takes effect: DPO whose loss reads the chosen side alone (a preference loss reads each
    pair's rejected answer too, so no pair repeats another there)."""
    return method == "dpo" and cfg.distinct_chosen and cfg.loss_type == "sft"


def kto_problems(cfg) -> list[str]:
    """What does not go with KTO (checked again once --method auto has read the data)."""
    p = []
    if cfg.per_device_train_batch_size < 2:
        p.append("--method kto needs --per_device_train_batch_size 2 or more: KTO estimates its KL term from the "
                 "other completions in the batch")
    p += dpo_only_problems(cfg, "kto")
    if cfg.init_adapter:
        p.append("--init_adapter is for DPO; --method kto does not take it")
    if cfg.use_liger_kernel:
        p.append("--use_liger_kernel: untested with --method kto here; train KTO without it")
    return p


def grpo_problems(cfg) -> list[str]:
    """What does not go with GRPO, and GRPO's own options."""
    p = dpo_only_problems(cfg, "grpo")
    for name in ("ref_model_name_or_path", "use_liger_kernel", "early_stopping_patience"):
        if getattr(cfg, name):
            p.append(f"--{name} is for DPO and KTO; --method grpo does not take it")
    if cfg.num_generations < 2:
        p.append(f"--num_generations must be at least 2: GRPO scores each answer against its group's (got "
                 f"{cfg.num_generations})")
    if cfg.max_completion_length < 1 or cfg.temperature <= 0:
        p.append("--max_completion_length must be at least 1 and --temperature positive")
    if cfg.use_vllm:
        import importlib.util

        if not importlib.util.find_spec("vllm"):
            p.append("--use_vllm needs the vllm package and a GPU (pip install vllm)")
    return p + rewards.problems(cfg.reward, cfg.reward_cmd, cfg.reward_weights, cfg.reward_grader, endpoints(cfg))


def endpoints(cfg) -> "graders.Endpoints":
    """Where the --reward_grader's judge and embeddings are (the keys come from the environment)."""
    return graders.Endpoints.from_env(cfg.judge_base_url, cfg.embeddings_base_url, cfg.embeddings_model)


def method_problems(cfg, method: str) -> list[str]:
    p = [] if cfg.desirable_weight >= 0 and cfg.undesirable_weight >= 0 else [
        "--desirable_weight and --undesirable_weight must not be negative (0 = from the class balance)"]
    p += [] if cfg.sft_weight >= 0 else [f"--sft_weight must not be negative (got {cfg.sft_weight})"]
    p += [] if cfg.broke_weight >= 0 else [f"--broke_weight must not be negative (got {cfg.broke_weight})"]
    p += [] if cfg.mix_answers == "given" or cfg.mix else ["--mix_answers base answers the --mix pairs: give --mix"]
    p += [] if cfg.mix_answer_tokens >= 8 else [f"--mix_answer_tokens must be at least 8 (got {cfg.mix_answer_tokens})"]
    return p + (kto_problems(cfg) if method == "kto" else grpo_problems(cfg) if method == "grpo" else [])


def whole_sentences(text: str, cut: bool) -> str | None:
    """An answer as rehearsal data: stripped; one cut at the token limit (cut) ends at its last sentence end (., !
    or ? before a space or the end), and is None when it has none."""
    text = text.strip()
    if not cut:
        return text or None
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", text)]
    return text[:ends[-1]] if ends else None


def answer_mix(cfg, model, tokenizer, pairs: list[dict], data) -> None:
    """--mix_answers base: each mixed-in pair's chosen answer becomes the base model's greedy answer to its prompt,
    made before training (the adapter, if any, off). An answer cut at --mix_answer_tokens ends at its last whole
    sentence; one with none, or one without any of its pair's meta.expect words (a small base rehearsing its own
    wrong fact teaches it: "2 + 3 is 4" made "1 + 1 is 1"), keeps its file's answer. In place; data.mix_answers
    (data.json) has every answer and which one trained."""
    mixed = [r for r in pairs if formats.MIX_KEY in r]
    if cfg.mix_answers != "base" or not mixed:
        return
    key_of = [json.dumps(r["prompt"], ensure_ascii=False) for r in mixed]  # a prompt's pairs share its answer
    first = {}  # each distinct prompt -> (its prompt, its first pair's meta.expect)
    for k, r in zip(key_of, mixed):
        first.setdefault(k, (r["prompt"], r.get(formats.EXPECT_KEY)))
    disable = getattr(model, "disable_adapter", None)  # a PEFT model: its base; a plain one is the base
    with disable() if disable else contextlib.nullcontext():
        answers = models.generate(model, tokenizer, [p for p, _ in first.values()], cfg.mix_answer_tokens,
                                  label="mix: the base answers")
    limit = cfg.mix_answer_tokens
    made = {k: whole_sentences(a, len(tokenizer(a, add_special_tokens=False)["input_ids"]) >= limit - 1)
            for k, a in zip(first, answers)}
    used = {k: a is not None and formats.has_fact(a, first[k][1]) is not False for k, a in made.items()}
    for k, r in zip(key_of, mixed):
        if used[k]:
            r["chosen"] = [{"role": "assistant", "content": made[k]}] if isinstance(r["chosen"], list) else made[k]
    own, wrong = sum(used.values()), sum(a is not None and not used[k] for k, a in made.items())
    data.mix_answers = {"prompts": len(made), "base": own, "given": len(made) - own, "wrong": wrong,
                        "answers": [{"prompt": first[k][0], "answer": a, "trained": "base" if used[k] else "file"}
                                    for k, a in made.items()]}  # what it rehearsed, readable
    print(f"[mix] {own} of the {len(made)} mixed-in prompts trained on the base model's own greedy answer"
          + (f"; {len(made) - own} on their file's ({wrong} where the base's lacked the expected fact, "
             f"{len(made) - own - wrong} with no whole sentence in {limit} tokens)" if own < len(made) else ""),
          flush=True)


# ---------------------------------------------------------------------------------------------
# Data: which method a file asks for; GRPO's prompts.
# ---------------------------------------------------------------------------------------------


def first_record(path: str) -> dict | None:
    """The first JSON object of a .jsonl file (None for anything else: other formats are pairs or examples)."""
    p = Path(path)
    if not p.is_file() or not p.name.endswith(".jsonl"):
        return None
    try:
        with open(p, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    obj = json.loads(line)
                    return obj if isinstance(obj, dict) else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None  # load_pairs reports it with its line
    return None


def holds_prompts(record: dict | None) -> bool:
    """Run logs (build_pairs' input) or a prompts file ({prompt, host?, run_id?}): GRPO's data, not pairs."""
    if not record:
        return False
    return "attempts" in record or ("prompt" in record and not {"chosen", "rejected", "completion", "label",
                                                                "preferred_output", "messages"} & set(record))


def load_prompts(path: str) -> tuple[list[dict], str]:
    """GRPO's prompts: a prompts file (checker.load_prompts: FILE:LINE errors), or run logs, each run's
    code-asking turn and host (checker.prompts_from_logs). Returns (rows, format)."""
    if not Path(path).is_file():
        raise UserError("no such file (GRPO reads a prompts file or run logs)", path)
    if "attempts" in (first_record(path) or {}):
        return checker.prompts_from_logs(path), "run_logs"
    return checker.load_prompts(path), "prompts"


def prompt_record(row: dict) -> dict:
    """A prompt row as training and the held-out split see it: its run (the same split as the run's pairs), and
    the row's item for OpenAI-style graders (a JSON string: Arrow would merge the items' keys across rows)."""
    return {"prompt": row["prompt"], "host": row.get("host", "")} | (
        {"item": json.dumps(row["item"], ensure_ascii=False)} if "item" in row else {}) | (
        {formats.RUN_KEY: row["run_id"]} if "run_id" in row else {})


def grpo_data(cfg, data: formats.TrainingData) -> tuple[list[dict], list[dict]]:
    """(training prompts, held-out prompts): held out by run as pairs are, shuffled with the seed."""
    rows, fmt = load_prompts(cfg.data)
    records = [prompt_record(r) for r in rows]
    data.format, data.pairs = fmt, len(records)
    held = [r for r in records if formats.held_out(r, cfg.eval_fraction)]
    train = [r for r in records if not formats.held_out(r, cfg.eval_fraction)]
    if not train:
        raise UserError(f"every prompt fell in the held-out share (--eval_fraction {cfg.eval_fraction}); lower it "
                        "or add prompts", cfg.data)
    data.held_out = len(held)

    per_step = cfg.per_device_train_batch_size * ranks.world()["world_size"] * cfg.gradient_accumulation_steps
    if len(train) < per_step:  # TRL's sampler keeps whole batches of prompts only: it would have none
        raise UserError(f"{len(train)} training prompts ({len(held)} held out of {len(records)}), fewer than the "
                        f"{per_step} a step samples: add prompts, or lower --per_device_train_batch_size", cfg.data)
    random.Random(cfg.seed).shuffle(train)
    return train, held


# ---------------------------------------------------------------------------------------------
# TRL configs: the only place the kit's options are mapped onto them.
# ---------------------------------------------------------------------------------------------


def trainer_kwargs(cfg, checkpoint_dir: str, on_gpu: bool, bf16_ok: bool, with_eval: bool = False) -> dict:
    """What every TRL config takes (transformers' TrainingArguments and the beta all three share)."""
    compute = models.resolve_compute_dtype(cfg.compute_dtype, on_gpu, bf16_ok)
    kwargs = dict(
        output_dir=checkpoint_dir, seed=cfg.seed, data_seed=cfg.seed, beta=cfg.beta, learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_scheduler_type, warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm, num_train_epochs=cfg.num_train_epochs, max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        gradient_checkpointing=cfg.gradient_checkpointing, use_liger_kernel=cfg.use_liger_kernel,
        logging_steps=cfg.logging_steps, save_strategy="steps", save_steps=cfg.save_steps, save_total_limit=2,
        bf16=compute == "bfloat16", fp16=on_gpu and compute == "float16", use_cpu=not on_gpu,
        report_to=trackers(cfg.report_to) or "none", disable_tqdm=True, dataloader_num_workers=0,  # progress: runs.training_callbacks
        ddp_find_unused_parameters=False,  # several processes: every LoRA weight is used, skip DDP's extra graph walk
    )
    if with_eval:
        kwargs.update(eval_strategy="steps", eval_steps=cfg.eval_steps,
                      per_device_eval_batch_size=cfg.per_device_train_batch_size)
        if cfg.early_stopping_patience:  # the best checkpoint must exist: save at every evaluation
            kwargs.update(load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=False,
                          save_steps=cfg.eval_steps)
    return kwargs


def trackers(report_to: str) -> list[str]:
    """--report_to as TRL's list ('none' and '' = no tracker)."""
    return [t.strip() for t in report_to.split(",") if t.strip() and t.strip() != "none"]


def pair_kwargs(cfg) -> dict:
    """What DPO and KTO share beyond the Trainer: sequences cut to max_length, the reference's log-probs."""
    return {"max_length": cfg.max_length, "precompute_ref_log_probs": cfg.precompute_ref_log_probs}


def dpo_config_kwargs(cfg, checkpoint_dir: str, on_gpu: bool, bf16_ok: bool, with_eval: bool = False) -> dict:
    """TRL's DPOConfig: the shared Trainer settings, DPO's loss (and the SFT term, TRL's MPO-style sum)."""
    kwargs = trainer_kwargs(cfg, checkpoint_dir, on_gpu, bf16_ok, with_eval) | pair_kwargs(cfg) | {
        "loss_type": [cfg.loss_type]}
    if cfg.sft_weight:
        kwargs.update(loss_type=[cfg.loss_type, "sft"], loss_weights=[1.0, cfg.sft_weight])
    if on_gpu and kwargs["precompute_ref_log_probs"]:  # a forward without a backward keeps no activations: 4x the
        kwargs["precompute_ref_batch_size"] = 4 * cfg.per_device_train_batch_size  # pairs (halved on running out)
    if cfg.loss_type == "sft" and cfg.precompute_ref_log_probs:
        # The sft loss never reads the reference; TRL would still run it over every pair before training.
        kwargs["precompute_ref_log_probs"] = False
        print("[model] no reference pass: the sft loss alone never reads the reference", flush=True)
    return kwargs


def kto_weights(n_desirable: int, n_undesirable: int, desirable: float = 0.0, undesirable: float = 0.0) -> tuple:
    """(desirable_weight, undesirable_weight): the ones given (non-zero), else weights that put the two
    classes' total weight at KTO_BALANCE to 1, the rarer class up-weighted (the KTO paper, eq. 8, and TRL's
    docs: desirable x its weight / (undesirable x its weight) in [1, 4/3])."""
    if desirable and undesirable:
        return desirable, undesirable
    d, u = max(n_desirable, 1), max(n_undesirable, 1)
    if desirable:  # the other from the balance
        return desirable, round(desirable * d / (u * KTO_BALANCE), 4)
    if undesirable:
        return round(undesirable * u * KTO_BALANCE / d, 4), undesirable
    return (round(u * KTO_BALANCE / d, 4), 1.0) if d <= u else (1.0, round(d / (u * KTO_BALANCE), 4))


def kto_config_kwargs(cfg, checkpoint_dir: str, on_gpu: bool, bf16_ok: bool, weights: tuple,
                      with_eval: bool = False) -> dict:
    """TRL's KTOConfig: the shared Trainer settings, KTO's loss and the two classes' weights."""
    return trainer_kwargs(cfg, checkpoint_dir, on_gpu, bf16_ok, with_eval) | pair_kwargs(cfg) | {
        "loss_type": "kto", "desirable_weight": weights[0], "undesirable_weight": weights[1]}


def grpo_config_kwargs(cfg, checkpoint_dir: str, on_gpu: bool, bf16_ok: bool) -> dict:
    """TRL's GRPOConfig. The kit's batch is in prompts, as it is in pairs for DPO: each prompt's num_generations
    answers go through one forward pass together (TRL's per_device_train_batch_size counts answers), so a step
    always holds whole groups; one generation per optimiser step (TRL's steps_per_generation = accumulation)."""
    kwargs = trainer_kwargs(cfg, checkpoint_dir, on_gpu, bf16_ok) | {
        "per_device_train_batch_size": cfg.per_device_train_batch_size * cfg.num_generations,
        "num_generations": cfg.num_generations, "max_completion_length": cfg.max_completion_length,
        "temperature": cfg.temperature, "top_p": cfg.top_p, "use_vllm": cfg.use_vllm, "log_completions": False}
    kwargs["reward_weights"] = rewards.weights(cfg.reward_weights) or rewards.default_weights(
        cfg.reward, cfg.reward_cmd, cfg.reward_grader)
    if cfg.use_vllm:
        kwargs["vllm_mode"] = "colocate"  # one process, the training GPU's memory shared (TRL's default)
    return kwargs


def trl_config(cfg, data: formats.TrainingData, rows: list[dict], checkpoint_dir: str, on_gpu: bool, bf16_ok: bool,
               with_eval: bool):
    """The method's TRL config (KTO: its class weights, decided here from the training examples and printed)."""
    from trl import DPOConfig, GRPOConfig, KTOConfig

    if data.method == "grpo":
        return GRPOConfig(**grpo_config_kwargs(cfg, checkpoint_dir, on_gpu, bf16_ok))
    if data.method == "kto":
        n_good = sum(e["label"] for e in rows)
        weights = kto_weights(n_good, len(rows) - n_good, cfg.desirable_weight, cfg.undesirable_weight)
        data.kto_weights = {"desirable": weights[0], "undesirable": weights[1]}
        print(f"[kto] {n_good:,} desirable and {len(rows) - n_good:,} undesirable training examples; weights "
              f"{weights[0]:g} and {weights[1]:g} (desirable x weight / (undesirable x weight) = "
              f"{weights[0] * max(n_good, 1) / (weights[1] * max(len(rows) - n_good, 1)):.2f}"
              f"{'' if cfg.desirable_weight and cfg.undesirable_weight else ', from the class balance'})", flush=True)
        kwargs = kto_config_kwargs(cfg, checkpoint_dir, on_gpu, bf16_ok, weights, with_eval)
        return KTOConfig(**kwargs | reference_pass(cfg, kwargs, len(rows), ranks.world()["world_size"]))
    kwargs = dpo_config_kwargs(cfg, checkpoint_dir, on_gpu, bf16_ok, with_eval)
    return DPOConfig(**kwargs | reference_pass(cfg, kwargs, len(rows), ranks.world()["world_size"]))


def reference_pass(cfg, kwargs: dict, n_rows: int, processes: int) -> dict:
    """The reference's log-probs once before training pay where training sees every row at least once: a pass
    costs one reference forward per row, the per-step reference one per row trained. A run of max_steps that
    sees fewer rows than the data holds keeps the reference forward in each step (said)."""
    if not kwargs.get("precompute_ref_log_probs") or cfg.max_steps < 1:
        return {}
    seen = cfg.max_steps * cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * processes
    if seen >= n_rows:
        return {}
    print(f"[model] the reference forward runs in each step: {cfg.max_steps} steps train {seen:,} of the "
          f"{n_rows:,} rows, so a pass over them all before training would cost more", flush=True)
    return {"precompute_ref_log_probs": False}


# ---------------------------------------------------------------------------------------------
# Trainers.
# ---------------------------------------------------------------------------------------------


def trainer_class(method: str, internals: bool, dpo_cache: tuple = (), tokenized: dict | None = None):
    """TRL's trainer for the method, or the kit's subclass of it where the installed TRL is the pinned one
    (fastpath.py: the kit's tokenisation and log-probs for DPO and KTO, GRPO's timings)."""
    from trl import DPOTrainer, GRPOTrainer, KTOTrainer

    if not internals:
        return {"dpo": DPOTrainer, "kto": KTOTrainer, "grpo": GRPOTrainer}[method]
    if method == "grpo":
        return trainers.grpo_trainer_class()
    if method == "kto":
        return trainers.kto_trainer_class()
    return trainers.dpo_trainer_class(*dpo_cache, tokenized if tokenized is not None else {})


def make_trainer(cls, cfg, method: str, model, ref_model, args, train: list[dict], held: list[dict], tokenizer,
                 peft_config, callbacks: list):
    """The trainer over the kit's records: pairs or examples with a frozen reference (DPO, KTO), or prompts
    and the reward functions (GRPO: the reference is the base with the adapter off, TRL's default for LoRA)."""
    from datasets import Dataset

    rows = formats.dataset_rows(formats.trainable(train))
    common = dict(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                  peft_config=peft_config, callbacks=callbacks)
    if method == "grpo":
        trainer = cls(reward_funcs=rewards.reward_functions(cfg.reward, cfg.reward_cmd, grader=cfg.reward_grader,
                                                            ends=endpoints(cfg)), **common)
        if hasattr(trainer, "kit_skip_alike"):  # the kit's subclass (trainers.grpo_trainer_class)
            trainer.kit_skip_alike = cfg.skip_alike
        return trainer
    eval_rows = formats.dataset_rows(formats.trainable(held))
    return cls(ref_model=ref_model, eval_dataset=Dataset.from_list(eval_rows) if held else None, **common)


def read_pairs(cfg, columns: dict) -> tuple[list[dict], dict]:
    """formats.load_pairs on --data, or supervised_pairs where it holds OpenAI's supervised rows (`messages`)."""
    first = first_record(cfg.data)
    if isinstance(first, dict) and "messages" in first and not columns and formats.detect_format(first) is None:
        return supervised_pairs(cfg)
    return formats.load_pairs(cfg.data, cfg.skip_invalid, columns, cfg.min_score_gap)


def supervised_pairs(cfg) -> tuple[list[dict], dict]:
    """OpenAI's supervised rows (supervised.py) as SFT pairs, one per assistant message trained on: loss_type sft,
    which reads only the chosen side (a loss_type given as a flag that is not sft is refused)."""
    if cfg.loss_type != "sft":
        if cfg.loss_type != DPO_ONLY["loss_type"] and "loss_type" not in kit.from_config_file(cfg):
            raise UserError(f"supervised rows (messages) train with --loss_type sft, not {cfg.loss_type}", cfg.data)
        print(f"[config] {cfg.data} holds supervised rows (messages): --loss_type sft, each assistant message's "
              f"likelihood (was {cfg.loss_type})", flush=True)
        cfg.loss_type = "sft"
    sft = supervised.read(cfg.data)
    records = from_logs.sft_pairs(sft.examples, cfg.seed)
    pairs, stats = formats.load_rows(cfg.data, enumerate(records, 1), kit.sha256_file(cfg.data), cfg.skip_invalid,
                                     {}, 0.0)
    print(f"[data] {sft.summary(cfg.data)}", flush=True)
    return pairs, stats | {"format": "openai_supervised", "lines": sft.rows, "files": []}


def recipe_fits(cfg, method: str, what: str) -> None:
    """A --config file's DPO options (the bundled model's recipe: loss_type sft, mix, distinct_chosen) where the data
    holds KTO examples or GRPO prompts (--method auto): left at their defaults, and said; the same options given as
    flags stay, and are refused as before."""
    if cfg.method != "auto" or method not in ("kto", "grpo"):
        return
    moved = {name: getattr(cfg, name) for name, default in DPO_ONLY.items()
             if name in kit.from_config_file(cfg) and getattr(cfg, name) != default}
    if not moved:
        return
    for name in moved:
        setattr(cfg, name, DPO_ONLY[name])
    source = kit.from_config_file(cfg)[next(iter(moved))]
    print(f"[config] {source}: {', '.join(f'{k} {v!r}' for k, v in moved.items())} are DPO options and the data holds "
          f"{what}: left at their defaults for --method {method}", flush=True)
