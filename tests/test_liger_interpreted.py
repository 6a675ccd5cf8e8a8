"""Liger's Triton kernels on a CPU, under Triton's interpreter (TRITON_INTERPRET=1), patched onto a tiny Llama
the way the kit patches them on CUDA (fastpath.apply_liger). `make test-triton` installs triton and liger-kernel
beside the CPU install (about 700 MB, kept out of it) and runs this file; skipped anywhere else.

What the interpreter can run with the pinned triton 3.7.1 and liger-kernel 0.8.5: RoPE. Not the RMSNorm and
SwiGLU kernels: they call `.to(tl.float32)` on a float scalar argument (eps, the gate multiplier), which the
interpreter passes as a Python float ("'float' object has no attribute 'to'"). Those raise on the kit's probe
and keep the model's own forward, which is the fail-safe path a GPU takes when a kernel cannot run."""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("liger_kernel", reason="make test-triton installs liger-kernel and triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (make test-triton)")

from dpokit.model import fastpath  # noqa: E402
from test_fastpath import tiny_llama_with_lora  # noqa: E402


def test_liger_rope_gives_the_models_rotary_values_and_gradients():
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 6, 16, generator=g), torch.randn(2, 2, 6, 16, generator=g)
    angles = torch.randn(2, 6, 8, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    results = []
    for rope in (apply_rotary_pos_emb, liger_rotary_pos_emb):
        qi, ki = q.clone().requires_grad_(), k.clone().requires_grad_()
        a, b = rope(qi, ki, cos, sin)
        ((a * torch.arange(16)).sum() + b.square().sum()).backward()
        results.append((a.detach(), b.detach(), qi.grad, ki.grad))
    for want, got in zip(*results):
        assert torch.allclose(got, want, atol=1e-5)


def test_apply_liger_on_a_tiny_llama_keeps_what_agrees_and_gives_the_models_logits():
    """Every patched norm and MLP is either checked or handed back by its probe, and the model computes what
    it did before (RoPE, which stays patched, included)."""
    from transformers.models.llama import modeling_llama

    model = tiny_llama_with_lora().eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    want = model(input_ids=ids).logits
    out = fastpath.apply_liger(model)
    assert out["failed"] is None
    assert out["checked"] + sum(out["reverted"].values()) == 5 + 2  # 2 norms a layer and the final one; 2 MLPs
    # RoPE is Liger's for tensors on this model's device type (cpu here), the model's own for any other
    assert modeling_llama.apply_rotary_pos_emb.liger.__module__.startswith("liger_kernel")
    assert modeling_llama.LlamaRMSNorm.__module__ == modeling_llama.__name__  # the classes went back
    assert torch.allclose(model(input_ids=ids).logits, want, atol=1e-5)
    patched = [m for m in model.modules() if "forward" in vars(m)]
    assert len(patched) == out["checked"]  # what its probe handed back runs the class's forward
