"""Fine-tune a causal LM on preference pairs with DPO (on unpaired labelled examples with KTO, or online with GRPO:
sampled answers scored by running them): 4-bit NF4 base, LoRA adapter, frozen reference.

    python train_dpo.py --data pairs.jsonl [--model_name_or_path DIR|HUB_ID] [--run_name NAME] [--config run.yaml]
    python train_dpo.py --data examples.jsonl         # {"prompt", "completion", "label"} lines: KTO (--method auto)
    python train_dpo.py --method grpo --data data/runs.jsonl   # run logs' prompts, answers scored by checker.py
    make train DATA=pairs.jsonl ARGS="--max_steps 20 --learning_rate 5e-5 --beta 0.1 --seed 7"
    python train_dpo.py --config configs/demo.yaml --data pairs.jsonl     # options from YAML, flags on top

Writes artifacts/<run_name>/ (adapter, tokenizer, model card, config, metrics, report, status, manifest) by
way of artifacts/<run_name>.partial/, then artifacts/<run_name>.tar.gz for handoff. Running again with the
same --run_name resumes from the last checkpoint; one process at a time trains a run. `--help` lists every
option. In-process callers (iterate.py, scaleout.py, bench) call `run(TrainConfig(...))`. From the command line,
preflight.py checks the machine first: on a machine with an NVIDIA GPU that PyTorch cannot use (CPU build, old
driver, container without --gpus), the run stops with one sentence saying what to do, unless --allow_cpu.

This file is the recipe: the options, then `run` in named steps. The parts live beside it: methods.py (what
differs between DPO, KTO and GRPO: their checks, data, TRL config and trainer), rewards.py (GRPO's reward
functions), models.py (loading, LoRA targets, generation), fastpath.py (kernels, TRL internals), tokenization.py
(pairs to tokens), token_cache.py (tokenised pairs kept between runs), evaluate.py (report, model card), runs.py
(run directory, status, lock, tarball), formats.py (pair files, held-out split, mixing), ranks.py, preflight.py
(the machine's checks before a run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import platform
import signal
import sys
import time
from collections import Counter
from pathlib import Path

from dpokit.core import kit, ranks, runs
from dpokit.data import formats, token_cache, tokenization
from dpokit.model import fastpath, models, preflight, shapes
from dpokit.scoring import checker, rewards
from dpokit.train import evaluate, methods, reference, trainers
from dpokit.core.kit import UserError
from dpokit.train.config import KIT_NAME, TrainConfig



# ---------------------------------------------------------------------------------------------
# Pure helpers: tested without a model.
# ---------------------------------------------------------------------------------------------


def truncation_stats(prompt_lens, chosen_lens, rejected_lens, max_length: int) -> int:
    """How many tokenised pairs the collator will cut (prompt + longer completion > max_length)."""
    return sum(1 for p, c, r in zip(prompt_lens, chosen_lens, rejected_lens) if p + max(c, r) > max_length)


class Interrupt:
    """SIGTERM/SIGINT (docker stop, spot preemption, Ctrl-C) -> save a checkpoint and stop cleanly."""

    def __init__(self):
        self.signum = None
        self.training = False

    def __call__(self, signum, frame):
        self.signum = signum
        if not self.training:
            raise KeyboardInterrupt


def adapter_step(state) -> int:
    """The step whose adapter the run keeps: the last, or with early stopping the best checkpoint's."""
    return int(state.best_global_step) if state.best_model_checkpoint and state.best_global_step else state.global_step


def batch_info(cfg: TrainConfig) -> dict:
    """Processes and pairs per optimiser step (the same global batch on 1 or N GPUs trains the same)."""
    w = ranks.world()
    return {"processes": w["world_size"], "nodes": w["nodes"], "effective_batch_size": ranks.effective_batch_size(
        cfg.per_device_train_batch_size, w["world_size"], cfg.gradient_accumulation_steps)}


@dataclasses.dataclass
class Built:
    """What the build steps hand to training and to the finish."""
    tokenizer: object
    model: object
    ref_model: object | None  # a separate reference model (--ref_model_name_or_path), else None
    targets: list[str]  # LoRA target modules
    params: dict  # parameter counts
    compute: fastpath.Compute
    on_gpu: bool
    internals: bool  # TRL's internals usable (fastpath.version_problem): the cache and the fast path
    trainer: object = None
    method: str = "dpo"  # or kto
    parent: dict | None = None  # --init_adapter: the run this one continues
    micro: tuple | None = None  # (pairs per forward, accumulation, why): plan_gpu_memory's choice; None = the run's


# ---------------------------------------------------------------------------------------------
# The recipe.
# ---------------------------------------------------------------------------------------------


