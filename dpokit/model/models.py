"""Models: finding or converting the base (or building a random one), loading it (4-bit NF4, dequantised on a
CPU), LoRA targets, parameter counts, a finished run's adapter on its base, and text generation.

Not run on its own: train_dpo.py builds the policy here; evaluate.py, self_pairs.py and build_pairs.py
(the model garbler) load and generate through it. `python entrypoint.py model` converts the bundled model.
torch, transformers, peft and bitsandbytes are imported inside the functions that use them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path

from dpokit.core import kit, ranks, runs
from dpokit.model import fastpath, sampler, shapes
from dpokit.core.kit import UserError
from dpokit.model.convert import BUNDLED_MODEL_DIR, export_bundled_model, gguf_model_dir
from dpokit.model.preflight import CUDA_MIN_DRIVER



@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How a base (or reference) model is loaded. train_dpo.TrainConfig takes its defaults from here, and a
    finished run's config.json holds the same names."""
    load_in_4bit: bool = True
    bnb_4bit_quant_type: str = "nf4"
    bnb_4bit_use_double_quant: bool = True
    compute_dtype: str = "auto"

    @classmethod
    def of(cls, config) -> "LoadOptions":
        """From a TrainConfig or a run's config.json (a dict)."""
        get = config.get if isinstance(config, dict) else lambda k, d: getattr(config, k, d)
        return cls(**{f.name: get(f.name, f.default) for f in dataclasses.fields(cls)})


# ---------------------------------------------------------------------------------------------
# Pure helpers: tested without a model.
# ---------------------------------------------------------------------------------------------


def resolve_compute_dtype(name: str, on_gpu: bool, bf16_ok: bool) -> str:
    if name != "auto":
        return name
    return "bfloat16" if on_gpu and bf16_ok else "float16" if on_gpu else "float32"


def lora_target_modules(named_modules, is_linear, head_names) -> list[str]:
    """Leaf names of every linear (or 4-bit linear) layer, except the output head(s).

    named_modules: (qualified name, module) pairs; is_linear: predicate on a module;
    head_names: qualified names to leave out (the LM head, which vLLM will not serve LoRA on).
    Returns the sorted leaf names peft's `target_modules` matches on, e.g. ['down_proj', 'q_proj'].
    """
    heads = set(head_names)
    return sorted({name.rsplit(".", 1)[-1] for name, module in named_modules
                   if name and name not in heads and is_linear(module)})


def logical_numel(param) -> int:
    """Parameters a tensor stands for: a packed 4-bit weight counts by its original shape."""
    quant_state = getattr(param, "quant_state", None)
    if quant_state is not None and getattr(quant_state, "shape", None) is not None:
        n = 1
        for d in quant_state.shape:
            n *= int(d)
        return n
    return param.numel()


def count_parameters(named_parameters) -> dict:
    """{'total', 'trainable', 'frozen', 'quantized_4bit'} parameter counts (logical, not packed)."""
    counts = {"total": 0, "trainable": 0, "frozen": 0, "quantized_4bit": 0}
    seen = set()
    for _, p in named_parameters:
        if id(p) in seen:  # tied weights (embeddings = head) count once
            continue
        seen.add(id(p))
        n = logical_numel(p)
        counts["total"] += n
        counts["trainable" if p.requires_grad else "frozen"] += n
        if getattr(p, "quant_state", None) is not None:
            counts["quantized_4bit"] += n
    return counts


def parameter_table(counts: dict) -> str:
    total = counts["total"] or 1
    rows = [("trainable (LoRA)", counts["trainable"]), ("frozen", counts["frozen"]),
            ("  of which 4-bit", counts["quantized_4bit"]), ("total", counts["total"])]
    return "\n".join(f"  {label:<18}{n:>15,}  {100 * n / total:6.2f}%" for label, n in rows)


def requested_targets(requested: str, leaves: set[str], detected: list[str]) -> list[str]:
    """--lora_target_modules: 'auto' = every linear layer but the head (detected); else the named leaf
    modules, each of which must exist in the model."""
    if requested == "auto":
        return detected
    asked = [t.strip() for t in requested.split(",") if t.strip()]
    if unknown := [t for t in asked if t not in leaves]:
        raise UserError(f"--lora_target_modules: no module named {', '.join(unknown)} in this model; "
                        f"its linear layers are {', '.join(detected)}")
    return asked


