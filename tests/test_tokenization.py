"""tokenization.py: where each completion's tokens start (aligned, continued, not_exact) on the bundled
SmolLM2 tokenizer (no model), for pairs and KTO examples alike, and the KTO dataset preparation."""

from pathlib import Path

import pytest

from dpokit.data import tokenization

BUNDLED = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def tokenizer():
    if not (BUNDLED / "tokenizer_config.json").exists():
        pytest.skip("bundled model not converted (make model)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BUNDLED)


def test_a_completion_that_merges_with_the_prompt_is_tokenised_after_it(tokenizer):
    """SmolLM2's template ends the generation prompt in '\\n'; an answer starting with spaces merges with it
    ('\\n    ' is one token), and TRL's split would leave that '\\n' out of the prompt."""
    prompt = [{"role": "user", "content": "Free some disk space."}]
    pair = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "import shutil"}],
            "rejected": [{"role": "assistant", "content": "    import shutil"}]}
    out = tokenization.tokenize_pair(tokenizer, pair)
    as_answered = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert out["boundary"] == "continued" and out["prompt_ids"] == as_answered["input_ids"]
    for side in ("chosen", "rejected"):
        whole = tokenizer.apply_chat_template(prompt + pair[side], tokenize=False)
        assert tokenizer.decode(out["prompt_ids"] + out[f"{side}_ids"]) == whole
    joint = tokenizer.apply_chat_template(prompt + pair["rejected"], tokenize=True, return_dict=True)["input_ids"]
    assert joint[:len(out["prompt_ids"])] != out["prompt_ids"]  # what TRL would have split


