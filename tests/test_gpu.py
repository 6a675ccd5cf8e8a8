"""CUDA-only parts of the fast path (marked gpu: skipped without CUDA, as on CI): Liger's Triton kernels on
the model's own layers, each checked on a probe, and the kit's kernels beside them, on a tiny real Llama
with LoRA under bfloat16 autocast, against the libraries' own forwards."""

import pytest

torch = pytest.importorskip("torch")

from dpokit.model import fastpath  # noqa: E402
from test_fastpath import tiny_4bit_llama_with_lora, tiny_llama_with_lora  # noqa: E402

pytestmark = pytest.mark.gpu


def loss_and_grads(model, ids, autocast=True):
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits.float()
    loss = logits.log_softmax(-1)[..., 0].mean()
    loss.backward()
    return loss.detach(), [p.grad.float() for p in model.parameters() if p.requires_grad]


def assert_as_accurate_as_the_library(model, ids, run_kernels):
    """The kernels under bfloat16 autocast against the library's own forward under it, both measured from the
    model without autocast: the loss within 2%, and the gradients no further from that reference than 1.5x the
    library's own bfloat16 error (plus 1% of their size). Element-wise closeness to the library's bfloat16
    gradients is no test: on an H200 two bfloat16 paths differed by 12% of a tensor's largest gradient, each
    as far from the reference as the other."""
    ref_loss, ref = loss_and_grads(model, ids, autocast=False)
    plain_loss, plain = loss_and_grads(model, ids)
    run_kernels()
    loss, got = loss_and_grads(model, ids)
    assert abs(loss - plain_loss) <= 2e-2 * abs(plain_loss)
    flat = lambda grads: torch.cat([g.flatten() for g in grads])  # noqa: E731
    ref, plain, got = flat(ref), flat(plain), flat(got)
    plain_error, error = (plain - ref).norm().item(), (got - ref).norm().item()
    assert error <= 1.5 * plain_error + 1e-2 * ref.norm().item(), (error, plain_error, ref.norm().item())
    assert torch.nn.functional.cosine_similarity(got, plain, dim=0) > 0.99


def test_liger_kernels_replace_norms_and_mlps_after_a_probe_and_keep_the_loss():
    pytest.importorskip("liger_kernel", reason="needs liger-kernel (the CUDA lock has it)")
    model = tiny_llama_with_lora().cuda()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3)).cuda()
    assert fastpath.liger_applies(True, ["q_proj"]) and not fastpath.liger_applies(True, ["lm_head"])

    def kernels():
        liger = fastpath.apply_liger(model, torch.bfloat16)
        assert liger == {"checked": 5 + 2, "reverted": {}, "failed": None}  # 2 norms a layer and the final one; 2 MLPs
        counts = fastpath.enable(model, autocast_dtype=torch.bfloat16)
        assert counts["rms_norm"] == counts["mlp"] == 0 and counts["lora_linear"] == 14  # Liger has norms and MLPs
    assert_as_accurate_as_the_library(model, ids, kernels)


def test_liger_on_one_model_leaves_models_built_later_on_the_cpu_their_own_layers():
    """Liger swaps the modeling module's norm and MLP classes and its RoPE function process-wide; on an H200 a
    CPU model built after a CUDA model got Liger then raised in Triton ('cpu tensor?'). The CUDA model keeps
    its kernels; a CPU model built afterwards has the library's classes and gives the same logits as before."""
    pytest.importorskip("liger_kernel", reason="needs liger-kernel (the CUDA lock has it)")
    from transformers.models.llama import modeling_llama

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = tiny_llama_with_lora().eval()(input_ids=ids).logits
    norm_class, rope = modeling_llama.LlamaRMSNorm, modeling_llama.apply_rotary_pos_emb
    model = tiny_llama_with_lora().cuda()
    assert fastpath.apply_liger(model, torch.bfloat16)["checked"] == 5 + 2
    assert modeling_llama.LlamaRMSNorm is norm_class and modeling_llama.apply_rotary_pos_emb.__wrapped__ is rope
    assert "liger" in modeling_llama.apply_rotary_pos_emb.liger.__module__
    later = tiny_llama_with_lora().eval()
    assert type(later.get_base_model().model.norm) is norm_class
    with torch.no_grad():
        assert torch.equal(later(input_ids=ids).logits, before)


def test_on_a_4_bit_bfloat16_base_as_trained_on_a_gpu_every_kernel_applies_and_keeps_the_loss(tmp_path):
    """The GPU default: NF4 base computing in bfloat16, float32 LoRA weights, bfloat16 autocast. peft's 4-bit
    LoRA layers take the kit's fused forward, Liger (where installed) the norms and MLPs, else the kit."""
    import importlib.util

    model = tiny_4bit_llama_with_lora(tmp_path, torch.bfloat16, device="cuda")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3)).cuda()

    def kernels():
        liger = fastpath.apply_liger(model, torch.bfloat16) if importlib.util.find_spec("liger_kernel") else None
        counts = fastpath.enable(model, autocast_dtype=torch.bfloat16)
        assert counts["lora_linear"] == 14 and counts["own_forward"] == {}
        if liger is not None:
            assert liger == {"checked": 5 + 2, "reverted": {}, "failed": None} and counts["rms_norm"] == counts["mlp"] == 0
        else:
            assert counts["rms_norm"] == 5 and counts["mlp"] == 2
    assert_as_accurate_as_the_library(model, ids, kernels)


def test_the_decode_loop_on_cuda_stops_rows_at_their_stop_tokens_and_gives_the_cpus_greedy_answers():
    """GRPO's generation and the report's scoring sample on the model's device: the stop tokens and the rows
    still running live there too (on an H200 the loop raised 'test_elements is on cpu'). Greedy answers on
    CUDA are the CPU's (a float32 model), and every row that stopped ends at a stop token."""
    from dpokit.model import sampler
    from test_sampler import tiny_llama_with_lora as tiny_sampler_llama

    model = tiny_sampler_llama().float()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    cpu = sampler.sample_ids(model, prompts, pad_id=0, max_new_tokens=16, stop_ids={7, 11}, sampling=None)
    gpu = sampler.sample_ids(model.cuda(), prompts, pad_id=0, max_new_tokens=16, stop_ids={7, 11}, sampling=None)
    assert gpu == cpu
    torch.manual_seed(0)
    drawn = sampler.sample_ids(model, prompts * 4, pad_id=0, max_new_tokens=16, stop_ids={7, 11},
                               sampling={"temperature": 1.0, "top_k": 0, "top_p": 1.0})
    assert any(len(row) < 16 for row in drawn)  # some rows left the batch early
    assert all(row[-1] in (7, 11) for row in drawn if len(row) < 16)