# ---------------------------------------------------------------------------------------------
# Finding and loading.
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def cpu_matmul_precision(name: str):
    """--cpu_matmul_precision bf16 on a CPU: torch's global oneDNN setting for float32 matmuls, restored
    on the way out (in-process callers, tests among them, keep exact float32 afterwards)."""
    import torch

    if name == "float32" or torch.cuda.is_available():
        yield
        return
    matmul = torch.backends.mkldnn.matmul
    if not hasattr(matmul, "fp32_precision"):
        raise UserError(f"--cpu_matmul_precision {name} needs torch 2.9 or later (this is {torch.__version__})")
    old, matmul.fp32_precision = matmul.fp32_precision, name
    try:
        yield
    finally:
        matmul.fp32_precision = old


def quiet_libraries(terminal: bool) -> None:
    """Library output that needs no action. bitsandbytes warns at import on CPUs with AVX512-BF16 that it
    could not fetch an optional gemm kernel from the Hugging Face hub ("kernels-community"): the kit does not
    need it (on a CPU it dequantises NF4 once, else bitsandbytes' own kernel runs). In a log (not a
    terminal), the weight-loading and dataset progress bars are a screen of carriage returns: off there."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    if not terminal:
        import datasets
        import transformers

        transformers.utils.logging.disable_progress_bar()
        datasets.disable_progress_bars()


def device() -> tuple[bool, bool]:
    """(on a GPU, bfloat16 supported there)."""
    import torch

    on_gpu = torch.cuda.is_available()
    return on_gpu, on_gpu and torch.cuda.is_bf16_supported()


def cuda_allocator_defaults() -> str | None:
    """PyTorch's CUDA caching allocator with expandable segments, unless the user configured it: DPO batches
    change length from step to step, and fixed-size segments leave the freed blocks of one length unusable
    for the next (reserved memory grows well past what is allocated). Set before the first CUDA allocation
    (the allocator reads it once). Returns the setting now in force, or None when the user's own applies."""
    if os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        return None
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    return os.environ["PYTORCH_ALLOC_CONF"]


def nvidia_driver(path: str = "/proc/driver/nvidia/version") -> str | None:
    """The NVIDIA kernel driver's version where one is loaded on this machine (or passed into this container),
    else None: read from /proc/driver/nvidia/version, which needs no CUDA library."""
    import re

    try:
        text = Path(path).read_text()
    except OSError:
        return None
    m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)", text)
    return m.group(1) if m else "unknown"


def gpu_unused_reason(driver: str | None, torch_cuda: str | None) -> str | None:
    """Why an NVIDIA GPU that is here goes unused (torch.cuda.is_available() was False), or None where no
    driver is loaded. driver: nvidia_driver(); torch_cuda: torch.version.cuda (None for a CPU build)."""
    if driver is None:
        return None
    if torch_cuda is None:
        return (f"an NVIDIA GPU is here (driver {driver}) but this PyTorch is its CPU build: training runs on the "
                "CPU. Install the CUDA build (`make distclean venv` on this machine, or the image: RUNNER=docker)")

    need = CUDA_MIN_DRIVER.get(int(torch_cuda.split(".")[0]))
    have = tuple(int(x) for x in driver.split(".") if x.isdigit()) if driver != "unknown" else ()
    if need and have and have < tuple(int(x) for x in need.split(".")):
        return (f"the NVIDIA driver {driver} is too old for this PyTorch's CUDA {torch_cuda} (it needs "
                f"{need} or newer): training runs on the CPU. Update the driver, or use a "
                f"PyTorch/image built for an older CUDA (BASE_IMAGE=, docs/container.md)")
    return (f"an NVIDIA GPU is here (driver {driver}) but PyTorch (CUDA {torch_cuda}) cannot use it: training "
            "runs on the CPU. `python -c 'import torch; torch.cuda.init()'` says why (CUDA_VISIBLE_DEVICES, "
            "the container's --gpus, a driver/library mismatch)")


