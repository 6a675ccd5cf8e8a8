"""CUDA-only parts of the fast path (marked gpu: skipped without CUDA, as on CI): Liger's Triton kernels on
the model's own layers, each checked on a probe, and the kit's kernels beside them, on a tiny real Llama
with LoRA under bfloat16 autocast, against the libraries' own forwards."""

import pytest

torch = pytest.importorskip("torch")

import fastpath  # noqa: E402
from test_fastpath import tiny_llama_with_lora  # noqa: E402

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
    assert liger == {"checked": 5 + 2, "reverted": {}}  # 2 norms per layer and the final one; 2 MLPs
    counts = fastpath.enable(model, autocast_dtype=torch.bfloat16)
    assert counts["rms_norm"] == counts["mlp"] == 0 and counts["lora_linear"] == 14  # Liger has the norms and MLPs
    loss, grads = loss_and_grads(model, ids)
    assert abs(loss - plain_loss) <= 2e-2 * abs(plain_loss)
    for a, b in zip(grads, plain_grads):
        assert (a - b).abs().max() <= 5e-2 * b.abs().max() + 1e-6
