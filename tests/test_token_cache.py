"""token_cache.py: what a key depends on, the tokenizer's digest (the bundled tokenizer), and an entry's life
on small datasets: made and saved by rank 0, read back, a damaged one replaced, a disk that cannot take it."""
from pathlib import Path

import pytest

from dpokit.model import models
from dpokit.data import token_cache

MODEL = Path(__file__).resolve().parent.parent / models.BUNDLED_MODEL_DIR
needs_model = pytest.mark.skipif(
    not (MODEL / "config.json").exists(), reason="bundled model not converted (make model)")


def test_tokenized_cache_key_changes_with_what_tokenisation_depends_on():
    rows = [{"prompt": "p1", "chosen": "a", "rejected": "b"}, {"prompt": "p2", "chosen": "c", "rejected": "d"}]
    key = token_cache.tokenized_cache_key(rows, "tok", {"max_length": 512})
    assert key == token_cache.tokenized_cache_key([dict(r) for r in rows], "tok", {"max_length": 512})
    assert key != token_cache.tokenized_cache_key(rows[::-1], "tok", {"max_length": 512})  # order is data order
    assert key != token_cache.tokenized_cache_key(rows[:1], "tok", {"max_length": 512})
    assert key != token_cache.tokenized_cache_key([rows[0], rows[1] | {"rejected": "e"}], "tok", {"max_length": 512})
    assert key != token_cache.tokenized_cache_key(rows, "other tokenizer", {"max_length": 512})
    assert key != token_cache.tokenized_cache_key(rows, "tok", {"max_length": 256})
    assert token_cache.tokenized_cache_dir("none") is None
    assert token_cache.tokenized_cache_dir("/x") == Path("/x/tokenized")


@needs_model
def test_tokenizer_digest_sees_the_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    digest = token_cache.tokenizer_digest(tok)
    assert digest == token_cache.tokenizer_digest(AutoTokenizer.from_pretrained(MODEL))
    tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    assert token_cache.tokenizer_digest(tok) != digest


def test_an_entry_is_made_once_read_back_and_replaced_when_damaged(tmp_path):
    from datasets import Dataset

    rows = [{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4]}] * 2
    made = []

    def prepare():
        made.append(1)
        return Dataset.from_list(rows)

    record = {}
    assert token_cache.cached(None, "k", "train", record, prepare).to_list() == rows  # --tokenized_cache none
    assert token_cache.cached(tmp_path, None, "eval", record, prepare).to_list() == rows  # a split without a key
    assert len(made) == 2 and record == {} and not any(tmp_path.iterdir())

    first = token_cache.cached(tmp_path / "tokenized", "k", "train", record, prepare)
    assert first.to_list() == rows and len(made) == 3
    assert record["train"].startswith("tokenised in ") and record["train"].endswith("s, cached")
    assert [p.name for p in (tmp_path / "tokenized").iterdir()] == ["k"]  # renamed into place, no .tmp left

    again = token_cache.cached(tmp_path / "tokenized", "k", "train", record, prepare)
    assert again.to_list() == rows and len(made) == 3 and record["train"] == "from cache (2 pairs)"

    (tmp_path / "tokenized" / "k" / "state.json").write_text("{")  # damaged: tokenised again and replaced
    assert token_cache.cached(tmp_path / "tokenized", "k", "train", record, prepare).to_list() == rows
    assert len(made) == 4 and record["train"].endswith(", cached")
    assert token_cache.cached(tmp_path / "tokenized", "k", "train", record, prepare).to_list() == rows
    assert len(made) == 4 and record["train"] == "from cache (2 pairs)"


def test_a_disk_that_cannot_take_an_entry_or_a_rank_other_than_0_leaves_none(tmp_path, monkeypatch, capsys):
    from datasets import Dataset

    from dpokit.core import ranks

    rows = [{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}]
    (tmp_path / "file").write_text("")  # a cache directory below a file: mkdir fails
    record = {}
    out = token_cache.cached(tmp_path / "file" / "tokenized", "k", "train", record, lambda: Dataset.from_list(rows))
    assert out.to_list() == rows and not record["train"].endswith("cached")
    assert "tokenised data not cached" in capsys.readouterr().out
    monkeypatch.setattr(ranks, "is_main_process", lambda: False)
    token_cache.cached(tmp_path / "tokenized", "k", "train", record, lambda: Dataset.from_list(rows))
    assert not (tmp_path / "tokenized").exists() and not record["train"].endswith("cached")
