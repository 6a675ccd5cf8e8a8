"""The kit's TRL trainer subclasses, and arming a trainer with the fast path: DPOTrainer's (shared prompts through
fastpath.dpo_logps, the losses of losses.py, the tokenised-data cache), KTOTrainer's (the kit's tokenisation) and
GRPOTrainer's (answers sampled through sampler.py, groups whose answers are all alike skipped). `arm` switches a
built trainer onto fastpath's kernels, Liger or TRL's chunked log-probs, as the run's options say, and
`print_counts` says what ran.

Their hooks reach into TRL 1.14's internals, as fastpath.py's forwards do, behind the same check of the versions
they were written for (fastpath.version_problem): another TRL gets one sentence, and --no_fused_ops trains
through TRL's public API. TRL is imported inside the functions that build the classes.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from dpokit.core.kit import BROKE_COLUMN
from dpokit.data import token_cache, tokenization
from dpokit.model import fastpath, sampler
from dpokit.train import losses, reference


def kto_trainer_class():
    """KTOTrainer whose dataset preparation keeps the prompt's tokens as the model sees them when it answers
    (tokenization.prepare_examples), as the DPO path's does (one hook into TRL 1.14's internals)."""
    from trl import KTOTrainer

    class KitKTOTrainer(KTOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if "completion" not in dataset.column_names or "prompt" not in dataset.column_names:
                return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
            return tokenization.prepare_examples(dataset, processing_class, args, dataset_name,
                                                 self.calculate_KL)

    KitKTOTrainer.__name__ = KitKTOTrainer.__qualname__ = "KTOTrainer"
    return KitKTOTrainer


def arm(cfg, built) -> None:
    """train_dpo.py's switches on its trainer: chunked log-probs (TRL's path behind its Liger switch), and the
    kit's fused kernels and shared prompts. cfg: a TrainConfig; built: train_dpo.Built (trainer, compute, ...)."""
    import torch

    trainer, compute = built.trainer, built.compute
    if cfg.chunked_logps and built.method == "dpo":  # TRL's DPOTrainer path
        compute.logps, compute.chunked = enable_chunked_logps(trainer, built.targets)
    if built.method == "dpo":
        trainer.kit_chosen_only = cfg.chosen_only
        compute.chosen_only = cfg.chosen_only and list(trainer.loss_types) == ["sft"]
        if compute.chosen_only:
            print("[model] sft loss alone: training steps forward the chosen rows only (no rejected rows, no "
                  "reference pass; --no_chosen_only: TRL's whole pass); held-out evaluation runs TRL's whole loss")
        if cfg.broke_weight:
            ds = trainer.train_dataset
            flagged = sum(ds[BROKE_COLUMN]) if BROKE_COLUMN in ds.column_names else 0
            trainer.kit_broke_weight = cfg.broke_weight
            compute.broke = {"weight": cfg.broke_weight, "pairs": flagged}
            print(f"[model] --broke_weight {cfg.broke_weight}: DPO's sigmoid term (beta {trainer.beta}) on the "
                  f"{flagged} training pairs whose rejected answer deleted what must be kept (build_pairs' "
                  "meta.rejected_broke)" + ("" if flagged else ": none here, so the term never runs"))
    if cfg.fused_ops:
        autocast = torch.bfloat16 if trainer.args.bf16 else torch.float16 if trainer.args.fp16 else None
        if fastpath.liger_applies(built.on_gpu, built.targets):  # CUDA: Liger's norms and MLPs, not the kit's
            liger = fastpath.apply_liger(trainer.model, autocast)
            if liger["failed"]:
                print(f"[model] Liger's kernels stepped aside ({liger['failed']}); the kit's own kernels instead")
            else:
                compute.liger = liger["checked"]
                print(f"[model] Liger's Triton kernels: {liger['checked']} norms and MLPs, and RoPE"
                      + (f"; kept their own forward (a probe disagreed): {liger['reverted']}" if liger["reverted"]
                         else ""))
        fused = fastpath.enable(trainer.model, autocast_dtype=autocast)  # each kernel checked on a probe first
        if compute.chunked:
            problem = fastpath.head_agrees(trainer.model.device, autocast)
            if problem:
                compute.chunked, compute.logps = False, f"chunked by TRL (the kit's lean head stepped aside: {problem})"
                print(f"[model] the kit's lean head stepped aside ({problem}): TRL's chunked log-probs instead")
        trainer.kit_fused_logps = compute.chunked  # both: DPO's trainer class (below) reads them
        trainer.kit_share_prompts = cfg.share_prompts and built.method == "dpo"
        args = trainer.args  # bf16 / fp16: accelerate's autocast, on a CPU too
        dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
        if not fastpath.silu_mul_applies(getattr(torch, dtype), "cuda" if built.on_gpu else "cpu"):
            fused["mlp"] = 0  # swapped on, but they run the module's own product in this dtype on this device
        compute.fused = fused | {"chunked_head": compute.chunked, "dtype": dtype}
        print(f"[model] fused ops (fastpath.py): {fused['lora_linear']} LoRA layers, {fused['rms_norm']} RMSNorms, "
              f"{fused['mlp']} SiLU gates{', the chunked head' if compute.chunked else ''} "
              f"({dtype if dtype == 'float32' else dtype + ' autocast'}; --no_fused_ops: off)")
        if fused["own_forward"]:
            print("[model] kept their own forward (a fused kernel did not reproduce them on a probe input): "
                  + ", ".join(f"{n} x{k}" for n, k in sorted(fused["own_forward"].items())))


