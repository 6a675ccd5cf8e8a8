"""Leaner DPO training: fused LoRA, RMSNorm, SiLU-gate and log-prob-head kernels, and each prompt run once.

    from dpokit.model import fastpath; counts = fastpath.enable(model)   # trainers.arm does this; --no_fused_ops: off

Eager PyTorch runs a LoRA layer as five operations (base matmul, A, B, a scale, an add), each writing
a full [tokens x width] tensor, and autograd keeps extra copies for the backward; RMSNorm is six
elementwise passes. On a CPU those passes are memory-bound and took about 40% of a DPO step
(`make bench`). The functions here compute the same values with fewer passes and keep fewer tensors
for the backward (they recompute what is cheap):

  LoRA linear   y = base(x) + s (x A^T) B^T with the LoRA product accumulated into the base output by
                one GEMM (addmm_): no scaled copy and no add pass, and fewer tensors kept
  RMSNorm       y = w * x * rsqrt(mean(x^2) + eps) with the backward written out: keeps x and one
                number per token instead of four full tensors
  SiLU gate     silu(gate) * up keeping gate and up, not silu(gate) too (recomputed in the backward)
  log-probs     the completion tokens' log-probs through the output head in chunks (as TRL's
                chunked path), without TRL's no-op scale passes and extra copies, and with the
                entropy (a logged metric) computed only where it is logged

dpo_logps, TRL 1.14's per-token log-prob hook, runs each pair's prompt once for both completions
(shared_prompt_layout, _shared_prompt_forward) where attention_work says that saves work.

TRL's and transformers' internals are touched here (the attributes dpo_logps reads, the attention functions) and
in the trainer subclasses that call these (dpokit/train/trainers.py, with the chunked-log-prob switch), behind
one check of the versions they were written for (`version_problem`): another TRL gets one sentence, and
--no_fused_ops trains through TRL's public API. The losses the kit adds are dpokit/train/losses.py's.

They are exact up to float rounding (tests/test_fastpath.py compares values and gradients with the
eager modules). Under bfloat16 or float16 autocast (--compute_dtype bfloat16: accelerate's autocast, on a
GPU or a CPU) they compute what autocast computes: matmuls in its dtype, the norm's statistics and the
head's logsumexp in float32, to that dtype's rounding. A class name only makes a module a candidate:
enable() swaps a kernel onto a module after it has reproduced that module's own forward and gradients on a
probe input (agrees_with_own; that is how the (1 + w) norms of Gemma, Qwen3.5 and Qwen3-Next get the
kernel in that form, and how look-alikes with another function keep theirs). Modules that fail the probe,
4-bit kernels, LoRA variants (DoRA) and dropout on the LoRA input keep the library's own forward, so
anything unusual stays correct and merely runs at the old speed; the run lists what kept its own forward.
The prompt-sharing forwards (dpo_logps) also register one attention function with transformers, for the
completion pass (_lower_right_sdpa).

What the trainer classes' dataset hooks compute is not here: the tokenisation of pairs and KTO examples (the
prompt as the model sees it when it answers; evaluate.py measures on the same tokens) is tokenization.py's,
and the tokenised-data cache between runs is token_cache.py's. The hooks call them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types


LOGP_TOKEN_CHUNK = 1024  # tokens per head tile: 1,024 x 2,048 x 4 bytes = 8 MB of logits at a time
LOGP_VOCAB_CHUNK = 2048  # vocabulary rows per head tile
# On a GPU a tile sized for a CPU's caches is dozens of small kernels per token range (at a 128k vocabulary,
# 63 vocabulary tiles, each several launches, forward and backward, from Python): there a tile is 4,096
# tokens x 16,384 rows (256 MB of float32 logits), 8 vocabulary tiles at 128k. Not yet timed on a GPU
# (bench/gpu.sh measures it).
LOGP_TILES_CUDA = (4096, 16384)
LOGP_KEEP_BYTES = 1536 << 20  # logits kept for the backward up to this size (6,144 tokens x 49,152 x 4 bytes = 1.2 GB)
# The versions whose internals this file reaches into (major.minor of trl; major of transformers), as pinned
# in requirements.txt. Another version may have renamed or changed any of them.
WRITTEN_FOR = {"trl": "1.14", "transformers": "5"}


@dataclasses.dataclass
class Compute:
    """How a run computes (data.json and the model card): filled in as the model and the trainer are built."""
    matmuls: str = ""  # e.g. "NF4 weights dequantised once to float32 (cpu), float32 matmuls"
    logps: str = "full logits (--no_chunked_logps)"
    chunked: bool = False  # completion tokens only, through the head in chunks
    # {"lora_linear": n, "rms_norm": n, "mlp": n, "own_forward": {class: n}, "chunked_head": bool, "dtype": "bfloat16"}
    fused: dict | None = None  # None = off
    liger: int = 0  # modules running Liger's Triton kernels (CUDA), each checked on a probe
    chosen_only: bool = False  # sft loss alone: training steps forward the chosen rows only (chosen_only_sft_loss)
    broke: dict | None = None  # --broke_weight: {"weight", "pairs"} (broke_preference_loss); None = off
    reference: dict | None = None  # split -> the reference pass before training (reference.py); None = none ran
    micro_batch: dict | None = None  # pairs per forward chosen from GPU memory (training.micro_batched); None = the run's


def version_problem(versions: dict[str, str] | None = None) -> str | None:
    """What is wrong when the installed trl or transformers is not a version this file was written for; None
    when they are. versions: {"trl": "1.14.2", "transformers": "5.20.2"} (default: the installed ones)."""
    if versions is None:
        import transformers
        import trl

        versions = {"trl": trl.__version__, "transformers": transformers.__version__}
    for name, want in WRITTEN_FOR.items():
        have = versions[name]
        if have.split(".")[:want.count(".") + 1] != want.split("."):
            return f"the kit's fast path (fastpath.py) reaches into {name} {want}.x internals and this is {name} {have}"
    return None


# ---------------------------------------------------------------------------------------------
# Autograd functions (torch imported lazily: this module is imported by train_dpo for --help).
# ---------------------------------------------------------------------------------------------


def _no_autocast(t):
    """Autocast off inside a kernel: each op's dtype is written out (autocast would run the float32
    statistics' vecdot, or the logits' logsumexp inputs, in bfloat16)."""
    import torch

    return torch.autocast(t.device.type, enabled=False)


def _logps_forward(ctx, hidden, weight, targets, with_entropy, dtype):
    """ChunkedLogps.forward: the log-probs (and entropies) tile by tile, with an online logsumexp."""
    import torch

    n, acc = hidden.shape[0], torch.promote_types(dtype, torch.float32)
    low = dtype != acc
    with _no_autocast(hidden):
        hd, w = hidden.to(dtype), weight.to(dtype)  # one cast of each, not one per tile
        tok, voc = tile_shape(hidden.device.type)
        lse = hidden.new_empty(n, dtype=acc)
        entropy = hidden.new_empty(n, dtype=acc) if with_entropy else hidden.new_zeros(0)
        keep = hidden.requires_grad and n * w.shape[0] * w.element_size() <= LOGP_KEEP_BYTES
        kept = w.new_empty(n * w.shape[0]) if keep else None
        exps, logit_tile = _tiles(n, w, acc, 2 if low or not keep else 1, tok, voc)
        mm_tile = _tiles(n, w, dtype, 1, tok, voc)[0] if low and not keep else logit_tile
        for t0, t1 in _token_chunks(n, tok):
            h = hd[t0:t1]
            big_m = big_s = big_x = None  # running max, sum of exp(logit - max), sum of exp(...) * logit
            for v0 in range(0, w.shape[0], voc):
                wv = w[v0:v0 + voc]
                out = _kept_tile(kept, n, t0, t1, v0, len(wv)) if keep else _tile(mm_tile, len(h), len(wv))
                logits = torch.mm(h, wv.t(), out=out)
                if low:
                    logits = _tile(logit_tile, len(h), len(wv)).copy_(logits)
                m = logits.amax(-1)
                e = torch.sub(logits, m.unsqueeze(-1), out=_tile(exps, len(h), len(wv))).exp_()
                s = e.sum(-1)
                x = torch.linalg.vecdot(e, logits) if with_entropy else None
                if big_m is None:
                    big_m, big_s, big_x = m, s, x
                    continue
                new_m = torch.maximum(big_m, m)
                old_w, w_new = (big_m - new_m).exp_(), (m - new_m).exp_()
                big_s = big_s * old_w + s * w_new
                big_x = big_x * old_w + x * w_new if with_entropy else None
                big_m = new_m
            lse[t0:t1] = big_m + big_s.log()
            if with_entropy:
                entropy[t0:t1] = lse[t0:t1] - big_x / big_s  # H = lse - E_p[logit]
        # one dot per row, rounded to dtype as the GEMM rounds the tiles' logits
        target_logit = torch.linalg.vecdot(hd.to(acc), w[targets].to(acc)).to(dtype).to(acc)
    ctx.save_for_backward(hidden, weight, targets, lse)
    ctx.kept, ctx.dtype = kept, dtype
    ctx.mark_non_differentiable(entropy)
    return target_logit - lse, entropy


def _logps_backward(ctx, g, _g_entropy):
    """ChunkedLogps.backward: the hidden's gradient, the logits kept or recomputed tile by tile."""
    import torch

    hidden, weight, targets, lse = ctx.saved_tensors
    kept, ctx.kept = ctx.kept, None
    dtype, acc = ctx.dtype, lse.dtype
    low = dtype != acc
    n = hidden.shape[0]
    with _no_autocast(hidden):
        hd, w = hidden.to(dtype), weight.to(dtype)
        tok, voc = tile_shape(hidden.device.type)
        g = g.to(acc)
        grad_hidden = w[targets].to(acc) * g.unsqueeze(-1)  # d(label logit)/dh, times g
        exps = _tiles(n, w, acc, 1, tok, voc)[0] if low or kept is None else None
        mm_tile = _tiles(n, w, dtype, 1, tok, voc)[0] if kept is None and low else exps
        rows = max((t1 - t0 for t0, t1 in _token_chunks(n, tok)), default=0)
        part = hd.new_empty(rows, w.shape[1]) if low else None  # one tile's share of the gradient
        for t0, t1 in _token_chunks(n, tok):
            h, gc, lc = hd[t0:t1], g[t0:t1].unsqueeze(-1), lse[t0:t1].unsqueeze(-1)
            out = grad_hidden[t0:t1]
            for v0 in range(0, w.shape[0], voc):
                wv = w[v0:v0 + voc]
                if kept is None:
                    logits = torch.mm(h, wv.t(), out=_tile(mm_tile, len(h), len(wv)))
                else:
                    logits = _kept_tile(kept, n, t0, t1, v0, len(wv))
                if not low:
                    out.addmm_(logits.sub_(lc).exp_().mul_(gc), wv, alpha=-1.0)  # g * softmax
                    continue
                p = torch.sub(logits, lc, out=_tile(exps, len(h), len(wv))).exp_().mul_(gc)
                # p rounded to dtype for the GEMM, written transposed into the logits' tile: p^T^T W is
                # the layout a CPU without bfloat16 GEMMs runs fastest (AVX2: 18 GFLOP/s against 2 for
                # p W, one core); cuBLAS takes either alike
                pt = logits.view(len(wv), len(h)).copy_(p.t())
                torch.mm(pt.t(), wv, out=part[:len(h)])
                out.sub_(part[:len(h)])
    return grad_hidden.to(hidden.dtype), None, None, None, None