def run(cfg: TrainConfig, callbacks: list = ()) -> runs.Run:
    """Train one run to the end (or to a signal): data, models, run directory, model, trainer, train,
    finish. Returns the run; its state is succeeded or cancelled (a failure raises). callbacks: extra
    transformers TrainerCallbacks (the bench's timing)."""
    started = runs.now_iso()
    models.cuda_allocator_defaults()  # before anything allocates on a GPU
    data, train_pairs, held = load_data(cfg)
    probes = evaluate.load_probes(cfg.probes)
    exec_prompts = evaluate.mark_seen(held_out_prompts(cfg), train_pairs)  # which are a training prompt word for word
    if data.method == "grpo":  # its held-out prompts are what the checker scores; it has no held-out pairs
        exec_prompts, held = exec_prompts + [{k: v for k, v in r.items() if k != formats.RUN_KEY} for r in held], []
    internals = trl_internals_usable(cfg)
    model_path = models.resolve_model_path(cfg.model_name_or_path)  # before a run directory exists
    ref_path = models.resolve_model_path(cfg.ref_model_name_or_path) if cfg.ref_model_name_or_path else None
    tokenizer = load_tokenizer(cfg, model_path, train_pairs + held, internals)  # a template problem: before any model
    run = runs.Run(cfg.output_dir, cfg.run_name or runs.default_run_name(data.sha256, dt.datetime.now(dt.timezone.utc)))
    with run.lock() if ranks.is_main_process() else contextlib.nullcontext():
        run, resume_from = open_run_dir(cfg, run, data)
        if resume_from is None:
            return run
        announce(cfg, run, data, len(train_pairs))
        with catch_signals() as interrupt, failures_recorded(run, interrupt), \
                models.cpu_matmul_precision(cfg.cpu_matmul_precision):
            built = build_model(cfg, model_path, ref_path, internals, tokenizer)
            methods.answer_mix(cfg, built.model, tokenizer, train_pairs, data)  # --mix_answers base
            build_trainer(cfg, run, built, train_pairs, held, data, interrupt, callbacks)
            record_data(cfg, run, built, data, n_pairs=len(train_pairs))
            train(run, built.trainer, resume_from, interrupt)
            if run.state == "running":
                finish(cfg, run, built, held, probes, data, model_path, started, exec_prompts)
    return run


def held_out_prompts(cfg: TrainConfig) -> list[dict]:
    """--eval_prompts, checked before anything loads: rows of a run (run_id) only when that run is held out (the
    same rule as the pairs', so the checker scores answers to runs the model never trained on)."""
    if not cfg.eval_prompts:
        return []

    rows = checker.load_prompts(cfg.eval_prompts)
    kept = [r for r in rows if formats.held_out_prompt(r, cfg.eval_fraction)]
    print(f"[eval] {len(kept)} of {len(rows)} --eval_prompts prompts are held out; the checker runs "
          f"{cfg.eval_samples} sampled answers to each, base and tuned", flush=True)
    return kept


def load_data(cfg: TrainConfig) -> tuple[formats.TrainingData, list[dict], list[dict]]:
    """The whole file validated before anything heavy happens; the held-out share; other files mixed in.
    GRPO: prompts (or run logs' prompts), the held-out ones kept for the checker."""
    if cfg.method == "grpo" or (cfg.method == "auto" and methods.holds_prompts(methods.first_record(cfg.data))):
        methods.recipe_fits(cfg, "grpo", "prompts (GRPO)")
        data = formats.TrainingData(path=cfg.data, sha256=kit.sha256_file(cfg.data) if Path(cfg.data).is_file() else "",
                                    format="prompts", pairs=0, skipped={}, method="grpo")
        problems = methods.grpo_problems(cfg) if cfg.method == "auto" else []
        if problems:
            raise UserError("the data holds prompts (GRPO), and " + "; ".join(problems), cfg.data)
        train, held = methods.grpo_data(cfg, data)
        return data, train, held
    columns = formats.parse_columns(cfg.columns)
    pairs, stats = methods.read_pairs(cfg, columns)
    data = formats.TrainingData(path=cfg.data, sha256=stats["sha256"], format=stats["format"], pairs=stats["pairs"],
                                skipped=stats["skipped"], ignored_columns=stats["ignored_columns"], columns=columns,
                                min_score_gap=cfg.min_score_gap, score_gap_dropped=stats["score_gap_dropped"],
                                files=stats["files"])
    data.method = resolve_method(cfg, pairs)
    if data.method == "kto":
        if not formats.is_example(pairs[0]):  # --method kto on pairs: chosen desirable, rejected undesirable
            pairs = formats.unpair(pairs)
            print(f"[data] --method kto: {stats['pairs']:,} pairs unpaired into {len(pairs):,} examples")
        data.labels = {"desirable": sum(e["label"] for e in pairs), "undesirable": sum(not e["label"] for e in pairs)}
    train_pairs, held = formats.split_and_mix(pairs, data, cfg.eval_fraction, cfg.mix, cfg.seed, cfg.skip_invalid,
                                              methods.distinct_applies(cfg, data.method), cfg.broke_weight > 0,
                                              rehearse=cfg.mix_answers == "base")
    if data.method == "kto":  # TRL's KTO samples in order (its KL term pairs each example with its neighbours)
        import random

        random.Random(cfg.seed).shuffle(train_pairs)
    return data, train_pairs, held


