"""fastpath.py: each fused kernel against the eager computation it replaces (values and gradients, in
float64 where gradcheck needs it), the recognisers on real modules, and a tiny real Llama with LoRA
giving the same outputs and gradients with the fused forwards swapped on as without; under CPU bfloat16
autocast, the same to bfloat16 rounding (compared with float32: the fast path's error no larger than the
eager modules')."""

import types

import pytest

torch = pytest.importorskip("torch")

from dpokit.model import fastpath  # noqa: E402


def test_lora_delta_matches_base_plus_scaled_low_rank_product_and_its_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w, b = torch.randn(7, 5, dtype=torch.float64, generator=g), torch.randn(7, dtype=torch.float64, generator=g)
    a = torch.randn(3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    lb = torch.randn(7, 3, dtype=torch.float64, generator=g, requires_grad=True)

    def fused(x, a, lb):
        return fastpath.fn().LoraDelta.apply(torch.nn.functional.linear(x, w, b), x, a, lb, 2.5)

    expected = x @ w.t() + b + 2.5 * (x @ a.t()) @ lb.t()
    assert torch.allclose(fused(x, a, lb), expected, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(fused, (x, a, lb))


def test_rms_norm_matches_the_llama_module_and_its_gradients():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(1)
    norm = LlamaRMSNorm(8, eps=1e-5)
    norm.weight.data = torch.randn(8, generator=g)
    x = torch.randn(3, 4, 8, generator=g)
    assert torch.allclose(fastpath.fn().RMSNorm.apply(x, norm.weight, 1e-5), norm(x), rtol=1e-6, atol=1e-6)
    x64 = x.double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: fastpath.fn().RMSNorm.apply(x, w, 1e-5), (x64, w64))
    # bfloat16 (a bfloat16 model under autocast): normalised in float32, rounded before the weight, as the module
    norm16, x16 = norm.bfloat16(), x.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = fastpath.fn().RMSNorm.apply(x16, norm16.weight, 1e-5), norm16(x16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    gy = torch.randn(3, 4, 8, generator=g).bfloat16()
    got_grads = torch.autograd.grad(got, (x16, norm16.weight), gy)
    for a, b in zip(got_grads, torch.autograd.grad(expected, (x16, norm16.weight), gy)):
        assert a.dtype == torch.bfloat16 and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("keep_bytes", [0, 1 << 30])  # the backward recomputes the logits / reads the kept ones
@pytest.mark.parametrize("vocab_chunk", [7, 8192])  # several tiles with a ragged last one, and a single tile
def test_chunked_logps_and_entropy_match_log_softmax(monkeypatch, vocab_chunk, keep_bytes):
    monkeypatch.setattr(fastpath, "LOGP_VOCAB_CHUNK", vocab_chunk)
    monkeypatch.setattr(fastpath, "LOGP_TOKEN_CHUNK", 4)  # and several token tiles, of 3 and 4 rows
    monkeypatch.setattr(fastpath, "LOGP_KEEP_BYTES", keep_bytes)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(10, 6, dtype=torch.float64, generator=g, requires_grad=True)
    weight = 3 * torch.randn(30, 6, dtype=torch.float64, generator=g)
    targets = torch.randint(0, 30, (10,), generator=g)
    logps, entropy = fastpath.chunked_logps(hidden, weight, targets, with_entropy=True)
    full = torch.log_softmax(hidden @ weight.t(), -1)
    assert torch.allclose(logps, full.gather(1, targets[:, None])[:, 0], atol=1e-12)
    assert torch.allclose(entropy, -(full.exp() * full).sum(-1), atol=1e-12)
    assert not entropy.requires_grad
    assert fastpath.chunked_logps(hidden, weight, targets)[1].numel() == 0  # not asked: not computed
    assert torch.autograd.gradcheck(lambda h: fastpath.chunked_logps(h, weight, targets)[0], (hidden,))


@pytest.mark.parametrize("keep_bytes", [0, 1 << 30])
@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
def test_chunked_logps_under_bfloat16_autocast_round_logits_once_and_sum_in_float32(monkeypatch, keep_bytes,
                                                                                      hidden_dtype):
    """The head in bfloat16 as a bfloat16 GEMM computes it (products summed in float32, each logit rounded
    once); the logsumexp in float32 over those logits; the gradient in the hidden's dtype."""
    monkeypatch.setattr(fastpath, "LOGP_VOCAB_CHUNK", 7)
    monkeypatch.setattr(fastpath, "LOGP_TOKEN_CHUNK", 4)
    monkeypatch.setattr(fastpath, "LOGP_KEEP_BYTES", keep_bytes)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(10, 6, generator=g).to(hidden_dtype).requires_grad_()
    weight = 3 * torch.randn(30, 6, generator=g)
    targets = torch.randint(0, 30, (10,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logps, entropy = fastpath.chunked_logps(hidden, weight, targets, with_entropy=True)
    assert logps.dtype == entropy.dtype == torch.float32
    h, w = hidden.detach().bfloat16().float().requires_grad_(), weight.bfloat16().float()
    full = torch.log_softmax((h @ w.t()).bfloat16().float(), -1)
    expected = full.gather(1, targets[:, None])[:, 0]
    assert torch.allclose(logps, expected, atol=1e-5)
    assert torch.allclose(entropy, -(full.exp() * full).sum(-1), atol=1e-5)
    (grad,) = torch.autograd.grad(logps.sum(), hidden)
    (expected_grad,) = torch.autograd.grad(expected.sum(), h)
    assert grad.dtype == hidden_dtype
    assert torch.allclose(grad.float(), expected_grad, rtol=2e-2, atol=2e-2)  # softmax tiles rounded to bfloat16


def test_silu_mul_matches_and_its_gradients():
    g = torch.Generator().manual_seed(5)
    gate, up = (torch.randn(4, 6, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    assert torch.allclose(fastpath.fn().SiluMul.apply(gate, up), torch.nn.functional.silu(gate) * up, atol=1e-12)
    assert torch.autograd.gradcheck(fastpath.fn().SiluMul.apply, (gate, up))
    gate16, up16 = (t.detach().bfloat16().requires_grad_() for t in (gate, up))  # the module's ops, in bfloat16
    got, expected = fastpath.fn().SiluMul.apply(gate16, up16), torch.nn.functional.silu(gate16) * up16
    assert torch.equal(got, expected)
    g = torch.randn(4, 6, generator=g).bfloat16()
    for a, b in zip(torch.autograd.grad(got, (gate16, up16), g), torch.autograd.grad(expected, (gate16, up16), g)):
        assert torch.equal(a, b)


def test_recognisers_on_real_modules():
    from peft import LoraConfig, get_peft_model
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert fastpath.is_rms_norm(LlamaRMSNorm(8))
    assert not fastpath.is_rms_norm(torch.nn.LayerNorm(8))
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    assert fastpath.is_gated_silu_mlp(LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2)))
    assert not fastpath.is_gated_silu_mlp(LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, hidden_act="gelu")))

    def lora_layer(**kw):
        net = torch.nn.Sequential(torch.nn.Linear(4, 4))
        return get_peft_model(net, LoraConfig(r=2, target_modules=["0"], **kw)).base_model.model[0]

    assert fastpath.lora_fusable(lora_layer()) == "default"
    assert fastpath.lora_fusable(lora_layer(lora_dropout=0.1)) is None  # dropout: peft's own forward
    assert fastpath.lora_fusable(lora_layer(use_dora=True)) is None
    layer = lora_layer()
    layer.enable_adapters(False)
    assert fastpath.lora_fusable(layer) is None  # the reference pass: the base layer alone


def tiny_llama_with_lora():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; move it so the LoRA product is part of what is compared
            torch.nn.init.normal_(p, std=0.1)
    return model.train()


def test_enable_gives_the_same_outputs_and_gradients_on_a_tiny_llama_and_disable_undoes_it():
    model = tiny_llama_with_lora()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))

    def run():
        model.zero_grad()
        logits = model(input_ids=ids).logits
        (logits.log_softmax(-1)[..., 0].sum()).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager_logits, eager_grads = run()
    counts = fastpath.enable(model)
    assert counts == {"lora_linear": 14, "rms_norm": 5, "mlp": 2, "own_forward": {}}  # 7 per layer; 2 per layer + the final norm
    fused_logits, fused_grads = run()
    assert torch.allclose(fused_logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert fused_grads.keys() == eager_grads.keys() and len(fused_grads) == 28
    for name, grad in eager_grads.items():
        assert torch.allclose(fused_grads[name], grad, rtol=1e-4, atol=1e-6), name
    with model.disable_adapter():  # the reference: LoRA off, the fused norms still on
        ref = model(input_ids=ids).logits
    assert not torch.allclose(ref, fused_logits, atol=1e-3)
    fastpath.disable(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_lora_on_a_16_bit_base_takes_the_kernel_under_autocast():
    """A base dequantised to bfloat16 (the CPU 4-bit path) with float32 LoRA weights cannot run a float32
    input at all; under the trainer's bfloat16 autocast the kernel is probed, and taken, there."""
    model = tiny_llama_with_lora()
    for name, module in model.named_modules():
        if name.endswith("base_layer"):
            module.to(torch.bfloat16)
    assert fastpath.enable(model, autocast_dtype=torch.bfloat16)["lora_linear"] == 14
    fastpath.disable(model)
    assert fastpath.enable(model)["lora_linear"] == 0  # without autocast its own forward raises: nothing to match


def tiny_4bit_llama_with_lora(tmp_path, compute_dtype, device="cpu"):
    """A tiny Llama loaded in NF4 through bitsandbytes (its 4-bit CPU kernels: the layers a GPU run keeps
    4-bit), LoRA on every linear, B moved off zero, the LoRA weights float32 as the kit trains them."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=compute_dtype, device_map={"": device},
                                                 quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model.train()


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_lora_over_a_4_bit_base_takes_the_kernel_and_gives_peft_values(tmp_path, autocast):
    """peft wraps a bitsandbytes 4-bit base in its own LoRA class (not the dense one): on a GPU, where the base
    stays 4-bit, every LoRA layer is one. The fused forward is taken there and gives peft's values."""
    model = tiny_4bit_llama_with_lora(tmp_path, torch.bfloat16)
    layers = [m for m in model.modules() if type(m).__module__ == "peft.tuners.lora.bnb"]
    assert len(layers) == 14
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))

    def run():
        model.zero_grad()
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            logits = model(input_ids=ids).logits.float()
        logits.log_softmax(-1)[..., 0].sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager_logits, eager_grads = run()
    counts = fastpath.enable(model, autocast_dtype=autocast)
    assert counts["lora_linear"] == 14 and counts["own_forward"] == {}
    fused_logits, fused_grads = run()
    tol = 1e-4 if autocast is None else 3e-2
    assert (fused_logits - eager_logits).abs().max() <= tol * eager_logits.abs().max()
    assert fused_grads.keys() == eager_grads.keys() and len(fused_grads) == 28
    for name, grad in eager_grads.items():
        assert (fused_grads[name] - grad).abs().max() <= 4 * tol * grad.abs().max() + 1e-6, name


