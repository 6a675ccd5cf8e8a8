"""train_dpo.py: pure helpers on toy modules, then real 4-bit DPO steps on the bundled model."""
import contextlib
import datetime as dt
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpokit.train import evaluate, losses
from dpokit.model import fastpath
from dpokit.data import formats
from dpokit.core import kit
from dpokit.train import methods
from dpokit.model import models
from dpokit.core import runs
from dpokit.train import training
from dpokit.core.kit import UserError

ROOT = Path(__file__).resolve().parent.parent
TOOL_LS = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}
# configs/demo.yaml's measured keys
RECIPE_KEYS = {"loss_type", "learning_rate", "num_train_epochs", "eval_steps", "eval_samples", "mix",
               "distinct_chosen"}
MODEL = ROOT / models.BUNDLED_MODEL_DIR


# ------------------------------------------------------------------ pure helpers, no model

def toy_lm(quantized: bool):
    """A two-block causal-LM-shaped toy: attention and MLP projections, embeddings, a head."""
    import torch.nn as nn

    linear = nn.Linear
    if quantized:
        import bitsandbytes as bnb

        linear = lambda i, o: bnb.nn.Linear4bit(i, o, bias=False, quant_type="nf4")  # noqa: E731

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.v_proj = linear(16, 16), linear(16, 16)
            self.mlp = nn.Sequential()
            self.mlp.add_module("up_proj", linear(16, 32))
            self.norm = nn.LayerNorm(16)

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(50, 16)
            self.layers = nn.ModuleList([Block(), Block()])
            self.lm_head = nn.Linear(16, 50, bias=False)

    return Toy().to("cpu")  # .to() is what quantises bitsandbytes weights


@pytest.mark.parametrize("quantized", [False, True])
def test_layer_detection_finds_every_linear_but_the_head(quantized):
    import torch

    model = toy_lm(quantized)
    found = models.lora_target_modules(model.named_modules(), lambda m: isinstance(m, torch.nn.Linear),
                                          ["lm_head"])
    assert found == ["q_proj", "up_proj", "v_proj"]


def test_parameter_count_uses_logical_shape_of_4bit_weights():
    model = toy_lm(quantized=True)
    model.lm_head.weight.requires_grad_(False)
    model.layers[0].q_proj.weight.requires_grad_(False)
    packed = model.layers[0].q_proj.weight
    assert packed.numel() == 16 * 16 // 2  # two 4-bit values per byte: numel() undercounts
    counts = models.count_parameters(model.named_parameters())
    linear_4bit = 2 * (16 * 16 + 16 * 16 + 16 * 32)
    norms = 2 * 2 * 16
    assert counts["quantized_4bit"] == linear_4bit
    assert counts["total"] == 50 * 16 + linear_4bit + norms + 16 * 50
    # requires_grad on packed Params4bit is False by construction; embeddings + norms stay trainable
    assert counts["trainable"] == 50 * 16 + norms
    assert counts["frozen"] == counts["total"] - counts["trainable"]


def test_dequantize_swaps_4bit_layers_for_the_same_function():
    import torch

    model = toy_lm(quantized=True)
    block = model.layers[0]
    x = torch.randn(3, 16)
    before = block.q_proj(x), block.mlp.up_proj(x)
    assert models.dequantize_4bit_(model) == 6  # q, v, up in each of two blocks; the head was never 4-bit
    assert type(block.q_proj) is torch.nn.Linear and not block.q_proj.weight.requires_grad
    after = block.q_proj(x), block.mlp.up_proj(x)
    for b, a in zip(before, after):
        assert torch.allclose(b, a, atol=1e-5)


def test_tied_weights_count_once():
    model = toy_lm(quantized=False)
    model.lm_head.weight = model.embed_tokens.weight
    assert models.count_parameters(model.named_parameters())["total"] == (
        50 * 16 + 2 * (2 * (16 * 16 + 16) + (16 * 32 + 32) + 2 * 16))  # head shares the embedding


def test_parameter_table_formats_thousands():
    table = models.parameter_table({"total": 1_000_000, "trainable": 10_000, "frozen": 990_000,
                                       "quantized_4bit": 900_000})
    assert "10,000    1.00%" in table and "1,000,000  100.00%" in table


def test_dpo_config_mapping_uses_trl_names_and_device():
    cfg = training.TrainConfig(data="x.jsonl", beta=0.3, max_steps=5, learning_rate=1e-5)
    cpu = methods.dpo_config_kwargs(cfg, "/tmp/ck", on_gpu=False, bf16_ok=False)
    assert (cpu["beta"], cpu["max_steps"], cpu["learning_rate"], cpu["loss_type"]) == (0.3, 5, 1e-5, ["sigmoid"])
    assert (cpu["use_cpu"], cpu["bf16"], cpu["fp16"]) == (True, False, False)
    gpu = methods.dpo_config_kwargs(cfg, "/tmp/ck", on_gpu=True, bf16_ok=True)
    assert (gpu["use_cpu"], gpu["bf16"], gpu["fp16"]) == (False, True, False)
    old_gpu = methods.dpo_config_kwargs(cfg, "/tmp/ck", on_gpu=True, bf16_ok=False)
    assert (old_gpu["bf16"], old_gpu["fp16"]) == (False, True)
    asked = training.TrainConfig(data="x.jsonl", compute_dtype="bfloat16")
    cpu_bf16 = methods.dpo_config_kwargs(asked, "/tmp/ck", on_gpu=False, bf16_ok=False)
    assert (cpu_bf16["use_cpu"], cpu_bf16["bf16"], cpu_bf16["fp16"]) == (True, True, False)  # autocast on the CPU
    pinned = training.TrainConfig(data="x.jsonl", compute_dtype="float32")
    assert methods.dpo_config_kwargs(pinned, "/tmp/ck", on_gpu=True, bf16_ok=True)["bf16"] is False


def test_every_dpo_config_key_exists_in_trl():
    from trl import DPOConfig

    kwargs = methods.dpo_config_kwargs(training.TrainConfig(data="x"), "/tmp/ck", False, False)
    DPOConfig(**kwargs)  # raises TypeError on a name TRL does not have


def test_config_problems_are_collected():
    cfg = training.TrainConfig(ref_model_name_or_path="m", lora_r=0, beta=-1, max_steps=0, run_name="../x")
    problems = "\n".join(cfg.problems())
    assert "reference mode" not in problems  # a separate reference's log-probs are computed once too, by default
    for needle in ("--data is required", "--lora_r must be at least 1",
                   "--beta must be positive", "--max_steps must be -1 or positive", "--run_name must be a plain"):
        assert needle in problems
    assert "--mix_answers base answers the --mix pairs: give --mix" in "\n".join(
        training.TrainConfig(data="x", mix_answers="base").problems())
    assert not training.TrainConfig(data="x", mix="0.2", mix_answers="base").problems()
    kto = training.TrainConfig(data="x", method="kto", mix="0.2", mix_answers="base").problems()
    assert "--mix_answers is for DPO; --method kto does not take it" in kto
    assert "--mix_answer_tokens must be at least 8 (got 2)" in training.TrainConfig(
        data="x", mix="0.2", mix_answers="base", mix_answer_tokens=2).problems()


def test_resume_conflicts_ignore_step_budget_but_not_hyperparameters():
    old = {"beta": 0.1, "max_steps": 10, "lora_r": 16}
    assert runs.config_conflicts(old, {**old, "max_steps": 40}) == []
    assert runs.config_conflicts(old, {**old, "beta": 0.2, "lora_r": 8}) == ["beta", "lora_r"]
    # a run stopped before the fast path existed resumes with it: the same values, computed faster
    assert runs.config_conflicts(old, {**old, "fused_ops": True, "share_prompts": True}) == []
    assert runs.config_conflicts(old, {**old, "use_liger_kernel": False}) == []  # an option newer than the run
    assert runs.config_conflicts(old, {**old, "report_to": "tensorboard"}) == []  # trackers only watch


def test_truncation_counts_prompt_plus_longer_completion():
    assert training.truncation_stats([10, 10, 30], [5, 30, 1], [25, 1, 1], max_length=32) == 2


def test_held_out_split_is_stable_as_the_file_grows_and_near_the_fraction():
    pairs = [{"prompt": f"q{i}", "chosen": "a", "rejected": "b"} for i in range(4000)]
    first = [p for p in pairs[:1000] if formats.held_out(p, 0.1)]
    grown = [p for p in pairs if formats.held_out(p, 0.1)]
    assert grown[:len(first)] == first  # appending pairs never moves an earlier pair across the split
    assert 330 <= len(grown) <= 470  # 10% of 4000, within a few standard deviations
    assert not any(formats.held_out(p, 0.0) for p in pairs)


def test_mix_spec_and_counts_follow_the_stated_shares():
    assert formats.parse_mix("") == []
    assert formats.parse_mix("0.2") == [(formats.GENERAL_MIX, 0.2)]
    assert formats.parse_mix("a.jsonl:0.2, b.jsonl:0.1") == [("a.jsonl", 0.2), ("b.jsonl", 0.1)]
    for bad in ("a.jsonl:x", "a.jsonl:0", "a.jsonl:0.6,b.jsonl:0.5"):
        with pytest.raises(ValueError):
            formats.parse_mix(bad)
    assert formats.mix_counts(80, [0.2]) == [20]  # the deck's 4:1: 80 domain + 20 general = 100, 20%
    assert formats.mix_counts(60, [0.2, 0.2]) == [20, 20]


@given(st.lists(st.tuples(st.sampled_from(["q1", "q2"]), st.sampled_from(["a", "b", "c"]),
                          st.sampled_from(["x", "y"]), st.booleans()), max_size=30))
def test_distinct_chosen_trains_each_prompt_and_chosen_answer_once(rows):
    pairs = [{"prompt": p, "chosen": c, "rejected": r} | ({"tools": [TOOL_LS]} if t else {}) for p, c, r, t in rows]
    kept = formats.distinct_chosen(pairs)
    key = lambda r: (r["prompt"], r["chosen"], "tools" in r)  # noqa: E731
    first = {}
    for i, r in enumerate(pairs):
        first.setdefault(key(r), i)
    assert [id(k) for k in kept] == [id(pairs[i]) for i in first.values()]  # the first of each, in file order


@given(st.lists(st.tuples(st.sampled_from(["q1", "q2"]), st.sampled_from(["a", "b"]), st.sampled_from(["x", "y"]),
                          st.booleans()), max_size=30))
def test_distinct_chosen_keeps_the_pairs_whose_rejected_answer_broke_what_must_be_kept(rows):
    pairs = [{"prompt": p, "chosen": c, "rejected": r} | ({formats.BROKE_KEY: True} if b else {})
             for p, c, r, b in rows]
    kept = formats.distinct_chosen(pairs, keep_broke=True)
    first = {}
    for i, r in enumerate(pairs):
        first.setdefault((r["prompt"], r["chosen"]), i)
    want = [i for i, r in enumerate(pairs) if r.get(formats.BROKE_KEY) or first[(r["prompt"], r["chosen"])] == i]
    assert [id(k) for k in kept] == [id(pairs[i]) for i in want]  # every flagged pair, and the first of the rest
    assert formats.distinct_chosen(pairs) == [pairs[i] for i in first.values()]  # without keep_broke: as before


def test_a_pairs_broke_mark_reaches_the_trainer_as_a_column_only_where_some_pair_has_it(tmp_path):
    rows = [r | {"meta": {"run_id": f"run-{i}", **({"rejected_broke": True} if i == 1 else {})}}
            for i, r in enumerate(pairs_in("trl_conversational"))]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs, _ = formats.load_pairs(str(path))
    assert [formats.BROKE_KEY in p for p in pairs] == [i == 1 for i in range(len(pairs))]
    rows_in = formats.trainable(pairs)
    assert [r[formats.BROKE_COLUMN] for r in rows_in] == [i == 1 for i in range(len(pairs))]
    assert not any(formats.BROKE_KEY in r or formats.RUN_KEY in r for r in rows_in)
    assert all(formats.BROKE_COLUMN not in r for r in formats.trainable(pairs[:1] + pairs[2:]))  # none flagged


