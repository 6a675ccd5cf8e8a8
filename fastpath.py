"""Leaner training kernels for the dense CPU path: fused LoRA linear layers, RMSNorm and the log-prob head.

    import fastpath; counts = fastpath.enable(model)   # train_dpo.py does this; --no_fused_ops turns it off

Eager PyTorch runs a LoRA layer as five operations (base matmul, A, B, a scale, an add), each writing
a full [tokens x width] tensor, and autograd keeps extra copies for the backward; RMSNorm is six
elementwise passes. On a CPU those passes are memory-bound and took about 40% of a DPO step
(`make bench`). The functions here compute the same values with fewer passes and keep fewer tensors
for the backward (they recompute what is cheap):

  LoRA linear   y = base(x) + s (x A^T) B^T with the LoRA product accumulated into the base output by
                one GEMM (addmm_): no scaled copy and no add pass, and fewer tensors kept
  RMSNorm       y = w * x * rsqrt(mean(x^2) + eps) with the backward written out: keeps x and one
                number per token instead of four full tensors
  log-probs     the completion tokens' log-probs through the output head in chunks (as TRL's
                chunked path), without TRL's no-op scale passes and extra copies, and with the
                entropy (a logged metric) computed only where it is logged

They are exact up to float rounding (tests/test_fastpath.py compares values and gradients with the
eager modules). Modules they do not recognise, 4-bit kernels, LoRA variants (DoRA), dropout on the
LoRA input and autocast keep the library's own forward, so anything unusual stays correct and merely
runs at the old speed.
"""

from __future__ import annotations

import types

LOGP_TOKEN_CHUNK = 1024  # tokens per head tile: 1,024 x 8,192 x 4 bytes = 32 MB of logits at a time
LOGP_VOCAB_CHUNK = 8192  # vocabulary rows per head tile


# ---------------------------------------------------------------------------------------------
# Autograd functions (torch imported lazily: this module is imported by train_dpo for --help).
# ---------------------------------------------------------------------------------------------