def resolve_method(cfg: TrainConfig, records: list[dict]) -> str:
    """dpo or kto: --method, or (auto) what the data holds; a file of examples cannot train DPO."""
    unpaired = formats.is_example(records[0])
    if cfg.method == "dpo" and unpaired:
        raise UserError("--method dpo needs preference pairs; this file holds unpaired (prompt/completion/label) "
                        "examples: train them with --method kto (or auto)", cfg.data)
    method = "kto" if unpaired else cfg.method if cfg.method != "auto" else "dpo"
    methods.recipe_fits(cfg, method, "unpaired examples (KTO)")
    problems = methods.kto_problems(cfg) if method == "kto" and cfg.method == "auto" else []
    if problems:
        raise UserError("the data holds unpaired examples (KTO), and " + "; ".join(problems), cfg.data)
    return method


def trl_internals_usable(cfg: TrainConfig) -> bool:
    """Whether the installed TRL and transformers are the versions fastpath.py reaches into. When they are
    not, the fast path is an error (one sentence) and --no_fused_ops trains through TRL's public API only."""
    problem = fastpath.version_problem()
    if problem and cfg.broke_weight:
        raise UserError(f"{problem}: --broke_weight's term runs in the kit's DPO trainer (fastpath.py); install the "
                        "pinned versions (requirements.txt; make venv)")
    if problem and cfg.fused_ops:
        raise UserError(f"{problem}: install the pinned versions (requirements.txt; make venv), or train with "
                        "--no_fused_ops, which uses TRL's public API only")
    if problem:
        print(f"[model] {problem}: TRL's own dataset preparation and log-probs (no tokenised-data cache, no "
              "chunked log-probs)")
    return problem is None


def open_run_dir(cfg: TrainConfig, run: runs.Run, data: formats.TrainingData) -> tuple[runs.Run, str | None]:
    """Rank 0 creates or reopens the run directory; with several processes the others take its run name and
    checkpoint, which must be on storage they see too. resume_from: a checkpoint, '' for a fresh start, None
    when the run is already complete."""
    resolved = dataclasses.asdict(cfg) | {"run_name": run.name}
    rank0 = ranks.is_main_process()
    name, resume_from = ranks.share_from_rank0((run.name, run.prepare(resolved, data.sha256)) if rank0 else None)
    if not rank0:
        run = runs.Run(cfg.output_dir, name)
    if resume_from and not Path(resume_from).is_dir():
        raise UserError(f"rank {ranks.world()['rank']} cannot see {resume_from} to resume from: with several "
                        "machines, put --output_dir on storage they all mount")
    return run, resume_from


def announce(cfg: TrainConfig, run: runs.Run, data: formats.TrainingData, n_train: int) -> None:
    if not ranks.is_main_process():
        print(f"[rank {ranks.world()['rank']}] training {run.name} as one of {batch_info(cfg)['processes']} "
              "processes", flush=True)
        return
    what = (f"{data.pairs:,} pairs" if data.method == "dpo" else f"{data.pairs:,} prompts, GRPO ({cfg.num_generations} "
            f"answers each, scored by {', '.join(rewards.names(cfg.reward) + (['--reward_cmd'] if cfg.reward_cmd else []))})"
            if data.method == "grpo" else f"{sum(data.labels.values()):,} examples ("
            f"{data.labels['desirable']:,} desirable, {data.labels['undesirable']:,} undesirable), KTO")
    print(f"[data] {cfg.data}: {what}, format {data.format}, skipped {data.skipped or 0}; "
          f"{data.held_out} held out; training on {n_train:,}"
          + (f" ({data.chosen_repeats:,} repeating a chosen answer left out)" if data.chosen_repeats else "")
          + "".join(f"; mixed in {m['pairs_used']} from {m['path']} ({m['share']:.0%} of the mixture)"
                    for m in data.mix))
    if data.ignored_columns or data.score_gap_dropped:
        print(f"[data] columns ignored (rows): {', '.join(f'{k} ({v:,})' for k, v in data.ignored_columns.items()) or 'none'}"
              + (f"; {data.score_gap_dropped:,} pairs dropped below --min_score_gap {data.min_score_gap}"
                 if data.min_score_gap else ""))
    values = {f.name: getattr(cfg, f.name) for f in kit.fields(TrainConfig)} | {"run_name": run.name}
    print("[config]\n" + "\n".join(f"  {k} = {v}" for k, v in values.items()))
    b = batch_info(cfg)  # tokens per step = this x up to max_length x 2 (chosen and rejected)
    unit = methods.UNITS[data.method]
    print(f"[batch] {b['effective_batch_size']} {unit} per optimiser step = {cfg.per_device_train_batch_size} per "
          f"device x {b['processes']} process(es) on {b['nodes']} machine(s) x {cfg.gradient_accumulation_steps} "
          "gradient accumulation" + (f"; {b['effective_batch_size'] * cfg.num_generations} sampled answers"
                                     if data.method == "grpo" else ""), flush=True)