def test_distinct_chosen_is_counted_and_the_mix_follows_what_is_left(tmp_path):
    pairs = [{"prompt": [{"role": "user", "content": f"q{i % 40}"}], "chosen": [{"role": "assistant", "content": "a"}],
              "rejected": [{"role": "assistant", "content": f"r{i}"}], formats.RUN_KEY: f"run-{i % 40}"}
             for i in range(160)]  # each run's prompt 4 times, with one chosen answer and 4 rejected ones
    general = tmp_path / "general.jsonl"
    general.write_text("".join(json.dumps(p | {"prompt": [{"role": "user", "content": f"g{i}"}]}) + "\n"
                               for i, p in enumerate(pairs[:50])))
    data = formats.TrainingData(path="p", sha256="", format="x", pairs=160, skipped={})
    train, held = formats.split_and_mix(pairs, data, 0.2, f"{general}:0.2", 1, False, distinct=True)
    n_train = 160 - len(held)
    assert len(held) % 4 == 0 and data.chosen_repeats == n_train - n_train // 4  # held-out pairs stay as they are
    assert len(train) == n_train // 4 + formats.mix_counts(n_train // 4, [0.2])[0]  # a fifth of what trains
    data = formats.TrainingData(path="p", sha256="", format="x", pairs=160, skipped={})
    assert len(formats.split_and_mix(pairs, data, 0.2, "", 1, False)[0]) == n_train and data.chosen_repeats == 0
    # the mixed-in pairs carry their file (what --mix_answers answers again), and the trainer never sees the mark
    assert [r[formats.MIX_KEY] for r in train if formats.MIX_KEY in r] == [str(general)] * (len(train) - n_train // 4)
    assert all(formats.MIX_KEY not in r for r in train[:n_train // 4] + held)
    assert all(set(r) == {"prompt", "chosen", "rejected"} for r in formats.trainable(train))
    # --mix_answers base on text pairs: refused with the mix file's name, before any model loads
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"prompt": f"t{i}", "chosen": "a", "rejected": "b"}) + "\n" for i in range(9)))
    rows = [{"prompt": f"q{i}", "chosen": "a", "rejected": f"r{i}"} for i in range(40)]
    assert formats.split_and_mix(rows, data, 0.2, f"{text}:0.2", 1, False)[0]  # text with text mixes as before
    with pytest.raises(kit.UserError, match="--mix_answers base needs message-list pairs") as e:
        formats.split_and_mix(rows, data, 0.2, f"{text}:0.2", 1, False, rehearse=True)
    assert str(text) in str(e.value)


def test_a_rehearsed_answer_is_kept_only_with_its_expected_fact(tmp_path):
    assert formats.has_fact("The capital of France is Paris.", ["Paris"])
    assert formats.has_fact("2 + 3 is 4.", ["5", "five"]) is False and formats.has_fact("Five.", ["5", "five"])
    assert formats.has_fact("Hello!", None) is None and formats.has_fact("Hello!", []) is None  # nothing to check
    good = {"prompt": [{"role": "user", "content": "2+3?"}], "chosen": [{"role": "assistant", "content": "5"}],
            "rejected": [{"role": "assistant", "content": "6"}]}
    path = tmp_path / "general.jsonl"
    path.write_text(json.dumps(good | {"meta": {"expect": ["5"]}}) + "\n" + json.dumps(good) + "\n")
    records, _ = formats.load_pairs(str(path))
    assert records[0][formats.EXPECT_KEY] == ["5"] and formats.EXPECT_KEY not in records[1]
    assert formats.trainable(records)[0] == good  # the trainer never sees it
    for wrong in ("5", [5], [" "], {"a": 1}):  # [] is allowed: nothing to check, as a probe's
        path.write_text(json.dumps(good) + "\n" + json.dumps(good | {"meta": {"expect": wrong}}) + "\n")
        with pytest.raises(UserError, match="meta.expect is a list of words") as e:
            formats.load_pairs(str(path))
        assert (e.value.path, e.value.line) == (str(path), 2)


def test_the_checked_general_pairs_are_the_bundled_ones_and_hold_their_own_facts():
    # bench/general-expect.jsonl (results-recipe.md's checked rehearsal): data/general.jsonl with meta.expect words
    checked, _ = formats.load_pairs(str(ROOT / "bench" / "general-expect.jsonl"))
    bundled, _ = formats.load_pairs(str(ROOT / "data" / "general.jsonl"))
    assert formats.trainable(checked) == formats.trainable(bundled)
    facts = [r for r in checked if formats.EXPECT_KEY in r]
    assert len(facts) == 17 and all(formats.has_fact(r["chosen"][-1]["content"], r[formats.EXPECT_KEY]) for r in facts)
    assert formats.has_fact("2 + 3 is 4.", facts[0][formats.EXPECT_KEY]) is False  # what the 4-bit base says


def test_a_rehearsed_answer_is_kept_whole_or_ends_at_its_last_sentence():
    assert methods.whole_sentences("  Paris.  ", cut=False) == "Paris."
    assert methods.whole_sentences("The capital is Paris. It is also kno", cut=True) == "The capital is Paris."
    assert methods.whole_sentences("Why? Because! Then 3.5 apples and", cut=True) == "Why? Because!"
    assert methods.whole_sentences("no sentence end here at all", cut=True) is None
    assert methods.whole_sentences("Done.", cut=True) == "Done." and methods.whole_sentences(" ", cut=False) is None


def test_the_reference_is_not_precomputed_for_the_sft_loss_alone(capsys):
    cfg = training.TrainConfig(data="x", loss_type="sft", precompute_ref_log_probs=True)
    assert methods.dpo_config_kwargs(cfg, "/tmp/ck", False, False)["precompute_ref_log_probs"] is False
    assert "never reads the reference" in capsys.readouterr().out
    for other in ({"loss_type": "sigmoid"}, {"loss_type": "sigmoid", "sft_weight": 1.0}):
        kwargs = methods.dpo_config_kwargs(dataclasses.replace(cfg, **other), "/tmp/ck", False, False)
        assert kwargs["precompute_ref_log_probs"] is True, other


def test_distinct_chosen_applies_to_the_sft_loss_alone():
    cfg = training.TrainConfig(data="x", loss_type="sft", distinct_chosen=True)
    assert methods.distinct_applies(cfg, "dpo") and not methods.distinct_applies(cfg, "kto")
    assert not methods.distinct_applies(dataclasses.replace(cfg, loss_type="sigmoid", sft_weight=1.0), "dpo")
    assert not methods.distinct_applies(dataclasses.replace(cfg, distinct_chosen=False), "dpo")
    assert "--distinct_chosen is for DPO" in " ".join(dataclasses.replace(cfg, method="kto", loss_type="sigmoid",
                                                                          per_device_train_batch_size=2).problems())


def test_draw_is_seeded_and_cycles_a_small_file():
    records = list("abcde")
    assert formats.draw(records, 12, seed=1) == formats.draw(records, 12, seed=1)
    drawn = formats.draw(records, 12, seed=1)
    assert sorted(drawn[:5]) == records and drawn[5:10] == drawn[:5]


def test_preference_stats_by_hand():
    rows = [(-10.0, -12.0, 5, 4), (-8.0, -6.0, 8, 2), (-3.0, -9.0, 1, 9)]
    stats = evaluate.preference_stats(rows)
    assert stats["accuracy"] == pytest.approx(2 / 3)
    # per token: -2 > -3 yes; -1 > -3 yes; -3 > -1 no
    assert stats["accuracy_per_token"] == pytest.approx(2 / 3)
    assert stats["mean_margin"] == pytest.approx((2 - 2 + 6) / 3)


class Unigram:
    """A toy LM whose next-token distribution is the same fixed one everywhere: a completion's
    log-likelihood is the sum of its tokens' log-probabilities, whatever the prompt."""

    def __init__(self, probs):
        import torch

        self.logp = torch.log(torch.tensor(probs))
        self.device = "cpu"

    def __call__(self, input_ids, attention_mask):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.logp.expand(*input_ids.shape, -1).clone())


def test_completion_logps_on_a_toy_model_with_known_likelihoods():
    import math

    lm = Unigram([0.5, 0.25, 0.125, 0.125])
    prompts = [[3, 3], [1], [2, 1, 0]]
    completions = [[0, 0], [1, 2, 3], [2]]
    got = evaluate.completion_logps(lm, prompts, completions, pad_id=0, batch_size=2)
    want = [(2 * math.log(0.5), 2), (math.log(0.25) + 2 * math.log(0.125), 3), (math.log(0.125), 1)]
    assert [(pytest.approx(a), b) for a, b in want] == got
    stats = evaluate.preference_stats([(got[0][0], got[1][0], 2, 3)])
    assert stats["accuracy"] == 1.0  # [0, 0] is likelier than [1, 2, 3] under this model


