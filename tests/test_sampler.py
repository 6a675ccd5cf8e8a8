"""sampler.py: the kit's decode loop gives transformers' greedy answers, filters logits as transformers' warpers do,
merges LoRA only while sampling and puts back the exact weights, and reports progress."""
from pathlib import Path

import pytest
import torch

from dpokit.model import models
from dpokit.model import sampler

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / models.BUNDLED_MODEL_DIR


def tiny_llama_with_lora(vocab: int = 64):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                                  "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return model.eval()


@pytest.mark.parametrize("options", [{"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.8},
                                     {"temperature": 1.5, "top_k": 10, "top_p": 0.95}])
def test_filtering_matches_transformers_warpers(options):
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 3
    expected = logits.clone()
    if "temperature" in options:
        expected = TemperatureLogitsWarper(options["temperature"])(None, expected)
    if "top_k" in options:
        expected = TopKLogitsWarper(options["top_k"])(None, expected)
    if "top_p" in options:
        expected = TopPLogitsWarper(options["top_p"])(None, expected)
    got = sampler.top_k_top_p(logits, **options)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.allclose(got[~torch.isinf(got)], expected[~torch.isinf(expected)])


def test_merged_folds_lora_in_and_puts_back_the_exact_weights():
    model = tiny_llama_with_lora()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        tuned = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        with sampler.merged(model) as n:
            assert n == 6  # q_proj, v_proj, down_proj in each of 2 layers
            inside = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert not torch.allclose(tuned, base, atol=1e-3)  # the adapter matters here
    assert torch.allclose(inside, tuned, atol=1e-5)
    assert torch.equal(after, tuned)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name  # bit for bit, not to rounding
    with model.disable_adapter(), sampler.merged(model) as n:
        assert n == 0  # the base is sampled as it is


@pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="needs the bundled model (make model)")
def test_greedy_answers_are_transformers_greedy_answers_on_the_bundled_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED)
    model = AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()
    prompts = [[{"role": "user", "content": "Delete the Yarn cache directory"}],
               [{"role": "user", "content": "What is 1+1?"}],
               [{"role": "user", "content": "Write Python that prints the bytes used by ~/.cache/pip"}]]
    ours = models.generate(model, tokenizer, prompts, 40)  # the preallocated cache (fastpath)
    theirs = models.hf_generate(model, tokenizer, prompts, 40)
    assert ours == theirs == sampler.sample(model, tokenizer, prompts, 40)  # and transformers' DynamicCache
    assert all(ours) and len(set(ours)) == 3


def test_sampled_answers_are_seeded_and_rows_leave_the_batch_when_they_finish(capsys, monkeypatch):
    from transformers import AutoTokenizer

    if not (BUNDLED / "config.json").exists():
        pytest.skip("needs the bundled model's tokenizer (make model)")
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED)
    model = tiny_llama_with_lora(vocab=len(tokenizer))
    model.generation_config.eos_token_id = None
    monkeypatch.setattr(sampler, "PROGRESS_EVERY", 0.0)
    prompts = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b c d"}]]
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    one = sampler.sample(model, tokenizer, prompts, 12, sampling, seed=5, n=3, label="sample")
    two = sampler.sample(model, tokenizer, prompts, 12, sampling, seed=5, n=3)
    assert one == two and len(one) == 6 and len(set(one)) > 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("[sample] 6/6 answers")


def test_time_left_is_bounded_by_the_decode_steps_left_when_a_batch_finishes_together():
    # 1 answer of 64 after 10 s of a 256-step batch at step 80: the answers' rate says 630 s, the steps 22 s
    assert sampler.time_left(1, 64, 10.0, steps=80, steps_total=256) == pytest.approx(176 * 10.0 / 80)
    assert sampler.time_left(1, 64, 10.0) == pytest.approx(630.0)  # no steps counted: the answers' rate
    assert sampler.time_left(32, 64, 10.0, steps=10, steps_total=1000) == pytest.approx(10.0)  # the smaller one
    assert sampler.time_left(0, 64, 10.0) is None  # nothing done, nothing counted: no guess
    assert sampler.time_left(0, 64, 10.0, steps=5, steps_total=10) == pytest.approx(10.0)
    assert sampler.time_left(64, 64, 10.0, steps=5, steps_total=10) == 0.0


def test_rows_per_batch_fills_as_few_equal_batches_as_the_budget_holds():
    assert sampler.rows_per_batch(164, 10, budget=10_000) == 164  # all fit: one batch
    assert sampler.rows_per_batch(164, 100, budget=15_500) == 82  # 155 fit: two batches of 82, not 155 + 9
    assert sampler.rows_per_batch(7, 100, budget=50) == 1  # one row over budget still samples, alone
    assert sampler.rows_per_batch(1, 100) == 1
    model = tiny_llama_with_lora()  # 2 layers, 2 key/value heads of 8 dims, float32
    assert sampler.kv_bytes_per_row(model, 100) == 2 * 2 * 2 * 8 * 100 * 4
    assert sampler.kv_bytes_per_row(object(), 100) == 0