def trl_batch(prompts, completions):
    """A DPO batch laid out as TRL's collator does: [prompt + chosen] rows, then [prompt + rejected] rows,
    right-padded with 0; completions[i] and completions[B + i] are pair i's two completions."""
    b = len(prompts)
    width = max(len(prompts[i % b]) + len(c) for i, c in enumerate(completions))
    ids = torch.zeros(2 * b, width, dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, comp in enumerate(completions):
        p = prompts[row % b]
        ids[row, :len(p) + len(comp)] = torch.tensor(p + comp)
        attention[row, :len(p) + len(comp)] = 1
        completion[row, len(p):len(p) + len(comp)] = 1
    return ids, attention, completion


def test_shared_prompt_layout_reads_prompt_and_completion_lengths():
    ids, att, comp = trl_batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 9, 9], [1], [2, 2, 2]])
    assert fastpath.shared_prompt_layout(ids, att, comp) == ([3, 1], [2, 4, 1, 3])


def test_shared_prompt_layout_refuses_what_it_cannot_share():
    ids, att, comp = trl_batch([[5, 6, 7], [8]], [[1, 2], [3, 4], [1], [2]])
    other = ids.clone()
    other[2, 1] = 99  # pair 0's rejected row has another prompt
    assert fastpath.shared_prompt_layout(other, att, comp) is None
    left = torch.roll(ids, 1, dims=1), torch.roll(att, 1, dims=1), torch.roll(comp, 1, dims=1)  # left padding
    assert fastpath.shared_prompt_layout(*left) is None
    no_prompt = comp.clone()
    no_prompt[:, 0] = att[:, 0]  # completions that start at the first token: nothing to share
    assert fastpath.shared_prompt_layout(ids, att, no_prompt) is None
    assert fastpath.shared_prompt_layout(ids[:3], att[:3], comp[:3]) is None  # not chosen/rejected halves