@contextlib.contextmanager
def catch_signals():
    """SIGTERM/SIGINT (docker stop, spot preemption, Ctrl-C): during training, save a checkpoint and stop
    at the end of the step; before it, stop at once (KeyboardInterrupt)."""
    interrupt = Interrupt()
    old = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield interrupt
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def failures_recorded(run: runs.Run, interrupt: Interrupt):
    """A failure leaves status failed (with the rank, under several processes) and the run resumable; a
    signal before the training loop leaves it cancelled."""
    try:
        yield
    except KeyboardInterrupt:
        run.set_status("cancelled", error="interrupted outside the training loop; resumes from the last checkpoint")
        run.stopped_by = interrupt.signum or signal.SIGINT
    except UserError as e:
        ranks.record_failure(run.partial, str(e), user_error=True)
        run.set_status("failed", error=str(e), rank=ranks.world()["rank"])
        raise
    except Exception as e:
        ranks.record_failure(run.partial, f"{type(e).__name__}: {e}")
        run.set_status("failed", error=f"{type(e).__name__}: {e}", rank=ranks.world()["rank"])
        print(f"[run] failed: {type(e).__name__}: {e}\n[run] state kept in {run.partial}; fix and rerun with "
              f"--run_name {run.name} to resume", file=sys.stderr)
        raise


