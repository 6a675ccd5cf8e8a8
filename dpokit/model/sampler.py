"""Sampling answers fast: the kit's own decode loop, used wherever the kit samples (the checker's held-out
scores, rounds of the model's own attempts, GRPO's answers, SPIN and self-reward answers, probes, chat).

Not run on its own; `make bench` measures it against transformers' `generate` (bench/sampling.py).

What makes it faster than `model.generate` on the same batch:
  - LoRA merged into the base weights while sampling (float weights only; a 4-bit base keeps its adapter on the
    side), and the exact original weights copied back afterwards: one matmul per layer instead of three, called
    directly (peft's forward of a merged layer only calls its base layer);
  - on a CPU, a model with fewer key/value heads than query heads (GQA: the bundled model has 3 for 9) reads them
    grouped (fastpath.grouped_kv_attention, which models.generate passes in): transformers copies them out to one
    per query head in every layer at every token when a batch is padded, which a sampling batch always is;
  - keys and values written in place (fastpath.preallocated_kv_cache, which models.generate passes in), not
    concatenated at every token;
  - finished answers leave the batch: a row that has written its end-of-turn token costs nothing more, so a batch
    runs as long as its longest answer only for the rows still writing;
  - the prompt's pass computes the output head for its last token only;
  - the nucleus (top-p) drawn from the few hundred likeliest tokens, not a sort of the whole vocabulary (exact:
    a row whose nucleus is wider falls back to the full sort).
GRPO's answers come through the same loop (trainers.grpo_trainer_class replaces TRL's plain-transformers branch).
Greedy answers are transformers' greedy answers (tests/test_sampler.py); sampled ones draw from the same
temperature / top-k / top-p distribution.
"""

from __future__ import annotations

import contextlib
import sys
import time

PROGRESS_EVERY = 10.0  # seconds between progress lines


def top_k_top_p(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """Logits of one step [rows, vocab] with temperature, top-k and nucleus (top-p) filtering applied as
    transformers' warpers do: what is filtered out is -inf."""
    import torch

    if temperature and temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False  # the most likely token always stays
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


CANDIDATES = 64  # tokens looked at per row first; a row whose nucleus is wider looks at 8x more, up to a full sort


def nucleus(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, candidates: int = CANDIDATES):
    """(token ids, probabilities) per row: the distribution top_k_top_p's logits give, over the few tokens it keeps,
    without sorting the vocabulary. Ids [rows, K] with probability 0 where a token is filtered out. The top
    `candidates` tokens (or top_k) hold the nucleus whenever their mass reaches top_p; the rows where they do not
    are computed again from 8x as many (the bundled model's code answers: 2% of rows past 64, 0.03% past 512),
    ending in the full sort, so the result is exact either way."""
    import torch

    vocab = logits.shape[-1]
    if temperature and temperature != 1.0:
        logits = logits / temperature
    k = min(vocab, top_k) if top_k else min(vocab, candidates) if top_p < 1.0 else vocab
    values, ids = logits.topk(k, dim=-1)  # sorted, largest first
    if top_k or k == vocab:
        probs = values.softmax(dim=-1)  # top-k renormalises before top-p, as transformers' warpers do
        inside = torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)
    else:
        probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()
        inside = probs.sum(dim=-1) >= top_p
    if top_p < 1.0:
        before = probs.cumsum(dim=-1) - probs  # the mass ranked strictly above each token
        probs = probs.masked_fill(before >= top_p, 0.0)
    if not bool(inside.all()):  # the nucleus spills past the candidates: those rows from more of them
        rows = (~inside).nonzero().squeeze(1)
        wide_ids, wide_probs = nucleus(logits[rows], 1.0, top_k, top_p, candidates * 8)
        kept = max(int((wide_probs > 0).sum(dim=-1).max()), k)  # sorted: what the nucleus left out is at the end
        wide_ids, wide_probs = wide_ids[:, :kept], wide_probs[:, :kept]
        pad = kept - k
        ids = torch.nn.functional.pad(ids, (0, pad))
        probs = torch.nn.functional.pad(probs, (0, pad))
        ids[rows], probs[rows] = wide_ids, wide_probs
    return ids, probs / probs.sum(dim=-1, keepdim=True)


def draw(logits, sampling: dict | None):
    """One token per row: the argmax (greedy), or a draw from nucleus()."""
    import torch

    if not sampling:
        return logits.argmax(dim=-1)
    ids, probs = nucleus(logits, **sampling)
    return ids.gather(-1, torch.multinomial(probs, 1)).squeeze(1)


def lora_layers(model) -> list:
    """The model's LoRA layers whose base is a plain (float) linear layer: what merging can fold in exactly."""
    import torch

    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, LoraLayer) and isinstance(m.get_base_layer(), torch.nn.Linear)
            and m.get_base_layer().weight.dtype in (torch.float32, torch.float16, torch.bfloat16)]