def test_completion_logps_through_the_lean_head_match_each_rows_own_logits(monkeypatch):
    """A tiny real Llama with LoRA: the lean path (the backbone, then the head on the completion tokens alone;
    rows sorted by length and padded in batches) gives each row what the model's own full logits give for that
    row alone, with the adapter on and off; and the model whose head is not a plain one takes its own logits."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    model.eval()
    causal_lm = model.get_base_model()
    assert fastpath.lean_parts(model) == (causal_lm.model, causal_lm.lm_head)
    assert fastpath.lean_parts(model.base_model.model) == (causal_lm.model, causal_lm.lm_head)  # as dpo_logps passes it
    gen = torch.Generator().manual_seed(1)
    lengths = [(5, 3), (1, 7), (9, 1), (2, 2), (6, 5)]
    prompts = [torch.randint(1, 64, (p,), generator=gen).tolist() for p, _ in lengths]
    completions = [torch.randint(1, 64, (c,), generator=gen).tolist() for _, c in lengths]

    def alone():
        out = []
        for p, c in zip(prompts, completions):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([p + c])).logits[0].float()
            logp = logits.log_softmax(-1)[len(p) - 1:-1].gather(-1, torch.tensor(c)[:, None])
            out.append((logp.sum().item(), len(c)))
        return out

    lean_calls = []
    real_chunked = fastpath.chunked_logps

    def spy(*args, **kwargs):  # the real kernel, counted: the lean path is what ran, not the fallback
        if args[1] is causal_lm.lm_head.weight:  # not head_agrees' own probe
            lean_calls.append(args[0].shape[0])
        return real_chunked(*args, **kwargs)

    monkeypatch.setattr(fastpath, "chunked_logps", spy)
    for context in (model.disable_adapter, contextlib.nullcontext):
        with context():
            got = evaluate.completion_logps(model, prompts, completions, pad_id=0, batch_size=2)
            want = alone()
        assert [n for _, n in got] == [n for _, n in want]
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], rel=1e-5, abs=1e-5)
    assert sum(lean_calls) == 2 * sum(c for _, c in lengths)  # the head ran on the completion tokens alone
    with model.disable_adapter():
        base = evaluate.completion_logps(model, prompts, completions, pad_id=0)
    assert base != got  # the adapter moved them: the comparison above saw both models

    model.get_base_model().config.final_logit_softcapping = 30.0  # a head the lean path would get wrong
    assert fastpath.lean_parts(model) is None


def test_default_run_name_is_time_and_data_hash():
    name = runs.default_run_name("abcdef0123456789", dt.datetime(2026, 11, 22, 3, 4, 5))
    assert name == "20261122-030405-abcdef01"


def test_help_is_fast_and_lists_every_option():
    t = time.time()
    out = subprocess.run([sys.executable, str(ROOT / "train_dpo.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and time.time() - t < 5  # no torch import for --help
    for name in ("--beta", "--lora_r", "--max_length", "--precompute_ref_log_probs", "--config"):
        assert name in out.stdout


def run_train(*args, timeout=900):
    return subprocess.run([sys.executable, str(ROOT / "train_dpo.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


def test_bad_file_exits_2_with_file_line_and_leaves_no_run(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n')
    out = run_train("--data", data, "--output_dir", tmp_path / "art", "--run_name", "r")
    assert out.returncode == 2
    assert out.stderr.strip() == f"{data}:2: missing field 'rejected'"
    assert not (tmp_path / "art").exists()


def test_unknown_flag_exits_2(tmp_path):
    out = run_train("--data", "x.jsonl", "--learning_rat", "1e-4")
    assert out.returncode == 2 and "unrecognized arguments: --learning_rat" in out.stderr


# ------------------------------------------------------------------ integration: real 4-bit DPO steps

needs_model = pytest.mark.skipif(not (MODEL / "config.json").exists(),
                                 reason="bundled model not converted (make model)")

PAIRS = [
    ("How do I free space used by pip?", "Run `pip cache purge`; it removes cached wheels.", "Delete /usr/lib."),
    ("How do I shrink the systemd journal?", "Run `journalctl --vacuum-size=200M`.", "rm -rf /var/log/*"),
    ("How do I clear apt's cache?", "Run `apt-get clean` to empty /var/cache/apt/archives.", "Reinstall Linux."),
    ("How do I find big files?", "Use `du -ah / | sort -rh | head -20`.", "Buy a bigger disk."),
]


def pairs_in(fmt: str) -> list[dict]:
    rows = []
    for q, good, bad in PAIRS:
        u, a = {"role": "user", "content": q}, lambda t: {"role": "assistant", "content": t}
        rows.append({
            "trl_standard": {"prompt": f"Question: {q}\nAnswer:", "chosen": f" {good}", "rejected": f" {bad}"},
            "trl_conversational": {"prompt": [u], "chosen": [a(good)], "rejected": [a(bad)]},
            "implicit_prompt": {"chosen": [u, a(good)], "rejected": [u, a(bad)]},
            "openai": {"input": {"messages": [u]}, "preferred_output": [a(good)], "non_preferred_output": [a(bad)]},
            "hh": {"chosen": f"\n\nHuman: {q}\n\nAssistant: {good}", "rejected": f"\n\nHuman: {q}\n\nAssistant: {bad}"},
        }[fmt])
    return rows


def small_run(tmp_path, fmt, name, *extra, data=None):
    """Two real DPO steps in-process (imports and the model cache are shared between tests), on pairs_in(fmt)
    or on `data` (a path) when given. Returns the run directory and what the run printed."""
    import contextlib
    import io

    if data is None:
        data = tmp_path / f"{fmt}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in pairs_in(fmt)))
    args = ["--data", data, "--output_dir", tmp_path / "art", "--run_name", name, "--max_steps", 2,
            "--per_device_train_batch_size", 2, "--max_length", 96, "--lora_r", 4, "--lora_alpha", 8,
            "--learning_rate", 5e-4, "--eval_fraction", 0, "--probes", "", *extra]
    cwd, out = os.getcwd(), io.StringIO()
    os.chdir(ROOT)  # the bundled model's default path is relative to the repository
    try:
        with contextlib.redirect_stdout(out):
            status = kit.run_cli(training.main, list(map(str, args)))
    finally:
        os.chdir(cwd)
    assert status == 0, out.getvalue()[-3000:]
    return tmp_path / "art" / name, out.getvalue()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One conversational run shared by the tests that only read it."""
    if not (MODEL / "config.json").exists():
        pytest.skip("bundled model not converted (make model)")
    return small_run(tmp_path_factory.mktemp("trained"), "trl_conversational", "a")


def generate(run_dir, question: str) -> str:
    """Load the 4-bit base and the run's adapter with PEFT, as a receiver would, and answer greedily."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    base = AutoModelForCausalLM.from_pretrained(
        MODEL, dtype=torch.float32, device_map={"": "cpu"},
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.float32))
    model, tok = PeftModel.from_pretrained(base, run_dir), AutoTokenizer.from_pretrained(run_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=8, do_sample=False)
    return tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


@needs_model
@pytest.mark.integration
# conversational: below; implicit_prompt and openai load to its very records (tests/test_formats.py)
@pytest.mark.parametrize("fmt", ["trl_standard", "hh"])
def test_each_format_trains_to_a_complete_run_that_peft_loads(tmp_path, fmt):
    run_dir, out = small_run(tmp_path, fmt, f"r-{fmt}")
    assert f"format {fmt}" in out
    check_complete_run(run_dir, steps=2)
    assert generate(run_dir, "How do I free disk space?")


def public_set_rows(family: str) -> list[dict]:
    """PAIRS in the columns of a public preference set (a few rows each, with the columns the kit ignores)."""
    rows = []
    for i, (q, good, bad) in enumerate(PAIRS):
        u, a = {"role": "user", "content": q}, lambda t: {"role": "assistant", "content": t}
        rows.append({
            "ultrafeedback": {"prompt": q, "prompt_id": f"p{i}", "chosen": [u, a(good)], "rejected": [u, a(bad)],
                              "messages": [u, a(good)], "score_chosen": 8.0, "score_rejected": 2.0 + i},
            "orca": {"system": "You are a careful Linux admin." if i % 2 else "", "question": q, "chosen": good,
                     "rejected": "    " + bad if i == 0 else bad},  # leading spaces merge with the prompt's last token
            "argilla": {"system": "", "input": q, "chosen": good, "rejected": bad, "generations": [good, bad],
                        "status": "unchanged", "chosen_score": 9.0},
            "custom": {"instruction": q, "good": good, "bad": bad, "sys": "Be brief.", "g": 9, "b": 9 - 2 * i},
        }[family])
    return rows


@needs_model
@pytest.mark.integration
def test_public_preference_sets_in_each_file_type_train_a_step(tmp_path):
    """UltraFeedback as Parquet, Intel/orca_dpo_pairs as gzipped JSONL and argilla's orca pairs as a JSON array, in
    one directory: one step trains on all three, and data.json names each file's format and ignored columns."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "sets"
    d.mkdir()
    pq.write_table(pa.Table.from_pylist(public_set_rows("ultrafeedback")), d / "ultrafeedback.parquet")
    (d / "orca.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in public_set_rows("orca"))
                                                    .encode()))
    (d / "argilla.json").write_text(json.dumps(public_set_rows("argilla"), indent=2))
    run_dir, out = small_run(tmp_path, "", "sets", "--max_steps", 1, data=d)
    data = json.loads((run_dir / "data.json").read_text())
    assert (data["format"], data["pairs"], data["pairs_trained"]) == ("system_question+ultrafeedback", 12, 12)
    assert {f["path"]: (f["format"], f["ignored_columns"]) for f in data["files"]} == {
        "argilla.json": ("system_question", {"chosen_score": 4, "generations": 4, "status": 4}),
        "orca.jsonl.gz": ("system_question", {}),
        "ultrafeedback.parquet": ("ultrafeedback", {"messages": 4, "prompt_id": 4, "score_chosen": 4,
                                                    "score_rejected": 4})}
    assert data["ignored_columns"]["prompt_id"] == 4 and "columns ignored (rows):" in out
    # the answer that starts with spaces is tokenised after the prompt's own tokens (tokenization.tokenize_pair)
    assert data["boundary"] == {"aligned": 11, "continued": 1, "not_exact": 0}


@needs_model
@pytest.mark.integration
def test_a_column_mapping_with_a_score_gap_trains_a_step(tmp_path):
    """Any other shape, named with --columns (system included), and pairs too close in score left out."""
    data = tmp_path / "custom.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in public_set_rows("custom")))
    columns = "prompt=instruction,chosen=good,rejected=bad,system=sys,score_chosen=g,score_rejected=b"
    run_dir, out = small_run(tmp_path, "", "custom", "--max_steps", 1, "--columns", columns, "--min_score_gap", 1,
                             "--report_to", "tensorboard", data=data)
    data = json.loads((run_dir / "data.json").read_text())
    assert (data["format"], data["pairs"], data["score_gap_dropped"], data["ignored_columns"]) == (
        "system_question", 3, 1, {})
    assert data["columns"]["prompt"] == "instruction" and data["min_score_gap"] == 1.0
    # --report_to tensorboard: the run's own directory holds the event file, with the loss metrics.jsonl logged
    events = sorted((run_dir / "logs" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and json.loads((run_dir / "manifest.json").read_text())["files"][
        str(events[0].relative_to(run_dir))]
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert tensorboard_scalars(events[0])["train/loss"] == [(1, pytest.approx(logged[0]["loss"], rel=1e-6))]


def tensorboard_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """An event file read as TensorBoard reads it: TFRecords (length, crc, Event protobuf, crc) -> tag: [(step, value)]."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    raw, at, scalars = path.read_bytes(), 0, {}
    while at < len(raw):
        (n,) = struct.unpack("<Q", raw[at:at + 8])
        event = Event.FromString(raw[at + 12:at + 12 + n])
        at += 12 + n + 4
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_report_to_names_known_trackers_whose_package_is_installed():
    assert methods.trackers("none") == [] and methods.trackers("tensorboard, wandb") == ["tensorboard", "wandb"]
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    assert set(runs.TRACKERS) == set(INTEGRATION_TO_CALLBACK)  # the kit's list is transformers' own
    assert runs.tracker_problems("tensorboard") == []  # tensorboardX is in the lock
    problems = runs.tracker_problems("tensorbored,kubeflow")
    assert problems[0].startswith("--report_to: unknown tracker 'tensorbored'")
    assert problems[1] == "--report_to kubeflow: needs the kubeflow package (pip install kubeflow)"
    cfg = training.TrainConfig(data="x.jsonl", report_to="tensorboard")
    assert methods.dpo_config_kwargs(cfg, "/tmp/ck", False, False)["report_to"] == ["tensorboard"]
    assert methods.dpo_config_kwargs(training.TrainConfig(data="x"), "/tmp/ck", False, False)["report_to"] == "none"


def check_complete_run(run_dir: Path, steps: int):
    assert not run_dir.with_name(run_dir.name + ".partial").exists()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "succeeded" and [h["state"] for h in status["history"]][-1] == "succeeded"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["files"] == runs.file_hashes(run_dir)
    assert manifest["steps"] == steps and manifest["versions"]["trl"] == "1.14.2"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps + 1))
    tarball = run_dir.with_name(run_dir.name + ".tar.gz")
    assert (tarball.parent / (tarball.name + ".sha256")).read_text().split()[0] == kit.sha256_file(tarball)


@needs_model
@pytest.mark.integration
def test_conversational_run_loads_with_peft_generates_and_is_reproducible(tmp_path, trained):
    from safetensors.torch import load_file

    run_a, out = trained
    check_complete_run(run_a, steps=2)
    assert "LoRA targets: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in out
    assert "of which 4-bit" in out
    params = json.loads((run_a / "parameters.json").read_text())
    # r * (in + out) per layer: q, k, v, o (k and v project to 3 KV heads x 64), then gate, up, down; 30 blocks
    per_block = (576 + 576) + 2 * (576 + 192) + (576 + 576) + 3 * (576 + 1536)
    assert params["trainable"] == 30 * 4 * per_block
    weights = load_file(run_a / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in weights.items())  # training moved B off zero
    assert generate(run_a, PAIRS[0][0])

    run_b, out_b = small_run(tmp_path, "trl_conversational", "b")
    assert "[data] train: from cache (4 pairs)" in out_b  # the same data and tokenizer: tokenised once
    assert kit.sha256_file(run_a / "adapter_model.safetensors") == kit.sha256_file(run_b / "adapter_model.safetensors")
    # The CPU shortcut (NF4 weights dequantised once) must train exactly what the 4-bit kernels train,
    # and tokenising afresh (no cache) exactly what the cached tokens train. (Compared with the libraries'
    # own LoRA modules on both sides: the fused ones sum the same gradients in another order, see below.)
    assert "NF4 layers dequantised once to float32" in out
    run_c, out_c = small_run(tmp_path, "trl_conversational", "c", "--no_dequantize_on_cpu", "--tokenized_cache", "none",
                             "--no_fused_ops")
    assert "dequantised once" not in out_c and "from cache" not in out_c and "fused ops" not in out_c
    run_d, out_d = small_run(tmp_path, "trl_conversational", "d", "--no_fused_ops")
    assert kit.sha256_file(run_d / "adapter_model.safetensors") == kit.sha256_file(run_c / "adapter_model.safetensors")
    # The fused kernels (the default) against the libraries' modules: the same training to float rounding.
    assert "fused ops (fastpath.py): 210 LoRA layers, 61 RMSNorms, 30 SiLU gates, the chunked head" in out
    assert "forward passes ran each prompt once for both completions" in out  # pairs share their prompt
    assert "each prompt once" not in out_d
    assert_same_training(run_a, run_d)
    # The layers a GPU keeps 4-bit (peft's bitsandbytes LoRA class) take the fused forward too.
    run_e, out_e = small_run(tmp_path, "trl_conversational", "e", "--no_dequantize_on_cpu", "--tokenized_cache", "none")
    assert "fused ops (fastpath.py): 210 LoRA layers" in out_e and "kept their own forward" not in out_e
    assert_same_training(run_e, run_c)


@needs_model
@pytest.mark.integration
def test_a_speed_up_that_raises_mid_training_steps_aside_and_the_run_finishes(tmp_path, monkeypatch):
    """The kit's lean head raising at a step (a kernel this GPU's build cannot run, say) does not end the run:
    one line says so and TRL's own log-probs carry on."""
    calls = []

    def raises(*a, **k):
        calls.append(1)
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    monkeypatch.setattr(fastpath, "dpo_logps", raises)
    run_dir, out = small_run(tmp_path, "trl_conversational", "aside", "--tokenized_cache", "none")
    assert len(calls) == 1 and out.count("the kit's lean head raised RuntimeError: CUDA error") == 1
    assert json.loads((run_dir / "status.json").read_text())["state"] == "succeeded"
    assert len([r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]) == 2


@needs_model
@pytest.mark.integration
def test_chunked_log_probs_learn_what_the_full_logits_path_learns(tmp_path, trained):
    """The default (completion tokens only, output head in chunks) against TRL's full-logits path:
    the same losses and rewards at every step, to float rounding, and the same adapter update."""
    run_a, out = trained
    assert "log-probs: chunked, completion tokens only" in out
    run_f, out_f = small_run(tmp_path, "trl_conversational", "full", "--no_chunked_logps")
    assert "log-probs: full logits" in out_f and "the chunked head" not in out_f
    assert_same_training(run_a, run_f)


def assert_same_training(run_a: Path, run_f: Path):
    """Two runs of the same steps on the same data learned the same: losses and rewards at every step to
    float rounding, and the same adapter update."""
    import torch
    from safetensors.torch import load_file

    def rows(run):
        return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    a, f = rows(run_a), rows(run_f)
    assert len(a) == len(f) == 2
    for ra, rf in zip(a, f):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "entropy"):
            assert ra[key] == pytest.approx(rf[key], rel=1e-4, abs=1e-5), key
    assert a[1]["loss"] != a[0]["loss"]  # the second step saw a moved adapter: the comparison is not vacuous
    # lora_B starts at zero, so it is all learned: the two updates agree to well under 1% (Adam divides by
    # the gradient's size, so near-zero gradients amplify rounding: an element-wise bound would be noise)
    wa, wf = load_file(run_a / "adapter_model.safetensors"), load_file(run_f / "adapter_model.safetensors")
    b = [k for k in wa if "lora_B" in k]
    learned = torch.cat([wa[k].flatten() for k in b])
    assert learned.norm() > 0
    assert (learned - torch.cat([wf[k].flatten() for k in b])).norm() / learned.norm() < 1e-2