def _functions():
    import torch

    class LoraDelta(torch.autograd.Function):
        """y = y_base + s (x A^T) B^T for 2-D x, accumulated into y_base in place (one GEMM with beta = 1):
        no scaled copy, no add pass. The base layer (dense, or bitsandbytes 4-bit) ran before, under its own
        autograd, so a dequantised base and the 4-bit kernels still train exactly alike."""

        @staticmethod
        def forward(ctx, y_base, x, lora_a, lora_b, scaling):
            h = x @ lora_a.t()  # [N, r]
            y_base.addmm_(h, lora_b.t(), alpha=scaling)
            ctx.mark_dirty(y_base)
            ctx.save_for_backward(x, lora_a, lora_b, h)
            ctx.scaling = scaling
            return y_base

        @staticmethod
        def backward(ctx, gy):
            x, lora_a, lora_b, h = ctx.saved_tensors
            s = ctx.scaling
            _, need_x, need_a, need_b = ctx.needs_input_grad[:4]
            gh = (gy @ lora_b).mul_(s)  # [N, r]
            gx = gh @ lora_a if need_x else None  # autograd adds the base layer's part
            ga = gh.t() @ x if need_a else None
            gb = (gy.t() @ h).mul_(s) if need_b else None
            return gy, gx, ga, gb, None

    class RMSNorm(torch.autograd.Function):
        """y = w * x * rsqrt(mean(x^2, last dim) + eps), in float32."""

        @staticmethod
        def forward(ctx, x, weight, eps):
            d = x.shape[-1]
            rstd = torch.rsqrt(torch.linalg.vecdot(x, x).unsqueeze(-1).div_(d).add_(eps))
            y = (x * rstd).mul_(weight)
            ctx.save_for_backward(x, weight, rstd)
            return y

        @staticmethod
        def backward(ctx, gy):
            x, weight, rstd = ctx.saved_tensors
            d = x.shape[-1]
            gxw = gy * weight  # dL/d(x * rstd)
            # d/dx of x * rstd: rstd * g - x * rstd^3 * (g . x) / d
            coef = torch.linalg.vecdot(gxw, x).unsqueeze(-1).mul_(rstd.pow(3)).div_(d)
            gx = gxw.mul_(rstd).addcmul_(x, coef, value=-1.0) if ctx.needs_input_grad[0] else None
            gw = None
            if ctx.needs_input_grad[1]:
                gw = (gy * x * rstd).reshape(-1, d).sum(0)
            return gx, gw, None

    class ChunkedLogps(torch.autograd.Function):
        """log softmax(h W^T)[target] per row of h (and, when asked, the entropy of that softmax, without
        gradient), the [N x vocab] logits only ever in [1,024 x 8,192] tiles."""

        @staticmethod
        def forward(ctx, hidden, weight, targets, with_entropy):
            n, acc = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
            lse = hidden.new_empty(n, dtype=acc)
            entropy = hidden.new_empty(n, dtype=acc) if with_entropy else hidden.new_zeros(0)
            for t0 in range(0, n, LOGP_TOKEN_CHUNK):
                h = hidden[t0:t0 + LOGP_TOKEN_CHUNK]
                big_m = big_s = big_x = None  # running max, sum of exp(logit - max), sum of exp(...) * logit
                for v0 in range(0, weight.shape[0], LOGP_VOCAB_CHUNK):
                    logits = h @ weight[v0:v0 + LOGP_VOCAB_CHUNK].t()
                    m = logits.amax(-1)
                    e = (logits - m.unsqueeze(-1)).exp_()
                    s = e.sum(-1)
                    x = torch.linalg.vecdot(e, logits) if with_entropy else None
                    if big_m is None:
                        big_m, big_s, big_x = m, s, x
                        continue
                    new_m = torch.maximum(big_m, m)
                    old_w, w = (big_m - new_m).exp_(), (m - new_m).exp_()
                    big_s = big_s * old_w + s * w
                    big_x = big_x * old_w + x * w if with_entropy else None
                    big_m = new_m
                lse[t0:t0 + len(h)] = big_m + big_s.log()
                if with_entropy:
                    entropy[t0:t0 + len(h)] = lse[t0:t0 + len(h)] - big_x / big_s  # H = lse - E_p[logit]
            target_logit = torch.linalg.vecdot(hidden, weight[targets]).to(lse.dtype)  # one dot per row
            ctx.save_for_backward(hidden, weight, targets, lse)
            ctx.mark_non_differentiable(entropy)
            return target_logit - lse, entropy

        @staticmethod
        def backward(ctx, g, _g_entropy):
            hidden, weight, targets, lse = ctx.saved_tensors
            grad_hidden = weight[targets] * g.unsqueeze(-1)  # d(label logit)/dh, times g
            for t0 in range(0, hidden.shape[0], LOGP_TOKEN_CHUNK):
                h, gc, lc = hidden[t0:t0 + LOGP_TOKEN_CHUNK], g[t0:t0 + LOGP_TOKEN_CHUNK], lse[t0:t0 + LOGP_TOKEN_CHUNK]
                out = grad_hidden[t0:t0 + len(h)]
                for v0 in range(0, weight.shape[0], LOGP_VOCAB_CHUNK):
                    w = weight[v0:v0 + LOGP_VOCAB_CHUNK]
                    p = (h @ w.t()).sub_(lc.unsqueeze(-1)).exp_().mul_(gc.unsqueeze(-1))  # g * softmax
                    out.addmm_(p, w, alpha=-1.0)
            return grad_hidden.to(hidden.dtype), None, None, None

    return types.SimpleNamespace(LoraDelta=LoraDelta, RMSNorm=RMSNorm, ChunkedLogps=ChunkedLogps)


_FN = None


def fn():
    """The autograd functions, built on first use."""
    global _FN
    if _FN is None:
        _FN = _functions()
    return _FN


# ---------------------------------------------------------------------------------------------
# Pure recognisers: which modules the fused forwards apply to (tested on toy modules).
# ---------------------------------------------------------------------------------------------

def is_rms_norm(module) -> bool:
    """A Llama-style RMSNorm: a class named *RMSNorm with a 1-D weight and an eps, no bias, no offset.
    (Gemma's norm multiplies by 1 + weight and is left alone: its class says so with 'Gemma'.)"""
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    return (name.endswith("RMSNorm") and "Gemma" not in name and weight is not None and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", getattr(module, "eps", None)), float)
            and getattr(module, "bias", None) is None)


def lora_fusable(layer, adapter_names=None) -> str | None:
    """The one active adapter of a peft LoRA layer when the fused update computes exactly what peft
    would (no dropout, no LoRA bias or variant, not merged, adapters on); else None."""
    import torch

    if layer.disable_adapters or layer.merged or adapter_names is not None:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1:
        return None
    a = active[0]
    if (a in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(a)
            or not isinstance(layer.lora_dropout[a], torch.nn.Identity)
            or layer.lora_B[a].bias is not None or getattr(layer, "fan_in_fan_out", False)):
        return None
    return a


# ---------------------------------------------------------------------------------------------
# Forwards swapped onto module instances.
# ---------------------------------------------------------------------------------------------

