"""Pairs and KTO examples to token ids: the prompt's tokens as the model sees them when it answers, each
completion tokenised as their continuation; training and the report's held-out measures use the same tokens.

    from dpokit.data import tokenization; tokenization.tokenize_pair(tokenizer, pair)   # prompt_ids, chosen_ids, rejected_ids, boundary

Why the kit does not let TRL tokenise: TRL 1.14 tokenises prompt+completion as one text and starts the
completion where that and the prompt alone diverge. Where a completion's first characters merge with the end
of the rendered prompt (SmolLM2's template ends in '\n'; an answer that starts with spaces makes '\n    ' one
token), the boundary token goes to the completion and the prompt loses it: the model would be trained on a
context it never sees when it answers. That is a data-correctness fix, so it lives here and not in the speed
module. fastpath.py's trainer classes (behind its one version check) hand TRL's dataset preparation to
prepare_pairs and prepare_examples, which write the columns TRL 1.14's collators read; evaluate.py scores
held-out pairs and examples through tokenize_pair and tokenize_example. Each pair records where its completions
start (BOUNDARY: aligned, continued, not_exact; data.json's boundary counts).
"""

from __future__ import annotations

from dpokit.data import formats

BOUNDARY = ("aligned", "continued", "not_exact")  # per pair, data.json's boundary counts


def tokenize_pair(tokenizer, example: dict) -> dict:
    """prompt_ids, chosen_ids, rejected_ids and `boundary` for one pair (TRL 1.14's tokenize_fn, one change).

    TRL tokenises prompt+completion as one text and starts the completion where that and the prompt alone
    diverge: where the completion's first characters merge with the end of the rendered prompt ('\\n' before
    an answer that starts with spaces), the prompt loses its last token and the model is trained on a context
    it never sees when it answers. Here the prompt keeps its tokens as rendered with the generation prompt, and
    the rest of the text is tokenised on its own as their continuation:
      aligned    the joint tokenisation already splits at the prompt's end (TRL's split, unchanged)
      continued  a token straddled the end; the completion is the rest of the text tokenised alone
      not_exact  the template renders the prompt otherwise before an answer, or the rest tokenised alone is
                 other text (a tokenizer that adds a space at the start): TRL's split, counted
    """
    example = formats.record_from_row(example)  # tool calls as the chat template takes them
    tools = example.get("tools")
    prompt_ids, prompt_text = _prompt_ids_and_text(tokenizer, example["prompt"], tools)
    out, boundary = {"prompt_ids": prompt_ids}, "aligned"
    joint = {}
    for side in ("chosen", "rejected"):
        ids, side_boundary, joint[side] = _completion_ids(tokenizer, example["prompt"], prompt_ids, prompt_text,
                                                          example[side], tools)
        if side_boundary == "not_exact":
            boundary = "not_exact"
            break
        out[f"{side}_ids"] = ids
        boundary = "continued" if "continued" in (boundary, side_boundary) else "aligned"
    if boundary == "not_exact":  # TRL's split: the completion starts where the tokenisations diverge
        joint = {side: joint.get(side) or _joint_ids(tokenizer, example["prompt"], example[side], tools)
                 for side in ("chosen", "rejected")}
        n = min(_common_prefix(prompt_ids, joint["chosen"]), _common_prefix(prompt_ids, joint["rejected"]))
        out = {"prompt_ids": prompt_ids[:n], "chosen_ids": joint["chosen"][n:], "rejected_ids": joint["rejected"][n:]}
    return out | {"boundary": boundary}


def tokenize_example(tokenizer, example: dict) -> dict:
    """prompt_ids, completion_ids and `boundary` for one unpaired (KTO) example: tokenize_pair's split for a
    single completion (TRL 1.14's KTO tokenize_fn cuts the prompt's merged end the same way DPO's does)."""
    example = formats.record_from_row(example)
    tools = example.get("tools")
    prompt_ids, prompt_text = _prompt_ids_and_text(tokenizer, example["prompt"], tools)
    ids, boundary, joint = _completion_ids(tokenizer, example["prompt"], prompt_ids, prompt_text, example["completion"],
                                           tools)
    if boundary == "not_exact":
        n = _common_prefix(prompt_ids, joint)
        return {"prompt_ids": prompt_ids[:n], "completion_ids": joint[n:], "boundary": boundary}
    return {"prompt_ids": prompt_ids, "completion_ids": ids, "boundary": boundary}