def load_tokenizer(cfg: TrainConfig, model_path: str, records: list[dict], internals: bool):
    """The base's tokenizer with --chat_template's template. Data with tool use is checked against the template
    here, before any model loads: a template that cannot show a tool call would train on text without it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    template = models.chat_template_text(cfg.chat_template)
    if template:
        tokenizer.chat_template = template
    if not any(formats.uses_tools(r) for r in records):
        return tokenizer
    problem = models.tool_template_problem(tokenizer)
    if problem and not cfg.chat_template and "<|im_start|>" in (tokenizer.chat_template or ""):
        # A ChatML model whose own template leaves tool use out: the kit's ChatML template with tool calls renders
        # the same turns with it. Said, and recorded in the run's config and tokenizer, as if given.
        tokenizer.chat_template = models.chat_template_text("chatml-tools")
        if models.tool_template_problem(tokenizer) is None:
            print(f"[data] the data uses tools and {model_path}'s own chat template cannot render them ({problem}): "
                  "training with the kit's chatml-tools template (ChatML with tool calls), saved with the run's "
                  "tokenizer (--chat_template FILE.jinja to choose another)", flush=True)
            cfg.chat_template, problem = "chatml-tools", None
    if problem:
        which = f"--chat_template {cfg.chat_template}" if cfg.chat_template else f"{model_path}'s own chat template"
        way_out = ("--chat_template chatml-tools (the kit's ChatML template with tool calls)"
                   if "<|im_start|>" in (tokenizer.chat_template or "") else
                   "--chat_template FILE.jinja (a template with tool support for this model's family; the kit ships "
                   + ", ".join(models.SHIPPED_TEMPLATES) + ")")
        raise UserError(f"the data holds tool calls, tools or tool results, and {which} cannot render them: "
                        f"{problem}. Train with {way_out}", cfg.data)
    if not internals:
        raise UserError("tool use is tokenised by the kit's own dataset preparation, which needs the pinned TRL "
                        "and transformers (requirements.txt)", cfg.data)
    return tokenizer


def build_model(cfg: TrainConfig, model_path: str, ref_path: str | None, internals: bool, tokenizer) -> Built:
    """The base (and a separate reference) loaded, prepared for k-bit training, its LoRA targets found; on a
    CPU the NF4 weights dequantised once when they fit."""
    models.quiet_libraries(sys.stdout.isatty())  # before bitsandbytes is imported
    on_gpu, bf16_ok = models.device()
    if not on_gpu:
        import torch

        reason = models.gpu_unused_reason(models.nvidia_driver(), torch.version.cuda)
        if reason:
            print(f"\n{'!' * 100}\n[model] WARNING: {reason}\n{'!' * 100}\n", file=sys.stderr, flush=True)
    compute_dtype = models.resolve_compute_dtype(cfg.compute_dtype, on_gpu, bf16_ok)
    t0 = time.time()
    model = models.load_model(model_path, models.LoadOptions.of(cfg), on_gpu, bf16_ok)
    if cfg.load_in_4bit:
        models.prepare_4bit_training(model, cfg.gradient_checkpointing)
    ref_model = models.load_model(ref_path, models.LoadOptions.of(cfg), on_gpu, bf16_ok) if ref_path else None
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = models.requested_targets(cfg.lora_target_modules, leaves, models.detect_lora_targets(model))
    quantized = models.count_parameters(model.named_parameters())["quantized_4bit"]
    compute = fastpath.Compute(matmuls=f"{'4-bit kernels' if cfg.load_in_4bit else 'full precision'}, "
                                       f"{compute_dtype} matmuls")
    print(f"[model] {model_path} loaded in {time.time() - t0:.1f}s on {'cuda' if on_gpu else 'cpu'}; "
          f"LoRA targets: {', '.join(targets)}", flush=True)
    if cfg.load_in_4bit and not on_gpu and cfg.dequantize_on_cpu:
        swapped = models.dequantize_if_it_fits([m for m in (model, ref_model) if m is not None], compute_dtype)
        if swapped:
            compute.matmuls = f"NF4 weights dequantised once to {compute_dtype} (cpu), {compute_dtype} matmuls"
            print(f"[model] cpu: {swapped[0]} NF4 layers dequantised once to {compute_dtype} ({swapped[1]:,.0f} MB): "
                  "the same values, without re-dequantising at every matmul (--no_dequantize_on_cpu keeps 4-bit kernels)")
        else:
            print("[model] cpu: keeping 4-bit kernels (a dense copy would not fit in 40% of free memory)")
    micro = plan_gpu_memory(cfg, [m for m in (model, ref_model) if m is not None], compute_dtype, compute) \
        if on_gpu else None
    if not on_gpu and cfg.fused_ops and fastpath.keep_freed_memory():
        print("[model] cpu: malloc keeps freed memory for reuse (fewer page faults; see fastpath.keep_freed_memory)")
    if not on_gpu and cfg.cpu_matmul_precision == "bf16":
        compute.matmuls += ", bfloat16 inputs accumulated in float32 (--cpu_matmul_precision bf16)"
        print("[model] cpu: float32 matmuls round their inputs to bfloat16 and accumulate in float32 "
              "(--cpu_matmul_precision bf16)")
    return Built(tokenizer=tokenizer, model=model, ref_model=ref_model, targets=targets,
                 params={"quantized_4bit": quantized}, compute=compute, on_gpu=on_gpu, internals=internals,
                 micro=micro)


def plan_gpu_memory(cfg: TrainConfig, loaded: list, compute_dtype: str, compute: fastpath.Compute) -> tuple | None:
    """On a GPU: the NF4 base dequantised once where it and a step fit (--dequantize_on_gpu), then the pairs per
    forward from what is free (--auto_micro_batch, one process: several would each choose from their own GPU).
    Returns (pairs per forward, accumulation, why) or None to keep the run's own; both said."""
    import torch

    config = loaded[0].config.to_dict()
    width = 2 if compute_dtype in ("bfloat16", "float16") else 4  # bytes a weight or activation takes
    pair_bytes = 2 * cfg.max_length * models.activation_bytes_per_token(config, width)  # no prompt shared: the bound
    step_bytes = cfg.per_device_train_batch_size * pair_bytes
    if cfg.load_in_4bit and cfg.dequantize_on_gpu:
        quantized = sum(models.count_parameters(m.named_parameters())["quantized_4bit"] for m in loaded)
        free = torch.cuda.mem_get_info()[0]
        if models.dequantize_on_gpu_fits(quantized, compute_dtype, free, step_bytes):
            swapped = sum(models.dequantize_4bit_(m) for m in loaded)
            torch.cuda.empty_cache()
            compute.matmuls = f"NF4 weights dequantised once to {compute_dtype} (cuda), {compute_dtype} matmuls"
            print(f"[model] cuda: {swapped} NF4 layers dequantised once to {compute_dtype} ({quantized * width / 1e9:.1f} "
                  f"GB; {free / 1e9:.0f} GB were free): the same values, without dequantising at every matmul "
                  "(--no_dequantize_on_gpu keeps 4-bit kernels)", flush=True)
        else:
            print(f"[model] cuda: keeping 4-bit kernels (a dense copy and a step of {cfg.per_device_train_batch_size} "
                  f"pairs would not fit in {models.MICRO_BATCH_HEADROOM:.0%} of the {free / 1e9:.0f} GB free)")
    if not cfg.auto_micro_batch or ranks.world()["world_size"] > 1:
        return None
    free = torch.cuda.mem_get_info()[0]
    micro, accumulation = models.plan_micro_batch(cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps,
                                                  pair_bytes, free)
    why = (f"{free / 1e9:.0f} GB free; up to {pair_bytes * models.ACTIVATION_SAFETY / 1e9:.1f} GB of activations "
           f"a pair at {cfg.max_length} tokens")
    return micro, accumulation, why


