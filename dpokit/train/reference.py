"""The reference's log-probs, computed once before training and kept on disk: DPO's loss reads each pair's
reference log-probs (the frozen base, or the --init_adapter run's adapter) and they never change while the
adapter trains, so a pass over the data before the first step replaces the reference forward every step did.

    out = reference.precompute(trainer, dataset, "train", batch_size, cache_dir, key, record)

The pass runs through the trainer as armed (trainers.arm: the kit's lean head, each prompt once), after arming,
not in TRL's __init__ where TRL's own precompute runs through full logits: the KitDPOTrainer defers TRL's call
until then (trainers.py). One entry per split is kept at <cache>/reference/<key>.safetensors, written under a
temporary name and renamed into place; the key (cache_key) hashes the split's tokenised-data key (its rows,
tokenizer and settings) with everything the numbers depend on (identity): the base's and reference's files, the
adapter that is the reference, the quantisation, dtypes, kernels and versions, the device. A resume, a rerun, or
another seed on the same data and base reads it instead of computing (`[model] reference log-probs: from cache`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path

from dpokit.core import ranks
from dpokit.core.kit import BROKE_COLUMN

CACHE_VERSION = 1  # bump when what an entry holds, or how it is computed, changes
COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # TRL 1.14's names: its collator and _compute_loss read them


def files_identity(path: str) -> dict:
    """What names a model's weights without reading them: each weights file's name, size and mtime, and the
    config's sha256 (a model directory); a single file's (a GGUF); the string itself otherwise (a hub name, a
    random:<shape> base)."""
    p = Path(path)
    if p.is_file():  # a GGUF base (make train MODEL=run.gguf)
        st = p.stat()
        return {"name": str(p.resolve()), p.name: [st.st_size, st.st_mtime_ns]}
    if not p.is_dir():
        return {"name": path}
    out = {"name": str(p.resolve())}
    for f in sorted(p.iterdir()):
        if f.suffix in (".safetensors", ".bin", ".gguf"):
            st = f.stat()
            out[f.name] = [st.st_size, st.st_mtime_ns]
        elif f.name == "config.json":
            out[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def identity(cfg, compute, adapter_sha256: str, device: str, versions: dict) -> dict:
    """Everything besides the tokenised data that the reference log-probs depend on. cfg: a TrainConfig;
    compute: fastpath.Compute (matmuls in their dtype, log-prob path, kernels); adapter_sha256: the --init_adapter
    run's adapter, the reference ('' for none: models.load_init_adapter hashed it); device: 'cpu' or the GPU's
    name; versions: the libraries' that compute them."""
    return {"base": files_identity(cfg.model_name_or_path),
            "ref_model": files_identity(cfg.ref_model_name_or_path) if cfg.ref_model_name_or_path else None,
            "adapter": adapter_sha256, "quant": [cfg.load_in_4bit, cfg.bnb_4bit_quant_type,
                                                 cfg.bnb_4bit_use_double_quant],
            "matmuls": compute.matmuls, "logps": compute.logps, "fused": compute.fused,
            "share_prompts": cfg.share_prompts, "device": device, "versions": versions}


def cache_key(token_key: str, ident: dict) -> str:
    """The entry's name: the split's tokenised-data key and the identity, hashed."""
    body = json.dumps({"v": CACHE_VERSION, "tokens": token_key, "identity": ident}, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def cache_dir(tokenized_dir: Path | None) -> Path | None:
    """Beside the tokenised-data cache (--tokenized_cache; 'none' turns both off)."""
    return None if tokenized_dir is None else tokenized_dir.parent / "reference"


def load(path: Path, n: int):
    """(chosen, rejected) float tensors of n rows from an entry, or None when there is none or it is damaged."""
    from safetensors.torch import load_file

    if not path.exists():
        return None
    try:
        t = load_file(str(path))
        chosen, rejected = t["chosen"], t["rejected"]
    except Exception as e:  # noqa: BLE001 - a damaged entry is computed again and replaced
        print(f"[model] ignoring damaged reference cache entry {path}: {e}")
        return None
    return (chosen, rejected) if chosen.shape == rejected.shape == (n,) else None


def save(path: Path, chosen, rejected) -> str:
    """Writes an entry under a temporary name and renames it into place; what happened, for the run's log."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"chosen": chosen.contiguous(), "rejected": rejected.contiguous()}, str(tmp))
        os.replace(tmp, path)
        return "cached"
    except OSError as e:  # a read-only or full disk costs the next run time, not this one
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return f"not cached ({e})"


def length_order(dataset) -> list[int]:
    """Row indices longest first (prompt plus the longer completion): batches of alike lengths pad least, and the
    longest batch first shows an out-of-memory at once."""
    lengths = [len(p) + max(len(c), len(r)) for p, c, r in
               zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"])]
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def compute(trainer, dataset, batch_size: int):
    """(chosen, rejected) float32 tensors, one value per row in dataset order: TRL 1.14's compute_ref_log_probs
    over batches of the trainer's own collator, longest rows first."""
    import torch

    order = length_order(dataset) if {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(dataset.column_names) \
        else list(range(len(dataset)))
    chosen, rejected = torch.empty(len(dataset)), torch.empty(len(dataset))
    model = trainer.ref_model or trainer.model
    rows = dataset.remove_columns([c for c in COLUMNS if c in dataset.column_names])
    i = 0
    while i < len(order):
        idx = order[i:i + batch_size]
        batch = trainer.data_collator([rows[j] for j in idx])
        batch = trainer._prepare_inputs({k: v for k, v in batch.items() if k != BROKE_COLUMN})
        try:
            c, r = trainer.compute_ref_log_probs(model, batch)
        except torch.OutOfMemoryError:
            if batch_size == 1:
                raise
            del batch
            batch_size = halved(batch_size)
            continue
        chosen[idx], rejected[idx] = c.float().cpu(), r.float().cpu()
        i += len(idx)
    return chosen, rejected


def halved(batch_size: int) -> int:
    """After an out-of-memory error in the pass: half the rows a forward, the GPU's cache emptied (the longest
    rows come first, so the first batch finds out)."""
    import torch

    torch.cuda.empty_cache()
    print(f"[model] the reference's pass ran out of GPU memory at {batch_size} pairs a forward; "
          f"{max(1, batch_size // 2)} from here", flush=True)
    return max(1, batch_size // 2)


def precompute(trainer, dataset, name: str, batch_size: int, where: Path | None, key: str | None, record: dict):
    """The dataset with TRL's two reference columns: read from where/key.safetensors when an earlier run left
    them, else computed (compute) and saved (rank 0). What happened goes into record[name] and is printed."""
    t0 = time.time()
    path = where / f"{key}.safetensors" if where is not None and key else None
    found = load(path, len(dataset)) if path is not None else None
    if found is not None:
        record[name] = f"from cache ({len(dataset)} pairs, {path})"
        chosen, rejected = found
    else:
        chosen, rejected = compute(trainer, dataset, batch_size)
        record[name] = f"computed once for {len(dataset)} pairs in {time.time() - t0:.1f}s"
        if path is not None and ranks.is_main_process():
            record[name] += f", {save(path, chosen, rejected)}"
    print(f"[model] reference log-probs ({name}): {record[name]}", flush=True)
    dataset = dataset.remove_columns([c for c in COLUMNS if c in dataset.column_names])
    return dataset.add_column(COLUMNS[0], chosen.tolist()).add_column(COLUMNS[1], rejected.tolist())