def _lora_forward(self, x, *args, **kwargs):
    import torch

    a = lora_fusable(self, kwargs.get("adapter_names")) if not args else None
    if a is None or torch.is_autocast_enabled(x.device.type) or x.dtype != self.lora_A[a].weight.dtype:
        return type(self).forward(self, x, *args, **kwargs)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    y = self.get_base_layer()(x2)
    if y.dim() != 2 or y.dtype != x.dtype or y._base is not None:  # not a fresh [N, out] tensor: leave it be
        y = y.clone()
    y = fn().LoraDelta.apply(y, x2, self.lora_A[a].weight, self.lora_B[a].weight, float(self.scaling[a]))
    return y.view(*shape[:-1], y.shape[-1])


def _rms_norm_forward(self, hidden_states):
    import torch

    if hidden_states.dtype != torch.float32 or self.weight.dtype != torch.float32 or \
            torch.is_autocast_enabled(hidden_states.device.type):
        return type(self).forward(self, hidden_states)
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
    return fn().RMSNorm.apply(hidden_states, self.weight, float(eps))


def enable(model) -> dict:
    """Swap the fused forwards onto the model's RMSNorm and peft LoRA linear instances (the
    instance's forward; the class is untouched). Returns how many of each; idempotent."""
    from peft.tuners.lora.layer import Linear as LoraLinearLayer

    counts = {"lora_linear": 0, "rms_norm": 0}
    for module in model.modules():
        if isinstance(module, LoraLinearLayer):
            module.forward, kind = types.MethodType(_lora_forward, module), "lora_linear"
        elif is_rms_norm(module):
            module.forward, kind = types.MethodType(_rms_norm_forward, module), "rms_norm"
        else:
            continue
        counts[kind] += 1
    return counts


def disable(model) -> None:
    """Undo enable(): the instances get their class's forward back."""
    for module in model.modules():
        if "forward" in vars(module) and getattr(module.forward, "__func__", None) in (_lora_forward,
                                                                                       _rms_norm_forward):
            del module.forward


def chunked_logps(hidden, weight, targets, with_entropy: bool = False):
    """Per-row log-prob of targets under softmax(hidden @ weight^T), never the full logits; and the
    entropy of each row's softmax (no gradient) when with_entropy, else an empty tensor."""
    return fn().ChunkedLogps.apply(hidden, weight, targets, with_entropy)


# ---------------------------------------------------------------------------------------------
# TRL 1.14's DPOTrainer: its per-token log-prob hook on the lean head.
# ---------------------------------------------------------------------------------------------

def _is_reference_pass(trainer, model) -> bool:
    """TRL computes the reference with a separate model, or with the policy's adapters disabled, or
    with the frozen 'ref' adapter active (--init_adapter): its entropy is never used."""
    unwrap = trainer.accelerator.unwrap_model
    if trainer.ref_model is not None and unwrap(model) is unwrap(trainer.ref_model):
        return True
    layer = next((m for m in unwrap(trainer.model).modules() if hasattr(m, "lora_A")), None)
    return layer is not None and (layer.disable_adapters or "ref" in layer.active_adapters)


def dpo_logps(trainer, model, model_kwargs: dict, input_ids, completion_mask):
    """What DPOTrainer._get_per_token_logps_and_entropies returns (per-token log-probs and entropies of
    the completion tokens, zeros elsewhere, and the backbone's outputs), through ChunkedLogps; None
    where this path does not apply (mixed precision, a biased, scaled, soft-capped, sharded or
    trainable head, a vision model), and TRL's own path runs instead."""
    import torch

    unwrapped = trainer.accelerator.unwrap_model(model)
    inner = unwrapped.base_model.model if hasattr(unwrapped, "peft_config") else unwrapped
    head = inner.get_output_embeddings()
    text = inner.config.get_text_config()
    if (trainer.args.bf16 or trainer.args.fp16 or getattr(trainer, "_is_vlm", False) or head is None
            or getattr(head, "bias", None) is not None or type(head.weight) is not torch.nn.Parameter
            or head.weight.requires_grad or getattr(text, "final_logit_softcapping", None) is not None
            or getattr(text, "logit_scale", None) not in (None, 1.0)
            or getattr(text, "output_multiplier", None) not in (None, 1.0)):
        return None
    outputs = inner.base_model(**model_kwargs)
    hidden = outputs.last_hidden_state[:, :-1]
    mask = completion_mask[:, 1:].bool()
    logps, entropy = chunked_logps(hidden[mask], head.weight, input_ids[:, 1:][mask],
                                   with_entropy=not _is_reference_pass(trainer, model))
    per_token_logps = logps.new_zeros(mask.shape).masked_scatter(mask, logps)
    per_token_entropy = logps.new_zeros(mask.shape)
    if entropy.numel():
        per_token_entropy = per_token_entropy.masked_scatter(mask, entropy)
    return per_token_logps, per_token_entropy, outputs