@pytest.mark.parametrize("options", [{"temperature": 0.7, "top_p": 0.95}, {"top_k": 100, "top_p": 0.95,
                                     "temperature": 1.5}, {"top_k": 7}, {"top_p": 0.5}, {"temperature": 0.9}])
@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # flat (the nucleus spills past the candidates) to peaked
def test_the_nucleus_is_the_distribution_transformers_filtering_gives(options, scale):
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(2)) * scale
    logits[0] *= 40  # one row nearly one-hot, one row flat, in the same batch
    logits[1] = 0.01 * logits[1]
    expected = sampler.top_k_top_p(logits, **options).softmax(dim=-1)
    ids, probs = sampler.nucleus(logits, **options)
    got = torch.zeros_like(expected).scatter_add_(-1, ids, probs)
    for r in range(len(logits)):
        if torch.allclose(got[r], expected[r], atol=1e-6):
            continue
        # A float tie at the nucleus's edge (a flat row): a token whose more likely tokens hold top_p to within
        # rounding may fall either side, summed in another order (transformers sums from the least likely end, and
        # CPUs' kernels round differently). Only such a token may differ, and the rest is the same distribution.
        full = sampler.top_k_top_p(logits[r:r + 1], **{**options, "top_p": 1.0})[0].softmax(-1)
        order = full.argsort(descending=True)
        before = torch.zeros_like(full).scatter_(0, order, full[order].cumsum(0) - full[order])
        differ = ((got[r] > 0) != (expected[r] > 0)).nonzero().flatten()
        assert len(differ) and (before[differ] - options["top_p"]).abs().max() < 1e-4, (r, differ)
        kept = full * (got[r] > 0)
        assert torch.allclose(got[r], kept / kept.sum(), atol=1e-6)
    draws = torch.stack([sampler.draw(logits, options) for _ in range(50)], dim=1)
    assert bool((expected.gather(-1, draws) > 0).all())  # only tokens the filters keep are ever drawn


def test_the_preallocated_cache_gives_the_dynamic_caches_logits_and_grows_past_its_capacity():
    from dpokit.model import fastpath
    from transformers import DynamicCache

    model = tiny_llama_with_lora()
    ids = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(4))
    steps = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(5))
    outs = []
    for cache in (DynamicCache(), fastpath.preallocated_kv_cache(7)):  # 6 + 5 tokens: grows once
        with torch.no_grad():
            logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
            for i in range(steps.shape[1]):
                logits.append(model(input_ids=steps[:, i:i + 1], past_key_values=cache, use_cache=True).logits[:, -1])
            cache.batch_select_indices(torch.tensor([0, 2]))
            logits.append(model(input_ids=steps[[0, 2], :1], past_key_values=cache, use_cache=True).logits[:, -1])
        outs.append(logits)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*outs))


def test_grouped_key_value_attention_gives_sdpas_logits_on_a_padded_batch_and_is_put_back():
    """The decode loop on a CPU reads a GQA model's key and value heads grouped, not repeated per query head:
    the same logits as transformers' sdpa for left-padded rows (prompt pass and decode steps), and the model's
    own attention implementation afterwards."""
    from dpokit.model import fastpath
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = tiny_llama_with_lora()
    assert model.config._attn_implementation == "sdpa" and model.config.num_key_value_heads == 2
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3], mask[2, :1] = 0, 0  # left padding, as a sampling batch has
    steps = torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(2))

    def logits():
        cache, m, out = fastpath.preallocated_kv_cache(16), mask, []
        with torch.no_grad():
            out.append(model(input_ids=ids, attention_mask=m, past_key_values=cache, use_cache=True).logits[:, -1])
            for i in range(steps.shape[1]):
                m = torch.cat([m, m.new_ones(3, 1)], 1)
                out.append(model(input_ids=steps[:, i:i + 1], attention_mask=m, past_key_values=cache,
                                 use_cache=True).logits[:, -1])
        return torch.stack(out)

    want = logits()
    with fastpath.grouped_kv_attention(model):
        assert model.config._attn_implementation == fastpath.GQA_ATTENTION
        got = logits()
    assert model.config._attn_implementation == "sdpa"
    assert torch.allclose(got, want, atol=1e-5)
    # the grouped call itself, against transformers' (which repeats the heads when there is a mask)
    layer = model.base_model.model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(3, 4, 1, 8, generator=g), torch.randn(3, 2, 9, 8, generator=g), torch.randn(3, 2, 9, 8,
                                                                                                        generator=g)
    pad = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    pad[1, ..., :4] = False
    ours, theirs = fastpath._gqa_sdpa(layer, q, k, v, pad), sdpa_attention_forward(layer, q, k, v, pad)
    assert ours[0].shape == theirs[0].shape == (3, 1, 4, 8) and torch.allclose(ours[0], theirs[0], atol=1e-6)
