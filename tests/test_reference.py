"""The reference's log-probs once before training (dpokit/train/reference.py), without a model: what an entry's key
depends on, how entries are written and read back, and when the pass is worth running (methods.reference_pass).
Training through it, against the reference forward in every step, is tests/test_objective.py's.

    .venv/bin/python -m pytest -q tests/test_reference.py
"""
import dataclasses
import os

import pytest

from dpokit.model import fastpath
from dpokit.train import methods, reference, training

IDENT = {"base": {"name": "m"}, "adapter": "", "dtype": "float32", "device": "cpu", "versions": {"trl": "1.14.2"}}


def test_the_key_changes_with_the_data_and_with_everything_the_numbers_depend_on():
    key = reference.cache_key("tokens-a", IDENT)
    assert key == reference.cache_key("tokens-a", dict(reversed(list(IDENT.items()))))  # order does not matter
    assert reference.cache_key("tokens-b", IDENT) != key
    for field, other in (("adapter", "ab12"), ("dtype", "bfloat16"), ("device", "NVIDIA H200"),
                         ("versions", {"trl": "1.14.3"}), ("base", {"name": "m2"})):
        assert reference.cache_key("tokens-a", IDENT | {field: other}) != key, field


def test_a_models_files_name_it_without_reading_the_weights(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    first = reference.files_identity(str(tmp_path))
    assert first[weights.name][0] == 10 and reference.files_identity(str(tmp_path)) == first
    os.utime(weights, ns=(1, 1))  # rewritten in place: another mtime
    assert reference.files_identity(str(tmp_path)) != first
    (tmp_path / "config.json").write_text('{"a": 2}')
    assert reference.files_identity(str(tmp_path))["config.json"] != first["config.json"]
    assert reference.files_identity("random:llama-8b") == {"name": "random:llama-8b"}
    gguf = tmp_path / "run-q8_0.gguf"
    gguf.write_bytes(b"GGUF one")
    before = reference.files_identity(str(gguf))
    gguf.write_bytes(b"GGUF two, longer")  # exported again to the same name
    assert reference.files_identity(str(gguf)) != before


def test_the_identity_names_the_adapter_that_is_the_reference_and_what_computes():
    cfg, compute = training.TrainConfig(data="x"), fastpath.Compute(matmuls="float32 matmuls")
    first = reference.identity(cfg, compute, "", "cpu", {"trl": "1.14.2"})
    assert reference.identity(cfg, compute, "", "cpu", {"trl": "1.14.2"}) == first
    for other in (reference.identity(cfg, compute, "ab12", "cpu", {"trl": "1.14.2"}),  # an --init_adapter run
                  reference.identity(cfg, fastpath.Compute(matmuls="bfloat16 matmuls"), "", "cpu", {"trl": "1.14.2"}),
                  reference.identity(dataclasses.replace(cfg, share_prompts=False), compute, "", "cpu",
                                     {"trl": "1.14.2"})):
        assert reference.cache_key("t", other) != reference.cache_key("t", first)


def test_an_entry_is_written_whole_and_read_back_only_for_the_same_rows(tmp_path):
    import torch

    path = tmp_path / "ref" / "k.safetensors"
    chosen, rejected = torch.tensor([-1.5, -2.25, -3.0]), torch.tensor([-4.0, -5.5, -6.125])
    assert reference.save(path, chosen, rejected) == "cached"
    assert [p.name for p in path.parent.iterdir()] == ["k.safetensors"]  # no temporary left behind
    got = reference.load(path, 3)
    assert torch.equal(got[0], chosen) and torch.equal(got[1], rejected)
    assert reference.load(path, 4) is None  # another split's length: not these rows
    assert reference.load(tmp_path / "none.safetensors", 3) is None
    path.write_bytes(b"junk")
    assert reference.load(path, 3) is None
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert reference.save(blocked / "k.safetensors", chosen, rejected).startswith("not cached")


def test_rows_are_batched_longest_first():
    class Rows(dict):
        column_names = ("prompt_ids", "chosen_ids", "rejected_ids")

    rows = Rows(prompt_ids=[[1], [1, 2, 3], [1, 2]], chosen_ids=[[1], [1], [1, 2, 3, 4]], rejected_ids=[[1, 2], [1], [1]])
    assert reference.length_order(rows) == [2, 1, 0]  # 6, 4, 3 tokens


@pytest.mark.parametrize("max_steps, batch, accumulation, processes, once", [
    (-1, 2, 1, 1, True),  # epochs: every row is trained
    (5, 2, 1, 1, True),  # 10 rows trained of 10
    (4, 2, 1, 1, False),  # 8 of 10
    (2, 2, 2, 1, False),
    (2, 2, 2, 2, True),  # two processes: 16 of 10
])
def test_the_pass_before_training_runs_where_training_sees_every_row(max_steps, batch, accumulation, processes, once,
                                                                     capsys):
    cfg = training.TrainConfig(data="x", max_steps=max_steps, per_device_train_batch_size=batch,
                               gradient_accumulation_steps=accumulation)
    got = methods.reference_pass(cfg, {"precompute_ref_log_probs": True}, 10, processes)
    assert got == ({} if once else {"precompute_ref_log_probs": False})
    assert ("the reference forward runs in each step" in capsys.readouterr().out) is not once
    assert methods.reference_pass(cfg, {"precompute_ref_log_probs": False}, 10, processes) == {}


def test_the_pass_gives_each_row_its_own_values_and_halves_its_batch_when_memory_runs_out(capsys):
    """reference.compute over a trainer's collator and compute_ref_log_probs (TRL's), here a stand-in that
    returns each row's id as its log-probs and runs out of memory above 2 pairs a forward: every row gets its
    own values in dataset order, longest rows first, the batch halved until it fits (said)."""
    import torch
    from datasets import Dataset

    rows = Dataset.from_list([{"prompt_ids": [1] * (i % 4 + 1), "chosen_ids": [1], "rejected_ids": [2, 2], "rid": i,
                               reference.BROKE_COLUMN: False} for i in range(7)])
    seen = []

    class Trainer:
        ref_model, model = None, "policy"

        @staticmethod
        def data_collator(examples):
            return {"rid": torch.tensor([e["rid"] for e in examples]), reference.BROKE_COLUMN: torch.tensor([False])}

        @staticmethod
        def _prepare_inputs(batch):
            assert reference.BROKE_COLUMN not in batch  # not a model input
            return batch

        @staticmethod
        def compute_ref_log_probs(model, batch):
            if len(batch["rid"]) > 2:
                raise torch.OutOfMemoryError("CUDA out of memory")
            seen.append(batch["rid"].tolist())
            return -batch["rid"].double(), -10.0 - batch["rid"].double()

    chosen, rejected = reference.compute(Trainer(), rows, 8)
    assert chosen.tolist() == [-float(i) for i in range(7)] and rejected.tolist() == [-10.0 - i for i in range(7)]
    assert seen[0] == [3, 2]  # the longest rows first (4 and 3 prompt tokens)
    assert sorted(sum(seen, [])) == list(range(7)) and max(map(len, seen)) == 2
    out = capsys.readouterr().out
    assert "ran out of GPU memory at 8 pairs a forward; 4 from here" in out and "at 4 pairs a forward; 2 from" in out