def resolve_model_path(name: str) -> str:
    """A local directory, a GGUF file (converted once into the cache: gguf_model_dir), a hub id, the bundled
    default (made on first use), or random:<shape>[:<seed>] (built once into the cache: random_model_dir)."""
    if shapes.is_random(name):
        return str(random_model_dir(name))
    if name.lower().endswith(".gguf"):
        if not Path(name).is_file():
            raise UserError(f"{name}: no such GGUF file")
        return str(gguf_model_dir(name))
    if Path(name).is_dir():
        if not (Path(name) / "config.json").exists():
            raise UserError(f"{name} is a directory without config.json: not a transformers model directory")
        return name
    if Path(name) == Path(BUNDLED_MODEL_DIR):
        return str(export_bundled_model(name))
    if Path(name).exists() or name.startswith((".", "/")) or name.count("/") > 1:
        raise UserError(f"model {name!r} is neither a model directory nor a hub id")
    return name  # a hub id; transformers downloads it (needs network and maybe HF_TOKEN)


# ---------------------------------------------------------------------------------------------
# Random bases (random:<shape>): a real model's shape with random weights, built once, loaded like any base.
# ---------------------------------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SHARD_BYTES = 4 << 30  # safetensors files of at most 4 GiB: one file's tensors are in host memory at a time


def random_uniform_(out, key: int, bound: float, chunk: int = 1 << 22):
    """Fill a tensor with values uniform in (-bound, bound) from a hash of (key, element index), in place.
    Integer hashing and exactly rounded float steps give the same bits on a CPU and a GPU, in any chunking;
    chunks of int32 scratch keep the memory small. Element i: x = mix(i); x ^= key; mix twice more, each mix
    x ^= x >> 16 then x *= an odd constant (mod 2^32); then ((x >> 9) + 0.5) / 2^22 - 1 (exact in float32),
    times bound (one rounding), cast to out's dtype (another)."""
    import torch

    flat = out.view(-1)
    n = flat.numel()
    if n >= 1 << 31:
        raise ValueError(f"random_uniform_: {n:,} elements; at most 2^31 - 1 in one tensor")
    chunk = min(chunk, max(n, 1))
    signed_key = key - (1 << 32) if key >= 1 << 31 else key  # the same 32 bits in an int32
    index = torch.arange(chunk, dtype=torch.int32, device=out.device)
    x, t = torch.empty_like(index), torch.empty_like(index)
    f = torch.empty(chunk, dtype=torch.float32, device=out.device)

    def mix(xs, ts, constant):
        torch.bitwise_right_shift(xs, 16, out=ts)
        ts &= 0xFFFF  # the shift is arithmetic on int32: keep the bits a logical shift gives
        xs ^= ts
        xs *= constant  # wraps mod 2^32

    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        xs, ts, fs = x[:m], t[:m], f[:m]
        torch.add(index[:m], start, out=xs)
        mix(xs, ts, 0x7FEB352D)
        xs ^= signed_key
        mix(xs, ts, 0x68E31DA5)
        mix(xs, ts, 0x5BD1E995)
        torch.bitwise_right_shift(xs, 9, out=ts)
        ts &= 0x7FFFFF  # 23 bits
        fs.copy_(ts).add_(0.5).mul_(2.0 ** -22).sub_(1.0).mul_(bound)
        flat[start:start + m].copy_(fs)
    return out


def bundled_tokenizer_dir() -> Path:
    """The SmolLM2 tokenizer every random shape uses: the bundled model's (converted first when missing; a
    directory holding only the tokenizer files is enough, as bench/gpu.sh sets one up on a GPU machine)."""
    d = Path(BUNDLED_MODEL_DIR)
    return d if (d / "tokenizer.json").exists() else export_bundled_model(d)


