"""The tokenised-data cache: a split's tokenised pairs kept on disk between runs of the same data, tokenizer and
settings, so that a second run starts training without tokenising again.

    out = token_cache.cached(cache_dir, key, "train", record, lambda: tokenization.prepare_pairs(...))

A key (tokenized_cache_key) hashes everything the tokenisation depends on: the rows in their order, the
tokenizer (tokenizer_digest: its serialisation, chat template and special tokens) and the settings the caller
names (max_length, truncation, versions). An entry is a `datasets` save_to_disk directory, <dir>/<key>, written
by rank 0 under a temporary name and renamed into place, so no run reads a half-written one; a damaged entry
is tokenised again and replaced. Where: --tokenized_cache DIR|none, else $DPO_KIT_CACHE/tokenized, else
~/.cache/dpo-kit/tokenized. fastpath.py's DPO trainer class reads and writes it; train_dpo.py makes the keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from dpokit.core import ranks


def tokenized_cache_key(rows: list[dict], tokenizer_digest: str, settings: dict) -> str:
    """What TRL's tokenisation of one split depends on: the rows (content and order), the tokenizer
    (vocabulary, special tokens, chat template) and the settings (max_length, truncation, versions)."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode() + b"\0" + tokenizer_digest.encode() + b"\0")
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
    return h.hexdigest()[:32]


def tokenizer_digest(tokenizer) -> str:
    """sha256 of everything in a tokenizer that changes token ids: its full serialisation (fast
    tokenizers), else its vocabulary, plus the chat template and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = json.dumps({"class": type(tokenizer).__name__, "chat_template": getattr(tokenizer, "chat_template", None),
                        "special": getattr(tokenizer, "special_tokens_map", {})}, sort_keys=True, default=str)
    return hashlib.sha256((body + "\0" + extra).encode("utf-8", "surrogatepass")).hexdigest()


def tokenized_cache_dir(setting: str) -> Path | None:
    """The cache directory for --tokenized_cache's value: None for "none", else DIR/tokenized ("" = the kit's
    cache, $DPO_KIT_CACHE or ~/.cache/dpo-kit)."""
    if setting.lower() == "none":
        return None
    return Path(setting or os.environ.get("DPO_KIT_CACHE") or Path.home() / ".cache" / "dpo-kit") / "tokenized"


def cached(cache_dir: Path | None, key: str | None, split: str, record: dict, prepare):
    """The dataset prepare() makes, read from cache_dir/key when an earlier run left it there, else made and
    saved there (rank 0). What happened goes into record[split]: "from cache (n pairs)", or "tokenised in
    1.2s" with ", cached" once saved. No directory or no key: prepare() alone, nothing recorded. A disk that
    cannot take the entry (read-only, full) costs the next run time, not this one."""
    from datasets import Dataset

    if cache_dir is None or key is None:
        return prepare()
    path = cache_dir / key
    if (path / "state.json").exists():
        try:
            out = Dataset.load_from_disk(str(path))
            record[split] = f"from cache ({len(out)} pairs)"
            return out
        except Exception as e:  # a damaged entry: tokenise again and replace it
            print(f"[data] ignoring damaged cache entry {path}: {e}")
    t0 = time.time()
    out = prepare()
    record[split] = f"tokenised in {time.time() - t0:.1f}s"
    if ranks.is_main_process():
        tmp = cache_dir / f".{key}.{os.getpid()}.tmp"
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            out.save_to_disk(str(tmp))
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
            record[split] += ", cached"
        except OSError as e:
            print(f"[data] tokenised data not cached ({e})")
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def for_run(where: str, max_length: int, tokenizer, args, pairs: list[dict], held: list[dict]) -> tuple:
    """A DPO run's cache (--tokenized_cache `where`): (cache directory or None, {split: key}), keyed by what TRL's
    tokenisation of each split depends on. args: its DPOConfig."""
    import trl

    cache_dir = tokenized_cache_dir(where)
    if cache_dir is None:
        return None, {}
    settings = {"max_length": max_length, "truncation_mode": args.truncation_mode, "trl": trl.__version__,
                "kit_cache": 2}  # 2: tokenize_pair
    digest = tokenizer_digest(tokenizer)
    keys = {"train": tokenized_cache_key(pairs, digest, settings | {"split": "train"})}
    if held:
        keys["eval"] = tokenized_cache_key(held, digest, settings | {"split": "eval"})
    return cache_dir, keys