@needs_model
@pytest.mark.integration
def test_the_sft_loss_on_the_chosen_rows_alone_learns_what_trls_whole_pass_learns(tmp_path):
    """--loss_type sft: training steps forward the chosen rows only (no rejected rows, no reference pass), with
    the lean head and with full logits, and learn what TRL's whole pass learns: the same loss at every step to
    float rounding, and the same adapter update."""
    import torch
    from safetensors.torch import load_file

    def rows(run):
        return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    whole, out_w = small_run(tmp_path, "trl_conversational", "whole", "--loss_type", "sft", "--no_chosen_only")
    assert "chosen rows only" not in out_w and "rewards/margins" in rows(whole)[0]
    ref = load_file(whole / "adapter_model.safetensors")
    b = [k for k in ref if "lora_B" in k]
    learned = torch.cat([ref[k].flatten() for k in b])
    assert learned.norm() > 0 and rows(whole)[1]["loss"] != rows(whole)[0]["loss"]
    for name, extra in (("chosen", ()), ("chosen-full-logits", ("--no_chunked_logps",))):
        run, out = small_run(tmp_path, "trl_conversational", name, "--loss_type", "sft", *extra)
        assert "training steps forward the chosen rows only" in out
        assert "2 training batches forwarded their chosen rows only" in out
        assert json.loads((run / "data.json").read_text())["chosen_only"] is True
        card = (run / "README.md").read_text()
        assert "| logps/chosen |" in card and "rewards/margins" not in card and "held-out evaluation only" in card
        for ra, rw in zip(rows(run), rows(whole), strict=True):
            assert ra["loss"] == pytest.approx(rw["loss"], rel=1e-4), name
            assert ra["num_tokens"] == rw["num_tokens"] and "rewards/margins" not in ra
            assert ra["logps/chosen"] == pytest.approx(rw["logps/chosen"], rel=1e-4), name
        got = load_file(run / "adapter_model.safetensors")
        assert (learned - torch.cat([got[k].flatten() for k in b])).norm() / learned.norm() < 1e-2, name
    # Each pair again with another rejected answer, as build_pairs pairs a best answer with each failed attempt:
    # --distinct_chosen trains each chosen answer once, so the run is the run on the distinct pairs.
    twice = tmp_path / "twice.jsonl"
    other = {"rejected": [{"role": "assistant", "content": "no"}]}
    twice.write_text("".join(f"{json.dumps(r)}\n{json.dumps(r | other)}\n" for r in pairs_in("trl_conversational")))
    run, out = small_run(tmp_path, "trl_conversational", "distinct", "--loss_type", "sft", "--distinct_chosen",
                         data=twice)
    assert f"({len(PAIRS)} repeating a chosen answer left out)" in out
    assert json.loads((run / "data.json").read_text())["chosen_repeats"] == len(PAIRS)
    assert f"left out as repeats of a chosen answer (--distinct_chosen): {len(PAIRS)} pairs" in \
        (run / "README.md").read_text()
    for ra, rw in zip(rows(run), rows(whole), strict=True):
        assert ra["loss"] == pytest.approx(rw["loss"], rel=1e-4)


@needs_model
@pytest.mark.integration
def test_the_broke_term_is_trls_sigmoid_loss_on_the_flagged_pairs_added_to_the_sft_loss(tmp_path):
    """--broke_weight W with --loss_type sft: a batch whose pairs all rejected an answer that deleted what must be
    kept trains on sft + W x DPO's sigmoid loss, which TRL's own pass computes as loss_type [sigmoid, sft]; with no
    pair flagged the term never runs and the run is the sft run."""
    def rows(run):
        return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    flagged = tmp_path / "flagged.jsonl"
    flagged.write_text("".join(json.dumps(r | {"meta": {"rejected_broke": True}}) + "\n"
                               for r in pairs_in("trl_conversational")))
    trl, _ = small_run(tmp_path, "trl_conversational", "trl", "--sft_weight", "1.0", data=flagged)
    ours, out = small_run(tmp_path, "trl_conversational", "ours", "--loss_type", "sft", "--broke_weight", "1.0",
                          data=flagged)
    assert f"on the {len(PAIRS)} training pairs whose rejected answer deleted" in out
    assert "2 training batches ran DPO's term on pairs whose rejected answer" in out
    assert json.loads((ours / "data.json").read_text())["broke_term"] == {"weight": 1.0, "pairs": len(PAIRS)}
    for ra, rt in zip(rows(ours), rows(trl), strict=True):
        assert ra["loss"] == pytest.approx(rt["loss"], rel=1e-3)
        assert ra["broke/rewards/margins"] == pytest.approx(rt["rewards/margins"], rel=1e-2, abs=1e-3)
        assert "rewards/margins" not in ra  # the step's own metrics stay the sft loss's
    half, _ = small_run(tmp_path, "trl_conversational", "half", "--loss_type", "sft", "--broke_weight", "0.5",
                        data=flagged)
    sft, _ = small_run(tmp_path, "trl_conversational", "sft", "--loss_type", "sft")
    first = [rows(run)[0]["loss"] for run in (sft, half, ours)]
    assert first[1] - first[0] == pytest.approx((first[2] - first[0]) / 2, rel=1e-3)  # the weight scales the term
    plain, out = small_run(tmp_path, "trl_conversational", "plain", "--loss_type", "sft", "--broke_weight", "1.0")
    assert "none here, so the term never runs" in out and "ran DPO's term" not in out
    assert [r["loss"] for r in rows(plain)] == pytest.approx([r["loss"] for r in rows(sft)], rel=1e-5)


def test_the_chosen_rows_need_only_their_own_width():
    import torch

    att = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]])
    assert losses.chosen_width(att, None) == 5
    assert losses.chosen_width(att, 4) == 8 and losses.chosen_width(att, 3) == 6
    assert losses.chosen_width(att, 16) == 8  # never wider than the batch
    assert losses.chosen_width(torch.zeros(2, 4, dtype=torch.long), None) == 1