def random_model_dir(spec: str) -> Path:
    """random:<shape>[:<seed>] -> a model directory in the cache (shapes.cache_dir), built on first use: the
    shape's config, bfloat16 safetensors of its random weights, the bundled tokenizer, kit_origin.json. Built in
    a temporary directory and renamed into place, so a directory there is always whole; a second process building
    the same one at the same time keeps the first's."""
    import json

    try:
        name, seed = shapes.parse(spec)
    except ValueError as e:
        raise UserError(str(e)) from None
    dest, want = shapes.cache_dir(name, seed), shapes.origin(name, seed)

    def built() -> bool:
        try:
            return json.loads((dest / "kit_origin.json").read_text()) == want
        except (OSError, ValueError):
            return False

    print(f"[model] {shapes.describe(spec)}", flush=True)
    if built():
        return dest
    tokenizer = bundled_tokenizer_dir()
    need = 2 * shapes.parameter_count(shapes.config_dict(name))  # bytes of bfloat16
    dest.parent.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(dest.parent).free < need * 1.05:
        raise UserError(f"building {spec} needs {need / 1e9:.1f} GB free in {dest.parent} "
                        f"({shutil.disk_usage(dest.parent).free / 1e9:.1f} GB are): set DPO_KIT_CACHE elsewhere")
    t0 = time.time()
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        where = write_random_weights(tmp, name, seed)
        for f in TOKENIZER_FILES:
            if (tokenizer / f).exists():
                shutil.copyfile(tokenizer / f, tmp / f)
        kit.atomic_write_json(tmp / "kit_origin.json", want)
        if dest.exists() and not built():  # an older format, or a damaged copy: replaced
            shutil.rmtree(dest)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not built():  # not another process's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[model] built {dest} ({need / 1e9:.2f} GB, weights made on {where}) in {time.time() - t0:.0f}s", flush=True)
    return dest


def write_random_weights(dest: Path, name: str, seed: int) -> str:
    """config.json and the safetensors files (sharded with an index, as transformers saves) of a shape's random
    weights into dest: linear and embedding weights random_uniform_ with the std of initializer_range, each
    tensor keyed by its name (shapes.tensor_key); norm weights 1, biases 0; a tied head is not stored. The
    parameter names and shapes come from the model built on the meta device (no memory). Made on a GPU when
    there is one (the same bits as a CPU, faster). Returns the device used."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    values = shapes.config_dict(name)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config.save_pretrained(dest)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    kinds = {}
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            dense = pname == "weight" and isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
            kinds[id(p)] = "random" if dense else "zeros" if pname == "bias" else "ones"
    params = {n: (tuple(p.shape), kinds[id(p)]) for n, p in model.named_parameters()}  # tied: once
    del model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bound = config.initializer_range * 3 ** 0.5  # uniform on (-b, b) has std b / sqrt(3)
    plan = shapes.shard_plan([(n, 2 * torch.Size(s).numel()) for n, (s, _) in params.items()], SHARD_BYTES)
    files, weight_map = shapes.shard_names(len(plan)), {}
    for names, file in zip(plan, files):
        tensors = {}
        for n in names:
            shape, kind = params[n]
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
            if kind == "random":
                random_uniform_(t, shapes.tensor_key(seed, n), bound, chunk=1 << (26 if device == "cuda" else 22))
            else:
                t.fill_(1.0 if kind == "ones" else 0.0)
            tensors[n] = t.cpu()
            weight_map[n] = file
        save_file(tensors, str(dest / file), metadata={"format": "pt"})
        del tensors
    if len(files) > 1:
        total = sum(2 * torch.Size(s).numel() for s, _ in params.values())
        kit.atomic_write_json(dest / "model.safetensors.index.json",
                              {"metadata": {"total_size": total}, "weight_map": weight_map})
    if device == "cuda":
        torch.cuda.empty_cache()  # the model is loaded next, maybe by another process: give the memory back
    return device


def base_model_identity(path: str) -> dict:
    """What the manifest records of a base: its name, each weights file's sha256, where the bundled one came from."""
    import json

    info = {"name_or_path": path}
    p = Path(path)
    if p.is_dir():
        info["weights_sha256"] = {f.name: kit.sha256_file(f) for f in sorted(p.glob("*.safetensors"))}
        if (p / "kit_origin.json").exists():
            info["origin"] = json.loads((p / "kit_origin.json").read_text())
    return info