def build_trainer(cfg: TrainConfig, run: runs.Run, built: Built, pairs: list[dict], held: list[dict],
                  data: formats.TrainingData, interrupt: Interrupt, callbacks) -> None:
    """The method's TRL trainer over the model (methods.py): LoRA (or the --init_adapter run's adapter), its
    config, the kit's callbacks, the tokenised-data cache and the fast path where the installed TRL allows them."""
    from peft import LoraConfig
    from transformers import EarlyStoppingCallback, PrinterCallback, set_seed

    on_gpu, bf16_ok = models.device()
    set_seed(cfg.seed)  # LoRA init and data order depend on it
    peft_config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                             target_modules=built.targets, task_type="CAUSAL_LM", bias="none")
    built.method = data.method
    args = methods.trl_config(micro_batched(cfg, built, data.method), data, pairs, str(run.checkpoints), on_gpu,
                              bf16_ok, with_eval=bool(held))
    extra = runs.training_callbacks(run, lambda: interrupt.signum is not None, sys.stdout.isatty())
    if held and cfg.early_stopping_patience:
        extra.append(EarlyStoppingCallback(early_stopping_patience=cfg.early_stopping_patience))
    if cfg.lineage:
        try:
            kit.atomic_write_json(run.partial / "lineage.json", json.loads(Path(cfg.lineage).read_text()))
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read the lineage file: {e}", cfg.lineage) from None
    model = built.model
    if cfg.init_adapter:
        model, built.targets, built.parent = models.load_init_adapter(model, cfg.init_adapter, models.LoadOptions.of(cfg),
                                                                      cfg.model_name_or_path)
        peft_config = None
    if data.method != "dpo":  # TRL's log-probs; the kit's tokenisation (KTO) and module kernels (trainers.arm)
        built.compute.logps = f"full logits (TRL's {methods.TRAINERS[data.method]})"
    dpo_cache = token_cache.for_run(cfg.tokenized_cache, cfg.max_length, built.tokenizer, args, pairs, held) \
        if data.method == "dpo" and built.internals else ()
    trainer_cls = methods.trainer_class(data.method, built.internals, dpo_cache, data.tokenized)
    args.run_name = run.name  # what trackers call the run
    with runs.tensorboard_dir(run.partial / "logs" / "tensorboard"):  # transformers' TensorBoardCallback reads it at init
        trainer = methods.make_trainer(trainer_cls, cfg, data.method, model, built.ref_model, args, pairs, held,
                                       built.tokenizer, peft_config, [*extra, *callbacks])
    trainer.remove_callback(PrinterCallback)  # raw dicts per step: runs.training_callbacks shows progress instead
    built.trainer = trainer
    for cb in callbacks:  # a caller's callback that reads the trainer's own record (make bench: its counters)
        if hasattr(cb, "kit_bind"):
            cb.kit_bind(trainer)
    if built.internals:
        trainers.arm(cfg, built)
    if cfg.use_liger_kernel:  # TRL's chunked log-probs, whatever --chunked_logps says
        built.compute.logps, built.compute.chunked = "chunked by TRL, Liger kernels in the model (--use_liger_kernel)", True
    models.float32_trainable(trainer.model)  # TRL casts them to bfloat16 for a 4-bit base, on a GPU too
    if hasattr(trainer, "kit_precompute_reference"):  # the reference's pass TRL's __init__ asked for, armed now
        trainer.kit_ref_cache = reference_cache(cfg, built, dpo_cache)
        built.compute.reference = trainer.kit_ref_record
        trainer.kit_precompute_reference()


def reference_cache(cfg: TrainConfig, built: Built, dpo_cache: tuple) -> tuple:
    """(where reference log-probs are kept or None, {split: tokenised-data key}, what else they depend on)."""
    import importlib.metadata

    import torch

    if not dpo_cache or dpo_cache[0] is None:
        return None, {}, {}
    device = torch.cuda.get_device_name() if built.on_gpu else "cpu"
    versions = {n: importlib.metadata.version(n) for n in ("torch", "transformers", "trl", "peft", "bitsandbytes")}
    adapter = built.parent["adapter_sha256"] if built.parent else ""
    return (reference.cache_dir(dpo_cache[0]), dpo_cache[1],
            reference.identity(cfg, built.compute, adapter, device, versions))