def stopped_after_a_step(args: list, partial: Path) -> str:
    """Start a training, SIGTERM it once its first step is logged; it must exit 128 + SIGTERM. Its output."""
    proc = subprocess.Popen(list(map(str, args)), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, deadline = partial / "metrics.jsonl", time.time() + 600
    while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 128 + signal.SIGTERM, log[-3000:]
    return log


@needs_model
@pytest.mark.integration
def test_sigterm_saves_a_checkpoint_and_the_same_command_resumes(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pairs_in("trl_conversational") * 4))

    def command(name):
        return [sys.executable, str(ROOT / "train_dpo.py"), "--data", data, "--output_dir", tmp_path / "art",
                "--run_name", name, "--max_steps", 6, "--save_steps", 100, "--per_device_train_batch_size", 2,
                "--max_length", 96, "--lora_r", 4, "--eval_fraction", 0, "--probes", ""]

    args = command("res")
    stopped_after_a_step(args, tmp_path / "art" / "res.partial")
    partial = tmp_path / "art" / "res.partial"
    status = json.loads((partial / "status.json").read_text())
    assert status["state"] == "cancelled" and 1 <= status["step"] < 6
    assert not (tmp_path / "art" / "res").exists()

    out = subprocess.run(list(map(str, args)), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"resuming res from {partial}/checkpoints/checkpoint-{status['step']}" in out.stdout
    run_dir = tmp_path / "art" / "res"
    check_complete_run(run_dir, steps=6)
    history = [h["state"] for h in json.loads((run_dir / "status.json").read_text())["history"]]
    assert history == ["pending", "running", "cancelled", "pending", "running", "succeeded"]
    # Stopped and resumed, it trained exactly what the same command trains uninterrupted (CPU float32 is
    # bit-deterministic: the same data order, RNG state, optimizer and scheduler state after the resume).
    whole = subprocess.run(list(map(str, command("whole"))), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]

    def steps(run):  # every logged training value but num_tokens, which TRL counts from 0 again on resume, and
        return [{k: v for k, v in r.items() if k not in ("num_tokens", "seconds_left")}  # the time estimate
                for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    assert steps(run_dir) == steps(tmp_path / "art" / "whole") and len(steps(run_dir)) == 6
    assert kit.sha256_file(run_dir / "adapter_model.safetensors") == kit.sha256_file(
        tmp_path / "art" / "whole" / "adapter_model.safetensors")

    again = subprocess.run(list(map(str, args)), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "already complete" in again.stdout
    changed = subprocess.run(list(map(str, args + ["--beta", "0.5"])), cwd=ROOT, capture_output=True, text=True)
    assert changed.returncode == 2 and "different beta" in changed.stderr


def test_missing_model_exits_2_before_any_run_directory(tmp_path):
    data = tmp_path / "ok.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    out = run_train("--data", data, "--output_dir", tmp_path / "art", "--model_name_or_path", tmp_path / "nope")
    assert out.returncode == 2 and "is neither a model directory nor a hub id" in out.stderr
    assert not (tmp_path / "art").exists()


@needs_model
@pytest.mark.integration
def test_chat_from_the_tarball_answers_with_base_and_tuned(trained, capsys):
    run_dir, _ = trained
    tarball = run_dir.with_name(run_dir.name + ".tar.gz")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert evaluate.chat(str(tarball), ["How do I clear apt's cache?"], compare=True, max_new_tokens=12) == 0
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    base = next(x for x in out.splitlines() if x.startswith("[base]"))
    tuned = next(x for x in out.splitlines() if x.startswith("[tuned]"))
    assert len(base) > len("[base] ") and len(tuned) > len("[tuned] ")


@needs_model
@pytest.mark.integration
def test_merge_gives_a_plain_16bit_model_that_matches_base_plus_adapter(trained, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    run_dir, _ = trained
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        dest = evaluate.merge(str(run_dir), str(tmp_path / "merged"))
    finally:
        os.chdir(cwd)
    report = json.loads((dest / "merge_report.json").read_text())
    assert report["float32_merge_max_abs_diff"] <= report["tolerance"] == 1e-3
    assert report["top1_agreement_vs_unmerged"] > 0.9  # bfloat16 rounding may flip a near tie, not many
    model = AutoModelForCausalLM.from_pretrained(dest)
    assert model.dtype == torch.bfloat16 and not hasattr(model, "peft_config")
    assert (dest / "tokenizer.json").exists() and "merged in" in (dest / "README.md").read_text()


@needs_model
def test_the_mixed_in_pairs_can_rehearse_the_base_models_own_greedy_answers():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    general = [json.loads(x) for x in (ROOT / "data/general.jsonl").read_text().splitlines()][:3]
    expect = [None, ["tokyo"], ["366"]]  # 2 + 3 with nothing to check, Japan's capital, a leap year's days
    domain = {"prompt": [{"role": "user", "content": "Clear npm's cache"}], "chosen": [{"role": "assistant",
              "content": "npm cache clean --force"}], "rejected": [{"role": "assistant", "content": "rm -rf /"}]}
    pairs = [dict(domain)] + [r | {formats.MIX_KEY: "general.jsonl"} | ({formats.EXPECT_KEY: e} if e else {})
                              for r, e in zip(general + general[:1], expect + expect[:1])]  # one repeats
    data = formats.TrainingData(path="p", sha256="", format="x", pairs=1, skipped={})
    given = training.TrainConfig(data="x", mix="0.5")
    methods.answer_mix(given, model, tokenizer, pairs, data)  # the default: the file's answers
    assert [r["chosen"] for r in pairs[1:]] == [r["chosen"] for r in general + general[:1]] and not data.mix_answers
    limit = 24  # --mix_answer_tokens: short enough that some of the base's answers are cut
    greedy = models.generate(model, tokenizer, [r["prompt"] for r in general], limit)
    methods.answer_mix(dataclasses.replace(given, mix_answers="base", mix_answer_tokens=limit), model, tokenizer,
                       pairs, data)
    assert pairs[0] == domain  # only the mixed-in pairs change, and only their chosen answer
    assert [r["rejected"] for r in pairs[1:]] == [r["rejected"] for r in general + general[:1]]
    cut = [len(tokenizer(a, add_special_tokens=False)["input_ids"]) >= limit - 1 for a in greedy]
    whole = [methods.whole_sentences(a, c) for a, c in zip(greedy, cut)]
    kept = [w if w is not None and formats.has_fact(w, e) is not False else None for w, e in zip(whole, expect)]
    assert [r["chosen"][0]["content"] for r in pairs[1:]] == [k or g["chosen"][0]["content"]
                                                               for k, g in zip(kept + kept[:1], general + general[:1])]
    assert data.mix_answers["prompts"] == 3 and data.mix_answers["base"] + data.mix_answers["given"] == 3
    assert [a["answer"] for a in data.mix_answers["answers"]] == whole
    assert [a["trained"] for a in data.mix_answers["answers"]] == ["base" if k else "file" for k in kept]
    # the bundled base (float32) says a leap year has 365 days: its own wrong fact is not rehearsed (in 4 bits it
    # says "2 + 3 is 4.", which, rehearsed, made a tuned model answer "1 + 1 is 1.")
    assert data.mix_answers["wrong"] >= 1 and kept[2] is None and whole[2] is not None


@needs_model
@pytest.mark.integration
def test_held_out_evaluation_probes_report_and_mix(tmp_path):
    probes = tmp_path / "probes.jsonl"
    probes.write_text('{"prompt": "What is 1+1?", "expect": ["2", "two"]}\n{"prompt": "Say hello.", "expect": []}\n')
    rows = [{**r, "prompt": [{"role": "user", "content": f"{r['prompt'][0]['content']} (host {i})"}]}
            for i in range(5) for r in pairs_in("trl_conversational")]
    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = [r for r in rows if formats.held_out(r, 0.25)]
    n_train = len(rows) - len(held)
    run_dir, out = small_run(tmp_path, "trl_conversational", "ev", "--data", data, "--eval_fraction", 0.25,
                             "--eval_steps", 1, "--probes", probes, "--mix", f"{ROOT / 'data/general.jsonl'}:0.2",
                             "--sft_weight", 0.1, "--mix_answers", "base")
    mixed = formats.mix_counts(n_train, [0.2])[0]
    assert f"{len(held)} held out; training on {n_train + mixed}" in out
    assert f"mixed in {mixed} from {ROOT / 'data/general.jsonl'} (20% of the mixture)" in out
    data_json = json.loads((run_dir / "data.json").read_text())
    assert data_json["mix"][0]["pairs_used"] == mixed and data_json["held_out"] == len(held)
    rehearsed = data_json["mix_answers"]  # --mix_answers base: the base's own answers, kept in data.json
    assert rehearsed["prompts"] == len({json.dumps(a["prompt"]) for a in rehearsed["answers"]}) > 0
    assert f"[mix] {rehearsed['base']} of the {rehearsed['prompts']} mixed-in prompts trained on the base model's" in out

    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    for name in ("base", "tuned"):
        assert evaluation["held_out"][name]["pairs"] == len(held)
    assert [p["prompt"] for p in evaluation["probes"]] == ["What is 1+1?", "Say hello."]
    assert evaluation["probes"][1]["tuned_has_fact"] is None  # nothing expected, nothing claimed
    report = (run_dir / "report.md").read_text()
    assert "## Held-out preference accuracy" in report and "## Retention probes" in report
    for png in ("loss.png", "margins.png", "accuracies.png"):
        assert (run_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png})" in report
    rows_logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in r for r in rows_logged)  # TRL's own held-out metrics during training
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert set(manifest["eval"]) == {"base", "tuned"} and manifest["mix"][0]["pairs_used"] == mixed

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        again = evaluate.evaluate_run(str(run_dir.with_name("ev.tar.gz")), str(data), str(tmp_path / "re-eval"))
    finally:
        os.chdir(cwd)
    assert json.loads((again / "evaluation.json").read_text())["held_out"]["tuned"]["pairs"] == len(rows)


@needs_model
@pytest.mark.integration
def test_unknown_lora_target_is_a_user_error_with_the_choices(tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pairs_in("trl_conversational")))
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        status = kit.run_cli(training.main, ["--data", str(data), "--output_dir", str(tmp_path / "art"),
                                              "--run_name", "bad", "--lora_target_modules", "q_proj,nope_proj"])
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert status == 2 and "no module named nope_proj" in err and "q_proj, up_proj, v_proj" in err
    status_json = json.loads((tmp_path / "art" / "bad.partial" / "status.json").read_text())
    assert status_json["state"] == "failed" and "nope_proj" in status_json["error"]


@needs_model
@pytest.mark.integration
def test_bfloat16_on_a_cpu_trains_through_the_fast_path(tmp_path):
    """--compute_dtype bfloat16 on a CPU (accelerate's autocast): the fused kernels, each prompt once and the lean
    head run under autocast, and the run says which (its log and data.json). One step: bfloat16 matmuls are
    slow on a CPU without native bfloat16 (AVX2 only)."""
    run_dir, out = small_run(tmp_path, "trl_conversational", "bf16", "--compute_dtype", "bfloat16", "--max_steps", 1)
    # the SiLU gates run the module's own product in bfloat16 on a CPU (fastpath.silu_mul_applies)
    assert ("fused ops (fastpath.py): 210 LoRA layers, 61 RMSNorms, 0 SiLU gates, the chunked head "
            "(bfloat16 autocast;") in out
    assert "[model] 2 forward passes took their log-probs through the lean head" in out  # the policy and the reference
    assert "[model] 2 forward passes ran each prompt once for both completions" in out
    fused = json.loads((run_dir / "data.json").read_text())["fused_ops"]
    assert fused == {"lora_linear": 210, "rms_norm": 61, "mlp": 0, "own_forward": {}, "chunked_head": True,
                     "dtype": "bfloat16"}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows if "loss" in r] == [pytest.approx(0.6931, abs=1e-3)]  # step 1: policy = reference


@needs_model
@pytest.mark.integration
def test_cpu_matmul_precision_bf16_is_recorded_close_to_float32_and_undone(tmp_path, trained):
    """The opt-in CPU 'TF32': the same training to bfloat16 rounding, recorded, and torch's global
    setting put back afterwards (the other in-process tests stay exact float32)."""
    import torch

    run_a, _ = trained
    run_m, out = small_run(tmp_path, "trl_conversational", "fpmath", "--cpu_matmul_precision", "bf16")
    assert "round their inputs to bfloat16" in out
    assert "--cpu_matmul_precision bf16" in json.loads((run_m / "data.json").read_text())["compute"]
    assert torch.backends.mkldnn.matmul.fp32_precision == "none"

    def losses(run):
        return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    assert losses(run_m) == pytest.approx(losses(run_a), abs=0.02)



def test_the_demo_recipe_holds_only_what_differs_from_the_defaults_and_flags_override_it():
    demo = str(ROOT / "configs" / "demo.yaml")
    recipe = kit._read_config_file(demo)
    assert set(recipe) == RECIPE_KEYS
    defaults = training.TrainConfig()
    assert all(kit.coerce(training.TrainConfig, {k: v}, demo)[k] != getattr(defaults, k) for k, v in recipe.items())
    assert kit.parse_config(training.TrainConfig, ["--config", demo, "--data", "p.jsonl"], "") == \
        dataclasses.replace(training.TrainConfig(data="p.jsonl"), **recipe)
    assert kit.parse_config(training.TrainConfig, ["--config", demo, "--data", "p.jsonl", "--beta", "0.3"], "").beta == 0.3


def test_progress_line_says_step_loss_margin_and_time_left():
    logs = {"loss": 0.69314, "rewards/margins": 0.01234, "rewards/accuracies": 0.5, "grad_norm": 1.0}
    assert runs.progress_line(3, 10, logs, 2.0) == "step 3/10  loss 0.6931  margin 0.012  acc 0.50  2.0 s/step  0:00:14 left"
    assert runs.progress_line(5, 10, {"eval_loss": 0.5, "eval_rewards/margins": 1.0}, None) == \
        "step 5/10  eval loss 0.5000  eval margin 1.000"
    assert runs.progress_line(10, 10, {"train_runtime": 61.2, "train_loss": 0.5}, 6.1) == \
        "step 10/10  done in 61s  mean loss 0.5000"