def load_model(path: str, opts: LoadOptions, on_gpu: bool, bf16_ok: bool):
    """The base (or reference) model: 4-bit NF4 through bitsandbytes unless load_in_4bit is off."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cfg = opts
    dtype = getattr(torch, resolve_compute_dtype(cfg.compute_dtype, on_gpu, bf16_ok))
    kwargs = {"dtype": dtype, "device_map": ranks.device_map(on_gpu)}  # each process: its own GPU
    if cfg.load_in_4bit:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=cfg.bnb_4bit_use_double_quant, bnb_4bit_compute_dtype=dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        raise UserError(f"cannot load model {path!r}: {e}") from None
    if cfg.load_in_4bit:
        keep_4bit_layout(model)
    return model


# bitsandbytes' Linear4bit attribute that turns its CPU repacking on (read in forward), as in the pinned 0.50
BNB_CPU_REPACK_FLAG = "support_avx512bf16_for_cpu"


def keep_4bit_layout(model) -> None:
    """Keep every 4-bit layer in the layout it was loaded in. On a CPU with AVX512-BF16, bitsandbytes 0.50 repacks a
    Linear4bit's weights the first time it runs in eval mode without gradients (the reference's pass, an evaluation,
    generation) and never unpacks them: the scales are rounded to bfloat16 for the rest of the process, and training
    then runs through gemv_4bit, which has no backward (the gradient to the layer's input is silently wrong). The
    same run trained differently on such a CPU than on any other. Off here, on every machine (a bitsandbytes without
    the attribute has no such repacking; the test reads it, so an upgrade that renames it fails there)."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit) and hasattr(module, BNB_CPU_REPACK_FLAG):
            setattr(module, BNB_CPU_REPACK_FLAG, False)


def float32_trainable(model) -> int:
    """The trainable (LoRA) weights back in float32 after TRL's trainers cast them to bfloat16 for a 4-bit base
    (QLoRA's recipe): AdamW then keeps float32 weights and moments, so an update smaller than a bfloat16 step
    of the weight is not rounded away, and with --init_adapter the trained copy starts equal to the float32
    reference. Autocast still multiplies in bfloat16 on a GPU; the cost is 2 bytes more per LoRA weight (about
    84 MB at 8B, rank 16, every linear). Returns how many tensors were cast."""
    import torch

    cast = 0
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
            cast += 1
    return cast


def prepare_4bit_training(model, gradient_checkpointing: bool) -> int:
    """peft's prepare_model_for_kbit_training without its float32 copies of the embedding table and the
    output head. peft freezes every weight and casts every 16-bit one that is not 4-bit to float32: the norms
    (their arithmetic in float32 is what keeps QLoRA's loss stable), biases, and also the embedding and the
    head, which at Llama-3-8B's vocabulary are two 2.1 GB float32 tables instead of two 1.05 GB bfloat16
    ones, the head cast back to bfloat16 by autocast at every forward. Here the norms and biases are cast as
    peft casts them; the embedding keeps its dtype and its output is cast to float32 (the values peft's
    float32 table gives, so the residual stream is float32 as with peft); the head keeps its dtype (autocast
    multiplies in bfloat16 either way: the same values). The same losses and gradients as peft's, bit for
    bit (tests/test_train_dpo.py checks it under bfloat16 autocast); less memory and no per-step cast on a
    GPU. On a CPU in float32 nothing is 16-bit and both do nothing. Returns the parameters cast."""
    import torch

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    kept = {id(m.weight) for m in (embed, head) if m is not None and getattr(m, "weight", None) is not None}
    cast = 0
    for param in model.parameters():
        param.requires_grad = False
        if param.dtype in (torch.float16, torch.bfloat16) and type(param).__name__ != "Params4bit" \
                and id(param) not in kept:
            param.data = param.data.to(torch.float32)
            cast += 1
    if embed is not None and embed.weight.dtype in (torch.float16, torch.bfloat16):
        embed.register_forward_hook(lambda module, args, out: out.float())
    if gradient_checkpointing:  # as peft: the inputs need grads for the checkpointed blocks' backward
        model.enable_input_require_grads()
        model.gradient_checkpointing_enable()
    return cast


def dequantize_4bit_(model) -> int:
    """Swap every bitsandbytes 4-bit linear layer for a plain linear layer holding its dequantised
    weights: exactly the values the 4-bit kernels multiply by, computed once instead of at every
    matmul. On a CPU that re-dequantisation dominates (a 4 x 100-token forward of the bundled model:
    ~13 s in 4-bit), so inference-only work (evaluation, chat) runs on the swapped copy; LoRA layers
    wrap whatever base layer they hold, so the adapter is untouched. Returns the count swapped."""
    import bitsandbytes as bnb
    import torch

    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, bnb.nn.Linear4bit) and getattr(child.weight, "quant_state", None) is not None:
                weight = bnb.functional.dequantize_4bit(child.weight.data, child.weight.quant_state)
                dense = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                        device=weight.device, dtype=child.compute_dtype or weight.dtype)
                dense.weight.data = weight.to(dense.weight.dtype)
                if child.bias is not None:
                    dense.bias.data = child.bias.data.to(dense.weight.dtype)
                setattr(module, name, dense.requires_grad_(False))
                swapped += 1
    return swapped