def micro_batched(cfg: TrainConfig, built: Built, method: str) -> TrainConfig:
    """The config TRL gets: the run's, with the pairs per forward plan_gpu_memory chose (DPO: each pair's loss
    stands alone, so accumulating forwards trains what one forward of them all trains; KTO's KL term and GRPO's
    groups read the batch as a whole)."""
    if built.micro is None or method != "dpo":
        return cfg
    micro, accumulation, why = built.micro
    same = (micro, accumulation) == (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps)
    print(f"[batch] {'kept' if same else 'chosen'} from GPU memory: {micro} pairs per forward x {accumulation} "
          f"accumulated = {micro * accumulation} pairs per step per device, as asked ({why}; --no_auto_micro_batch "
          "keeps the run's own)", flush=True)
    built.compute.micro_batch = {"pairs_per_forward": micro, "accumulation": accumulation, "why": why}
    return dataclasses.replace(cfg, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation)


def record_data(cfg: TrainConfig, run: runs.Run, built: Built, data: formats.TrainingData, n_pairs: int) -> None:
    """What TRL kept of the pairs, and the parameter counts: printed, and into data.json / parameters.json."""
    ds = built.trainer.train_dataset
    data.pairs_trained = len(ds)
    data.dropped_too_long = n_pairs - len(ds)  # TRL drops pairs whose prompt alone fills max_length
    if built.method != "grpo":  # GRPO's prompts are tokenised as they are sampled, its answers cut while sampled
        sides = ("completion_ids", "completion_ids") if built.method == "kto" else ("chosen_ids", "rejected_ids")
        data.truncated = truncation_stats(map(len, ds["prompt_ids"]), map(len, ds[sides[0]]), map(len, ds[sides[1]]),
                                          cfg.max_length)
    if "boundary" in ds.column_names:  # tokenization.tokenize_pair's record of each pair
        counts = Counter(ds["boundary"])
        data.boundary = {k: counts[k] for k in tokenization.BOUNDARY}
        print(f"[data] where completions start: {data.boundary['aligned']} pairs at the prompt's own end, "
              f"{data.boundary['continued']} tokenised after the prompt's tokens (the two merged across it), "
              f"{data.boundary['not_exact']} where the prompt's end merged and could not be kept (TRL's split)")
    print(f"[model] log-probs: {built.compute.logps}")
    if data.tokenized:
        print(f"[data] {'; '.join(f'{k}: {v}' for k, v in data.tokenized.items())} "
              f"({token_cache.tokenized_cache_dir(cfg.tokenized_cache)})")
    if built.method != "grpo":
        print(f"[data] {data.truncated} {methods.UNITS[built.method]} truncated to max_length={cfg.max_length} "
              f"tokens; {data.dropped_too_long} dropped (prompt alone fills max_length)", flush=True)
    built.params = models.count_parameters(built.trainer.model.named_parameters()) | {
        "quantized_4bit": built.params["quantized_4bit"]}
    print("[params]\n" + models.parameter_table(built.params), flush=True)
    if ranks.is_main_process():
        kit.atomic_write_json(run.partial / "data.json", data_record(data, built.compute, cfg))
        kit.atomic_write_json(run.partial / "parameters.json", built.params)


def data_record(data: formats.TrainingData, compute: fastpath.Compute, cfg: TrainConfig) -> dict:
    """data.json: what the run trained on, and how it computed (and, on a random:<shape> base, that it is one)."""
    random_base = shapes.describe(cfg.model_name_or_path) if shapes.is_random(cfg.model_name_or_path) else None
    return dataclasses.asdict(data) | {"compute": compute.matmuls, "logps": compute.logps, "fused_ops": compute.fused,
                                       "chosen_only": compute.chosen_only, "broke_term": compute.broke,
                                       "reference": compute.reference, "micro_batch": compute.micro_batch,
                                       "random_base": random_base}


def train(run: runs.Run, trainer, resume_from: str, interrupt: Interrupt) -> None:
    """The training loop; a signal ends it at a checkpoint with the run cancelled (resumable)."""
    models.sync_trainable_adapter_(trainer.model, resume_from)
    run.set_status("running")
    interrupt.training = True
    trainer.train(resume_from_checkpoint=resume_from or None)
    interrupt.training = False
    trainers.print_counts(trainer)
    if interrupt.signum is not None:
        run.set_status("cancelled", error=f"signal {interrupt.signum}", step=trainer.state.global_step)
        run.stopped_by = interrupt.signum