def _token_chunks(n, chunk):
    """Token ranges of at most chunk tokens, equal in size (1,536 -> 768 + 768, not 1,024 + 512:
    a half-height tile's matmul ran at 1.2x the time per token)."""
    count = max(1, -(-n // chunk))
    bounds = [round(i * n / count) for i in range(count + 1)]
    return list(zip(bounds, bounds[1:]))


def _kept_tile(kept, n, t0, t1, v0, cols):
    """Tile (tokens t0:t1, vocabulary v0:v0+cols) of the kept logits: vocabulary tiles one after another,
    each [n x cols], so every token range of a tile is one contiguous block."""
    base = v0 * n + t0 * cols
    return kept[base:base + (t1 - t0) * cols].view(t1 - t0, cols)


def _tiles(n, weight, dtype, count, tok, voc):
    """count flat buffers for one [token range x vocabulary tile] tile each, in dtype; None for the rest
    of two."""
    rows = max((t1 - t0 for t0, t1 in _token_chunks(n, tok)), default=0)
    size = rows * min(weight.shape[0], voc)
    return [weight.new_empty(size, dtype=dtype) for _ in range(count)] + [None] * (2 - count)


def _tile(buffer, rows, cols):
    return buffer[:rows * cols].view(rows, cols)  # contiguous for any tile size, the ragged last ones too


def _functions():
    """The kit's autograd functions, built on first use (fn): torch is imported here, not when the module is."""
    import torch

    class LoraDelta(torch.autograd.Function):
        """y = y_base + s (x A^T) B^T for 2-D x, accumulated into y_base in place (one GEMM with beta = 1):
        no scaled copy, no add pass. The base layer (dense, or bitsandbytes 4-bit) ran before, under its own
        autograd, so a dequantised base and the 4-bit kernels still train exactly alike. y_base and x in one
        dtype (under autocast, autocast's); A and B are the float32 weights, read in x's dtype through
        cast_weight (one cast per weight per optimiser step, not one per call), their gradients computed in
        x's dtype and returned in theirs, as autograd's cast would."""

        @staticmethod
        def forward(ctx, y_base, x, lora_a, lora_b, scaling):
            a, b = cast_weight(lora_a, x.dtype), cast_weight(lora_b, x.dtype)
            with _no_autocast(x):
                h = x @ a.t()  # [N, r]
                y_base.addmm_(h, b.t(), alpha=scaling)
            ctx.mark_dirty(y_base)
            ctx.save_for_backward(x, a, b, h)
            ctx.scaling, ctx.weight_dtypes = scaling, (lora_a.dtype, lora_b.dtype)
            return y_base

        @staticmethod
        def backward(ctx, gy):
            x, lora_a, lora_b, h = ctx.saved_tensors
            s, (a_dtype, b_dtype) = ctx.scaling, ctx.weight_dtypes
            _, need_x, need_a, need_b = ctx.needs_input_grad[:4]
            with _no_autocast(x):
                gh = (gy @ lora_b).mul_(s)  # [N, r]
                gx = gh @ lora_a if need_x else None  # autograd adds the base layer's part
                ga = (gh.t() @ x).to(a_dtype) if need_a else None
                gb = (gy.t() @ h).mul_(s).to(b_dtype) if need_b else None
            return gy, gx, ga, gb, None

    class RMSNorm(torch.autograd.Function):
        """y = w * x * rsqrt(mean(x^2, last dim) + eps), the statistics in float32 (or wider). A bfloat16 or
        float16 x is normalised in float32 and rounded back to its dtype before the weight, as transformers'
        Llama norm does; the backward works in float32 and returns x's dtype."""

        @staticmethod
        def forward(ctx, x, weight, eps):
            d = x.shape[-1]
            with _no_autocast(x):
                xf = x.float() if x.element_size() < 4 else x
                rstd = torch.rsqrt(torch.linalg.vecdot(xf, xf).unsqueeze(-1).div_(d).add_(eps))
                y = (xf * rstd).to(x.dtype)
                y = y.mul_(weight) if torch.result_type(y, weight) == y.dtype else y * weight
            ctx.save_for_backward(x, weight, rstd)
            return y

        @staticmethod
        def backward(ctx, gy):
            x, weight, rstd = ctx.saved_tensors
            d = x.shape[-1]
            with _no_autocast(x):
                xf = x.float() if x.element_size() < 4 else x
                gxw = (gy * weight).to(xf.dtype)  # dL/d(x * rstd)
                # d/dx of x * rstd: rstd * g - x * rstd^3 * (g . x) / d
                coef = torch.linalg.vecdot(gxw, xf).unsqueeze(-1).mul_(rstd.pow(3)).div_(d)
                gx = gxw.mul_(rstd).addcmul_(xf, coef, value=-1.0).to(x.dtype) if ctx.needs_input_grad[0] else None
                gw = None
                if ctx.needs_input_grad[1]:
                    gw = (gy.to(xf.dtype) * (xf * rstd).to(x.dtype)).reshape(-1, d).sum(0).to(weight.dtype)
            return gx, gw, None

    class SiluMul(torch.autograd.Function):
        """silu(gate) * up, the gated MLP's middle; keeps gate and up only (eager autograd also keeps
        silu(gate), a third [tokens x intermediate] tensor) and recomputes silu in the backward. The same ops
        in the same dtype as the eager module (under autocast too: silu and mul are not autocast ops)."""

        @staticmethod
        def forward(ctx, gate, up):
            ctx.save_for_backward(gate, up)
            return torch.nn.functional.silu(gate).mul_(up)

        @staticmethod
        def backward(ctx, g):
            gate, up = ctx.saved_tensors
            g_gate = torch.ops.aten.silu_backward(g * up, gate) if ctx.needs_input_grad[0] else None
            g_up = torch.nn.functional.silu(gate).mul_(g) if ctx.needs_input_grad[1] else None
            return g_gate, g_up

    class ChunkedLogps(torch.autograd.Function):
        """log softmax(h W^T)[target] per row of h (and, when asked, the entropy of that softmax, without
        gradient), the logits computed in [1,024 x 2,048] tiles (8 MB: the elementwise passes over a tile
        find it in cache). When h needs a gradient and all its logits fit in LOGP_KEEP_BYTES, they are
        written tile by tile into one buffer kept for the backward (which then needs one head matmul, not
        two); otherwise the tile buffers are reused and the backward recomputes each tile. (A fresh 8-32 MB
        tensor per tile page-faults all its memory in: the head ran at 130 GFLOP/s instead of 170.)

        The head's matmuls run in `dtype`: autocast's bfloat16 or float16 (what autocast would run the head
        in), else the hidden's. In a 16-bit dtype each logits tile is copied to float32 for the logsumexp and
        the entropy, the target's logit is rounded as the tile's are (so a log-prob stays <= 0), and the
        backward's softmax tile is rounded to `dtype` for its matmul and summed into a float32 gradient,
        returned in the hidden's dtype."""
        forward = staticmethod(_logps_forward)
        backward = staticmethod(_logps_backward)

    return types.SimpleNamespace(LoraDelta=LoraDelta, RMSNorm=RMSNorm, SiluMul=SiluMul, ChunkedLogps=ChunkedLogps)


def tile_shape(device_type: str) -> tuple[int, int]:
    """(tokens, vocabulary rows) of one head tile on this device type."""
    return LOGP_TILES_CUDA if device_type == "cuda" else (LOGP_TOKEN_CHUNK, LOGP_VOCAB_CHUNK)


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
    """A candidate for the RMSNorm kernel: a class named *RMSNorm with a 1-D weight and a float eps, no bias.
    Only a candidate: which form it computes (w * x or (1 + w) * x, as Gemma's, Qwen3.5's and Qwen3-Next's
    do), and whether it is an RMSNorm at all, is settled by enable()'s probe, never by the name."""
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    return (name.lower().endswith("rmsnorm") and weight is not None and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", getattr(module, "eps", None)), float)
            and getattr(module, "bias", None) is None)


def is_gated_silu_mlp(module) -> bool:
    """A candidate for the SiLU-gate kernel: a class named *MLP with gate_proj, up_proj and down_proj and
    SiLU as its activation module; enable()'s probe checks that it computes down(silu(gate(x)) * up(x))."""
    import torch

    act = getattr(module, "act_fn", None)
    silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"  # transformers' own: F.silu
    return (all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")) and silu
            and type(module).__name__.endswith("MLP"))


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


def autocast_dtype(device_type: str):
    """The dtype autocast runs matmuls in on this device type, or None where autocast is off."""
    import torch

    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _lora_forward(self, x, *args, **kwargs):
    """Under autocast the base and LoRA matmuls run in autocast's dtype, as peft's forward runs them there,
    with x cast once for both (autocast casts it for each linear) and the bfloat16 copy of x kept for the
    backward instead of float32."""
    a = lora_fusable(self, kwargs.get("adapter_names")) if not args else None
    low = autocast_dtype(x.device.type)
    if a is None or (low is None and x.dtype != self.lora_A[a].weight.dtype):
        return type(self).forward(self, x, *args, **kwargs)
    dtype = low or x.dtype
    shape = x.shape
    x2 = _cast_once(x, dtype)
    y = self.get_base_layer()(x2)
    if y.dim() != 2 or y.dtype != dtype or y._base is not None:  # not a fresh [N, out] tensor: leave it be
        y = y.to(dtype, copy=True)
    y = fn().LoraDelta.apply(y, x2, self.lora_A[a].weight, self.lora_B[a].weight, float(self.scaling[a]))
    return y.view(*shape[:-1], y.shape[-1])


_WEIGHT_CASTS: dict = {}  # id(weight) -> (weakref to it, its version, STEPS[0], dtype, the copy in dtype)
STEPS = [0]  # optimiser steps taken in this process (any optimiser): a cast made before the last one is stale
_STEP_HOOK: list = [None]  # the handle of the hook that counts them


def cast_weight(w, dtype):
    """w (a LoRA weight, float32) in dtype, cast once per optimiser step: the copy is reused until an optimiser
    steps (counted by a hook on every torch optimiser, since a fused AdamW updates weights in place without
    bumping their version counter) or w changes in place otherwise (a checkpoint loaded: its version). Under
    bfloat16 autocast each LoRA layer read its two weights through a cast on every call: at the 8B shape 448
    small casts a forward, each a kernel launch and an autograd node. The copy is detached: LoraDelta returns
    the gradient in w's dtype itself."""
    import weakref

    if w.dtype == dtype:
        return w
    _count_optimiser_steps()
    hit = _WEIGHT_CASTS.get(id(w))
    if hit is not None and hit[0]() is w and hit[1:4] == (w._version, STEPS[0], dtype):
        return hit[4]
    low = w.detach().to(dtype)
    _WEIGHT_CASTS[id(w)] = (weakref.ref(w), w._version, STEPS[0], dtype, low)
    return low


def _count_optimiser_steps():
    """Registers, once, the hook that counts optimiser steps and drops the casts they made stale."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    if _STEP_HOOK[0] is not None:
        return

    def stepped(optimizer, args, kwargs):
        STEPS[0] += 1
        _WEIGHT_CASTS.clear()

    _STEP_HOOK[0] = register_optimizer_step_post_hook(stepped)


_LAST_CAST: list = [None, None]  # [(weakref to x, x's version, dtype, grad mode), x as [N, in] in dtype]


def _cast_once(x, dtype):
    """x as a [tokens, in] matrix in dtype, made once for the LoRA layers that read the same x one after the
    other (q, k and v; gate and up): one copy computed and one kept for their backward, not one each (at
    Llama-3-8B's shape, 6 bfloat16 copies of the layer's input became 3: 11% of its saved activations). The
    last cast is remembered through a weak reference to x, so a freed x (whose id a new tensor may reuse) or an
    x changed in place never matches."""
    import weakref

    import torch

    key, cached = _LAST_CAST
    if key is not None and key[0]() is x and key[1:] == (x._version, dtype, torch.is_grad_enabled()):
        return cached
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    _LAST_CAST[:] = [(weakref.ref(x), x._version, dtype, torch.is_grad_enabled()), x2]
    return x2


def _rms_norm_forward(self, hidden_states):
    """Any float32, bfloat16 or float16 input and weight, under autocast or not (the norm has no autocast
    ops: the module computes the same either way)."""
    import torch

    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    if hidden_states.dtype not in dtypes or self.weight.dtype not in dtypes:
        return type(self).forward(self, hidden_states)
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
    offset = vars(self).get("_kit_weight_offset", 0.0)  # 1.0 for the (1 + w) norms (the probe found which)
    return fn().RMSNorm.apply(hidden_states, self.weight + offset if offset else self.weight, float(eps))


def silu_mul_applies(dtype, device_type: str) -> bool:
    """Whether SiluMul runs for a gate of this dtype on this device: in float32; in bfloat16 or float16
    (autocast) on a GPU, for the [tokens x intermediate] tensor per layer it does not keep (its speed there
    not measured); not on a CPU, where the 16-bit silu it recomputes in the backward made the gate's
    forward + backward slower than the module's (0.8x, bfloat16, AVX2, one core)."""
    import torch

    half = dtype in (torch.bfloat16, torch.float16)
    return dtype in (torch.float32, torch.float64) or (half and device_type != "cpu")


def _mlp_forward(self, x):
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.dtype != up.dtype or not silu_mul_applies(gate.dtype, gate.device.type):
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(fn().SiluMul.apply(gate, up))


def lora_linear_classes() -> tuple:
    """peft's LoRA layers over a linear base: the dense one, and the one peft wraps a bitsandbytes 4-bit base
    in (peft.tuners.lora.bnb.Linear4bit is not a subclass of the dense layer; on a GPU, where the base stays
    4-bit, it is every LoRA layer). Both add B(A(x)) * scaling to the base's output, which is what the fused
    forward computes; the probe (agrees_with_own) checks that per instance."""
    from peft.tuners.lora.layer import Linear

    classes = [Linear]
    try:
        from peft.tuners.lora import bnb
    except ImportError:  # bitsandbytes not installed: no 4-bit layers to match
        return tuple(classes)
    if hasattr(bnb, "Linear4bit"):  # peft defines it only where bitsandbytes' 4-bit is available
        classes.append(bnb.Linear4bit)
    return tuple(classes)


def enable(model, autocast_dtype=None) -> dict:
    """Swap the fused forwards onto the model's peft LoRA linear, RMSNorm and gated-MLP instances (the
    instance's forward; the class is untouched), each only after it reproduced that instance's own forward
    on a probe input (values, and gradients; see agrees_with_own). autocast_dtype: the dtype training
    autocasts to, if any (the probe runs under it too, at its tolerance). Returns how many of each kind
    were swapped, and under "own_forward" the classes (with counts) that kept their own forward because the
    kernel did not reproduce it. Idempotent."""
    lora_classes = lora_linear_classes()
    counts = {"lora_linear": 0, "rms_norm": 0, "mlp": 0, "own_forward": {}}
    for module in model.modules():
        if isinstance(module, lora_classes):
            kind, forward, offsets = "lora_linear", _lora_forward, [None]
        elif is_rms_norm(module):
            kind, forward, offsets = "rms_norm", _rms_norm_forward, [0.0, 1.0]
        elif is_gated_silu_mlp(module):
            kind, forward, offsets = "mlp", _mlp_forward, [None]
        else:
            continue
        if "forward" in vars(module) and getattr(module.forward, "__func__", None) not in OURS:
            continue  # another library's kernel (Liger's on CUDA): check_liger probes those
        vars(module).pop("forward", None)  # idempotent: probe against the class's forward
        for offset in offsets:
            if offset is not None:
                module._kit_weight_offset = offset
            if agrees_with_own(module, forward, kind, autocast_dtype):
                module.forward = types.MethodType(forward, module)
                counts[kind] += 1
                break
        else:
            vars(module).pop("_kit_weight_offset", None)
            name = type(module).__name__
            counts["own_forward"][name] = counts["own_forward"].get(name, 0) + 1
    return counts


# Probe tolerances, relative to the largest magnitude of the module's own output (values) and gradients:
# float32 kernels differ from eager by rounding only; under bfloat16 autocast both round to 8 bits of mantissa.
PROBE_RTOL = {"float64": (1e-4, 1e-3), "float32": (1e-4, 1e-3), "bfloat16": (3e-2, 6e-2), "float16": (4e-3, 8e-3)}


def agrees_with_own(module, forward, kind: str, autocast_dtype=None) -> bool:
    """Whether forward(module, x) reproduces type(module).forward(module, x) on a random probe input x:
    the values, and the gradients of a random projection of the output with respect to x and to the
    module's trainable weights. The weights a kernel multiplies by are made random for the probe (a norm's
    scale, LoRA's B, which start as ones and zeros and would hide a wrong form) and restored after; the
    module's .grad fields are not touched. A forward that takes more than the one input, raises, or returns
    something else is not reproduced. In float32 (or the dtype of the module's weights), and under
    autocast_dtype when training autocasts (then only there, for a module holding 16-bit weights)."""
    import inspect

    import torch

    params = [p for p in inspect.signature(type(module).forward).parameters.values()][1:]
    if kind != "lora_linear" and (len(params) != 1 or params[0].kind not in (params[0].POSITIONAL_ONLY,
                                                                             params[0].POSITIONAL_OR_KEYWORD)):
        return False
    if kind == "rms_norm":
        width, probed = module.weight.shape[0], [module.weight]
    elif kind == "mlp":
        width, probed = getattr(module.gate_proj, "in_features", None), []
    else:
        width, probed = module.in_features, [module.lora_B[a].weight for a in module.active_adapters if a in module.lora_B]
    ref = next(module.parameters(), None)
    if not width or ref is None or any(p.is_meta for p in module.parameters()):
        return False
    # float32 first where the module computes in float32 (the strictest check of the kernel's form); a module
    # holding 16-bit weights (a base dequantised to bfloat16) only ever runs under autocast or on 16-bit inputs
    floats = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if autocast_dtype is not None:
        dtypes = ([None] if floats == {torch.float32} else []) + [autocast_dtype]
    else:
        dtypes = [None]
    x_dtype = floats.pop() if autocast_dtype is None and len(floats) == 1 else torch.float32
    saved = [(p, p.detach().clone(), p.requires_grad) for p in probed]
    try:
        gen = torch.Generator(device=ref.device).manual_seed(0)
        with torch.no_grad():
            for p, _, _ in saved:
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).to(p.dtype))
                p.requires_grad_(p.is_floating_point())
        x = torch.randn(2, 3, width, generator=gen, device=ref.device, dtype=torch.float32).to(x_dtype)
        return all(_probe_agrees(module, forward, x, dtype) for dtype in dtypes)
    except Exception:  # noqa: BLE001 - a probe that cannot run means the kernel is not shown to apply
        return False
    finally:
        with torch.no_grad():
            for p, value, grad in saved:
                p.copy_(value)
                p.requires_grad_(grad)