ALIKE = 1e-6  # an advantage below this is a group's rounding, not a signal (a real one is a reward's gap / its std)


def grpo_trainer_class():
    """GRPOTrainer that logs where a step's time goes (three of TRL 1.14's internal methods, timed): seconds
    generating the answers (time/generation), scoring them (time/scoring: the reward functions, the checker's
    sandboxed runs), and preparing the batch in all (time/rollout: those two and the reference's log-probs);
    the rest of a step is training. `make bench` (grpo mode) and the progress line read them."""
    from trl import GRPOTrainer

    def timed(name, method):
        def wrapper(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                mode = "train" if self.model.training else "eval"
                self._metrics[mode][f"time/{name}"].append(time.perf_counter() - t0)
        return wrapper

    class KitGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            """TRL's plain-transformers branch through sampler.py's loop (LoRA merged, finished rows leaving the
            batch) where it is that branch and the loop computes the same distribution: one process, text only,
            temperature / top-k / top-p sampling. Anything else (vLLM, continuous batching, several processes,
            images, repetition penalties) is TRL's own."""
            g = self.generation_config
            plain = (not self.use_vllm and not self.use_transformers_continuous_batching and not images
                     and not multimodal_fields and self.accelerator.num_processes == 1 and g.do_sample
                     and g.repetition_penalty in (None, 1.0) and not getattr(g, "min_p", None))
            if not plain:
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
            sampling = {"temperature": g.temperature or 1.0, "top_k": g.top_k or 0, "top_p": g.top_p or 1.0}
            was_training = self.model.training
            self.model.eval()
            try:
                ids = sampler.sample_ids(self.model, prompt_ids, self._tokenizer.pad_token_id, g.max_new_tokens,
                                         set(self.eos_token_ids), sampling, kv_cache=fastpath.preallocated_kv_cache,
                                         attention=fastpath.grouped_kv_attention)
            finally:
                self.model.train(was_training)
            return ids, None

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            """A training batch whose every answer has a zero advantage (each group scored alike) teaches nothing
            but the KL term: logged as kit/signal 0, and with skip_alike its forward and backward are skipped (a
            zero loss on the trainable weights; one process only, where no other rank waits on its gradients)."""
            if not model.training:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            alike = bool(inputs["advantages"].abs().max() < ALIKE)
            self._metrics["train"]["kit/signal"].append(0.0 if alike else 1.0)
            if alike and self.kit_skip_alike and self.accelerator.num_processes == 1:
                return sum(p.sum() for p in model.parameters() if p.requires_grad) * 0.0
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        kit_skip_alike = True
        _generate = timed("generation", GRPOTrainer._generate)
        _calculate_rewards = timed("scoring", GRPOTrainer._calculate_rewards)
        _generate_and_score_completions = timed("rollout", GRPOTrainer._generate_and_score_completions)

    KitGRPOTrainer.__name__ = KitGRPOTrainer.__qualname__ = "GRPOTrainer"
    return KitGRPOTrainer


COUNTERS = (("kit_lean_batches", "forward passes took their log-probs through the lean head"),
            ("kit_chosen_batches", "training batches forwarded their chosen rows only (sft loss)"),
            ("kit_broke_batches", "training batches ran DPO's term on pairs whose rejected answer deleted what must "
                                  "be kept (--broke_weight)"),
            ("kit_shared_batches", "forward passes ran each prompt once for both completions"))


def counts(trainer) -> dict:
    """How many passes each of the kit's paths took: {counter: n} (make bench records them)."""
    return {attr: getattr(trainer, attr, 0) for attr, _ in COUNTERS}


def print_counts(trainer) -> None:
    """After training: how many passes each of the kit's paths took (none printed for a path not taken)."""
    for attr, what in COUNTERS:
        if getattr(trainer, attr, 0):
            print(f"[model] {getattr(trainer, attr)} {what}")


def dpo_trainer_class(cache_dir: Path | None, keys: dict, record: dict):
    """DPOTrainer with two hooks into TRL 1.14's internals. Dataset preparation is tokenization.prepare_pairs
    (chat template, tokenisation at the prompt's own end, dropping prompts that fill max_length) through the
    tokenised-data cache (token_cache.cached: cache_dir/keys[split], None = off; what happened goes into
    record[split]). Per-token log-probs go through dpo_logps once kit_fused_logps is set (TRL's chunked path
    wherever that one does not apply)."""
    from trl import DPOTrainer

    class KitDPOTrainer(DPOTrainer):
        kit_fused_logps = False  # the chunked head through dpo_logps
        kit_share_prompts = False  # and each prompt once, where attention_work says it pays
        kit_lean_batches = 0  # forward passes whose log-probs went through the lean head (counted by dpo_logps)
        kit_shared_batches = 0  # of those, the ones that shared their prompts
        kit_chosen_only = True  # sft loss alone: training steps forward the chosen rows only (chosen_only_sft_loss)
        kit_chosen_batches = 0  # training batches that did
        kit_broke_weight = 0.0  # --broke_weight (broke_preference_loss); 0 = off
        kit_broke_batches = 0  # training batches that ran it
        kit_ref_cache: tuple = (None, {}, {})  # (reference cache dir or None, {split: token key}, identity)

        def __init__(self, *args, **kwargs):
            # split -> batch size TRL's __init__ asked a reference pass for; split -> what it did (data.json); ready
            self.kit_ref_pending, self.kit_ref_record, self.kit_ref_ready = {}, {}, False  # once __init__ returns
            with model_hash_skipped():
                super().__init__(*args, **kwargs)
            self.data_collator = losses.BrokeCollator(self.data_collator)
            self.kit_ref_ready = True

        def _precompute_ref_logps(self, dataset, name, batch_size):
            """TRL's __init__ asks before trainers.arm has switched the lean head on: deferred to
            kit_precompute_reference (called after arming, and by train / evaluate at the latest). Called again
            after that (evaluate on a new dataset), it computes at once. With several processes each computes the
            whole split on its own device before the model is wrapped (no collective, the same values a rank's
            steps would have computed); rank 0 keeps them on disk for the next run."""
            if not self.kit_ref_ready:  # inside super().__init__
                self.kit_ref_pending[name] = batch_size
                return dataset
            where, keys, ident = self.kit_ref_cache
            key = reference.cache_key(keys[name], ident) if where is not None and name in keys else None
            return reference.precompute(self, dataset, name, batch_size, where, key, self.kit_ref_record)

        def kit_precompute_reference(self):
            """The reference passes TRL's __init__ asked for, through the trainer as armed now."""
            pending, self.kit_ref_pending = self.kit_ref_pending, {}
            for name, batch_size in pending.items():
                if name == "train":
                    self.train_dataset = self._precompute_ref_logps(self.train_dataset, name, batch_size)
                elif isinstance(self.eval_dataset, dict):
                    self.eval_dataset[name] = self._precompute_ref_logps(self.eval_dataset[name], name, batch_size)
                else:
                    self.eval_dataset = self._precompute_ref_logps(self.eval_dataset, name, batch_size)

        def train(self, *args, **kwargs):
            self.kit_precompute_reference()
            return super().train(*args, **kwargs)

        def evaluate(self, *args, **kwargs):
            self.kit_precompute_reference()
            return super().evaluate(*args, **kwargs)

        def _set_signature_columns_if_needed(self):  # keep BROKE_COLUMN through the Trainer's column pruning
            super()._set_signature_columns_if_needed()
            if BROKE_COLUMN not in self._signature_columns:
                self._signature_columns = [*self._signature_columns, BROKE_COLUMN]

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return token_cache.cached(cache_dir, keys.get(dataset_name), dataset_name, record,
                                      lambda: tokenization.prepare_pairs(dataset, processing_class, args, dataset_name))

        def _compute_loss(self, model, inputs, return_outputs):
            flags = inputs.get(BROKE_COLUMN)
            inputs = {k: v for k, v in inputs.items() if k != BROKE_COLUMN}  # not a model input
            if (self.kit_chosen_only and model.training and not return_outputs
                    and losses.chosen_only_applies(self, inputs)):
                loss = losses.chosen_only_sft_loss(self, model, inputs)
            else:
                loss = super()._compute_loss(model, inputs, return_outputs)
            if (self.kit_broke_weight and flags is not None and bool(flags.any()) and model.training
                    and not return_outputs):
                loss = loss + losses.broke_preference_loss(
                    self, model, inputs, flags, lambda m, sub: DPOTrainer._compute_loss(self, m, sub, False))
            return loss

        def _get_per_token_logps_and_entropies(self, model, model_kwargs, input_ids, completion_mask):
            out = None
            if self.kit_fused_logps:
                import torch

                try:
                    out = fastpath.dpo_logps(self, model, model_kwargs, input_ids, completion_mask)
                except torch.OutOfMemoryError:
                    raise  # TRL's path needs more memory, not less
                except Exception as e:  # noqa: BLE001 - a speed-up that breaks steps aside; training goes on
                    self.kit_fused_logps = False
                    print(f"[model] the kit's lean head raised {type(e).__name__}: {str(e).splitlines()[0][:160]}; "
                          "TRL's own log-probs from here on (--no_fused_ops starts that way)", flush=True)
            return out if out is not None else super()._get_per_token_logps_and_entropies(
                model, model_kwargs, input_ids, completion_mask)

    KitDPOTrainer.__name__ = KitDPOTrainer.__qualname__ = "DPOTrainer"
    return KitDPOTrainer


@contextlib.contextmanager
def model_hash_skipped():
    """TRL 1.14's DPOTrainer.__init__ hashes every weight of the reference for its own precompute's cache key
    (trl.trainer.utils.hash_module: each tensor copied to the CPU, bfloat16 widened to float32: 32 GB of host
    memory and tens of seconds for a dequantised 8B base). The kit's pass keys its cache itself (reference.py), so
    while the kit's subclass is built the hash is an empty string."""
    from trl.trainer import dpo_trainer

    saved = dpo_trainer.hash_module
    dpo_trainer.hash_module = lambda module: ""
    try:
        yield
    finally:
        dpo_trainer.hash_module = saved


def enable_chunked_logps(trainer, targets: list[str]) -> tuple[str, bool]:
    """Switch TRL 1.14's DPOTrainer to its chunked log-prob path: the body's hidden states of the completion
    tokens only go through the output head 8,192 vocabulary rows at a time with an online logsumexp, and the
    backward recomputes each tile, so the [2 x batch x tokens x 49,152] float32 logits (1.6 GB at batch 4 and
    1,024 tokens, several times over with log_softmax and its gradient) never exist, for the policy and the
    reference alike. TRL only offers it behind use_liger_kernel=True, which it gates on the liger-kernel
    package although the path is plain PyTorch (trl/trainer/utils.py, _ChunkedLogProbFunction); the same
    losses to float rounding (tests/test_train_dpo.py checks it). Not with LoRA on the head: TRL reads the
    head's weight directly. Returns (what the log-probs go through, whether chunked)."""
    from trl.models.utils import _ForwardRedirection

    if any(t in ("lm_head", "embed_out", "output") for t in targets):
        return "full logits (LoRA on the output head)", False
    trainer.use_liger_kernel = True
    trainer._forward_redirection = _ForwardRedirection()  # runs the loss inside DDP's / ZeRO's forward: syncs grads
    return "chunked, completion tokens only", True