def test_attention_work_by_hand():
    # One pair, prompt 2, completions 2 and 2, rows of 4 tokens without padding: TRL computes 2 rows x 4 tokens
    # and half of 2 x 4 x 4 scores; shared: 2 prompt tokens (half of 2 x 2 scores), 4 completion tokens x 4 keys.
    assert fastpath.attention_work([2], [2, 2], 4, lin=1.0, att=1.0) == (8 + 16, 2 + 2 + 4 + 16)
    # Kernels that skip the lower-right causal mask's blocks (CUDA): each completion token's 2 prompt keys,
    # and half of the completion's 2 x 2 square.
    assert fastpath.attention_work([2], [2, 2], 4, lin=1.0, att=1.0, lower_right_skips=True) == (24, 2 + 2 + 4 + 12)
    # Prompts of different lengths leave holes in the shorter rows' keys: a mask, the rectangle again (4 rows
    # x 3 x 6). The prompt pass stays causal (right padding): half of 2 x 3 x 3. TRL's rows hold no padding
    # here: half of 4 x 4 x 4.
    trl, shared = fastpath.attention_work([3, 1], [1, 3, 1, 3], 4, lin=0.0, att=1.0, lower_right_skips=True)
    assert (trl, shared) == (32, 9 + 4 * 3 * (3 + 3))
    # Long prompts make sharing pay; long completions against a short prompt do not (the rectangle).
    trl, shared = fastpath.attention_work([900], [100, 100], 1000, lin=1.0, att=0.01)
    assert shared < 0.6 * trl
    trl, shared = fastpath.attention_work([10], [990, 990], 1000, lin=1.0, att=0.01)
    assert shared > trl


