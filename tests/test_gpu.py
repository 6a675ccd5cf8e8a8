"""CUDA-only parts of the fast path (marked gpu: skipped without CUDA, as on CI): Liger's Triton kernels on
the model's own layers, each checked on a probe, and the kit's kernels beside them, on a tiny real Llama
with LoRA under bfloat16 autocast, against the libraries' own forwards."""

import pytest

torch = pytest.importorskip("torch")

import fastpath  # noqa: E402
from test_fastpath import tiny_4bit_llama_with_lora, tiny_llama_with_lora  # noqa: E402

pytestmark = pytest.mark.gpu


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits.float()
    loss = logits.log_softmax(-1)[..., 0].mean()
    loss.backward()
    return loss.detach(), [p.grad.float() for p in model.parameters() if p.requires_grad]


def test_liger_kernels_replace_norms_and_mlps_after_a_probe_and_keep_the_loss():
    pytest.importorskip("liger_kernel", reason="needs liger-kernel (the CUDA lock has it)")
    model = tiny_llama_with_lora().cuda()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3)).cuda()
    plain_loss, plain_grads = loss_and_grads(model, ids)
    assert fastpath.liger_applies(True, ["q_proj"]) and not fastpath.liger_applies(True, ["lm_head"])
    liger = fastpath.apply_liger(model, torch.bfloat16)
    assert liger == {"checked": 5 + 2, "reverted": {}, "failed": None}  # 2 norms per layer and the final one; 2 MLPs
    counts = fastpath.enable(model, autocast_dtype=torch.bfloat16)
    assert counts["rms_norm"] == counts["mlp"] == 0 and counts["lora_linear"] == 14  # Liger has the norms and MLPs
    loss, grads = loss_and_grads(model, ids)
    assert abs(loss - plain_loss) <= 2e-2 * abs(plain_loss)
    for a, b in zip(grads, plain_grads):
        assert (a - b).abs().max() <= 5e-2 * b.abs().max() + 1e-6


def test_on_a_4_bit_bfloat16_base_as_trained_on_a_gpu_every_kernel_applies_and_keeps_the_loss(tmp_path):
    """The GPU default: NF4 base computing in bfloat16, float32 LoRA weights, bfloat16 autocast. peft's 4-bit
    LoRA layers take the kit's fused forward, Liger (where installed) the norms and MLPs, else the kit."""
    import importlib.util

    model = tiny_4bit_llama_with_lora(tmp_path, torch.bfloat16, device="cuda")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3)).cuda()
    plain_loss, plain_grads = loss_and_grads(model, ids)
    liger = fastpath.apply_liger(model, torch.bfloat16) if importlib.util.find_spec("liger_kernel") else None
    counts = fastpath.enable(model, autocast_dtype=torch.bfloat16)
    assert counts["lora_linear"] == 14 and counts["own_forward"] == {}
    if liger is not None:
        assert liger == {"checked": 5 + 2, "reverted": {}, "failed": None} and counts["rms_norm"] == counts["mlp"] == 0
    else:
        assert counts["rms_norm"] == 5 and counts["mlp"] == 2
    loss, grads = loss_and_grads(model, ids)
    assert abs(loss - plain_loss) <= 2e-2 * abs(plain_loss)
    for a, b in zip(grads, plain_grads):
        assert (a - b).abs().max() <= 5e-2 * b.abs().max() + 1e-6
