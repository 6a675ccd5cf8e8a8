"""What one training step keeps for its backward: the bytes of saved activations per token and layer of a real
model shape (shapes.py), for the libraries' own modules and with the kit's fused ops, on the GPU default's
4-bit path (NF4 base computing in bfloat16, float32 LoRA weights, bfloat16 autocast, peft's float32 norms).
One decoder layer of the shape is built with random weights and run forward on --tokens tokens on the CPU,
every tensor autograd saves counted once by its storage; the figure is scaled to every layer and to
--step_tokens tokens a step (the policy's pass; the reference's runs without a graph).

    .venv/bin/python bench/activations.py [--shape llama-3-8b] [--tokens 256] [--step_tokens 8192]

Prints a table (MiB per layer at --tokens, GiB a step) and the largest saved tensors with the fused ops."""

import argparse
import dataclasses
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclasses.dataclass
class Settings:
    shape: str = "llama-3-8b"
    tokens: int = 256  # tokens run through the layer (saved bytes grow linearly with them)
    step_tokens: int = 8192  # tokens a training step: 4 pairs x 2 completions x 1,024 tokens
    lora_r: int = 16


def saved_bytes(model, ids) -> tuple[int, Counter]:
    """Bytes autograd saves for the backward in one forward of model over ids (each storage once), and the
    bytes by (dtype, shape) of the first tensor seen on each storage."""
    import torch

    storages: dict[int, int] = {}
    by_kind: Counter = Counter()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in storages:
            storages[ptr] = t.untyped_storage().nbytes()
            by_kind[(str(t.dtype).removeprefix("torch."), tuple(t.shape))] += storages[ptr]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids)
    return sum(storages.values()), by_kind


def build(shape: str, r: int, fused: bool):
    """One decoder layer of the shape, in 4-bit as the kit trains it on a GPU, LoRA on every linear."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    from dpokit.model import fastpath
    from dpokit.model import models
    from dpokit.model import shapes

    config = {**shapes.SHAPES[shape].config, "num_hidden_layers": 1, "vocab_size": 1024}
    path = tempfile.mkdtemp(prefix="dpo-kit-activations-")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16))
    models.prepare_4bit_training(model, False)
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    models.float32_trainable(model)
    if fused:
        fastpath.enable(model, autocast_dtype=torch.bfloat16)
    return model.base_model.model.model, shapes.SHAPES[shape].config["num_hidden_layers"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Settings()
    for f in dataclasses.fields(Settings):
        parser.add_argument(f"--{f.name}", type=type(getattr(defaults, f.name)), default=getattr(defaults, f.name))
    s = Settings(**vars(parser.parse_args(argv)))
    import os

    os.environ.setdefault("TQDM_DISABLE", "1")  # no loading bars between the table's rows
    import torch

    from dpokit.model import shapes

    if s.shape not in shapes.SHAPES:
        print(f"--shape: one of {', '.join(shapes.SHAPES)}", file=sys.stderr)
        return 2
    ids = torch.randint(0, 1024, (1, s.tokens), generator=torch.Generator().manual_seed(0))
    print(f"| {s.shape}, NF4 + LoRA r={s.lora_r}, bfloat16 autocast | saved MiB, 1 layer x {s.tokens} tokens "
          f"| GiB a step ({s.step_tokens:,} tokens, every layer) |\n| --- | --- | --- |")
    kinds = None
    for fused in (False, True):
        backbone, layers = build(s.shape, s.lora_r, fused)
        total, kinds = saved_bytes(backbone, ids)
        print(f"| {'kit fused ops' if fused else 'libraries own modules'} | {total / 2 ** 20:,.1f} "
              f"| {total / s.tokens * s.step_tokens * layers / 2 ** 30:,.1f} |")
    print("\nLargest saved tensors with the fused ops (dtype, shape: MiB):")
    for (dtype, shape), n in kinds.most_common(8):
        print(f"  {dtype} {list(shape)}: {n / 2 ** 20:,.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