def test_shared_prompt_forward_gives_trls_log_probs_and_gradients():
    """A tiny real Llama with LoRA: each prompt once with its keys and values cached (with gradients)
    for both completions, against TRL's layout, on pairs of different prompt and completion lengths."""
    model = tiny_llama_with_lora()
    fastpath.enable(model)
    g = torch.Generator().manual_seed(4)

    def toks(n):
        return torch.randint(1, 64, (n,), generator=g).tolist()

    prompts = [toks(5), toks(9), toks(3)]
    ids, att, comp = trl_batch(prompts, [toks(n) for n in (4, 7, 6, 2, 5, 8)])
    layout = fastpath.shared_prompt_layout(ids, att, comp)
    inner = model.base_model.model
    head = inner.lm_head.weight
    params = [p for p in model.parameters() if p.requires_grad]
    mask = comp[:, 1:].bool()
    hidden = inner.model(input_ids=ids, attention_mask=att).last_hidden_state[:, :-1][mask]
    expected = fastpath.chunked_logps(hidden, head, ids[:, 1:][mask])[0]
    expected_grads = torch.autograd.grad(expected.sum(), params)
    predictors, labels, _ = fastpath._shared_prompt_forward(inner.model, ids, *layout)
    assert torch.equal(labels, ids[:, 1:][mask])
    got = fastpath.chunked_logps(predictors, head, labels)[0]
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got.sum(), params), expected_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Checked swaps: every norm and MLP class of the pinned transformers keeps its outputs.
# ---------------------------------------------------------------------------------------------

SMALL = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
             vocab_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, hidden_act="silu")


def small_configs(module):
    """Each config class a modeling module imports, built with its defaults and shrunk (text config too)."""
    from transformers import PretrainedConfig

    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, PretrainedConfig) and value is not PretrainedConfig:
            try:
                config = value()
            except Exception:
                continue
            for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
                for key, v in SMALL.items():
                    try:
                        if hasattr(c, key):
                            setattr(c, key, v)
                    except Exception:  # per-layer attributes of heterogeneous configs refuse the global one
                        pass
                yield c