def _probe_agrees(module, forward, x, autocast_dtype) -> bool:
    import torch

    leaves = [x] + [p for p in module.parameters() if p.requires_grad]
    results = []
    for f in (type(module).forward, forward):
        xi = x.detach().requires_grad_()
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else [], device_type=x.device.type), \
                torch.autocast(x.device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            torch.manual_seed(0)  # the same dropout masks, where a module draws any
            y = f(module, xi)
        if not isinstance(y, torch.Tensor) or not y.is_floating_point():
            return False
        cotangent = torch.randn(y.shape, generator=torch.Generator(device=y.device).manual_seed(1), device=y.device)
        grads = torch.autograd.grad((y.float() * cotangent).sum(), [xi] + leaves[1:], allow_unused=True)
        results.append((y.detach().float(), [None if g is None else g.float() for g in grads]))
    (y0, g0), (y1, g1) = results
    rtol_v, rtol_g = PROBE_RTOL[str(autocast_dtype or x.dtype).removeprefix("torch.")]
    if y0.shape != y1.shape or not _close(y1, y0, rtol_v):
        return False
    return all(_close(b if b is not None else torch.zeros_like(a), a, rtol_g) if a is not None else b is None or not b.any()
               for a, b in zip(g0, g1))


def _close(got, want, rtol: float) -> bool:
    """Every element within rtol of want's largest magnitude, and nothing infinite or NaN."""
    import torch

    if got.numel() == 0:
        return True
    scale = want.abs().max().item()
    return bool(torch.isfinite(got).all()) and (got - want).abs().max().item() <= rtol * scale + 1e-12


OURS = (_lora_forward, _rms_norm_forward, _mlp_forward)


def disable(model) -> None:
    """Undo enable(): the instances get their class's forward back."""
    for module in model.modules():
        if "forward" in vars(module) and getattr(module.forward, "__func__", None) in OURS:
            del module.forward
            vars(module).pop("_kit_weight_offset", None)


# Liger's kernels for the model's own layers on CUDA (transformers' liger_kernel_config): the norms, the gated
# MLPs and RoPE. Not its losses: the kit's head and DPO loss are TRL's chunked path (dpo_logps on top).
LIGER_LAYERS = {"rope": True, "rms_norm": True, "swiglu": True, "geglu": True, "cross_entropy": False,
                "fused_linear_cross_entropy": False}


def liger_applies(on_gpu: bool, targets: list[str]) -> bool:
    """Liger's Triton kernels run on CUDA only and need the liger-kernel package (in the CUDA lock, left out of
    CPU installs); TRL refuses use_liger_kernel with LoRA on the output head."""
    import importlib.util

    return (on_gpu and importlib.util.find_spec("liger_kernel") is not None
            and not any(t in ("lm_head", "embed_out", "output") for t in targets))


def apply_liger(model, autocast_dtype=None) -> dict:
    """Liger's Triton kernels on the model's norms, gated MLPs and RoPE, through transformers'
    apply_liger_kernel (what TrainingArguments.use_liger_kernel calls inside train(), called here instead so
    that each patched norm and MLP is then probed against its class's forward, as enable() does the kit's
    own kernels; where they disagree the module gets its class forward back). Then the whole model (RoPE is
    patched into its modeling module, not an instance) runs a short probe forward and backward: where that
    raises, or its logits differ from the unpatched model's, every Liger patch is undone (instances and the
    modeling module) and "failed" says why. Returns {"checked": n agreeing, "reverted": {class: count},
    "failed": reason or None}. CUDA only (Triton): liger_applies says when."""
    import sys

    from transformers.integrations.liger import apply_liger_kernel

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    namespace = vars(sys.modules[type(inner).__module__])
    saved = dict(namespace)
    out = {"checked": 0, "reverted": {}, "failed": None}
    try:
        before = _model_probe(model, autocast_dtype)
        apply_liger_kernel(model, dict(LIGER_LAYERS))
        scope_module_patches(namespace, saved, next(model.parameters()).device.type)
        for module in model.modules():
            forward = vars(module).get("forward")
            if forward is None or getattr(forward, "__func__", None) in OURS:
                continue
            kind = "rms_norm" if is_rms_norm(module) else "mlp" if hasattr(module, "gate_proj") else None
            if kind is None:
                continue
            if agrees_with_own(module, forward.__func__, kind, autocast_dtype):
                out["checked"] += 1
            else:
                del module.forward
                name = type(module).__name__
                out["reverted"][name] = out["reverted"].get(name, 0) + 1
        after = _model_probe(model, autocast_dtype)
        rtol = PROBE_RTOL[str(autocast_dtype or after.dtype).removeprefix("torch.")][1]
        if not _close(after, before, rtol):
            out["failed"] = "the patched model's logits differ from the model's own on a probe"
    except Exception as e:  # noqa: BLE001 - Triton or Liger cannot run here: the model's own forwards instead
        out["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    if out["failed"]:
        disable_liger(model)
        for name, value in saved.items():  # the modeling module's functions Liger swapped (RoPE)
            if namespace.get(name) is not value:
                namespace[name] = value
        out["checked"], out["reverted"] = 0, {}
    return out


def scope_module_patches(namespace: dict, saved: dict, device_type: str) -> list[str]:
    """Keep Liger's patches of a modeling module to the model it was applied to. Liger swaps the module's
    classes (LlamaRMSNorm, LlamaMLP) for its own and its RoPE function for a Triton one, process-wide: every
    model of that architecture built later in the process, a CPU one too, got Triton layers that raise on a CPU
    tensor (on an H200, a CPU model sampled after a CUDA run with Liger failed so). The model's own layers are
    patched by instance, so each swapped class goes back; each swapped function becomes one that takes Liger's
    path for tensors on the patched model's device type and the original's for any other. Returns the names
    put back or wrapped."""
    changed = []
    for name, before in saved.items():
        after = namespace.get(name)
        if after is before:
            continue
        changed.append(name)
        if isinstance(before, type) or not callable(before) or not callable(after):
            namespace[name] = before
        else:
            namespace[name] = _on_device(after, before, device_type)
    return changed


def _on_device(fast, own, device_type: str):
    """fast where the first tensor argument is on device_type ("cuda"), own otherwise (same signature)."""
    import functools

    @functools.wraps(own)
    def either(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if hasattr(a, "device")), None)
        return (fast if first is not None and first.device.type == device_type else own)(*args, **kwargs)

    either.liger = fast
    return either


def _model_probe(model, autocast_dtype):
    """The logits of an 8-token probe through the whole model (LoRA on, dropout off), after a backward through
    them (a kernel whose backward cannot run raises here, not at the first step)."""
    import torch

    p = next(model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.arange(8, device=p.device)[None] * 7 % vocab
    was_training = model.training
    model.eval()
    try:
        with torch.autocast(p.device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            logits = model(input_ids=ids).logits.float()
        if any(q.requires_grad for q in model.parameters()):
            logits.square().mean().backward()
            model.zero_grad(set_to_none=True)
        return logits.detach()
    finally:
        model.train(was_training)


def disable_liger(model) -> None:
    """Undo apply_liger where it got part way: every instance forward that is not the kit's goes (Liger patches
    instances' forwards; its RoPE patch of the modeling module stays, for that model's device type, and is only used by
    those forwards' attention, which Liger leaves to the model)."""
    for module in model.modules():
        forward = vars(module).get("forward")
        if forward is not None and getattr(forward, "__func__", None) not in OURS and (
                is_rms_norm(module) or hasattr(module, "gate_proj")):
            del module.forward


def keep_freed_memory() -> bool:
    """glibc: serve allocations up to 32 MB from the heap and keep freed memory for reuse instead of
    unmapping it. PyTorch on a CPU allocates a fresh tensor for nearly every op; past glibc's default
    thresholds each one is a new mapping whose every page faults in (and is zeroed) on first touch:
    a 3-step 256-token run of the bundled model took 2.65 M minor faults, 1.33 M with this, and its
    steps about 12% less time. Process-wide; the values are unchanged. False where there is no glibc."""
    import ctypes

    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def head_agrees(device, autocast_dtype=None) -> str | None:
    """Why the lean head cannot be trusted on this device and dtype, or None: chunked_logps against
    log_softmax of the full logits on a small random probe (several token and vocabulary tiles), values and
    the hidden's gradient, under autocast_dtype where training autocasts. Run before training, so that a
    kernel this device's build cannot run, or one that disagrees, steps aside before the first step."""
    import torch

    global LOGP_TOKEN_CHUNK, LOGP_VOCAB_CHUNK, LOGP_TILES_CUDA
    saved = LOGP_TOKEN_CHUNK, LOGP_VOCAB_CHUNK, LOGP_TILES_CUDA
    LOGP_TOKEN_CHUNK, LOGP_VOCAB_CHUNK, LOGP_TILES_CUDA = 8, 16, (8, 16)  # 3 x 4 tiles of a [20, 56] probe
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        h = torch.randn(20, 32, generator=gen, device=device, requires_grad=True)
        w = torch.randn(56, 32, generator=gen, device=device) / 4
        t = torch.randint(0, 56, (20,), generator=gen, device=device)
        results = []
        for lean in (True, False):
            hi = h.detach().requires_grad_()
            with torch.autocast(torch.device(device).type, dtype=autocast_dtype or torch.float32,
                                enabled=autocast_dtype is not None):
                logp = chunked_logps(hi, w, t)[0] if lean else \
                    (hi @ w.t()).float().log_softmax(-1).gather(1, t[:, None])[:, 0]
            (g,) = torch.autograd.grad(logp.sum(), hi)
            results.append((logp.detach().float(), g.float()))
        (lv, lg), (fv, fg) = results
        rtol = PROBE_RTOL[str(autocast_dtype or torch.float32).removeprefix("torch.")]
        if not (_close(lv, fv, rtol[0]) and _close(lg, fg, rtol[1])):
            return "its log-probs or gradients disagreed with log_softmax on a probe"
        return None
    except Exception as e:  # noqa: BLE001 - a probe that cannot run: the head steps aside
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    finally:
        LOGP_TOKEN_CHUNK, LOGP_VOCAB_CHUNK, LOGP_TILES_CUDA = saved


def lean_parts(causal_lm):
    """(backbone, output head) of a causal LM (PEFT's wrapper taken off) when its log-probs may go through
    chunked_logps on the backbone's last hidden states: a bias-free linear head whose logits the model neither
    scales nor soft-caps. None otherwise (and for anything that is not a transformers model), where the caller
    takes the model's own logits."""
    import torch

    inner = causal_lm.get_base_model() if hasattr(causal_lm, "get_base_model") else causal_lm  # PEFT's wrapper
    if not hasattr(inner, "get_output_embeddings") or not hasattr(inner, "base_model"):
        return None
    head = inner.get_output_embeddings()
    text = inner.config.get_text_config()
    if (head is None or getattr(head, "bias", None) is not None or type(head.weight) is not torch.nn.Parameter
            or getattr(text, "final_logit_softcapping", None) is not None
            or getattr(text, "logit_scale", None) not in (None, 1.0)
            or getattr(text, "output_multiplier", None) not in (None, 1.0)):
        return None
    return inner.base_model, head


def chunked_logps(hidden, weight, targets, with_entropy: bool = False):
    """Per-row log-prob of targets under softmax(hidden @ weight^T), never the full logits; and the
    entropy of each row's softmax (no gradient) when with_entropy, else an empty tensor. The head's matmuls
    run in autocast's dtype where autocast is on (the log-probs in float32), else in the wider of the
    hidden's and the weight's dtypes."""
    import torch

    dtype = autocast_dtype(hidden.device.type) or torch.promote_types(hidden.dtype, weight.dtype)
    return fn().ChunkedLogps.apply(hidden, weight, targets, with_entropy, dtype)


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


def shared_prompt_layout(input_ids, attention_mask, completion_mask):
    """TRL's DPO batch holds each pair twice, [prompt + chosen] in row i and [prompt + rejected] in row
    B + i, right-padded. Returns (prompt lengths of the B pairs, completion lengths of the 2B rows) as
    lists when every pair's two rows start with the same prompt and their completions follow it to the
    end of the row; None otherwise (then the prompt cannot be computed once for both)."""
    import torch

    rows, width = input_ids.shape
    if rows % 2 or rows == 0:
        return None
    b = rows // 2
    lengths = attention_mask.sum(1)
    comp = completion_mask.sum(1)
    prompt = lengths - comp
    pos = torch.arange(width, device=input_ids.device)
    if (prompt[:b] != prompt[b:]).any() or (prompt[:b] < 1).any() or (comp < 1).any():
        return None
    if not torch.equal(attention_mask.bool(), pos < lengths[:, None]):  # right padding only
        return None
    if not torch.equal(completion_mask.bool(), (pos >= prompt[:, None]) & (pos < lengths[:, None])):
        return None
    in_prompt = pos < prompt[:b, None]
    if not torch.equal(input_ids[:b][in_prompt], input_ids[b:][in_prompt]):
        return None
    return prompt[:b].tolist(), comp.tolist()


def attention_work(prompts: list[int], completions: list[int], width: int, lin: float, att: float,
                   lower_right_skips: bool = False) -> tuple[float, float]:
    """Matmul work of one forward (per layer, in units the caller picks): TRL's layout (2B rows of
    `width` tokens) against the shared-prompt one (B prompt rows, then 2B completion rows attending to
    the prompt cache). lin = work per token through the linear layers; att = work per query-key pair.

    The kernels' rule, the same for SDPA on a CPU and on CUDA: causal attention without a mask tensor
    (is_causal) skips about half the scores; with a mask tensor they compute the whole rectangle. TRL's
    rows need a mask unless none is padded. The shared prompt pass never does (right padding sits after
    every real token). The completion pass is causal aligned to the lower right when every prompt of the
    batch has one length: lower_right_skips says the kernels skip its masked triangle (CUDA's flash and
    memory-efficient kernels, through CausalBias: _lower_right_sdpa), otherwise they compute the rectangle
    (a CPU: the same mask as a tensor; prompts of different lengths: holes in every shorter row's keys).
    All work counts at one rate: memory traffic and kernel launches are left out. A GPU's attention kernels
    run near its matmul rate; a CPU's run slower than its GEMMs, so on a CPU sharing pays a little less
    than counted where the completion pass's attention is large (long completions)."""
    b = len(prompts)
    p_max, c_max = max(prompts), max(completions)
    full_rows = all(p + c == width for p, c in zip(prompts * 2, completions))
    trl = 2 * b * width * lin + 2 * b * width * width * att * (0.5 if full_rows else 1.0)
    causal = lower_right_skips and len(set(prompts)) == 1
    completion_keys = c_max * p_max + c_max * c_max * (0.5 if causal else 1.0)  # per completion row
    shared = b * p_max * lin + b * p_max * p_max * att * 0.5 + 2 * b * c_max * lin + 2 * b * completion_keys * att
    return trl, shared


def _prefix_sharing_applies(trainer, inner, model_kwargs) -> bool:
    text = inner.config.get_text_config()
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    return (set(model_kwargs) <= {"input_ids", "attention_mask", "use_cache"} and not trainer.aux_loss_enabled
            and not trainer.args.gradient_checkpointing and layer_types == {"full_attention"}
            and not getattr(text, "sliding_window", None)
            and getattr(text, "_attn_implementation", inner.config._attn_implementation) in ("sdpa", "eager")
            and trainer.ld_alpha is None)


LOWER_RIGHT_ATTENTION = "dpo_kit_lower_right_sdpa"  # its name in transformers' AttentionInterface


def _lower_right_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa attention for a completion pass whose rows all read a prompt cache of one length:
    query i of q attends to keys 0 .. s - q + i (causal, aligned to the lower right; transformers builds no
    mask for it), as torch's CausalBias. On CUDA that runs flash or memory-efficient attention with the
    masked blocks skipped (not run here: the kit's tests run on a CPU); elsewhere it materialises the
    [q, s] mask once, broadcast over batch and heads (the CPU kernel then computes the rectangle)."""
    import torch
    from torch.nn.attention.bias import causal_lower_right
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # CausalBias's flash call takes equal heads
    # CausalBias dispatches to its kernels outside autocast: on the 4-bit path q, k and v arrive in float32 (the
    # residual stream is), which flash attention refuses. In autocast's dtype, as sdpa under autocast (the
    # batches whose prompts differ in length, through transformers' mask) computes them: the same precision
    # from batch to batch.
    low = autocast_dtype(query.device.type)
    if low is not None:
        query, key, value = query.to(low), key.to(low), value.to(low)
    q, s = query.shape[2], key.shape[2]
    global _LOWER_RIGHT_FAILED
    if not _LOWER_RIGHT_FAILED:
        try:
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=causal_lower_right(q, s), dropout_p=dropout, scale=scaling)
            return out.transpose(1, 2).contiguous(), None
        except RuntimeError as e:  # no kernel of this build takes it here: the same mask, materialised
            _LOWER_RIGHT_FAILED = True
            print(f"[model] torch's lower-right causal attention raised ({str(e).splitlines()[0][:120]}): "
                  "its mask materialised instead, from here on", flush=True)
    mask = torch.ones(q, s, dtype=torch.bool, device=query.device).tril(s - q)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.transpose(1, 2).contiguous(), None


_LOWER_RIGHT_FAILED = False


GQA_ATTENTION = "dpo_kit_gqa_sdpa"  # its name in transformers' AttentionInterface (and its mask interface)


def _gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention, but with a padding mask on a CPU the key and value heads are not copied
    out to one per query head (repeat_kv): SDPA reads them grouped (enable_gqa, torch >= 2.5), the same values.
    transformers takes that path only without a mask (CUDA's kernels fall back to the math one with both); a
    sampling batch of left-padded prompts always has a mask, and repeating a growing cache per layer and token
    was the largest cost of a decode step after the matmuls. Anything else goes to transformers' own."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if getattr(module, "num_key_value_groups", 1) == 1 or query.device.type != "cpu" or attention_mask is None \
            or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    b, heads, q, d = query.shape
    if q == 1:  # a decode step: each key/value head's query heads as that head's query rows (no GQA kernel needed)
        groups = heads // key.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            query.reshape(b, key.shape[1], groups, d), key, value, attn_mask=attention_mask, dropout_p=dropout,
            scale=scaling)
        return out.reshape(b, 1, heads, d), None  # [b, heads, 1, d] transposed, as the layer takes it
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def grouped_kv_attention(model):
    """The model's sdpa attention as _gqa_sdpa while the block runs (sampler.decode_loop's attention); a model on
    a GPU, or on another attention implementation (eager, flash), is left as it is."""
    config = model.config
    on_cpu = next(model.parameters()).device.type == "cpu"
    if getattr(config, "_attn_implementation", None) != "sdpa" or not on_cpu or any(
            getattr(config, k, None) for k in ("sliding_window", "attn_logit_softcapping")):
        yield
        return
    from transformers import AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)  # the same masks sdpa gets
    with _attention_implementation(config, GQA_ATTENTION):
        yield


@contextlib.contextmanager
def _attention_implementation(config, name: str | None):
    """config's attention implementation set to name (registered with transformers) while the block runs."""
    if name is None:
        yield
        return
    from transformers import AttentionInterface

    AttentionInterface.register(LOWER_RIGHT_ATTENTION, _lower_right_sdpa)
    AttentionInterface.register(GQA_ATTENTION, _gqa_sdpa)
    old = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = old


def _shared_prompt_forward(backbone, input_ids, prompts: list[int], completions: list[int]):
    """The backbone over each prompt once and each completion against that prompt's keys and values.
    Returns the hidden states that predict every completion token, [tokens, hidden], in TRL's order
    (chosen rows, then rejected rows; each completion in order), and the completion pass's outputs.

    Attention layout (attention_work's costs follow it): prompts stay left-aligned, so a prompt row's padding
    comes after all its real tokens and the prompt pass needs no mask (is_causal: flash on CUDA, the
    upper triangle skipped on a CPU); what the padding positions compute is never read. Right-aligning them
    would put the padding first, where every query sees it, and cost the prompt pass its is_causal. In
    the completion pass a completion's own padding again comes last; only a prompt shorter than the
    batch's longest leaves a hole among its row's keys. Without holes (every prompt of one length) the
    pass is causal aligned to the lower right (_lower_right_sdpa); with them, transformers' 4-D mask
    (memory-efficient attention on CUDA). Grouping rows by prompt length would give every group the
    lower-right kernel, at one attention call per length per layer; not measured on a GPU, not done."""
    import torch
    from transformers import DynamicCache

    device = input_ids.device
    b = len(prompts)
    p = torch.tensor(prompts, device=device)
    c = torch.tensor(completions, device=device)
    p_max, c_max = max(prompts), max(completions)
    cache = DynamicCache(config=backbone.config)
    prompt_out = backbone(input_ids=input_ids[:b, :p_max], past_key_values=cache, use_cache=True)
    for layer in cache.layers:  # both completions of pair i read pair i's prompt: the cache twice over
        layer.keys, layer.values = torch.cat([layer.keys, layer.keys]), torch.cat([layer.values, layer.values])
    pp = torch.cat([p, p])
    steps = torch.arange(c_max, device=device)
    comp_ids = input_ids.gather(1, (pp[:, None] + steps).clamp(max=input_ids.shape[1] - 1))
    comp_mask = steps < c[:, None]
    kv_mask, attention = None, None
    if len(set(prompts)) > 1:
        prompt_mask = (torch.arange(p_max, device=device) < p[:, None]).long()
        kv_mask = torch.cat([torch.cat([prompt_mask, prompt_mask]), comp_mask.long()], 1)  # [2B, p_max + c_max]
    elif backbone.config._attn_implementation == "sdpa":
        attention = LOWER_RIGHT_ATTENTION
    with _attention_implementation(backbone.config, attention):
        out = backbone(input_ids=comp_ids, attention_mask=kv_mask, position_ids=pp[:, None] + steps,
                       past_key_values=cache, use_cache=True)
    last_prompt = prompt_out.last_hidden_state[torch.arange(b, device=device), p - 1]  # predicts token 0
    predictors = torch.cat([torch.cat([last_prompt, last_prompt])[:, None], out.last_hidden_state[:, :-1]], 1)
    return predictors[comp_mask], comp_ids[comp_mask], out


def dpo_logps(trainer, model, model_kwargs: dict, input_ids, completion_mask):
    """What DPOTrainer._get_per_token_logps_and_entropies returns (per-token log-probs and entropies of
    the completion tokens, zeros elsewhere, and the backbone's outputs), through ChunkedLogps and, when
    each pair's rows share their prompt and that saves work (attention_work), with the prompt run
    once for both completions. Under the trainer's autocast (bf16 / fp16: accelerate's, as TRL runs its own
    path), so the fused forwards and the head run in its dtype. None where this path does not apply (a
    biased, scaled, soft-capped, sharded or trainable head, a vision model), and TRL's own path runs instead."""
    import torch

    unwrapped = trainer.accelerator.unwrap_model(model)
    inner = unwrapped.base_model.model if hasattr(unwrapped, "peft_config") else unwrapped
    parts = lean_parts(inner)
    if getattr(trainer, "_is_vlm", False) or parts is None or parts[1].weight.requires_grad:
        return None
    backbone, head = parts
    text = inner.config.get_text_config()
    mask = completion_mask[:, 1:].bool()
    layout = None
    if trainer.kit_share_prompts and _prefix_sharing_applies(trainer, inner, model_kwargs):
        layout = shared_prompt_layout(input_ids, model_kwargs["attention_mask"], completion_mask)
    if layout is not None:
        width = input_ids.shape[1]
        skips = input_ids.device.type == "cuda" and inner.config._attn_implementation == "sdpa"
        trl, shared = attention_work(*layout, width, lin=1.0, att=attention_per_token_pair(text),
                                     lower_right_skips=skips)
        if shared > 0.97 * trl:  # not worth a second pass
            layout = None
    with trainer.accelerator.autocast():
        if layout is not None:
            predictors, labels, outputs = _shared_prompt_forward(backbone, input_ids, *layout)
            trainer.kit_shared_batches += 1
        else:
            outputs = backbone(**model_kwargs)
            predictors, labels = outputs.last_hidden_state[:, :-1][mask], input_ids[:, 1:][mask]
        logps, entropy = chunked_logps(predictors, head.weight, labels,
                                       with_entropy=not _is_reference_pass(trainer, model))
    trainer.kit_lean_batches += 1
    per_token_logps = logps.new_zeros(mask.shape).masked_scatter(mask, logps)
    per_token_entropy = logps.new_zeros(mask.shape)
    if entropy.numel():
        per_token_entropy = per_token_entropy.masked_scatter(mask, entropy)
    return per_token_logps, per_token_entropy, outputs


def attention_per_token_pair(config) -> float:
    """Attention matmul work per query-key pair relative to the linear layers' work per token, one
    layer: QK^T and AV are 2 x heads x head_dim multiply-adds each; the linear layers hold q, k, v, o
    and the MLP's weights (gate, up, down when it has a gate)."""
    d, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    linear = d * heads * head_dim * 2 + d * kv * head_dim * 2 + 3 * d * inter
    return 2 * heads * head_dim / linear


# ---------------------------------------------------------------------------------------------
# Sampling (sampler.py): a KV cache that writes in place instead of concatenating at every token.
# ---------------------------------------------------------------------------------------------

def preallocated_kv_cache(capacity: int):
    """transformers' DynamicCache whose layers keep keys and values in buffers of `capacity` positions and hand
    attention views of the filled part: DynamicLayer.update concatenates, copying the whole cache at every new
    token (a quarter of a 32-row decode step of the bundled model on a CPU). Finished rows still leave it
    (batch_select_indices). transformers' internals (DynamicLayer, layer_class_to_replicate): another version
    than WRITTEN_FOR gets the plain DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if version_problem() or not hasattr(cache, "layer_class_to_replicate"):
        return cache
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def lazy_initialization(self, key_states, value_states) -> None:
            super().lazy_initialization(key_states, value_states)
            b, h, _, d = key_states.shape
            self.buffers = [key_states.new_empty(b, h, capacity, d), value_states.new_empty(b, h, capacity, d)]
            self.filled = 0

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.filled + key_states.shape[-2]
            if end > self.buffers[0].shape[-2]:  # past the capacity asked for: grow (never on the sampler's path)
                self.buffers = [grown(b, end) for b in self.buffers]
            self.buffers[0][:, :, self.filled:end] = key_states
            self.buffers[1][:, :, self.filled:end] = value_states
            self.filled = end
            self.keys, self.values = (b[:, :, :end] for b in self.buffers)
            return self.keys, self.values

        def batch_select_indices(self, indices) -> None:
            if self.is_initialized:
                self.buffers = [b[indices] for b in self.buffers]
                self.keys, self.values = (b[:, :, :self.filled] for b in self.buffers)

    def grown(buffer, length):  # a copy with room for `length` positions (doubling)
        bigger = buffer.new_empty(*buffer.shape[:2], max(length, 2 * buffer.shape[-2]), buffer.shape[-1])
        bigger[:, :, :buffer.shape[-2]] = buffer
        return bigger

    cache.layer_class_to_replicate = PreallocatedLayer
    return cache