@contextlib.contextmanager
def merged(model):
    """LoRA folded into the base weights inside the block (adapters on, not already merged), and the exact
    original weights back after it: the model trains and evaluates on afterwards as if nothing happened."""
    import torch

    layers = [m for m in lora_layers(model) if not m.merged and not m.disable_adapters and m.active_adapters
              and not any(getattr(m, "use_dora", {}).get(a) for a in m.active_adapters)]  # DoRA: its own forward
    saved = []
    try:
        with torch.no_grad():
            for layer in layers:
                weight = layer.get_base_layer().weight
                names = [a for a in layer.active_adapters if a in layer.lora_A]
                saved.append((layer, weight.detach().clone(), names, vars(layer).get("forward")))
                for name in names:  # peft's merge() by hand: a 4-bit layer dequantised on a CPU keeps its bnb class
                    weight += layer.get_delta_weight(name).to(weight.dtype)
                    layer.merged_adapters.append(name)  # peft's forward: the base layer alone
                layer.forward = layer.get_base_layer().forward  # what peft's forward calls once merged, directly
        yield len(saved)
    finally:
        with torch.no_grad():
            for layer, weight, names, forward in saved:
                layer.get_base_layer().weight.copy_(weight)
                for name in names:
                    layer.merged_adapters.remove(name)
                if forward is None:
                    vars(layer).pop("forward", None)
                else:
                    layer.forward = forward


def time_left(done: int, total: int, elapsed: float, steps: int = 0, steps_total: int = 0) -> float | None:
    """Seconds left, or None before anything can be said. By answers done, the rate so far; where decode steps
    are counted too, at most the steps left at the time a step has taken so far: a batch's rows mostly finish
    together near its end, so 1 answer of 64 after 10 s does not mean 630 s more."""
    if done >= total:
        return 0.0
    estimates = []
    if done:
        estimates.append((total - done) * elapsed / done)
    if steps and steps_total > steps:
        estimates.append((steps_total - steps) * elapsed / steps)
    return min(estimates) if estimates else None


class Progress:
    """A line every PROGRESS_EVERY seconds on stderr: items done of how many, tokens/s (sampling), time left.
    steps_total: decode steps the work takes at most (batches x max_new_tokens), 0 = not counted; a decode loop
    adds its steps, which bound the time left (time_left)."""

    def __init__(self, label: str, total: int, unit: str, steps_total: int = 0):
        self.label, self.total, self.unit, self.done, self.tokens = label, total, unit, 0, 0
        self.steps, self.steps_total = 0, steps_total
        self.start = self.last = time.monotonic()

    def add(self, done: int = 0, tokens: int = 0, force: bool = False, steps: int = 0) -> None:
        self.done, self.tokens, self.steps = self.done + done, self.tokens + tokens, self.steps + steps
        now = time.monotonic()
        if not self.label or not (force or now - self.last >= PROGRESS_EVERY):
            return
        self.last, elapsed = now, max(now - self.start, 1e-9)
        left = time_left(self.done, self.total, elapsed, self.steps, self.steps_total)
        rate = f"  {self.tokens / elapsed:.0f} tokens/s" if self.tokens else ""
        print(f"[{self.label}] {self.done}/{self.total} {self.unit}{rate}  {int(elapsed)} s"
              + (f", ~{int(left)} s left" if left and self.done < self.total else ""),
              file=sys.stderr, flush=True)

    def skip_steps(self, steps: int) -> None:
        """A batch ended before max_new_tokens: its unused steps leave the bound."""
        self.steps_total = max(self.steps, self.steps_total - steps)


def decode_loop(model, input_ids, attention_mask, max_new_tokens: int, stop_ids: set[int], sampling: dict | None,
                progress: Progress | None = None, keep_stop: bool = False, kv_cache=None,
                attention=None) -> list[list[int]]:
    """Each row's new tokens (with its stop token when keep_stop), rows leaving the batch as they finish.
    kv_cache: capacity -> a transformers cache (fastpath.preallocated_kv_cache); None = a DynamicCache.
    attention: model -> a context the loop runs in (fastpath.grouped_kv_attention); None = the model's own."""
    import torch
    from transformers import DynamicCache

    rows, device = input_ids.shape[0], input_ids.device
    out: list[list[int]] = [[] for _ in range(rows)]
    alive = torch.arange(rows, device=device)  # on the model's device, as token and done are (CUDA: one device)
    mask = attention_mask
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = kv_cache(input_ids.shape[1] + max_new_tokens) if kv_cache else DynamicCache()
    step_input, step_position = input_ids, position
    stops = torch.tensor(sorted(stop_ids), device=device) if stop_ids else None
    with attention(model) if attention else contextlib.nullcontext():
        for step in range(max_new_tokens):
            logits = model(input_ids=step_input, attention_mask=mask, position_ids=step_position,
                           past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :].float()
            token = draw(logits, sampling)
            done = torch.isin(token, stops) if stops is not None else torch.zeros_like(token, dtype=torch.bool)
            for row, t, d in zip(alive.tolist(), token.tolist(), done.tolist()):
                if keep_stop or not d:
                    out[row].append(t)
            keep = (~done).nonzero().squeeze(1)
            if progress:
                progress.add(done=int(done.sum()), tokens=int(keep.numel()), steps=1)
            if keep.numel() == 0:
                if progress:
                    progress.skip_steps(max_new_tokens - step - 1)
                break
            if keep.numel() < alive.numel():
                alive, token = alive[keep], token[keep]
                mask, position = mask[keep], position[keep]
                cache.batch_select_indices(keep)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            position = position[:, -1:] + 1
            step_input, step_position = token[:, None], position
        else:
            if progress:  # the rows that reached max_new_tokens
                progress.add(done=int(alive.numel()))
    return out