def build_small(cls, module):
    """An instance of cls at a small width, or None where its constructor wants what this cannot guess."""
    import inspect

    params = [p for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    guesses = {"intermediate_size": 32, "layer_idx": 0, "hidden_size": 16, "dim": 16, "eps": 1e-6}
    extra = {p.name: guesses[p.name] for p in params[1:] if p.default is p.empty and p.name in guesses}
    if params and params[0].name == "config":
        for config in small_configs(module):
            try:
                return cls(config, **extra)
            except Exception:
                continue
        return None
    try:
        return cls(16, **extra)
    except Exception:
        return None


def transformers_classes(suffixes=("RMSNorm", "MLP")):
    """(name, class, modeling module) for every class of the pinned transformers whose name ends in a suffix."""
    import importlib
    import pathlib
    import re

    import transformers

    pattern = re.compile(r"^class (\w+(?:%s))\(" % "|".join(suffixes), re.M)
    for path in sorted((pathlib.Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        names = pattern.findall(path.read_text(encoding="utf-8"))
        if names:
            module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
            for name in names:
                yield name, getattr(module, name), module


def outputs_and_grads(module, x):
    module.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_()
    torch.manual_seed(0)
    y = module(xi)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), [xi.grad] + [p.grad for p in module.parameters() if p.requires_grad]


def test_enabling_the_fast_path_changes_no_norm_or_mlp_output_in_the_pinned_transformers():
    """Each *RMSNorm and *MLP class that builds small, its weights random and trainable: the same values and
    gradients with enable() as without, whatever enable() decided. The (1 + w) norms (Gemma, Qwen3.5,
    Qwen3-Next, Step3p7, Qwen4Exp), which a name-based choice once took for Llama's, get the kernel in its
    (1 + w) form; classes it cannot reproduce keep their own forward and are listed by name."""
    from transformers.utils import logging

    logging.set_verbosity_error()  # default configs of hundreds of models warn about their token ids
    import inspect

    checked, swapped, own, twins = set(), {}, {}, {}
    for name, cls, module in transformers_classes():
        # Classes with the same source and bases compute the same (most are generated copies): check one.
        key = (inspect.getsource(cls).replace(name, "X"), tuple(f"{b.__module__}.{b.__qualname__}" for b in cls.__bases__))
        if key in twins:
            for seen in (swapped, own):
                if twins[key] in seen:
                    seen[name] = seen[twins[key]]
            continue
        twins[key] = name
        built = build_small(cls, module)
        if built is None:
            continue
        for sub in list(built.modules()):
            kind = "rms_norm" if fastpath.is_rms_norm(sub) else "mlp" if fastpath.is_gated_silu_mlp(sub) else None
            if kind is None:
                continue
            torch.manual_seed(0)
            with torch.no_grad():
                for p in sub.parameters():
                    p.normal_()
            width = sub.weight.shape[0] if kind == "rms_norm" else sub.gate_proj.in_features
            x = torch.randn(2, 3, width, generator=torch.Generator().manual_seed(2))
            try:
                want, want_grads = outputs_and_grads(sub, x)
            except Exception:  # needs more than one input (a gate, a residual): the probe must refuse it
                counts = fastpath.enable(sub)
                assert counts[kind] == 0 and counts["own_forward"] == {type(sub).__name__: 1}, type(sub).__name__
                continue
            counts = fastpath.enable(sub)
            got, got_grads = outputs_and_grads(sub, x)
            label = type(sub).__name__
            checked.add(label)
            (swapped if counts[kind] else own)[label] = vars(sub).get("_kit_weight_offset")
            fastpath.disable(sub)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max()), label
            for g, w in zip(got_grads, want_grads):
                assert (g is None) == (w is None), label
                assert g is None or torch.allclose(g, w, rtol=1e-4, atol=1e-4 * w.abs().max()), label
    assert len(checked) > 60 and len(swapped) + len(own) > 250  # 288 + 9 classes in transformers 5.20, 70 distinct
    for norm in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm"):
        assert norm in swapped, norm
    for norm in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm", "Qwen3_5RMSNorm", "Qwen3NextRMSNorm",
                 "Step3p7RMSNorm", "Qwen4ExpTextRMSNorm"):
        assert norm in swapped, norm  # in the (1 + w) form, and exact (the loop above)
    assert {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3_5MLP", "Qwen3NextMLP"} <= set(swapped)
    assert swapped["Qwen3_5RMSNorm"] == 1.0 and swapped["LlamaRMSNorm"] == 0.0
    print(f"{len(swapped)} classes take the kernels; {len(own)} keep their own forward: {sorted(own)}")


def test_the_probe_refuses_a_norm_that_only_looks_like_llamas():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class ScaledRMSNorm(LlamaRMSNorm):  # the same attributes, another function
        def forward(self, x):
            return 2 * super().forward(x)

    class GatedRMSNorm(LlamaRMSNorm):  # a second input the kernel would drop
        def forward(self, x, gate=None):
            return super().forward(x) * (1 if gate is None else torch.sigmoid(gate))

    model = torch.nn.Sequential(LlamaRMSNorm(8), ScaledRMSNorm(8), GatedRMSNorm(8))
    weights = [m.weight.detach().clone() for m in model]
    counts = fastpath.enable(model)
    assert counts["rms_norm"] == 1
    assert counts["own_forward"] == {"ScaledRMSNorm": 1, "GatedRMSNorm": 1}
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1]) and "forward" not in vars(model[2])
    assert all(torch.equal(m.weight, w) and m.weight.grad is None for m, w in zip(model, weights))  # restored


# The families users bring, tiny: (config class, module, extra config). Qwen2 has q/k/v biases, Qwen3 q/k norms,
# Qwen3.5 (1 + w) norms and linear-attention layers, Gemma 2/3 (1 + w) norms, GELU MLPs and sliding windows,
# Phi-3 fused qkv and gate_up projections.
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_5": ("Qwen3_5TextConfig", {"layer_types": ["linear_attention", "full_attention"],
                                     "linear_num_value_heads": 2, "linear_num_key_heads": 2,
                                     "linear_key_head_dim": 8, "linear_value_head_dim": 8}),
    "gemma2": ("Gemma2Config", {"sliding_window": 8}),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 8}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
}


def tiny_family_model(family):
    import transformers
    from peft import LoraConfig, get_peft_model

    from dpokit.model import models

    config_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():  # norms start at their neutral value (ones, or zeros for 1 + w): make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    targets = models.lora_target_modules(model.named_modules(), lambda m: isinstance(m, torch.nn.Linear),
                                         ("lm_head",))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model.train()