def _prompt_ids_and_text(tokenizer, prompt, tools=None) -> tuple[list, str]:
    """The prompt's tokens and text as the model sees them when it answers (with the generation prompt)."""
    if isinstance(prompt, list):
        return (_joint_ids(tokenizer, prompt, [], tools, add_generation_prompt=True),
                tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True))
    return _joint_ids(tokenizer, prompt, ""), prompt


def _joint_ids(tokenizer, prompt, completion, tools=None, **template) -> list:
    """prompt+completion tokenised as one text, as TRL 1.14's _tokenize does for a text-only tokenizer: the
    chat template (with the row's tools) for messages, the tokenizer's own special tokens for text."""
    if isinstance(prompt, list):
        return list(tokenizer.apply_chat_template(prompt + completion, tools=tools, tokenize=True, return_dict=True,
                                                  **template)["input_ids"])
    return list(tokenizer(text=prompt + completion)["input_ids"])


def _completion_ids(tokenizer, prompt, prompt_ids: list, prompt_text: str, completion, tools=None) -> tuple:
    """(completion ids or None, aligned | continued | not_exact, the joint tokenisation of prompt+completion)."""
    joint = _joint_ids(tokenizer, prompt, completion, tools)
    if joint[:len(prompt_ids)] == prompt_ids:
        return joint[len(prompt_ids):], "aligned", joint
    whole = prompt + completion
    text = tokenizer.apply_chat_template(whole, tools=tools, tokenize=False) if isinstance(prompt, list) else whole
    rest = tokenizer(text[len(prompt_text):], add_special_tokens=False)["input_ids"] \
        if text.startswith(prompt_text) else None
    if rest is None or tokenizer.decode(prompt_ids + rest) != tokenizer.decode(joint):
        return None, "not_exact", joint
    return rest, "continued", joint


def _common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def with_eos(tokenizer, record: dict, sides: tuple) -> dict:
    """A text record's completions (`sides`) ending in EOS, as TRL's dataset preparation makes them; a
    message-list record is returned as it is (the chat template ends each turn)."""
    if isinstance(record["prompt"], list):
        return record
    eos = tokenizer.eos_token
    return record | {k: record[k] if record[k].endswith(eos) else record[k] + eos for k in sides}


def prepare_pairs(dataset, tokenizer, args, name: str):
    """TRL 1.14's _prepare_dataset for the kit's pairs (every record has a prompt; no tools, no images): EOS
    after text completions, tokenize_pair, and the pairs whose prompt alone fills max_length dropped."""
    kwargs = {"num_proc": args.dataset_num_proc}
    if not isinstance(dataset[0]["prompt"], list):
        dataset = dataset.map(lambda x: with_eos(tokenizer, x, ("chosen", "rejected")),
                              desc=f"Adding EOS to {name} dataset", **kwargs)
    dataset = dataset.map(lambda x: tokenize_pair(tokenizer, x), desc=f"Tokenizing {name} dataset", **kwargs)
    if args.max_length is not None and args.truncation_mode == "keep_start":
        dataset = dataset.filter(lambda x: len(x["prompt_ids"]) < args.max_length,
                                 desc=f"Dropping fully truncated examples from {name} dataset", **kwargs)
    return dataset


def prepare_examples(dataset, tokenizer, args, name: str, calculate_kl: bool):
    """TRL 1.14's KTOTrainer._prepare_dataset for the kit's examples (every record has a prompt, none is paired;
    no tools): EOS after text completions, tokenize_example, the examples whose prompt alone fills max_length
    dropped, and TRL's KL completions (each batch's completions rotated by one)."""
    kwargs = {"num_proc": args.dataset_num_proc}
    if not isinstance(dataset[0]["prompt"], list):
        dataset = dataset.map(lambda x: with_eos(tokenizer, x, ("completion",)), desc=f"Adding EOS to {name} dataset",
                              **kwargs)
    dataset = dataset.map(lambda x: tokenize_example(tokenizer, x), desc=f"Tokenizing {name} dataset", **kwargs)
    if args.max_length is not None:
        dataset = dataset.filter(lambda x: len(x["prompt_ids"]) < args.max_length,
                                 desc=f"Dropping fully truncated examples from {name} dataset", **kwargs)
    if calculate_kl:
        dataset = dataset.map(lambda x: {"KL_completion_ids": x["completion_ids"][-1:] + x["completion_ids"][:-1]},
                              batched=True, batch_size=args.per_device_train_batch_size,
                              desc=f"Extracting KL {name} dataset", **kwargs)
    return dataset