KV_BUDGET = 3 << 30  # bytes of keys and values one sampling batch may hold: all rows x (prompt + answer) tokens


def rows_per_batch(rows: int, row_bytes: int, budget: int = KV_BUDGET) -> int:
    """Rows per sampling batch: every row in one batch when their keys and values fit in `budget`, else as few
    batches of equal size as fit. A decode step reads every weight once for the whole batch, and a batch runs as
    long as its longest answer, so fewer, fuller batches are faster; the budget bounds the memory."""
    cap = max(1, budget // max(row_bytes, 1))
    batches = -(-rows // cap)
    return max(1, -(-rows // max(batches, 1)))


def kv_bytes_per_row(model, tokens: int) -> int:
    """Bytes of keys and values one row of `tokens` tokens holds in the model's cache (its config's shape, its
    compute dtype); 0 when the config does not say."""
    import torch

    cfg = getattr(model, "config", None)
    try:
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        layers = cfg.num_hidden_layers
    except (AttributeError, TypeError, ZeroDivisionError):
        return 0
    dtype = getattr(model, "dtype", torch.float32)
    size = torch.tensor([], dtype=dtype).element_size() if dtype.is_floating_point else 4
    return 2 * layers * kv_heads * head_dim * tokens * size


def prompt_texts(tokenizer, prompts: list[list[dict]], prefix: str = "") -> list[str]:
    """Each message list through the chat template, ready for the assistant's turn (+ prefix); a tokenizer
    without a chat template gets the messages' contents separated by blank lines."""
    if tokenizer.chat_template:
        return [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) + prefix
                for p in prompts]
    return ["\n\n".join(m["content"] for m in p) + "\n\n" + prefix for p in prompts]


def sample(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, sampling: dict | None = None,
           seed: int | None = None, n: int = 1, batch_size: int = 0, label: str = "", kv_cache=None,
           attention=None) -> list[str]:
    """Answers to message lists: greedy (sampling None) or sampled with {temperature, top_k, top_p} after seeding
    torch with `seed`; n answers per prompt, in prompt order. The LoRA adapter, when on, is merged while sampling.
    batch_size: rows per batch, 0 = as many as KV_BUDGET holds (rows_per_batch). label: a progress line on stderr
    ('' = none)."""
    import torch

    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [t for t in prompt_texts(tokenizer, prompts) for _ in range(n)]
    ids = tokenizer(texts, add_special_tokens=not tokenizer.chat_template)["input_ids"] if texts else []  # once
    if not batch_size:
        row_bytes = kv_bytes_per_row(model, max(map(len, ids), default=0) + max_new_tokens)
        batch_size = rows_per_batch(len(texts), row_bytes) if row_bytes else 64
    stop_ids = {tokenizer.eos_token_id} - {None}
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stop_ids |= set(extra if isinstance(extra, list) else [extra] if extra is not None else [])
    if seed is not None:
        torch.manual_seed(seed)
    steps_total = -(-len(texts) // batch_size) * max_new_tokens
    progress = Progress(label, len(texts), "answers", steps_total) if label else None
    answers: list[str] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), merged(model):
            for i in range(0, len(texts), batch_size):
                batch = tokenizer.pad({"input_ids": ids[i:i + batch_size]}, return_tensors="pt").to(model.device)
                new = decode_loop(model, batch["input_ids"], batch["attention_mask"], max_new_tokens, stop_ids,
                                  sampling, progress, kv_cache=kv_cache, attention=attention)
                answers += [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]
    finally:
        model.train(was_training)
    if progress:
        progress.add(0, force=True)
    return answers


def sample_ids(model, prompt_ids: list[list[int]], pad_id: int, max_new_tokens: int, stop_ids: set[int],
               sampling: dict | None, kv_cache=None, attention=None) -> list[list[int]]:
    """Token ids in, token ids out (each answer with its stop token, as TRL's GRPO keeps it): GRPO's generation
    through this loop (trainers.grpo_trainer_class). The model's own train/eval mode is left as it was."""
    import torch

    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    device = next(model.parameters()).device
    with torch.no_grad(), merged(model):
        return decode_loop(model, ids.to(device), mask.to(device), max_new_tokens, stop_ids, sampling,
                           keep_stop=True, kv_cache=kv_cache, attention=attention)