def dpo_loss_of(policy_logps, ref_logps, b, beta=0.1):
    """The sigmoid DPO loss of B pairs from per-row summed log-probs (chosen rows, then rejected rows)."""
    margin = (policy_logps[:b] - ref_logps[:b]) - (policy_logps[b:] - ref_logps[b:])
    return -torch.nn.functional.logsigmoid(beta * margin).mean()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_dpo_loss_on_tiny_families_matches_the_plain_path(family):
    """Per family: the DPO loss and its LoRA gradients through the fast path (checked kernels, the chunked head,
    each prompt once where the model allows it) equal the plain path's (the libraries' forwards, full logits,
    TRL's layout); the parts that stepped aside are the expected ones."""
    model = tiny_family_model(family)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (6, 9)]
    ids, att, comp = trl_batch(prompts, [torch.randint(1, 64, (n,), generator=g).tolist() for n in (4, 3, 5, 2)])
    mask = comp[:, 1:].bool()
    params = [p for p in model.parameters() if p.requires_grad]

    def summed(logps):
        return logps.new_zeros(mask.shape).masked_scatter(mask, logps).sum(1)

    def loss_and_grads(fast):
        inner = model.base_model.model
        with torch.no_grad(), model.disable_adapter():
            full = inner(input_ids=ids, attention_mask=att).logits[:, :-1].log_softmax(-1)
            ref = full.gather(-1, ids[:, 1:, None])[..., 0][mask]
        if fast:
            text = inner.config.get_text_config()
            layout = fastpath.shared_prompt_layout(ids, att, comp)
            share = set(getattr(text, "layer_types", None) or ["full_attention"]) == {"full_attention"} and \
                not getattr(text, "sliding_window", None) and getattr(text, "final_logit_softcapping", None) is None
            if share:
                predictors, labels, _ = fastpath._shared_prompt_forward(inner.model, ids, *layout)
            else:
                hidden = inner.model(input_ids=ids, attention_mask=att).last_hidden_state
                predictors, labels = hidden[:, :-1][mask], ids[:, 1:][mask]
            if getattr(text, "final_logit_softcapping", None) is not None:  # dpo_logps leaves these to TRL
                logits = inner.lm_head(predictors)
                cap = text.final_logit_softcapping
                logits = torch.tanh(logits / cap) * cap
                policy = logits.log_softmax(-1).gather(-1, labels[:, None])[:, 0]
            else:
                policy = fastpath.chunked_logps(predictors, inner.lm_head.weight, labels)[0]
        else:
            full = inner(input_ids=ids, attention_mask=att).logits[:, :-1].log_softmax(-1)
            policy = full.gather(-1, ids[:, 1:, None])[..., 0][mask]
        loss = dpo_loss_of(summed(policy), summed(ref), len(prompts))
        return loss.detach(), torch.autograd.grad(loss, params)

    plain_loss, plain_grads = loss_and_grads(fast=False)
    counts = fastpath.enable(model)
    fast_loss, fast_grads = loss_and_grads(fast=True)
    fastpath.disable(model)
    assert counts["lora_linear"] > 0 and counts["own_forward"] == {}, counts
    assert counts["rms_norm"] == sum(1 for m in model.modules() if type(m).__name__.endswith("RMSNorm")), counts
    assert abs(fast_loss - plain_loss) <= 1e-5 * abs(plain_loss), (fast_loss, plain_loss)
    for a, b in zip(fast_grads, plain_grads):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5 * max(1.0, b.abs().max())), family


@pytest.mark.parametrize("installed", [True, False])
def test_liger_only_on_cuda_with_the_package_and_without_lora_on_the_head(monkeypatch, installed):
    import importlib.util

    find_spec = importlib.util.find_spec  # the package's presence is drawn both ways, whatever this install has
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if installed else None) if name == "liger_kernel" else find_spec(name, *a))
    assert fastpath.liger_applies(True, ["q_proj", "v_proj"]) is installed  # CUDA with the package: Liger's
    assert not fastpath.liger_applies(False, ["q_proj"])  # a CPU: the kit's own kernels
    assert not fastpath.liger_applies(True, ["q_proj", "lm_head"])  # TRL refuses Liger with LoRA on the head


