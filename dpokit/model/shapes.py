"""Architecture shapes for random bases: `--model_name_or_path random:<name>[:<seed>]` is a randomly initialised
model with a real model's published config (its full vocabulary, layers and widths), built with no download.

    python train_dpo.py --data pairs.jsonl --model_name_or_path random:llama-3-8b --max_steps 2
    make bench DEVICE=cuda MODEL=random:llama-3.2-1b

For measuring speed and memory at a size the bundled 135M model cannot show: the weights mean nothing. Not run
on its own: this file is the table and the pure helpers around it (standard library only); models.py writes a
shape's weights once into the cache (models.random_model_dir) and loads them like any base. Every shape is
tokenised with the bundled SmolLM2 tokenizer (ids 0..49,151 fit every vocabulary here), so the token ids in each
config are that tokenizer's, not the source model's.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from pathlib import Path

PREFIX = "random:"
FORMAT = 1  # bump when the weights a shape and seed give change: older cache entries are then built again
TOKENIZER = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the bundled tokenizer every shape uses
TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}  # SmolLM2's <|im_start|>, <|im_end|>

_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "attention_bias": False,
          "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02, "rms_norm_eps": 1e-5}
_QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "attention_dropout": 0.0,
          "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_sliding_window": False}  # q, k, v have biases


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclasses.dataclass(frozen=True)
class Shape:
    source: str  # the model whose published config.json this is
    config: dict


SHAPES = {
    "smollm2-135m": Shape("HuggingFaceTB/SmolLM2-135M-Instruct", {
        **_LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "tie_word_embeddings": True}),
    "smollm2-360m": Shape("HuggingFaceTB/SmolLM2-360M-Instruct", {
        **_LLAMA, "hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 15,
        "num_key_value_heads": 5, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "tie_word_embeddings": True}),
    "smollm2-1.7b": Shape("HuggingFaceTB/SmolLM2-1.7B-Instruct", {
        **_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
        "num_key_value_heads": 32, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 130000.0}, "tie_word_embeddings": True}),
    "llama-3.2-1b": Shape("meta-llama/Llama-3.2-1B-Instruct", {
        **_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rope_parameters": _llama3_rope(32.0), "tie_word_embeddings": True}),
    "llama-3.2-3b": Shape("meta-llama/Llama-3.2-3B-Instruct", {
        **_LLAMA, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rope_parameters": _llama3_rope(32.0), "tie_word_embeddings": True}),
    "llama-3-8b": Shape("meta-llama/Llama-3.1-8B-Instruct", {
        **_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rope_parameters": _llama3_rope(8.0), "tie_word_embeddings": False}),
    "qwen2.5-0.5b": Shape("Qwen/Qwen2.5-0.5B-Instruct", {
        **_QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "max_window_layers": 21,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": True}),
    "qwen2.5-1.5b": Shape("Qwen/Qwen2.5-1.5B-Instruct", {
        **_QWEN2, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "max_window_layers": 21,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": True}),
    "qwen2.5-7b": Shape("Qwen/Qwen2.5-7B-Instruct", {
        **_QWEN2, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768, "max_window_layers": 28,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": False}),
}


# ---------------------------------------------------------------------------------------------
# Pure helpers: tested without a model (tests/test_shapes.py).
# ---------------------------------------------------------------------------------------------


def is_random(spec: str) -> bool:
    return str(spec).startswith(PREFIX)


def parse(spec: str) -> tuple[str, int]:
    """'random:llama-3-8b' -> ('llama-3-8b', 0); 'random:llama-3-8b:7' -> ('llama-3-8b', 7). ValueError (one
    sentence naming the known shapes) for anything else."""
    name, _, seed = spec[len(PREFIX):].partition(":") if is_random(spec) else (spec, "", "")
    if name not in SHAPES:
        raise ValueError(f"no random model shape {name!r}: the known ones are {', '.join(SHAPES)} "
                         f"(as {PREFIX}<name> or {PREFIX}<name>:<seed>)")
    if seed and not seed.isdigit():
        raise ValueError(f"{spec}: the seed after the shape's name must be a whole number (got {seed!r})")
    return name, int(seed or 0)


def problem(spec: str, option: str = "--model_name_or_path") -> str | None:
    """What is wrong with a random:... spec (for a config's problems()); None when it is fine or not random."""
    if not is_random(spec):
        return None
    try:
        parse(spec)
    except ValueError as e:
        return f"{option}: {e}"
    return None


def config_dict(name: str) -> dict:
    """The config.json of a shape as the kit writes it: the source's values, the bundled tokenizer's token ids,
    bfloat16 weights."""
    return {**SHAPES[name].config, **TOKEN_IDS, "dtype": "bfloat16", "use_cache": True}


def parameter_count(config: dict) -> int:
    """Parameters of a Llama or Qwen2 model from its config (tied embeddings counted once): embeddings, each
    block's attention (Qwen2: with q, k, v biases), gated MLP and two norms, the final norm, an untied head."""
    d, inter, layers, vocab = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                   "vocab_size"))
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or d // heads
    q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    attention = d * q + 2 * d * kv + q * d + ((q + 2 * kv) if config["model_type"] == "qwen2" else 0)
    block = attention + 3 * d * inter + 2 * d
    head = 0 if config.get("tie_word_embeddings") else vocab * d
    return vocab * d + layers * block + d + head


def describe(spec: str) -> str:
    """One line for logs, data.json and the model card."""
    name, seed = parse(spec)
    return (f"{spec} is RANDOMLY INITIALISED (seed {seed}) in the shape of {SHAPES[name].source} "
            f"({parameter_count(config_dict(name)) / 1e9:.2f}B parameters, vocabulary "
            f"{SHAPES[name].config['vocab_size']:,}), with the SmolLM2 tokenizer: for measuring speed and memory; "
            "what it learns means nothing")


def origin(name: str, seed: int) -> dict:
    """kit_origin.json of a random model's directory (the manifest copies it): what it is and how it was made."""
    return {"random": True, "spec": f"{PREFIX}{name}" + (f":{seed}" if seed else ""), "shape": name, "seed": seed,
            "shape_of": SHAPES[name].source, "tokenizer": TOKENIZER, "format": FORMAT,
            "init": "linear and embedding weights uniform with the std of initializer_range (a hash of seed, "
                    "tensor name and element index: the same bits on a CPU and a GPU); norms 1, biases 0; bfloat16",
            "config": config_dict(name)}


def cache_dir(name: str, seed: int, environ=os.environ) -> Path:
    """Where a shape is built once: $DPO_KIT_CACHE/random/<name>-seed<k> (default ~/.cache/dpo-kit)."""
    root = environ.get("DPO_KIT_CACHE") or Path.home() / ".cache" / "dpo-kit"
    return Path(root) / "random" / f"{name}-seed{seed}"


def tensor_key(seed: int, tensor_name: str) -> int:
    """The 32-bit key of one tensor's values: its own stream, whatever order the tensors are made in."""
    return zlib.crc32(f"{seed}:{tensor_name}".encode())


def shard_plan(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensors in order, grouped into safetensors files of at most max_bytes each (a larger tensor alone)."""
    shards, current, used = [], [], 0
    for name, nbytes in sizes:
        if current and used + nbytes > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    return shards + [current] if current else shards


def shard_names(count: int) -> list[str]:
    """transformers' file names: model.safetensors, or model-00001-of-0000N.safetensors with an index."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