def test_fastpath_version_check_names_what_it_was_written_for():
    assert fastpath.version_problem({"trl": "1.14.2", "transformers": "5.20.2"}) is None
    assert fastpath.version_problem({"trl": "1.14.0", "transformers": "5.17.0"}) is None  # the GPU machine's
    assert fastpath.version_problem({"trl": "1.15.0", "transformers": "5.20.2"}) == \
        "the kit's fast path (fastpath.py) reaches into trl 1.14.x internals and this is trl 1.15.0"
    assert fastpath.version_problem({"trl": "1.140.0", "transformers": "5.20.2"}) is not None
    assert "transformers 6.0.0" in fastpath.version_problem({"trl": "1.14.2", "transformers": "6.0.0"})


def test_the_broke_term_refuses_a_trl_it_was_not_written_for_where_the_public_api_would_skip_it(monkeypatch, capsys):
    monkeypatch.setattr(fastpath, "version_problem", lambda: "the kit's fast path reaches into trl 1.14.x internals")
    cfg = training.TrainConfig(data="x", fused_ops=False)
    assert training.trl_internals_usable(cfg) is False and "TRL's own dataset preparation" in capsys.readouterr().out
    with pytest.raises(UserError, match="--broke_weight's term runs in the kit's DPO trainer"):
        training.trl_internals_usable(dataclasses.replace(cfg, broke_weight=1.0))


def test_run_lock_keeps_a_run_to_one_process(tmp_path):
    with runs.RunLock(tmp_path, "x"):
        assert (tmp_path / ".x.lock").read_text().strip() == f"{os.getpid()} {socket.gethostname()}"
        with pytest.raises(UserError) as e:
            runs.RunLock(tmp_path, "x").__enter__()  # another open file: flock refuses it as it would another process
        assert str(e.value).startswith(f"run x is in use by pid {os.getpid()} on {socket.gethostname()};")
        with runs.RunLock(tmp_path, "y"):  # another run name is another lock
            pass
    assert not (tmp_path / ".x.lock").exists()
    with runs.RunLock(tmp_path, "x"):  # released: free again
        pass


def test_status_has_one_writer_that_keeps_the_history(tmp_path):
    runs.write_status(tmp_path, "r", "pending")
    runs.write_status(tmp_path, "r", "running")
    runs.write_status(tmp_path, "r", "failed", error="boom", rank=1)
    runs.write_status(tmp_path, "r", "failed", error="boom again", rank=0)  # a state is not repeated back to back
    status = json.loads((tmp_path / "status.json").read_text())
    assert [h["state"] for h in status["history"]] == ["pending", "running", "failed"]
    assert {k: status[k] for k in ("run_name", "state", "error", "rank")} == \
        {"run_name": "r", "state": "failed", "error": "boom again", "rank": 0}


@needs_model
@pytest.mark.integration
def test_a_second_training_into_one_run_stops_with_exit_2_and_the_first_finishes_untouched(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pairs_in("trl_conversational") * 2))
    args = list(map(str, [sys.executable, ROOT / "train_dpo.py", "--data", data, "--output_dir", tmp_path / "art",
                          "--run_name", "lk", "--max_steps", 3, "--per_device_train_batch_size", 2, "--max_length", 96,
                          "--lora_r", 4, "--eval_fraction", 0, "--probes", ""]))
    first = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    status = tmp_path / "art" / "lk.partial" / "status.json"
    deadline = time.time() + 600
    while not status.exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    second = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    log = first.communicate(timeout=900)[0]
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
    assert second.stderr.strip() == f"error: run lk is in use by pid {first.pid} on {socket.gethostname()}; wait " \
                                    "for it, or choose another --run_name (RUN=)"
    assert first.returncode == 0, log[-3000:]
    run_dir = tmp_path / "art" / "lk"
    check_complete_run(run_dir, steps=3)
    history = [h["state"] for h in json.loads((run_dir / "status.json").read_text())["history"]]
    assert history == ["pending", "running", "succeeded"]
    assert not (tmp_path / "art" / ".lk.lock").exists()


@needs_model
@pytest.mark.integration
def test_another_trl_gets_one_sentence_and_no_fused_ops_still_trains(tmp_path, monkeypatch, capsys):
    import trl

    monkeypatch.setattr(trl, "__version__", "1.15.0")
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pairs_in("trl_conversational")))
    args = ["--data", str(data), "--output_dir", str(tmp_path / "art"), "--run_name", "v", "--max_steps", "2",
            "--max_length", "96", "--lora_r", "4", "--eval_fraction", "0", "--probes", ""]
    assert kit.run_cli(training.main, args) == 2
    assert capsys.readouterr().err == (
        "error: the kit's fast path (fastpath.py) reaches into trl 1.14.x internals and this is trl 1.15.0: install "
        "the pinned versions (requirements.txt; make venv), or train with --no_fused_ops, which uses TRL's public "
        "API only\n")
    assert not (tmp_path / "art").exists()  # refused before any run directory
    run_dir, out = small_run(tmp_path, "trl_conversational", "v", "--no_fused_ops")
    check_complete_run(run_dir, steps=2)
    assert "this is trl 1.15.0: TRL's own dataset preparation and log-probs" in out
    assert "log-probs: full logits" in out and "fused ops" not in out and "[data] train:" not in out  # no cache


def test_resume_trims_later_rows_and_the_interrupted_attempts_summary(tmp_path):
    rows = [{"step": 1, "loss": 0.7}, {"step": 2, "loss": 0.6}, {"step": 2, "train_runtime": 9.0, "train_loss": 0.65},
            {"step": 3, "loss": 0.5}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs.trim_metrics(path, 2)
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows[:2]


def test_the_cuda_allocator_gets_expandable_segments_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert models.cuda_allocator_defaults() is None and "PYTORCH_ALLOC_CONF" not in os.environ
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert models.cuda_allocator_defaults() == "expandable_segments:True" == os.environ["PYTORCH_ALLOC_CONF"]


def test_a_gpu_that_goes_unused_is_named_with_the_reason(tmp_path):
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.183.01  Release Build  (dvs-builder@U16)\n"
                       "GCC version:  gcc version 12.3.0\n")
    assert models.nvidia_driver(str(version)) == "535.183.01"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.256.02  Thu May  2 14:37:44 UTC 2024\n")
    assert models.nvidia_driver(str(version)) == "470.256.02"
    assert models.nvidia_driver(str(tmp_path / "absent")) is None
    assert models.gpu_unused_reason(None, "12.8") is None  # no driver: a CPU machine, nothing to say
    assert "too old" in models.gpu_unused_reason("535.183.01", "13.0") and "580.65.06" in models.gpu_unused_reason(
        "535.183.01", "13.0")
    assert "too old" in models.gpu_unused_reason("470.256.02", "12.8")
    assert "CPU build" in models.gpu_unused_reason("550.54.14", None)
    other = models.gpu_unused_reason("580.95.05", "13.0")  # new enough: something else (devices hidden, ...)
    assert "too old" not in other and "cannot use it" in other