def test_lower_right_attention_sees_the_prompt_cache_and_the_causal_part():
    """_lower_right_sdpa (CausalBias, lower right): query i of q sees keys 0 .. s - q + i; the key and value
    heads repeated for grouped-query attention."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    g = torch.Generator().manual_seed(6)
    module = LlamaAttention(LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2), 0)
    q = torch.randn(2, 4, 3, 4, generator=g)
    k, v = torch.randn(2, 2, 7, 4, generator=g), torch.randn(2, 2, 7, 4, generator=g)
    out, _ = fastpath._lower_right_sdpa(module, q, k, v, None, scaling=0.5)
    k4, v4 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ k4.transpose(-1, -2)) * 0.5
    scores[..., 0, 5:] = scores[..., 1, 6:] = float("-inf")  # 7 keys, 3 queries: the last query sees all
    assert torch.allclose(out, (scores.softmax(-1) @ v4).transpose(1, 2), atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 q, k, v (the 4-bit path's) run in autocast's dtype
        low, _ = fastpath._lower_right_sdpa(module, q, k, v, None, scaling=0.5)
    assert low.dtype == torch.bfloat16 and torch.allclose(low.float(), out, atol=3e-2)


def test_lower_right_attention_that_raises_steps_aside_to_the_same_mask(monkeypatch, capsys):
    """A torch build whose kernels refuse CausalBias: the same mask materialised, said once."""
    import torch.nn.attention.bias as bias
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    g = torch.Generator().manual_seed(6)
    module = LlamaAttention(LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2), 0)
    q, k, v = torch.randn(2, 4, 3, 4, generator=g), torch.randn(2, 2, 7, 4, generator=g), torch.randn(2, 2, 7, 4, generator=g)
    want, _ = fastpath._lower_right_sdpa(module, q, k, v, None, scaling=0.5)

    def refuses(*a, **k):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(bias, "causal_lower_right", refuses)
    monkeypatch.setattr(fastpath, "_LOWER_RIGHT_FAILED", False)
    for _ in range(2):
        got, _ = fastpath._lower_right_sdpa(module, q, k, v, None, scaling=0.5)
        assert torch.allclose(got, want, atol=1e-6)
    assert capsys.readouterr().out.count("lower-right causal attention raised") == 1


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_the_lean_head_probe_passes_here_and_catches_a_wrong_or_failing_kernel(monkeypatch, autocast):
    assert fastpath.head_agrees("cpu", autocast) is None
    real = fastpath.fn()

    class Off:  # log-probs off by a constant: what a mis-tiled kernel would give
        @staticmethod
        def apply(*a):
            logp, entropy = real.ChunkedLogps.apply(*a)
            return logp - 0.5, entropy

    class Raises:
        @staticmethod
        def apply(*a):
            raise RuntimeError("triton: out of resources")

    for broken, says in ((Off, "disagreed"), (Raises, "RuntimeError: triton: out of resources")):
        monkeypatch.setattr(fastpath, "fn", lambda b=broken: types.SimpleNamespace(ChunkedLogps=b))
        assert says in fastpath.head_agrees("cpu", autocast)
    assert fastpath.LOGP_TOKEN_CHUNK == 1024 and fastpath.LOGP_TILES_CUDA == (4096, 16384)  # the probe's tiles undone


def test_liger_that_fails_on_the_model_is_undone_everywhere_it_patched(monkeypatch):
    """Liger patches instance forwards and the modeling module's RoPE; a failure anywhere (here: a RoPE that
    raises on the whole-model probe, as a Triton kernel that cannot compile would) undoes all of it."""
    import transformers.integrations.liger as liger_integration
    from transformers.models.llama import modeling_llama

    model = tiny_llama_with_lora().eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    want = model(input_ids=ids).logits
    rope = modeling_llama.apply_rotary_pos_emb

    def fake_apply(model, config):  # what Liger does, with a kernel that cannot run here
        def broken_rope(*a, **k):
            raise RuntimeError("triton.compiler.errors.CompilationError")
        modeling_llama.apply_rotary_pos_emb = broken_rope
        for m in model.modules():
            if fastpath.is_rms_norm(m):
                m.forward = types.MethodType(lambda self, x: type(self).forward(self, x), m)

    monkeypatch.setattr(liger_integration, "apply_liger_kernel", fake_apply)
    out = fastpath.apply_liger(model)
    assert "CompilationError" in out["failed"] and out["checked"] == 0
    assert modeling_llama.apply_rotary_pos_emb is rope
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(model(input_ids=ids).logits, want)


@pytest.mark.parametrize("prompt_lengths", [(6, 6, 6), (5, 9, 3)])  # the lower-right kernel; holes and a mask
def test_shared_prompts_and_lean_head_under_bfloat16_autocast_give_the_eager_values_and_gradients(prompt_lengths):
    """Under CPU bfloat16 autocast, the fast path (fused forwards, each prompt once, the lean head) against
    the eager model's own logits: within bfloat16 rounding, and no further from float32 than eager is."""
    model = tiny_llama_with_lora()
    inner = model.base_model.model
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(4)

    def toks(n):
        return torch.randint(1, 64, (n,), generator=g).tolist()

    ids, att, comp = trl_batch([toks(n) for n in prompt_lengths], [toks(n) for n in (4, 7, 6, 2, 5, 8)])
    mask = comp[:, 1:].bool()
    labels = ids[:, 1:][mask]

    def eager(autocast):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, attention_mask=att).logits[:, :-1][mask]
            logps = torch.log_softmax(logits.float(), -1).gather(1, labels[:, None])[:, 0]
        return logps.detach(), torch.autograd.grad(logps.sum(), params)

    def fast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            predictors, got_labels, _ = fastpath._shared_prompt_forward(
                inner.model, ids, *fastpath.shared_prompt_layout(ids, att, comp))
            logps = fastpath.chunked_logps(predictors, inner.lm_head.weight, got_labels)[0]
        assert torch.equal(got_labels, labels)
        return logps.detach(), torch.autograd.grad(logps.sum(), params)

    exact, exact_grads = eager(autocast=False)
    bf16, bf16_grads = eager(autocast=True)
    assert fastpath.enable(model, autocast_dtype=torch.bfloat16) == {"lora_linear": 14, "rms_norm": 5, "mlp": 2, "own_forward": {}}
    got, got_grads = fast()
    assert got.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got_grads)  # LoRA weights' dtype
    assert torch.allclose(got, bf16, atol=1e-2)
    assert (got - exact).abs().max() <= 2 * (bf16 - exact).abs().max() + 1e-3

    def rel(a, b):
        return max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b))

    assert rel(got_grads, bf16_grads) < 5e-2
    assert rel(got_grads, exact_grads) <= 2 * rel(bf16_grads, exact_grads) + 1e-3