def test_a_completion_on_a_token_boundary_keeps_trls_split(tokenizer):
    pair = {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5"}]}
    out = tokenization.tokenize_pair(tokenizer, pair)
    joint = tokenizer.apply_chat_template(pair["prompt"] + pair["chosen"], tokenize=True, return_dict=True)["input_ids"]
    assert out["boundary"] == "aligned" and out["prompt_ids"] + out["chosen_ids"] == joint
    text = tokenization.tokenize_pair(tokenizer, {"prompt": "Q: 2+2?\nA:", "chosen": " 4</s>", "rejected": " 5</s>"})
    assert text["boundary"] == "aligned"


def test_a_template_that_renders_the_prompt_otherwise_falls_back_and_says_so(tokenizer):
    """A template whose generation prompt the full conversation does not repeat (as Gemma's empty thought block):
    the completion cannot be the prompt's continuation; TRL's split, counted as not_exact."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant><think></think>{% endif %}")
    pair = {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5"}]}
    out = tokenization.tokenize_pair(tok, pair)
    assert out["boundary"] == "not_exact"
    joint = tok.apply_chat_template(pair["prompt"] + pair["chosen"], tokenize=True, return_dict=True)["input_ids"]
    assert out["prompt_ids"] + out["chosen_ids"] == joint


def test_a_kto_example_is_tokenised_as_the_pair_side_with_the_same_completion(tokenizer):
    """tokenize_example is tokenize_pair for one completion: the merged '\\n    ' case keeps the prompt as the
    model sees it when it answers (TRL's KTO split would cut its last token), the plain case is TRL's split."""
    prompt = [{"role": "user", "content": "Free some disk space."}]
    merged, plain = [{"role": "assistant", "content": "    import shutil"}], [{"role": "assistant", "content": "ok"}]
    as_answered = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
    pair = tokenization.tokenize_pair(tokenizer, {"prompt": prompt, "chosen": plain, "rejected": merged})
    for completion, side, boundary in ((merged, "rejected", "continued"), (plain, "chosen", "aligned")):
        out = tokenization.tokenize_example(tokenizer, {"prompt": prompt, "completion": completion})
        assert out["boundary"] == boundary and out["prompt_ids"] == as_answered
        assert out["completion_ids"] == pair[f"{side}_ids"]
        assert tokenizer.decode(out["prompt_ids"] + out["completion_ids"]) == \
            tokenizer.apply_chat_template(prompt + completion, tokenize=False)


def test_kto_examples_are_prepared_with_eos_kl_completions_and_the_overlong_dropped(tokenizer):
    """prepare_examples, the KTO trainer's dataset preparation: EOS after text completions, the prompts that
    fill max_length dropped, and TRL's KL completions (each batch's completions rotated by one)."""
    from types import SimpleNamespace

    from datasets import Dataset

    rows = [{"prompt": f"Q{i}: " + ("long " * 40 if i == 2 else "") + "?", "completion": f" a{i}", "label": i % 2 == 0}
            for i in range(5)]
    args = SimpleNamespace(dataset_num_proc=None, max_length=32, per_device_train_batch_size=2)
    ds = tokenization.prepare_examples(Dataset.from_list(rows), tokenizer, args, "train", calculate_kl=True)
    assert [r["label"] for r in ds] == [True, False, False, True]  # Q2's prompt alone fills 32 tokens
    for r, src in zip(ds, [rows[i] for i in (0, 1, 3, 4)]):
        assert r["completion_ids"][-1] == tokenizer.eos_token_id
        assert tokenizer.decode(r["prompt_ids"] + r["completion_ids"]) == src["prompt"] + src["completion"] + \
            tokenizer.eos_token
    c = [r["completion_ids"] for r in ds]
    assert [r["KL_completion_ids"] for r in ds] == [c[1], c[0], c[3], c[2]]
    no_kl = tokenization.prepare_examples(Dataset.from_list(rows), tokenizer, args, "eval", calculate_kl=False)
    assert "KL_completion_ids" not in no_kl.column_names


def test_pairs_are_prepared_with_eos_after_text_and_the_overlong_dropped_only_when_the_start_is_kept(tokenizer):
    """prepare_pairs, the DPO trainer's dataset preparation: EOS after text completions (a message list's
    template ends its turns itself), each pair's boundary, and the pairs whose prompt alone fills max_length
    dropped under keep_start (TRL's keep_end cuts the prompt's start instead, so nothing is dropped)."""
    from types import SimpleNamespace

    from datasets import Dataset

    rows = [{"prompt": f"Q{i}: " + ("long " * 40 if i == 1 else "") + "?", "chosen": f" a{i}", "rejected": f" b{i}"}
            for i in range(3)]
    args = SimpleNamespace(dataset_num_proc=None, max_length=32, truncation_mode="keep_start")
    ds = tokenization.prepare_pairs(Dataset.from_list(rows), tokenizer, args, "train")
    assert len(ds) == 2 and set(ds["boundary"]) <= set(tokenization.BOUNDARY)  # Q1's prompt alone fills 32 tokens
    for r, src in zip(ds, [rows[0], rows[2]]):
        for side in ("chosen", "rejected"):
            assert r[f"{side}_ids"][-1] == tokenizer.eos_token_id
            text = src["prompt"] + src[side] + tokenizer.eos_token
            assert tokenizer.decode(r["prompt_ids"] + r[f"{side}_ids"]) == text
    end = SimpleNamespace(dataset_num_proc=None, max_length=32, truncation_mode="keep_end")
    assert len(tokenization.prepare_pairs(Dataset.from_list(rows), tokenizer, end, "train")) == 3
    chat = [{"prompt": [{"role": "user", "content": "2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
             "rejected": [{"role": "assistant", "content": "5"}]}]
    wide = SimpleNamespace(dataset_num_proc=None, max_length=512, truncation_mode="keep_start")  # SmolLM2's system turn
    (msg,) = tokenization.prepare_pairs(Dataset.from_list(chat), tokenizer, wide, "train")
    assert tokenizer.decode(msg["prompt_ids"] + msg["chosen_ids"]) == \
        tokenizer.apply_chat_template(chat[0]["prompt"] + chat[0]["chosen"], tokenize=False)  # no EOS added