def trained_base(config: dict):
    """A finished run's base as the run trained against it, as plain float32 layers: where it trained in 4-bit, the
    4-bit weights' dequantised values (exactly what its kernels multiplied by), so an adapter merged into it is
    the trained model; merged into the original weights instead, the default make train run's logits moved by up
    to 10.7 and its held-out pass rate fell from 0.297 to 0.078. config: the run's config.json."""
    import torch

    on_gpu, bf16_ok = device()
    base = load_model(resolve_model_path(config["model_name_or_path"]), LoadOptions.of(config), on_gpu, bf16_ok)
    dequantize_4bit_(base)
    base.config.__dict__.pop("quantization_config", None)  # nothing is quantised any more
    base.hf_quantizer = None
    for flag in ("is_loaded_in_4bit", "is_loaded_in_8bit", "is_quantized", "quantization_method"):
        if hasattr(base, flag):
            setattr(base, flag, False)
    for tensor in [*base.parameters(), *base.buffers()]:  # float32 by hand: transformers' .to refuses a bnb model
        if tensor.is_floating_point():
            tensor.data = tensor.data.float()
    base.config.dtype = torch.float32
    return base.eval()


def available_memory_mb() -> float:
    """MemAvailable from /proc/meminfo (Linux), else a conservative 4 GB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 4096.0


def detect_lora_targets(model) -> list[str]:
    import torch

    head = model.get_output_embeddings()
    head_names = [n for n, m in model.named_modules() if m is head]
    return lora_target_modules(model.named_modules(), lambda m: isinstance(m, torch.nn.Linear), head_names)


MICRO_BATCH_HEADROOM = 0.8  # of the GPU's free memory, what a step's activations may plan to take
ACTIVATION_SAFETY = 1.5  # the estimate below is of the tensors kept for the backward; temporaries come on top


def activation_bytes_per_token(config: dict, dtype_bytes: int = 2) -> float:
    """The tensors a decoder layer keeps for the backward, per token, summed over the layers, as the kit's fast
    path keeps them (fastpath.py): the two norms' inputs, the attention and MLP inputs cast once for their LoRA
    layers, q, k, v and the attention output (SDPA), the MLP's gate, up and their product. In elements per layer:
    6 hidden + 2 key/value widths + 4 intermediate; times dtype_bytes and the layers. At Llama-3-8B's shape in
    bfloat16: 5.4 MB a token (a pair of 1,024 tokens, the prompt three quarters and run once: 6.9 GB; the H200
    run's default measured (38.6 GB - 5.5 GB of 4-bit weights) / 4 pairs = 8.3 GB, hence ACTIVATION_SAFETY)."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads) * (config.get("head_dim") or h // heads)
    return float((6 * h + 2 * kv + 4 * inter) * dtype_bytes * layers)


def plan_micro_batch(per_device: int, accumulation: int, pair_bytes: float, free_bytes: float,
                     headroom: float = MICRO_BATCH_HEADROOM) -> tuple[int, int]:
    """(pairs per forward, accumulation steps) holding the same pairs per optimiser step as the run asked for
    (per_device x accumulation): the largest whole divisor of it whose activations (pair_bytes each, times
    ACTIVATION_SAFETY) fit in headroom of the free memory; 1 pair when not even one fits (the run then finds out).
    The same pairs per step and the same mean loss: only how many forwards a step takes changes."""
    total = per_device * accumulation
    fit = int(headroom * free_bytes // max(pair_bytes * ACTIVATION_SAFETY, 1.0))
    micro = max((d for d in range(1, total + 1) if total % d == 0 and d <= fit), default=1)
    return micro, total // micro


def dequantize_on_gpu_fits(quantized_params: int, compute: str, free_bytes: float, step_bytes: float,
                           headroom: float = MICRO_BATCH_HEADROOM) -> bool:
    """Whether the NF4 base's dense copy in the compute dtype (2 bytes a weight; the 4-bit one, half a byte, is
    freed) leaves room for a step of step_bytes in headroom of the GPU's free memory."""
    dense = quantized_params * ((2 if compute in ("bfloat16", "float16") else 4) - 0.5)
    return dense + step_bytes * ACTIVATION_SAFETY <= headroom * free_bytes


def dequantize_if_it_fits(models: list, compute: str) -> tuple[int, float] | None:
    """On a CPU, swap the 4-bit layers of these models for dense ones (dequantize_4bit_) when the dense
    copies take under 40% of free memory. Returns (layers swapped, megabytes), or None when kept 4-bit."""
    quantized = sum(count_parameters(m.named_parameters())["quantized_4bit"] for m in models)
    dense_mb = quantized * (2 if compute == "bfloat16" else 4) / 1e6
    if dense_mb >= 0.4 * available_memory_mb():
        return None
    return sum(dequantize_4bit_(m) for m in models), dense_mb


def load_init_adapter(model, init_adapter: str, opts: LoadOptions, model_name_or_path: str):
    """Rounds (--init_adapter): the model gets a finished run's adapter, trainable. DPOTrainer, given a
    PeftModel and no peft_config, copies that adapter into a frozen one named 'ref' and activates it for the
    reference log-probs (TRL 1.14 has no ref_adapter_name option; this is its way of loading the adapter
    twice), so the reference is base + previous adapter, not the bare base. Returns (model, its LoRA target
    modules, the parent run's {path, run_name, adapter_sha256})."""
    import tempfile

    from peft import PeftModel

    with tempfile.TemporaryDirectory(prefix="init-adapter-") as tmp:
        parent, parent_cfg = runs.open_run(init_adapter, tmp)
        here = dataclasses.asdict(opts) | {"model_name_or_path": model_name_or_path}
        mismatch = [f"{k} {parent_cfg.get(k)!r} (here {here[k]!r})"
                    for k in ("model_name_or_path", "load_in_4bit", "bnb_4bit_quant_type")
                    if str(parent_cfg.get(k)).rstrip("/") != str(here[k]).rstrip("/")]
        if mismatch:
            raise UserError(f"--init_adapter {init_adapter} was trained with {'; '.join(mismatch)}: the "
                            "reference must be the model that run produced")
        model = PeftModel.from_pretrained(model, parent, is_trainable=True)
        info = {"path": init_adapter, "run_name": parent.name,
                "adapter_sha256": kit.sha256_file(parent / "adapter_model.safetensors")}
    print(f"[model] starting from the adapter of {info['run_name']} (reference = base + that adapter, frozen)")
    return model, sorted(model.peft_config["default"].target_modules), info


def sync_trainable_adapter_(model, resume_from: str) -> None:
    """Put the trainable adapter where it must start: equal to the frozen 'ref' copy on a fresh start
    (TRL rounded it to bfloat16 for a 4-bit base; on a CPU it is cast back but the rounding stays), or
    the checkpoint's weights on resume (transformers, finding the 'ref' subdirectory in a checkpoint,
    loads only that one and leaves the trained adapter at its initial value)."""
    import peft
    from safetensors.torch import load_file

    if "ref" not in getattr(model, "peft_config", {}):
        return
    if resume_from:
        peft.set_peft_model_state_dict(model, load_file(Path(resume_from) / "adapter_model.safetensors"),
                                       adapter_name="default")
        return
    params = dict(model.named_parameters())
    for name, p in params.items():
        if ".ref." in name:
            params[name.replace(".ref.", ".default.")].data.copy_(p.data)


def load_run(run_dir: Path, config: dict):
    """A finished run's base loaded as it was trained (4-bit when it was), its adapter on top, in eval
    mode, and its tokenizer. config: the run's config.json."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    on_gpu, bf16_ok = device()
    base = load_model(resolve_model_path(config["model_name_or_path"]), LoadOptions.of(config), on_gpu, bf16_ok)
    model = PeftModel.from_pretrained(base, run_dir).eval()
    if not on_gpu:
        dequantize_4bit_(model)  # same values, without re-dequantising at every matmul
    return model, AutoTokenizer.from_pretrained(run_dir)


# ---------------------------------------------------------------------------------------------
# Chat templates: the kit's own (templates/), and whether a template renders tool use.
# ---------------------------------------------------------------------------------------------

TEMPLATES_DIR = kit.ROOT / "templates"
# Template families and the shipped template that adds tool use to each (--chat_template <name>).
SHIPPED_TEMPLATES = {"chatml-tools": "ChatML (SmolLM2, and other <|im_start|> models)"}
PROBE_TOOL = {"type": "function", "function": {"name": "kit_probe_tool", "description": "kit_probe_description",
                                               "parameters": {"type": "object", "properties": {}}}}
PROBE_CONVERSATION = [
    {"role": "user", "content": "probe"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_kit_probe", "type": "function", "function": {"name": "kit_probe_tool",
                                                                  "arguments": {"kit_probe_arg": 1}}}]},
    {"role": "tool", "tool_call_id": "call_kit_probe", "content": "kit_probe_result"},
    {"role": "assistant", "content": "done"}]


def chat_template_text(spec: str) -> str | None:
    """--chat_template: '' = the model's own (None), a name in SHIPPED_TEMPLATES, or a .jinja file's text."""
    if not spec:
        return None
    path = TEMPLATES_DIR / f"{spec}.jinja" if spec in SHIPPED_TEMPLATES else Path(spec)
    if not path.is_file():
        raise kit.UserError(f"--chat_template {spec!r} is neither a template the kit ships "
                        f"({', '.join(SHIPPED_TEMPLATES)}) nor a file")
    return path.read_text(encoding="utf-8")


def tool_template_problem(tokenizer) -> str | None:
    """Why this tokenizer's chat template cannot train on tool use, or None: it must render a conversation with a
    tools list, an assistant's tool call (null content) and the tool's result, showing all three."""
    if not tokenizer.chat_template:
        return "it has no chat template"
    try:
        text = tokenizer.apply_chat_template(PROBE_CONVERSATION, tools=[PROBE_TOOL], tokenize=False)
    except Exception as e:  # noqa: BLE001 - jinja's errors, a None content concatenated, ...
        return f"its chat template cannot render a tool call ({type(e).__name__}: {str(e)[:120]})"
    missing = [what for what, mark in (("the tools list", "kit_probe_description"), ("the call", "kit_probe_arg"),
                                       ("the tool's result", "kit_probe_result")) if mark not in text]
    if "kit_probe_tool" not in text:
        missing.insert(0, "the tool's name")
    return f"its chat template leaves out {', '.join(missing)}" if missing else None


# ---------------------------------------------------------------------------------------------
# Generation: every "chat template -> generate -> decode" of the kit.
# ---------------------------------------------------------------------------------------------


def prompt_texts(tokenizer, prompts: list[list[dict]], prefix: str = "") -> list[str]:
    """sampler.prompt_texts: each message list through the chat template, ready for the assistant's turn."""
    return sampler.prompt_texts(tokenizer, prompts, prefix)


def generate(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, sampling: dict | None = None,
             seed: int | None = None, n: int = 1, label: str = "") -> list[str]:
    """Answers to message lists: greedy, or sampled with `sampling` (temperature / top_k / top_p) after seeding
    torch with `seed`; n answers per prompt, in prompt order. Through sampler.py's decode loop (LoRA merged while
    sampling, finished rows leaving the batch); label: a progress line while it runs."""
    return sampler.sample(model, tokenizer, prompts, max_new_tokens, sampling, seed, n, label=label,
                          kv_cache=fastpath.preallocated_kv_cache, attention=fastpath.grouped_kv_attention)


def hf_generate(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, sampling: dict | None = None,
                seed: int | None = None, n: int = 1) -> list[str]:
    """The same through transformers' `generate` (left-padded batch, adapter unmerged): what sampler.py
    replaced, kept as the benchmark's baseline and the greedy answers its tests compare against."""
    import torch

    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompt_texts(tokenizer, prompts), return_tensors="pt", padding=True,
                      add_special_tokens=not tokenizer.chat_template).to(model.device)
    if seed is not None:
        torch.manual_seed(seed)
    options = {"do_sample": True, **sampling} if sampling else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, num_return_sequences=n,
                             pad_token_id=tokenizer.pad_token_id, **options)
    width = batch["input_ids"].shape[1]
    return [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out]