def test_liger_module_patches_go_back_for_classes_and_take_the_fast_path_only_for_cuda_tensors():
    """scope_module_patches on a stand-in for a modeling module's namespace after Liger's swaps: a class goes
    back, a function runs Liger's version only where its first tensor argument is on the patched model's device
    type, and what Liger did not touch stays."""
    class OwnNorm:
        pass

    class LigerNorm:
        pass

    def own_rope(q, k, cos=None):
        return "own"

    def liger_rope(q, k, cos=None):
        return "liger"

    def untouched():
        return "x"

    saved = {"LlamaRMSNorm": OwnNorm, "apply_rotary_pos_emb": own_rope, "other": untouched, "EPS": 1e-6}
    namespace = {**saved, "LlamaRMSNorm": LigerNorm, "apply_rotary_pos_emb": liger_rope, "EPS": 1e-5}
    changed = fastpath.scope_module_patches(namespace, saved, "cuda")
    assert sorted(changed) == ["EPS", "LlamaRMSNorm", "apply_rotary_pos_emb"]
    assert namespace["LlamaRMSNorm"] is OwnNorm and namespace["other"] is untouched and namespace["EPS"] == 1e-6
    rope = namespace["apply_rotary_pos_emb"]
    cpu = torch.zeros(2)

    class OnCuda:  # what the wrapper reads of a CUDA tensor, which this machine cannot make
        device = torch.device("cuda")

    assert rope(cpu, cpu) == "own" and rope(OnCuda(), cpu) == "liger" and rope(q=OnCuda(), k=cpu) == "liger"
    assert rope.__wrapped__ is own_rope and rope.liger is liger_rope
    assert fastpath.scope_module_patches(namespace, dict(namespace), "cuda") == []  # nothing swapped: no change
    namespace["apply_rotary_pos_emb"] = liger_rope
    fastpath.scope_module_patches(namespace, saved, "cpu")  # a model patched on the CPU (the interpreter's Triton)
    rope = namespace["apply_rotary_pos_emb"]
    assert rope(cpu, cpu) == "liger" and rope(OnCuda(), cpu) == "own"


@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_lora_weights_are_cast_once_per_optimiser_step_and_never_read_stale(optimizer):
    """Under bfloat16 autocast the fused LoRA layer reads its float32 weights in bfloat16 through one cast per
    optimiser step (fastpath.cast_weight), not one per call. After each step (a fused AdamW updates the weights
    without bumping their version) the layer's output and gradients are peft's own on the updated weights, and
    a weight changed in place between steps (a checkpoint loaded) is read anew."""
    torch.manual_seed(0)
    model = tiny_llama_with_lora()
    assert fastpath.enable(model, autocast_dtype=torch.bfloat16)["lora_linear"] == 14
    layer = next(m for m in model.modules() if isinstance(m, fastpath.lora_linear_classes()))
    weights = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(weights, lr=0.1, **{optimizer: True})
    x = torch.randn(2, 5, layer.in_features)

    def outputs(own: bool):
        for p in weights:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = type(layer).forward(layer, x) if own else layer(x)
        y.float().square().sum().backward()
        return y.detach(), [p.grad.clone() for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight)]

    a_weight, before = layer.lora_A["default"].weight, None
    for step in range(3):
        y, grads = outputs(own=False)
        cast = fastpath.cast_weight(a_weight, torch.bfloat16)
        assert cast is not before  # a new step: a new cast
        y2, _ = outputs(own=False)  # a second call in the same step reads the same copy
        assert fastpath.cast_weight(a_weight, torch.bfloat16) is cast and torch.equal(y, y2)
        before = cast
        fastpath._WEIGHT_CASTS.clear()
        fresh, fresh_grads = outputs(own=False)  # cast anew from the weights as they are now: bit for bit the same
        assert torch.equal(y, fresh) and all(torch.equal(g, f) for g, f in zip(grads, fresh_grads)), step
        y_own, grads_own = outputs(own=True)  # peft's own forward, to bfloat16 rounding
        assert torch.allclose(y.float(), y_own.float(), rtol=0, atol=2e-2), step
        for g, g_own in zip(grads, grads_own):
            assert g.dtype == torch.float32 and ((g - g_own).norm() / g_own.norm()) < 2e-2, step
        outputs(own=False)
        opt.step()  # moves A and B by about lr: a stale copy would be off by far more than the rounding
    with torch.no_grad():
        layer.lora_B["default"].weight.mul_(2.0)  # in place, outside any optimiser
    y, _ = outputs(own=False)
    fastpath._WEIGHT_CASTS.clear()
    assert torch.equal(y, outputs(own=False)[0])