def finish(cfg: TrainConfig, run: runs.Run, built: Built, held: list[dict], probes: list[dict],
           data: formats.TrainingData, model_path: str, started: str, exec_prompts: list[dict] = ()) -> None:
    """Rank 0 saves the adapter and tokenizer, evaluates, writes the report, model card and manifest, renames
    the run into place and packs the tarball."""
    trainer = built.trainer
    sharded = ranks.device_map(built.on_gpu) is None  # ZeRO-3 / FSDP: each process holds a shard of the weights
    if sharded:  # gathering the shards is collective; the Trainer writes on rank 0 (untested here: no GPUs)
        trainer.save_model(str(run.partial))
        (run.partial / "training_args.bin").unlink(missing_ok=True)
    if not ranks.is_main_process():  # rank 0 alone saves, evaluates and hands off
        return
    if not sharded:
        trainer.model.save_pretrained(run.partial, selected_adapters=["default"])  # not TRL's frozen 'ref' copy
    built.tokenizer.save_pretrained(run.partial)
    metrics = run.metrics()
    evaluation = evaluate_trained(cfg, run, built, held, probes, sharded, metrics, exec_prompts)
    for problem in runs.serving_problems(json.loads((run.partial / "adapter_config.json").read_text())):
        print(f"[serve] warning: {problem}", file=sys.stderr)  # only reachable with explicit target modules
    kit.atomic_write_text(run.partial / "README.md", evaluate.model_card(
        run.name, cfg, data_record(data, built.compute, cfg), built.params, built.targets, metrics, batch_info(cfg)))
    digest = run.finish(manifest(cfg, run, built, data, evaluation, model_path, started))
    if adapter_step(trainer.state) != trainer.state.global_step:
        print(f"[run] early stopping: the adapter is step {adapter_step(trainer.state)}'s, the best held-out loss")
    print(f"[run] succeeded: {run.final}\n[run] handoff: {run.tarball} (sha256 {digest})", flush=True)


def evaluate_trained(cfg: TrainConfig, run: runs.Run, built: Built, held: list[dict], probes: list[dict],
                     sharded: bool, metrics: list[dict], exec_prompts: list[dict] = ()) -> dict:
    """Held-out accuracy and probes of the model as trained (adapter on) against its base; report.md."""
    import torch

    model = built.trainer.model
    model.eval()
    t0 = time.time()
    if not built.on_gpu:
        models.dequantize_4bit_(model)  # after saving; same values, much faster CPU inference
    if sharded:
        print(f"[eval] skipped: rank 0 holds only a shard; `make eval RUN={run.name}` evaluates the saved adapter")
    bf16_cpu = not built.on_gpu and models.resolve_compute_dtype(cfg.compute_dtype, False, False) == "bfloat16"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_cpu):
        evaluation = {} if sharded else evaluate.evaluate(model, built.tokenizer, held, probes, cfg.max_length, cfg.seed,
                                                          list(exec_prompts), cfg.eval_samples, cfg.eval_max_new_tokens)
    evaluate.write_report(run.partial, f"{run.name}: what training changed", evaluation, metrics)
    for line in evaluate.summary_lines(evaluation):
        print(f"[eval] {line}")
    print(f"[eval] report.md written in {time.time() - t0:.0f}s", flush=True)
    return evaluation


def manifest(cfg: TrainConfig, run: runs.Run, built: Built, data: formats.TrainingData, evaluation: dict,
             model_path: str, started: str) -> dict:
    """manifest.json without its file list (runs.Run.finish adds every file's sha256)."""
    import torch

    held = evaluation.get("held_out")
    return {
        "kit": KIT_NAME, "run_name": run.name, "method": data.method,
        "base_model": models.base_model_identity(model_path),
        "data": {k: getattr(data, k) for k in ("path", "sha256", "format", "pairs", "pairs_trained", "truncated")},
        "lora_target_modules_requested": cfg.lora_target_modules, "seed": cfg.seed, "distributed": batch_info(cfg),
        "started_at": started, "finished_at": runs.now_iso(), "steps": built.trainer.state.global_step,
        "adapter_step": adapter_step(built.trainer.state),
        "eval": {k: held[k]["accuracy"] for k in ("base", "tuned")} if held else None, "mix": data.mix,
        "execution": evaluate.execution_summary(evaluation),
        "versions": kit.package_versions(), "python": platform.python_version(), "platform": platform.platform(),
        "device": torch.cuda.get_device_name(0) if built.on_gpu else "cpu", "git_commit": kit.git_commit(),
        "init_adapter": built.parent}  # the parent run in a chain of rounds (lineage.json has the whole chain)


def exit_code(done: runs.Run) -> int:
    """0 when the run is complete; 128 + the signal when one cancelled it (a shell's convention)."""
    if done.state == "cancelled":
        print(f"[run] cancelled; resume with --run_name {done.name}", file=sys.stderr)
        return 128 + (done.stopped_by or signal.SIGINT)
    return 0


def main(argv=None) -> int:
    cfg = kit.parse_config(TrainConfig, argv, __doc__)
    # The machine first (one process per machine checks it): a GPU PyTorch cannot use, an old driver, a missing
    # compiler stop here, one sentence each, rather than deep inside a library after the model has loaded.
    if ranks.world()["local_rank"] == 0 and not preflight.passes(preflight.for_training(cfg)):
        return preflight.EXIT_FAILED
    return exit_code(run(cfg))


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
