"""The losses the kit adds to TRL's DPO, where a reader looks for them: the chosen answers' likelihood alone
(`--loss_type sft` computed on the chosen half of the batch only: chosen_only_sft_loss) and the preference term on
the pairs whose rejected answer deleted what must be kept (`--broke_weight`: broke_preference_loss, with the
collator that carries each pair's mark). DPOTrainer's subclass (trainers.py) calls them. torch is imported inside
the functions.
"""

from __future__ import annotations

from dpokit.core.kit import BROKE_COLUMN


CHOSEN_ONLY_KEYS = {"input_ids", "attention_mask", "completion_mask", "ref_chosen_logps", "ref_rejected_logps"}


def chosen_only_applies(trainer, inputs) -> bool:
    """TRL's sft loss alone (loss_type ["sft"]) reads only the chosen rows' log-probs: the rejected rows and the
    reference pass it computes beside them change neither the loss nor its gradient. Not with WPO weighting, a
    MoE's auxiliary loss, LD-DPO's length split, or a batch with more than text in it."""
    return (list(trainer.loss_types) == ["sft"] and not trainer.use_weighting and not trainer.aux_loss_enabled
            and trainer.ld_alpha is None and not getattr(trainer, "_is_vlm", False)
            and set(inputs) <= CHOSEN_ONLY_KEYS and inputs["input_ids"].shape[0] % 2 == 0)


def chosen_width(attention_mask, multiple: int | None) -> int:
    """Columns the chosen rows need: TRL pads the batch right, to its longest row of either side (and to a
    multiple of pad_to_multiple_of when set); the chosen rows alone need only up to their own longest."""
    full = attention_mask.shape[1]
    width = max(int(attention_mask.sum(1).max()), 1)
    if multiple:
        width = -(-width // multiple) * multiple
    return min(width, full)


def chosen_only_sft_loss(trainer, model, inputs):
    """TRL 1.14's DPOTrainer._compute_loss for loss_type ["sft"] (the mean negative log-likelihood of the chosen
    completions' tokens, times its weight) from a forward of the chosen rows alone: about 3 of TRL's 8 row-passes
    per pair (policy forward and backward over both rows, and the reference's forward over both). Logged: the
    loss, num_tokens as TRL counts it (both rows) and logps/chosen; the pair metrics (rewards/*) need the
    rejected and reference passes and are left to the held-out evaluation, which runs TRL's whole loss."""
    import torch
    import torch.nn.functional as F

    b = inputs["input_ids"].shape[0] // 2
    width = chosen_width(inputs["attention_mask"][:b], trainer.args.pad_to_multiple_of)
    input_ids = inputs["input_ids"][:b, :width]
    attention_mask = inputs["attention_mask"][:b, :width]
    completion_mask = inputs["completion_mask"][:b, :width]
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
    mask = completion_mask[:, 1:].bool()
    if trainer.use_liger_kernel:  # the kit's lean head or TRL's chunked one: log-probs of the completion tokens
        per_token_logps, _, _ = trainer._get_per_token_logps_and_entropies(model, kwargs, input_ids,
                                                                           completion_mask)
        loss = -per_token_logps[mask].mean()
    else:
        logits = model(**kwargs).logits[:, :-1]
        loss = F.cross_entropy(logits[mask], input_ids[:, 1:][mask])
        with torch.no_grad():
            per_token_logps = torch.zeros(mask.shape, dtype=logits.dtype, device=logits.device).masked_scatter(
                mask, -F.cross_entropy(logits[mask].detach(), input_ids[:, 1:][mask], reduction="none"))
    loss = loss * trainer.loss_weights[0]
    metrics, gather = trainer._metrics["train"], trainer.accelerator.gather_for_metrics
    trainer._total_train_tokens += gather(inputs["attention_mask"].sum()).sum().item() // trainer._tp_size
    metrics["num_tokens"] = [trainer._total_train_tokens]
    metrics["logps/chosen"].append(gather(per_token_logps.detach().sum(1)).mean().item())
    trainer.kit_chosen_batches += 1
    return loss


class BrokeCollator:
    """TRL's preference collator, with BROKE_COLUMN (formats.trainable's column) as a bool tensor beside its
    batch, where the examples have it: TRL's collator reads only the columns it knows."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, examples):
        import torch

        batch = self.inner(examples)
        if examples and BROKE_COLUMN in examples[0]:
            batch[BROKE_COLUMN] = torch.tensor([bool(e[BROKE_COLUMN]) for e in examples])
        return batch


def broke_preference_loss(trainer, model, inputs, flags, parent_loss):
    """--broke_weight: DPO's sigmoid term on the pairs of the batch whose rejected answer deleted what must be
    kept, added to the step's loss. A loss that reads only the chosen answers (sft) never sees such an answer, so
    nothing pushes the model away from it; the term is TRL 1.14's own loss (parent_loss: DPOTrainer._compute_loss,
    reference pass included) on those pairs' rows alone, with loss_types ["sigmoid"] while it runs. Scaled by
    weight x flagged / batch: a flagged pair weighs `weight` times what a pair of the sft mean does. Its metrics
    are logged under broke/ (rewards/margins etc. of those pairs), not as the step's own."""
    b = inputs["input_ids"].shape[0] // 2
    idx = flags.to(inputs["input_ids"].device).nonzero().squeeze(1)
    rows = idx.new_tensor(idx.tolist() + [i + b for i in idx.tolist()])
    sub = {k: inputs[k][rows] for k in ("input_ids", "attention_mask", "completion_mask")}
    width = chosen_width(sub["attention_mask"], trainer.args.pad_to_multiple_of)
    sub = {k: v[:, :width] for k, v in sub.items()}
    for k in ("ref_chosen_logps", "ref_rejected_logps"):
        if k in inputs:
            sub[k] = inputs[k][idx]
    metrics = trainer._metrics["train"]
    before = {k: len(v) for k, v in metrics.items()}
    saved = trainer.loss_types, trainer.loss_weights
    trainer.loss_types, trainer.loss_weights = ["sigmoid"], [1.0]
    try:
        loss = parent_loss(model, sub)
    finally:
        trainer.loss_types, trainer.loss_weights = saved
    for k in [k for k in metrics if not k.startswith("broke/") and len(metrics[k]) > before.get(k, 0)]:
        new = metrics[k][before.get(k, 0):]
        del metrics[k][before.get(k, 0):]
        if not metrics[k]:
            del metrics[k]
        metrics[f"broke/{k}"].extend(new)
    trainer.kit_broke_batches += 1
    return loss * trainer.kit_broke_weight * idx.numel() / b