def test_lora_weights_are_trained_in_float32_after_trls_bfloat16_cast(tmp_path):
    """TRL's trainers cast a 4-bit model's trainable weights to bfloat16 (on any device); the kit casts them
    back, so AdamW's weights and moments are float32 as --compute_dtype's help says. Frozen weights stay."""
    pytest.importorskip("bitsandbytes")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16))
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for p in model.parameters():  # what TRL's DPOTrainer and KTOTrainer do to a quantised model
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    frozen = {n: p.dtype for n, p in model.named_parameters() if not p.requires_grad}
    assert models.float32_trainable(model) == 4
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {n: p.dtype for n, p in model.named_parameters() if not p.requires_grad} == frozen
    assert models.float32_trainable(model) == 0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_prepare_4bit_training_gives_peft_losses_and_gradients_without_float32_tables(checkpointing):
    """Under bfloat16 autocast, a bfloat16 tiny Llama with LoRA: the kit's preparation (norms cast, embedding
    output cast, tables kept in bfloat16) gives the same loss and LoRA gradients, bit for bit, as peft's
    prepare_model_for_kbit_training, which makes float32 copies of the embedding and the head."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import LlamaConfig, LlamaForCausalLM

    from dpokit.model import models

    def build(prepare):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.is_loaded_in_4bit = True  # peft enables checkpointing for k-bit models only
        prepare(model)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
        return model.train()

    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    results = []
    for prepare in (lambda m: prepare_model_for_kbit_training(m, use_gradient_checkpointing=checkpointing),
                    lambda m: models.prepare_4bit_training(m, checkpointing)):
        model = build(prepare)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        inner = model.base_model.model
        results.append((loss.detach(), grads, inner.model.embed_tokens.weight.dtype, inner.lm_head.weight.dtype,
                        inner.model.norm.weight.dtype))
    (peft_loss, peft_grads, *peft_dtypes), (kit_loss, kit_grads, *kit_dtypes) = results
    assert peft_dtypes == [torch.float32] * 3
    assert kit_dtypes == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert torch.equal(kit_loss, peft_loss)
    assert kit_grads.keys() == peft_grads.keys() and len(kit_grads) == 12
    for name, grad in peft_grads.items():
        assert torch.equal(kit_grads[name], grad), name


# ------------------------------------------------------------------ KTO: unpaired examples

def test_kto_weights_put_the_classes_at_the_papers_balance():
    d, u = methods.kto_weights(10, 40)  # rarer desirable: up-weighted, 1.15 x 40 / 10
    assert (d, u) == (4.6, 1.0) and d * 10 / (u * 40) == pytest.approx(methods.KTO_BALANCE)
    d, u = methods.kto_weights(40, 10)  # rarer undesirable: the desirable side still just ahead
    assert d == 1.0 and d * 40 / (u * 10) == pytest.approx(methods.KTO_BALANCE, rel=1e-3)
    assert 1 <= methods.kto_weights(7, 7)[0] * 7 / 7 <= 4 / 3
    assert methods.kto_weights(10, 40, 2.0, 0.5) == (2.0, 0.5)  # both given: kept
    d, u = methods.kto_weights(10, 40, undesirable=2.0)  # one given: the other from the balance
    assert d * 10 / (u * 40) == pytest.approx(methods.KTO_BALANCE)


def test_kto_problems_and_the_method_follow_the_data():
    cfg = training.TrainConfig(data="x.jsonl", method="kto", per_device_train_batch_size=1, sft_weight=0.5)
    problems = " ".join(cfg.problems())
    assert "batch_size 2 or more" in problems and "--sft_weight is for DPO" in problems
    examples = [{"prompt": "q", "completion": "a", "label": True}]
    pairs = [{"prompt": "q", "chosen": "a", "rejected": "b"}]
    assert training.resolve_method(training.TrainConfig(data="x"), examples) == "kto"
    assert training.resolve_method(training.TrainConfig(data="x"), pairs) == "dpo"
    assert training.resolve_method(training.TrainConfig(data="x", method="kto"), pairs) == "kto"
    with pytest.raises(UserError, match="--method dpo needs preference pairs"):
        training.resolve_method(training.TrainConfig(data="x", method="dpo"), examples)
    with pytest.raises(UserError, match="unpaired examples .KTO., and --mix is for DPO"):
        training.resolve_method(training.TrainConfig(data="x", mix="0.2"), examples)
    kwargs = methods.kto_config_kwargs(training.TrainConfig(data="x"), "/tmp/c", False, False, (1.5, 1.0))
    from trl import KTOConfig

    args = KTOConfig(**kwargs)
    assert (args.loss_type, args.desirable_weight, args.undesirable_weight, args.beta) == ("kto", 1.5, 1.0, 0.1)
    assert args.train_sampling_strategy == "sequential"  # TRL's KL term needs it; load_data shuffles instead


def kto_examples(runs_: int = 8) -> list[dict]:
    """PAIRS as build_pairs --emit kto writes them: each answer an example, one run id per question copy."""
    rows = []
    for i in range(runs_):
        q, good, bad = PAIRS[i % len(PAIRS)]
        u, a = [{"role": "user", "content": q}], lambda t: [{"role": "assistant", "content": t}]
        bad = "    " + bad if i == 0 else bad  # an answer that starts with spaces merges with the prompt's end
        rows += [{"prompt": u, "completion": a(good), "label": True, "meta": {"run_id": f"r{i}"}},
                 {"prompt": u, "completion": a(bad), "label": False, "meta": {"run_id": f"r{i}"}}]
    return rows


@needs_model
@pytest.mark.integration
def test_kto_in_4bit_stops_on_sigterm_resumes_and_hands_off_a_tarball_that_verifies(tmp_path):
    data = tmp_path / "kto.jsonl"
    rows = kto_examples()
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = sorted({r["meta"]["run_id"] for r in rows if formats.held_out({"_run": r["meta"]["run_id"]}, 0.25)})
    assert 0 < len(held) < 8  # the fixed ids hold some runs out: their pairs are what the report compares

    def command(name):
        return [sys.executable, str(ROOT / "train_dpo.py"), "--data", data, "--output_dir", tmp_path / "art",
                "--run_name", name, "--max_steps", 4, "--save_steps", 100, "--per_device_train_batch_size", 2,
                "--max_length", 96, "--lora_r", 4, "--learning_rate", 5e-4, "--eval_fraction", 0.25,
                "--eval_steps", 100, "--probes", ""]

    args = command("kto")
    log = stopped_after_a_step(args, tmp_path / "art" / "kto.partial")
    assert "KTO, format kto" in log and "from the class balance" in log and "of which 4-bit" in log
    status = json.loads((tmp_path / "art" / "kto.partial" / "status.json").read_text())
    assert status["state"] == "cancelled" and 1 <= status["step"] < 4

    out = subprocess.run(list(map(str, args)), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"checkpoint-{status['step']}" in out.stdout
    run_dir = tmp_path / "art" / "kto"
    check_complete_run(run_dir, steps=4)
    data_json = json.loads((run_dir / "data.json").read_text())
    assert data_json["method"] == "kto" and data_json["labels"] == {"desirable": 8, "undesirable": 8}
    assert data_json["held_out"] == 2 * len(held) and data_json["pairs_trained"] == 16 - 2 * len(held)
    # r0's indented answer is tokenised after the prompt's own tokens (tokenization.tokenize_example), not TRL's split
    assert "r0" not in held
    assert data_json["boundary"] == {"aligned": 16 - 2 * len(held) - 1, "continued": 1, "not_exact": 0}
    assert "not a prefix" not in out.stdout + out.stderr
    assert json.loads((run_dir / "manifest.json").read_text())["method"] == "kto"
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    kto = evaluation["held_out_kto"]
    assert kto["base"]["desirable"]["examples"] == kto["base"]["undesirable"]["examples"] == len(held)
    assert evaluation["held_out"]["base"]["pairs"] == len(held)  # each held-out run's good answer vs its bad one
    assert "Held-out examples (KTO)" in (run_dir / "report.md").read_text()
    assert "LoRA KTO adapter" in (run_dir / "README.md").read_text()
    manifest = runs.verify_tarball(run_dir.with_name("kto.tar.gz"))
    assert manifest["run_name"] == "kto" and f"{16 - 2 * len(held)} KTO examples, kto" in runs.describe_run(manifest)
    # Stopped and resumed, it trained what the same command trains uninterrupted
    whole = subprocess.run(list(map(str, command("whole"))), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert kit.sha256_file(run_dir / "adapter_model.safetensors") == kit.sha256_file(
        tmp_path / "art" / "whole" / "adapter_model.safetensors")


# ------------------------------------------------------------------ tool-calling agents

TOOL_PAIRS = ROOT / "data" / "tool_pairs.jsonl"


def test_tool_use_needs_a_template_that_shows_it_and_the_run_stops_before_any_model_loads(tmp_path):
    plain = tmp_path / "plain.jinja"  # not ChatML, and blind to tools: nothing the kit ships stands in for it
    plain.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    out = run_train("--data", TOOL_PAIRS, "--output_dir", tmp_path / "art", "--run_name", "t",
                    "--chat_template", plain)
    assert out.returncode == 2, out.stderr[-2000:]
    message = out.stderr.strip().splitlines()[-1]
    assert message.startswith(f"{TOOL_PAIRS}: the data holds tool calls") and f"--chat_template {plain}" in message
    assert "--chat_template FILE.jinja" in message and "loaded" not in out.stdout  # no model was loaded
    assert not (tmp_path / "art").exists()
    missing = run_train("--data", TOOL_PAIRS, "--chat_template", "nope", "--output_dir", tmp_path / "art")
    assert missing.returncode == 2 and "neither a template the kit ships (chatml-tools) nor a file" in missing.stderr


@needs_model
@pytest.mark.integration
def test_tool_calling_conversations_train_with_the_shipped_template_to_a_tarball_peft_loads(tmp_path):
    from dpokit.data import tokenization
    from transformers import AutoTokenizer

    # No --chat_template: the bundled model's own ChatML template leaves tool use out, so the kit's chatml-tools
    # is chosen, said, and recorded as if given
    run_dir, out = small_run(tmp_path, "openai", "tools", "--max_length", 512, data=TOOL_PAIRS)
    assert "own chat template cannot render them" in out and "training with the kit's chatml-tools template" in out
    check_complete_run(run_dir, steps=2)
    verified = runs.verify_tarball(run_dir.with_name("tools.tar.gz"), tmp_path / "unpacked")
    assert verified["files"]
    assert json.loads((run_dir / "config.json").read_text())["chat_template"] == "chatml-tools"
    assert "chat template: `chatml-tools`" in (run_dir / "README.md").read_text()
    # The run's tokenizer carries the template, so whoever serves the adapter renders tool calls as it trained.
    tok = AutoTokenizer.from_pretrained(run_dir)
    record = formats.load_pairs(str(TOOL_PAIRS))[0][0]
    text = tok.apply_chat_template(record["prompt"] + record["chosen"], tools=record["tools"], tokenize=False)
    assert '<tool_call>\n{"name": "run_python", "arguments": {"code": ' in text and "<tool_response>\nok\n" in text
    assert '"name": "disk_usage"' in text.split("<|im_end|>")[0]  # the tools list is in the system turn
    ids = tokenization.tokenize_pair(tok, formats.dataset_rows([record, pairs_in("trl_conversational")[0]])[0])
    assert tok.decode(ids["prompt_ids"] + ids["chosen_ids"]) == text  # what the trainer saw, through Arrow's rows
    assert generate(run_dir, "How do I free disk space?")  # PEFT loads the adapter on the 4-bit base


def test_the_shipped_tool_template_renders_plain_chats_as_smollm2s_own_and_shows_every_part_of_tool_use():
    from transformers import AutoTokenizer

    if not (MODEL / "tokenizer.json").exists():
        pytest.skip("bundled model not converted (make model)")
    tok = AutoTokenizer.from_pretrained(MODEL)
    assert models.tool_template_problem(tok) == "its chat template leaves out the tool's name, the tools list, the call"
    own, shipped = tok.chat_template, models.chat_template_text("chatml-tools")
    for chat in ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]):
        for generation in (False, True):
            texts = []
            for template in (own, shipped):
                tok.chat_template = template
                texts.append(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation))
            assert texts[0] == texts[1]
    tok.chat_template = shipped
    assert models.tool_template_problem(tok) is None


# ------------------------------------------------------------------ answers scored by running them

def test_eval_prompts_are_checked_before_anything_loads(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "Clear pip\'s cache", "host": "Host a, user ci"}\n{"prompt": "x"}\n')
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pairs_in("trl_conversational")))
    out = run_train("--data", data, "--eval_prompts", bad, "--output_dir", tmp_path / "art")
    assert out.returncode == 2 and out.stderr.strip().endswith(
        f"{bad}:2: host must be a string (the host as the prompt describes it)")
    assert not (tmp_path / "art").exists()


def test_the_report_shows_base_and_tuned_checker_scores():
    execution = {"prompts": 2, "samples": 3, "rows": [],
                 "base": {"pass_rate": 0.0, "mean_score": 0.0, "outcomes": {"failed": 6}, "isolation": "bwrap"},
                 "tuned": {"pass_rate": 0.5, "mean_score": 0.0312, "outcomes": {"failed": 3, "freed": 3},
                           "isolation": "bwrap"}}
    text = evaluate.report_markdown("r", {"execution": execution}, [])
    assert "## Answers run by the checker" in text and "Sandbox: **bwrap mode**, no Landlock." in text
    execution["base"]["landlock"] = 7
    assert "Sandbox: **bwrap mode**, Landlock ABI 7." in evaluate.report_markdown("r", {"execution": execution}, [])
    assert "| base | 0.000 | +0.0000 | failed 6 | n/a | n/a |" in text
    assert "| tuned | 0.500 | +0.0312 | failed 3, freed 3 | n/a | n/a |" in text
    assert "could not be scored" not in text
    # limits mode: the header names it, counts what it could not score, and the rates are over the rest
    for name, n in (("base", 2), ("tuned", 0)):
        execution[name] |= {"isolation": "limits", "answers": 6, "unscorable": n, "scored": 6 - n}
    text = evaluate.report_markdown("r", {"execution": execution}, [])
    assert "Sandbox: **limits mode**" in text
    assert ("**base: 2 of 6 answers could not be scored in limits mode (they name or reach host paths it cannot "
            "plant; bubblewrap or unshare mode scores them): every rate is over the other 4.**") in text
    assert "tuned: 0 of" not in text
    execution["tuned"] |= {"pass_rate": None, "mean_score": None}  # none could be scored: n/a, never a 0
    assert "| tuned | n/a | n/a |" in evaluate.report_markdown("r", {"execution": execution}, [])


def test_the_report_tells_the_story_base_and_tuned_answers_side_by_side_with_bytes_freed():
    rows = [{"model": m, "prompt": p, "sample": i, "outcome": o, "score": sc, "freed_bytes": fb, "reason": why,
             "answer": a} for m, p, i, o, sc, fb, why, a in [
        ("base", "Clear pip", 0, "failed", 0.0, 0, "does not compile", "pip is a tool ```x```"),
        ("base", "Clear pip", 1, "no_effect", 0.0, 0, "", "print(0)"),
        ("tuned", "Clear pip", 0, "failed", 0.0, 0, "exit status 1", "import nope"),
        ("tuned", "Clear pip", 1, "freed", 0.05, 600 << 20, "", "import shutil\nshutil.rmtree('x')"),
        ("base", "Empty trash", 0, "broke", -1.0, 0, "~/Documents/thesis.odt", "rm -rf ~"),
        ("tuned", "Empty trash", 0, "no_effect", 0.0, 0, "", "pass")]]
    execution = {"prompts": 2, "samples": 2, "rows": rows,
                 "base": {"pass_rate": 0.0, "mean_score": -0.33, "outcomes": {"failed": 1, "no_effect": 1, "broke": 1},
                          "isolation": "bwrap", "freed_bytes": 0, "kept_files_touched": 1},
                 "tuned": {"pass_rate": 1 / 3, "mean_score": 0.0167, "outcomes": {"failed": 1, "freed": 1,
                           "no_effect": 1}, "isolation": "bwrap", "freed_bytes": 600 << 20, "kept_files_touched": 0}}
    text = evaluate.report_markdown("r", {"execution": execution}, [])
    assert "| base | 0.000 | -0.3300 | broke 1, failed 1, no_effect 1 | 0 MB | 1 |" in text
    assert "| tuned | 0.333 | +0.0167 | failed 1, freed 1, no_effect 1 | 600 MB | 0 |" in text
    story = text.split("### Base and tuned, side by side")[1]
    assert story.index("**Clear pip**") < story.index("**Empty trash**")
    assert "base (answer 1 of 2; 0 of 2 passed): failed: does not compile" in story
    assert "tuned (answer 2 of 2; 1 of 2 passed): freed 600 MB, score +0.050" in story  # its passing answer
    assert "base (answer 1 of 1; 0 of 1 passed): deleted what must be kept: ~/Documents/thesis.odt" in story
    assert "````\npip is a tool ```x```\n````" in story  # an answer's own fences stay inside the block


def test_the_report_gives_the_prompts_no_training_record_has_apart():
    trained = [{"prompt": [{"role": "user", "content": "Clear pip"}], "chosen": "x", "rejected": "y"},
               {"prompt": "Clear npm", "chosen": "x", "rejected": "y"}]
    prompts = [{"prompt": [{"role": "user", "content": c}], "host": "h"} for c in ("Clear pip", "Empty trash")]
    assert [p["seen"] for p in evaluate.mark_seen(prompts, trained)] == [True, False]
    assert evaluate.mark_seen([{"prompt": "Clear npm", "host": "h"}], trained)[0]["seen"]  # text prompts too
    assert not evaluate.mark_seen(prompts[:1], [{"prompt": [{"role": "system", "content": "Clear pip"}]}])[0]["seen"]
    rows = [{"model": m, "prompt": p, "sample": 0, "outcome": o, "score": sc, "seen": p == "Clear pip"}
            for m, p, o, sc in [("base", "Clear pip", "failed", 0.0), ("base", "Empty trash", "broke", -1.0),
                                ("tuned", "Clear pip", "freed", 0.2), ("tuned", "Empty trash", "freed", 0.1)]]
    result = {"prompts": 2, "samples": 1, "rows": rows}
    assert evaluate.new_text_scores(result, "tuned") == {"prompts": 1, "answers": 1, "pass_rate": 1.0,
                                                         "mean_score": 0.1, "broke": 0, "unscorable": 0}
    assert evaluate.new_text_scores(result, "base")["broke"] == 1
    unmarked = {**result, "rows": [{k: v for k, v in r.items() if k != "seen"} for r in rows]}
    assert evaluate.new_text_scores(unmarked, "tuned") is None  # make eval on another file: nothing to split
    all_new = {**result, "rows": [r | {"seen": False} for r in rows]}
    assert evaluate.new_text_scores(all_new, "tuned") is None
    for name, rate, score in (("base", 0.0, -0.5), ("tuned", 1.0, 0.15)):
        result[name] = {"pass_rate": rate, "mean_score": score, "outcomes": {}, "isolation": "bwrap",
                        "new_prompts": evaluate.new_text_scores(result, name)}
    text = evaluate.report_markdown("r", {"execution": result}, [])
    assert ("1 of the 2 prompts are word for word a training record's prompt (the same strategy, retried on another "
            "run). On the other 1: pass rate 0.000 -> 1.000, mean score -1.0000 -> +0.1000, answers that deleted kept "
            "files 1 -> 0.") in text
    assert evaluate.summary_lines({"execution": result})[0].endswith(
        "; on the 1 prompts no training record has: pass rate 0.000 -> 1.000")


@needs_model
@pytest.mark.integration
def test_a_run_with_eval_prompts_reports_what_the_checker_made_of_base_and_tuned_answers(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    texts = [f"Write Python 3 code that {task}. Reply with the code only." for task in ("deletes ~/.cache/pip",
                                                                                        "deletes old files in /tmp")]
    texts.append(PAIRS[0][0])  # a training pair's prompt, word for word
    prompts.write_text("".join(json.dumps({"prompt": t, "host": "Host ci-runner-03, Ubuntu 22.04, user ci (no sudo)"})
                               + "\n" for t in texts))
    run_dir, out = small_run(tmp_path, "trl_conversational", "ex", "--eval_prompts", prompts, "--eval_samples", 2,
                             "--eval_max_new_tokens", 32)
    assert "[eval] 3 of 3 --eval_prompts prompts are held out" in out and "[eval] checker on held-out prompts" in out
    execution = json.loads((run_dir / "evaluation.json").read_text())["execution"]
    for name in ("base", "tuned"):
        assert sum(execution[name]["outcomes"].values()) == 6 and 0 <= execution[name]["pass_rate"] <= 1
        assert execution[name]["new_prompts"]["prompts"] == 2 and execution[name]["new_prompts"]["answers"] == 4
    assert [r["seen"] for r in execution["rows"] if r["model"] == "tuned"] == [False] * 4 + [True] * 2
    assert "On the other 2: pass rate" in (run_dir / "report.md").read_text()
    assert "## Answers run by the checker" in (run_dir / "report.md").read_text()


# ------------------------------------------------------------------ make train DATA=<file>: the recipe on every format

RECIPE = ["--config", "configs/demo.yaml"]  # what `make train DATA=...` adds on the bundled model (the Makefile's RECIPE)


def every_format(tmp_path) -> dict:
    """A file in each shape docs/formats.md lists (its table's pair formats, text and message lists, KTO's unpaired
    examples, GRPO's prompts, tool-calling pairs, supervised rows), 20 rows where the shape allows."""
    def n(f):
        return [f(i) for i in range(20)]

    u = lambda i: {"role": "user", "content": f"What is {i} + 2?"}  # noqa: E731
    a = lambda t: {"role": "assistant", "content": t}  # noqa: E731
    files = {
        "trl_standard": n(lambda i: {"prompt": f"{i}+2=", "chosen": f" {i + 2}", "rejected": f" {i + 3}"}),
        "trl_conversational": n(lambda i: {"prompt": [u(i)], "chosen": [a(f"{i + 2}")], "rejected": [a(f"{i + 3}")]}),
        "implicit_prompt": n(lambda i: {"chosen": [u(i), a(f"{i + 2}")], "rejected": [u(i), a(f"{i + 3}")]}),
        "implicit_prompt_text": n(lambda i: {"chosen": f"What is {i} plus 2? It is {i + 2}",
                                             "rejected": f"What is {i} plus 2? It is {i + 3}"}),
        "openai": n(lambda i: {"input": {"messages": [u(i)]}, "preferred_output": [a(f"{i + 2}")],
                               "non_preferred_output": [a(f"{i + 3}")]}),
        "hh": n(lambda i: {"chosen": f"\n\nHuman: {i}+2?\n\nAssistant: {i + 2}",
                           "rejected": f"\n\nHuman: {i}+2?\n\nAssistant: {i + 3}"}),
        "ultrafeedback": n(lambda i: {"prompt": f"What is {i} + 2?", "chosen": [u(i), a(f"{i + 2}")],
                                      "rejected": [u(i), a(f"{i + 3}")], "score_chosen": 8.0, "score_rejected": 3.0}),
        "system_question": n(lambda i: {"system": "You add.", "question": f"{i}+2?", "chosen": f"{i + 2}",
                                        "rejected": f"{i + 3}"}),
        "kto": n(lambda i: {"prompt": [u(i)], "completion": [a(f"{i + 2 if i % 2 else i + 3}")], "label": bool(i % 2)}),
        "kto_text": n(lambda i: {"prompt": f"{i}+2=", "completion": f" {i + 2 if i % 2 else i + 3}",
                                 "label": bool(i % 2)}),
        "supervised": n(lambda i: {"messages": [u(i), a(f"{i + 2}")]}),
    }
    out = {}
    for name, rows in files.items():
        out[name] = tmp_path / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    from dpokit.scoring import checker

    out["prompts"] = tmp_path / "prompts.jsonl"
    out["prompts"].write_text("".join(json.dumps(r) + "\n" for r in checker.prompts_from_logs(str(ROOT / "data" / "runs.jsonl"))))
    out["tools"] = ROOT / "data" / "tool_pairs.jsonl"
    return out


def test_every_format_docs_formats_lists_is_covered_here(tmp_path):
    listed = set(re.findall(r"^\| `(\w+)` \|", (ROOT / "docs" / "formats.md").read_text(), re.M))
    assert listed and listed <= set(every_format(tmp_path))


@pytest.mark.parametrize("name", ["trl_standard", "trl_conversational", "implicit_prompt", "implicit_prompt_text",
                                  "openai", "hh", "ultrafeedback", "system_question", "kto", "kto_text", "supervised",
                                  "prompts", "tools"])
def test_make_trains_data_of_every_format_with_the_recipe_it_adds(tmp_path, name, capsys):
    """`make train DATA=<file>`: the recipe's mix of general pairs (message lists) comes in the data's shape, and
    its DPO options are left out, said, where the data holds KTO examples or GRPO prompts."""
    data = every_format(tmp_path)[name]
    cfg = kit.parse_config(training.TrainConfig, [*RECIPE, "--data", str(data)], "")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        info, train, held = training.load_data(cfg)
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    assert train
    if info.method in ("kto", "grpo"):
        assert "configs/demo.yaml: loss_type 'sft', mix '0.2', distinct_chosen True are DPO options" in out
        assert (cfg.loss_type, cfg.mix) == ("sigmoid", "")
        return
    assert info.mix and info.mix[0]["path"] == "data/general.jsonl" and info.mix[0]["pairs_used"] > 0
    mixed = [r for r in train if formats.MIX_KEY in r]
    assert mixed and {isinstance(r["prompt"], list) for r in train} == {isinstance(train[0]["prompt"], list)}
    if not isinstance(train[0]["prompt"], list):
        assert "message-list pairs brought to the data's text shape" in out
    if name == "supervised":
        assert info.format == "openai_supervised" and cfg.loss_type == "sft"


def test_a_flag_is_never_dropped_for_the_data_only_a_recipe_files_option():
    cfg = kit.parse_config(training.TrainConfig, [*RECIPE, "--data", "x.jsonl", "--mix", "0.1"], "")
    assert kit.from_config_file(cfg).get("loss_type") == "configs/demo.yaml" and "mix" not in kit.from_config_file(cfg)
    methods.recipe_fits(cfg, "kto", "unpaired examples (KTO)")
    assert (cfg.loss_type, cfg.mix) == ("sigmoid", "0.1")  # the flag stays: resolve_method then refuses it


@needs_model
@pytest.mark.integration
@pytest.mark.parametrize("name", ["trl_standard", "kto_text", "supervised"])
def test_make_train_data_trains_text_pairs_kto_examples_and_supervised_rows_with_the_recipe(tmp_path, name):
    data = every_format(tmp_path)[name]
    run_dir, out = small_run(tmp_path, "", f"recipe-{name}", *RECIPE, "--eval_samples", 1, "--max_steps", 1,
                             "--per_device_train_batch_size", 2, "--max_length", 96, "--lora_r", 4,
                             "--eval_fraction", 0, "--probes", "", data=data)
    assert (run_dir / "adapter_model.safetensors").exists(), out[-2000:]


def test_an_eval_forward_leaves_the_4bit_layers_as_loaded_so_training_after_it_is_unchanged(tmp_path):
    """The reference's pass and evaluations run the 4-bit base in eval mode without gradients. On a CPU with
    AVX512-BF16, bitsandbytes 0.50 repacks each layer then (scales rounded to bfloat16, a kernel with no backward)
    and keeps it so: loaded through the kit, a model trains after such a pass exactly as one that never ran it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from dpokit.model import models

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))

    def grads_after(eval_pass: bool):
        model = models.load_model(str(tmp_path / "tiny"), models.LoadOptions(compute_dtype="float32"),
                                  on_gpu=False, bf16_ok=False)
        layer = model.model.layers[0].mlp.up_proj
        assert type(layer).__name__ == "Linear4bit" and not getattr(layer, models.BNB_CPU_REPACK_FLAG)
        loaded = layer.weight.data.clone()
        torch.manual_seed(2)  # LoRA's A
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
        if eval_pass:
            with torch.no_grad():
                model.eval()(input_ids=ids)
        assert torch.equal(layer.weight.data, loaded)  # not repacked
        loss = model.train()(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    (loss_a, grads_a), (loss_b, grads_b) = grads_after(False), grads_after(True)
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys() and len(grads_a) == 8
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
