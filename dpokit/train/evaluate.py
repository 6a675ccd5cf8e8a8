"""What training changed: held-out preference accuracy, retention probes, plots, report.md and the model
card; and the receiving end of a handoff: chat with, re-evaluate, or merge a finished run or its tarball.

    python entrypoint.py chat artifacts/RUN[.tar.gz] [--compare] [PROMPT ...]    (make chat RUN=...)
    python entrypoint.py eval artifacts/RUN[.tar.gz] [PAIRS.jsonl]               (make eval RUN=...)
    python entrypoint.py merge artifacts/RUN[.tar.gz] [OUT_DIR]                  (make merge RUN=...)

train_dpo.py calls `evaluate` and `write_report` at the end of a run. torch and friends are imported
inside the functions that use them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from dpokit.core import kit, runs
from dpokit.data import formats, tokenization
from dpokit.model import fastpath, models, shapes
from dpokit.scoring import checker
from dpokit.train import methods
from dpokit.core.kit import UserError
from dpokit.train.methods import TRAINERS, UNITS


SAMPLING = {"temperature": 1.5, "top_k": 100, "top_p": 0.95}  # the co-training deck's settings
MERGE_PROBES = ["How do I free disk space on a Linux server?", "What is 1+1?", "Tell me the history of the US."]


# ---------------------------------------------------------------------------------------------
# Pure helpers: tested without a model.
# ---------------------------------------------------------------------------------------------


def preference_stats(rows) -> dict:
    """rows: (chosen logp sum, rejected logp sum, chosen tokens, rejected tokens) per pair.

    accuracy: chosen more likely than rejected (summed log-likelihood); accuracy_per_token: the same
    length-normalised; mean_margin: mean of chosen minus rejected summed log-likelihood (nats)."""
    rows = list(rows)
    n = len(rows) or 1
    return {"pairs": len(rows),
            "accuracy": sum(c > r for c, r, _, _ in rows) / n,
            "accuracy_per_token": sum(c / max(nc, 1) > r / max(nr, 1) for c, r, nc, nr in rows) / n,
            "mean_margin": sum(c - r for c, r, _, _ in rows) / n}


def reward_rows(metrics: list[dict]) -> list[dict]:
    """GRPO's logged steps: reward mean and spread, the checker's pass and ran rates, seconds per part."""
    keys = ("reward", "reward_std", "pass_rate", "ran_rate", "kit/signal", "kl", "time/generation", "time/scoring",
            "step_time")
    return [{"step": m["step"], **{k: m[k] for k in keys if k in m}} for m in metrics if "reward" in m]


def signal_summary(steps: list[dict]) -> list[str]:
    """GRPO: how many logged steps had a signal (some batch in which a group's answers scored differently)."""
    known = [r["kit/signal"] for r in steps if "kit/signal" in r]
    if not known:
        return []
    return [f"**{sum(v > 0 for v in known)} of {len(known)} steps had a signal.**", ""]


def report_markdown(title: str, evaluation: dict, plots: list[str], metrics: list[dict] = ()) -> str:
    acc, probes, examples = evaluation.get("held_out"), evaluation.get("probes", []), evaluation.get("examples", [])
    cell = lambda t: " ".join(str(t).split()).replace("|", "\\|")[:160]  # noqa: E731
    lines = [f"# {title}", ""]
    kto = evaluation.get("held_out_kto")
    if kto:
        lines += ["## Held-out examples (KTO)", "",
                  f"{kto['base']['desirable']['examples']} desirable and {kto['base']['undesirable']['examples']} "
                  "undesirable examples from runs kept out of training. Mean log-likelihood per token of each "
                  "class's completions; gap = desirable minus undesirable (training should widen it).", "",
                  "| model | desirable (nats/token) | undesirable (nats/token) | gap |", "| --- | --- | --- | --- |"]
        lines += [f"| {name} | {kit.num(kto[name]['desirable']['logp_per_token'], '.3f')} | "
                  f"{kit.num(kto[name]['undesirable']['logp_per_token'], '.3f')} | {kit.num(kto[name]['gap'], '+.3f')} |"
                  for name in ("base", "tuned")] + [""]
        if acc:
            lines += ["The held-out runs' desirable answers against their undesirable ones to the same prompt, as "
                      "preference pairs: the accuracy a DPO run on the same logs reports.", ""]
    if acc:
        lines += ["## Held-out preference accuracy", "",
                  f"{acc['base']['pairs']} pairs kept out of training. Accuracy: how often the model finds the "
                  "chosen response more likely than the rejected one.", "",
                  "| model | accuracy | accuracy (per token) | mean margin (nats) |", "| --- | --- | --- | --- |"]
        lines += [f"| {name} | {acc[name]['accuracy']:.3f} | {acc[name]['accuracy_per_token']:.3f} | "
                  f"{acc[name]['mean_margin']:.2f} |" for name in ("base", "tuned")] + [""]
    elif not kto and not evaluation.get("execution"):
        lines += ["No held-out pairs (eval_fraction 0 or too few pairs).", ""]
    execution = evaluation.get("execution")
    if execution:
        mode = execution["base"]["isolation"]
        lines += ["## Answers run by the checker", "",
                  f"Sandbox: **{mode} mode**, " + (f"Landlock ABI {execution['base']['landlock']}"
                                                    if execution['base'].get('landlock') else "no Landlock") + ". "
                  f"{execution['samples']} sampled answers (seeded) to each of {execution['prompts']} held-out prompts, "
                  "their code run on the prompt's host by checker.py. Pass: it ran and freed space; score: bytes "
                  "freed over the plantable junk, -1 for deleting what must be kept.", ""]
        notes = [f"{name}: {n}" for name in ("base", "tuned") if (n := checker.unscorable_note(execution[name], mode))]
        lines += [f"**{n}.**" for n in notes] + ([""] if notes else [])
        lines += ["| model | pass rate | mean score | outcomes | bytes freed | kept files touched |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {kit.num(execution[name]['pass_rate'], '.3f')} | {kit.num(execution[name]['mean_score'], '+.4f')} | "
                  + ", ".join(f"{k} {v}" for k, v in sorted(execution[name]["outcomes"].items())) + " | "
                  + (f"{execution[name]['freed_bytes'] / (1 << 20):,.0f} MB | {execution[name]['kept_files_touched']} |"
                     if "freed_bytes" in execution[name] else "n/a | n/a |")
                  for name in ("base", "tuned")] + [""]
        new = [execution[name].get("new_prompts") for name in ("base", "tuned")]
        if all(new):
            lines += [f"{execution['prompts'] - new[1]['prompts']} of the {execution['prompts']} prompts are word for "
                      "word a training record's prompt (the same strategy, retried on another run). On the other "
                      f"{new[1]['prompts']}: pass rate {kit.num(new[0]['pass_rate'], '.3f')} -> "
                      f"{kit.num(new[1]['pass_rate'], '.3f')}, mean score {kit.num(new[0]['mean_score'], '+.4f')} -> "
                      f"{kit.num(new[1]['mean_score'], '+.4f')}, answers that deleted kept files {new[0]['broke']} -> "
                      f"{new[1]['broke']}.", ""]
        lines += ["![execution.png](execution.png)", ""] if "execution.png" in plots else []
        story = side_by_side(execution)
        lines += ["### Base and tuned, side by side", "", *story] if story else []
    steps = reward_rows(list(metrics))
    if steps:
        f = lambda r, k, fmt: f"{r[k]:{fmt}}" if k in r else "n/a"  # noqa: E731
        lines += ["## Reward per step (GRPO)", "",
                  "Each step's sampled answers: the reward's mean and spread (the group-relative advantage is each "
                  "answer's reward against its group's), and the share the checker passed (freed space) or saw run. "
                  "Signal: the share of the step's batches in which some group's answers scored differently; a "
                  "batch without one teaches only the KL term (skipped with --skip_alike).", "",
                  *signal_summary(steps),
                  "| step | reward | ± | pass | ran | signal | KL | generation s | scoring s | step s |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['step']} | {f(r, 'reward', '.3f')} | {f(r, 'reward_std', '.3f')} | {f(r, 'pass_rate', '.2f')} "
                  f"| {f(r, 'ran_rate', '.2f')} | {f(r, 'kit/signal', '.2f')} | {f(r, 'kl', '.4f')} | "
                  f"{f(r, 'time/generation', '.1f')} | "
                  f"{f(r, 'time/scoring', '.1f')} | {f(r, 'step_time', '.1f')} |" for r in steps] + [""]
    curves = [p for p in plots if p != "execution.png"]
    if curves:
        lines += ["## Training curves", ""] + [f"![{p}]({p})" for p in curves] + [""]
    if probes:
        lines += ["## Retention probes", "",
                  "Greedy answers; 'fact' = the expected words appear; Δ logp = how much more (+) or less (-) likely "
                  "the tuned model finds the base's answer, nats per token.", "",
                  "| prompt | base | tuned | fact base → tuned | Δ logp |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {cell(r['prompt'])} | {cell(r['base'])} | {cell(r['tuned'])} | "
                  f"{r['base_has_fact']} → {r['tuned_has_fact']} | {r['delta_logp_per_token']:+.3f} |" for r in probes]
        lines += ["", f"Sampled ({', '.join(f'{k} {v}' for k, v in SAMPLING.items())}, seeded):", "",
                  "| prompt | base | tuned |", "| --- | --- | --- |"]
        lines += [f"| {cell(r['prompt'])} | {cell(r['base_sampled'])} | {cell(r['tuned_sampled'])} |" for r in probes]
        lines.append("")
    if examples:
        lines += ["## Held-out prompts", "", "| prompt | base | tuned |", "| --- | --- | --- |"]
        lines += [f"| {cell(e['prompt'])} | {cell(e['base'])} | {cell(e['tuned'])} |" for e in examples] + [""]
    return "\n".join(lines)


def load_probes(path: str) -> list[dict]:
    if not path:
        return []
    probes = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UserError(f"cannot read probes: {e.strerror}", path) from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                probe = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"malformed JSON: {e.msg}", path, n) from None
            if not isinstance(probe, dict) or not isinstance(probe.get("prompt"), str):
                raise UserError('a probe is {"prompt": "...", "expect": ["words", ...]}', path, n)
            probes.append(probe)
    return probes


def reference_mode(cfg, passes: dict | None = None) -> str:
    """What the run's reference model was, and when its log-probs were computed. cfg: a train_dpo.TrainConfig;
    passes: data.json's reference record (split -> what the pass before training did), empty when none ran."""
    when = f"; its log-probs computed once before training ({passes['train']})" if (passes or {}).get("train") else ""
    if cfg.init_adapter:
        return f"base with the adapter of {cfg.init_adapter} (the run this one started from), frozen{when}"
    if cfg.ref_model_name_or_path:
        return f"separate model {cfg.ref_model_name_or_path} ({'4-bit' if cfg.load_in_4bit else 'full'}){when}"
    return f"base model with the adapter disabled{when}"


def model_card(run_name: str, cfg, data: dict, params: dict, targets, metrics: list[dict],
               batch: dict) -> str:
    """README.md of a run: what it was trained on and how, first and last step, how to load and serve it.
    cfg: its train_dpo.TrainConfig; data: its data.json; batch: train_dpo.batch_info."""
    base = cfg.model_name_or_path
    train_rows = [m for m in metrics if "loss" in m]
    first, last = (train_rows[0], train_rows[-1]) if train_rows else ({}, {})

    def fmt(row, key):
        return f"{row[key]:.4f}" if key in row else "n/a"

    lines = [
        f"# {run_name}: LoRA {data.get('method', 'dpo').upper()} adapter for {base}", "",
        f"Trained with dpo-kit (TRL {TRAINERS.get(data.get('method', 'dpo'), 'DPOTrainer')}, "
        f"{'4-bit NF4' if cfg.load_in_4bit else 'full-precision'} base, "
        f"LoRA r={cfg.lora_r} alpha={cfg.lora_alpha}).", "",
        *([f"**Random base**: {shapes.describe(base)}.", ""] if shapes.is_random(base) else []),
        "## Data", "",
        f"- file: `{data['path']}` (sha256 `{data['sha256']}`), format `{data['format']}`",
        *([f"- KTO examples: {data['labels']['desirable']:,} desirable, {data['labels']['undesirable']:,} "
           f"undesirable; loss weights {data['kto_weights'].get('desirable')} and "
           f"{data['kto_weights'].get('undesirable')}"] if data.get("method") == "kto" else []),
        *([f"- GRPO: {cfg.num_generations} answers sampled per prompt (temperature {cfg.temperature}, up to "
           f"{cfg.max_completion_length} tokens), rewards {cfg.reward}"
           + (f" and `{cfg.reward_cmd}`" if cfg.reward_cmd else "") + f", KL beta {cfg.beta}"]
          if data.get("method") == "grpo" else []),
        f"- {UNITS.get(data.get('method', 'dpo'), 'pairs')} used: {data['pairs_trained']:,}; skipped invalid: "
        f"{sum(data['skipped'].values())}; truncated to {cfg.max_length} tokens: {data['truncated']}; dropped "
        f"(prompt fills max_length): {data['dropped_too_long']}",
        f"- held out of training: {data['held_out']} {UNITS.get(data.get('method', 'dpo'), 'pairs')} "
        f"(eval_fraction {cfg.eval_fraction})"
        + (f"; left out as repeats of a chosen answer (--distinct_chosen): {data['chosen_repeats']:,} pairs"
           if data.get("chosen_repeats") else "")
        + "".join(f"; mixed in {m['pairs_used']} pairs from `{m['path']}` ({m['share']:.0%})" for m in data["mix"]),
        "",
        "## Training", "",
        f"- steps: {last.get('step', 0)}, beta {cfg.beta}, learning rate {cfg.learning_rate}, "
        f"batch {batch['effective_batch_size']} pairs per step ({cfg.per_device_train_batch_size} per device "
        f"x {batch['processes']} process(es) x accumulation {cfg.gradient_accumulation_steps}), seed {cfg.seed}",
        f"- reference: {reference_mode(cfg, data.get('reference'))}"
        + (" (held-out evaluation only: the sft loss alone trained on the chosen rows, which it reads)"
           if data.get("chosen_only") else "") + f"; compute: {data['compute']}",
        f"- parameters: {params['trainable']:,} trainable of {params['total']:,} "
        f"({100 * params['trainable'] / max(params['total'], 1):.2f}%)",
        f"- LoRA target modules: {', '.join(targets)}",
        *([f"- chat template: `{cfg.chat_template}` (saved with the tokenizer: chat, merge and serving render with it)"]
          if getattr(cfg, "chat_template", "") else []), "",
        "| metric | first step | last step |", "| --- | --- | --- |",
        *(f"| {k} | {fmt(first, k)} | {fmt(last, k)} |" for k in (
            ("reward", "reward_std", "pass_rate", "kl") if data.get("method") == "grpo" else
            ("loss", "logps/chosen") if data.get("chosen_only") else  # no rejected or reference pass in training
            ("loss", "rewards/margins", "rewards/accuracies"))),
        "", "Training-set numbers: they show the optimisation worked, not that the model got better; "
        "[report.md](report.md) has held-out accuracy before and after, retention probes and plots.", "",
        "## Use", "", "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"base = AutoModelForCausalLM.from_pretrained({base!r})",
        f"model = PeftModel.from_pretrained(base, {run_name!r})",
        f"tokenizer = AutoTokenizer.from_pretrained({run_name!r})", "```", "",
        f"vLLM: `vllm serve {base} --enable-lora --lora-modules {run_name}=./{run_name} --max-lora-rank {cfg.lora_r}`",
        "", "Every file's sha256 is in manifest.json.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Measuring a model (adapter on) against its base (adapter off).
# ---------------------------------------------------------------------------------------------


def tokenize_pair(tokenizer, rec: dict, max_length: int) -> tuple[list, list, list]:
    """(prompt, chosen, rejected) token ids as training saw them (tokenization.tokenize_pair: the prompt as the
    model sees it when it answers, the chat template for message lists, EOS after text), cut to max_length."""
    out = tokenization.tokenize_pair(tokenizer, tokenization.with_eos(tokenizer, rec, ("chosen", "rejected")))
    prompt = out["prompt_ids"][: max_length - 1]
    return prompt, *(out[f"{k}_ids"][: max_length - len(prompt)] for k in ("chosen", "rejected"))


def tokenize_example(tokenizer, rec: dict, max_length: int) -> tuple[list, list]:
    """(prompt, completion) token ids of one KTO example as training saw them (tokenization.tokenize_example)."""
    out = tokenization.tokenize_example(tokenizer, tokenization.with_eos(tokenizer, rec, ("completion",)))
    prompt = out["prompt_ids"][: max_length - 1]
    return prompt, out["completion_ids"][: max_length - len(prompt)]


def completion_logps(model, prompts: list[list], completions: list[list], pad_id: int, batch_size: int = 4):
    """Summed log-likelihood (nats) of each completion given its prompt, and its token count. Rows run shortest
    first, so a batch pads little; where the model's head is a plain one (fastpath.lean_parts), the head runs on
    the completion tokens' hidden states alone, through fastpath.chunked_logps, never the [tokens x vocabulary]
    logits of the whole batch; else from the model's own logits."""
    import torch

    backbone, head = fastpath.lean_parts(model) or (None, None)
    if head is not None and fastpath.head_agrees(head.weight.device,
                                                 fastpath.autocast_dtype(head.weight.device.type)) is not None:
        backbone = None  # the lean head's kernel disagrees here: the model's own logits
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(completions[i]))
    out = [None] * len(prompts)
    for i in range(0, len(order), batch_size):
        rows = order[i:i + batch_size]
        seqs = [prompts[r] + completions[r] for r in rows]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        # the hidden state (logit) at position t predicts token t + 1: a completion's tokens are predicted from
        # its prompt's last position on
        predicts = torch.zeros(len(rows), max(width - 1, 0), dtype=torch.bool)
        for j, r in enumerate(rows):
            predicts[j, len(prompts[r]) - 1:len(prompts[r]) - 1 + len(completions[r])] = True
        targets = ids[:, 1:][predicts]
        with torch.no_grad():
            if backbone is not None:
                hidden = backbone(input_ids=ids.to(head.weight.device),
                                  attention_mask=mask.to(head.weight.device)).last_hidden_state
                logp = fastpath.chunked_logps(hidden[:, :-1][predicts.to(hidden.device)], head.weight,
                                              targets.to(hidden.device))[0]
            else:
                logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits
                chosen = logits[:, :-1][predicts.to(logits.device)].float()
                logp = torch.log_softmax(chosen, dim=-1).gather(-1, targets[:, None].to(logits.device))[:, 0]
        for r, part in zip(rows, logp.split([len(completions[r]) for r in rows])):
            out[r] = (part.sum().item(), len(completions[r]))
    return out


def held_out_accuracy(model, tokenizer, records: list[dict], max_length: int) -> dict:
    """Preference accuracy and margin on held-out pairs, for the base (adapter off) and base + adapter."""
    toks = [tokenize_pair(tokenizer, r, max_length) for r in records]
    prompts = [p for p, _, _ in toks] * 2
    completions = [c for _, c, _ in toks] + [r for _, _, r in toks]
    result = {}
    for name, context in (("base", model.disable_adapter), ("tuned", contextlib.nullcontext)):
        with context():
            scores = completion_logps(model, prompts, completions, tokenizer.pad_token_id)
        n = len(toks)
        result[name] = preference_stats((c[0], r[0], c[1], r[1]) for c, r in zip(scores[:n], scores[n:]))
    return result


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers to single-turn prompts (make chat)."""
    return models.generate(model, tokenizer, [[{"role": "user", "content": p}] for p in prompts], max_new_tokens)


def base_and_tuned(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, sampling: dict | None,
                   seed: int | None, n: int = 1, label: str = "") -> dict[str, list[str]]:
    """`n` answers to each prompt from the base (adapter off) and from the tuned model (greedy when sampling is
    None), each seeded alike. One model after the other, the adapter merged while the tuned model samples: one
    batch holding both (PEFT's adapter_names, the adapter unmerged) measured slower on a 2-core CPU."""
    answers = {}
    for name, context in (("base", model.disable_adapter), ("tuned", contextlib.nullcontext)):
        with context():
            answers[name] = models.generate(model, tokenizer, prompts, max_new_tokens, sampling, seed, n=n,
                                            label=label and f"{label} {name}")
    return answers


def run_probes(model, tokenizer, probes: list[dict], seed: int, max_new_tokens: int = 48) -> list[dict]:
    """Base vs tuned on general prompts: greedy and sampled answers, whether the expected fact survives,
    and how much less (or more) likely the tuned model finds the base's greedy answer (nats per token)."""
    prompts = [p["prompt"] for p in probes]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    greedy = base_and_tuned(model, tokenizer, chats, max_new_tokens, None, None)
    sampled = base_and_tuned(model, tokenizer, chats, max_new_tokens, SAMPLING, seed)
    answers = {"base": greedy["base"], "base_sampled": sampled["base"], "tuned": greedy["tuned"],
               "tuned_sampled": sampled["tuned"]}
    chat = [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]) for p in prompts]
    replies = [tokenizer(a, add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id] for a in answers["base"]]
    with model.disable_adapter():
        base_lp = completion_logps(model, chat, replies, tokenizer.pad_token_id)
    tuned_lp = completion_logps(model, chat, replies, tokenizer.pad_token_id)
    rows = []
    for i, probe in enumerate(probes):
        expect = probe.get("expect", [])
        rows.append({"prompt": probe["prompt"], "expect": expect, **{k: v[i] for k, v in answers.items()},
                     "base_has_fact": formats.has_fact(answers["base"][i], expect),
                     "tuned_has_fact": formats.has_fact(answers["tuned"][i], expect),
                     "delta_logp_per_token": (tuned_lp[i][0] - base_lp[i][0]) / max(base_lp[i][1], 1)})
    return rows


def plot_metrics(metrics: list[dict], out_dir: Path) -> list[str]:
    """loss.png, margins.png, accuracies.png: train and held-out curves against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for key, title in (("loss", "loss"), ("rewards/margins", "reward margin (chosen - rejected)"),
                       ("rewards/accuracies", "reward accuracy"),
                       ("reward", "GRPO reward per step (mean of the step's answers, ± spread)"),
                       ("pass_rate", "GRPO: answers the checker passed, per step")):
        if not any(key in m or "eval_" + key in m for m in metrics):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        for prefix, label in (("", "train"), ("eval_", "held-out")):
            pts = [(m["step"], m[prefix + key]) for m in metrics if m.get(prefix + key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o" if prefix else None, label=label)
            spread = [(m["step"], m[prefix + key], m[prefix + key + "_std"]) for m in metrics  # None: no answer scored
                      if m.get(prefix + key + "_std") is not None and m.get(prefix + key) is not None]
            if spread:
                steps, mean, std = zip(*spread)
                ax.fill_between(steps, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)],
                                alpha=0.2)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        name = key.split("/")[-1] + ".png"
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        names.append(name)
    return names


def plot_execution(execution: dict, out_dir: Path) -> str:
    """execution.png: the checker's outcomes for the base's and the tuned model's sampled answers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    names = ("base", "tuned")
    left = [0.0, 0.0]
    colours = {"failed": "#bbbbbb", "no_effect": "#f0c05a", "freed": "#4c9a5b", "broke": "#c8423b",
               checker.UNSCORABLE: "#8fa8c8"}
    for outcome in (*checker.OUTCOMES, checker.UNSCORABLE):
        share = [execution[n]["outcomes"].get(outcome, 0) / max(sum(execution[n]["outcomes"].values()), 1)
                 for n in names]
        ax.barh(names, share, left=left, color=colours[outcome], label=outcome)
        left = [a + b for a, b in zip(left, share)]
    for i, n in enumerate(names):
        ax.text(1.01, i, f"pass {execution[n]['pass_rate']:.2f}\nscore {execution[n]['mean_score']:+.3f}",
                va="center", fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_xlabel(f"share of {execution['prompts'] * execution['samples']} sampled answers per model")
    ax.set_title("held-out prompts: what the checker saw")
    ax.legend(ncol=4, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, -0.55))
    fig.tight_layout()
    fig.savefig(out_dir / "execution.png")
    plt.close(fig)
    return "execution.png"


def example_likelihoods(model, tokenizer, examples: list[dict], max_length: int) -> dict:
    """Held-out KTO examples: the mean log-likelihood per token of the desirable and of the undesirable
    completions, and their gap (desirable minus undesirable, nats per token), for the base and base + adapter.
    Per token: the two classes' completions need not be the same length (a failed attempt is often shorter)."""
    toks = [tokenize_example(tokenizer, e, max_length) for e in examples]
    result = {}
    for name, context in (("base", model.disable_adapter), ("tuned", contextlib.nullcontext)):
        with context():
            scores = completion_logps(model, [p for p, _ in toks], [c for _, c in toks], tokenizer.pad_token_id)
        per_class = {}
        for label, key in ((True, "desirable"), (False, "undesirable")):
            rows = [s / max(n, 1) for (s, n), e in zip(scores, examples) if e["label"] is label]
            per_class[key] = {"examples": len(rows), "logp_per_token": sum(rows) / len(rows) if rows else None}
        d, u = per_class["desirable"]["logp_per_token"], per_class["undesirable"]["logp_per_token"]
        result[name] = per_class | {"gap": d - u if d is not None and u is not None else None}
    return result


CODE_SAMPLING = {"temperature": 0.7, "top_p": 0.95}  # answers the checker runs: varied, but still code


def mark_seen(prompts: list[dict], trained: list[dict]) -> list[dict]:
    """Each held-out prompt with "seen": whether its words are a training record's prompt word for word. A
    held-out run is never trained on, but agents retry a strategy on other hosts, and a code prompt is the
    strategy sentence alone: the report gives the pass rate on the new prompts apart."""
    texts = {formats.prompt_text(r["prompt"], r.get("tools")) for r in trained}
    return [p | {"seen": formats.prompt_text(p["prompt"], p.get("tools")) in texts} for p in prompts]


def new_text_scores(result: dict, name: str) -> dict | None:
    """Pass rate, mean score and deletions of one model's answers to the prompts no training record has (None
    when the prompts were not marked, or all or none of them are new)."""
    rows = [r for r in result["rows"] if r["model"] == name]
    if not rows or any("seen" not in r for r in rows) or len({r["seen"] for r in rows}) < 2:
        return None
    new = [r for r in rows if not r["seen"]]
    scored = [r for r in new if r["outcome"] != checker.UNSCORABLE]
    n = len(scored)
    return {"prompts": len({r["prompt"] for r in new}), "answers": len(new), "unscorable": len(new) - n,
            "pass_rate": checker.pass_rate(r["outcome"] for r in scored),
            "mean_score": sum(r["score"] for r in scored) / n if n else None,
            "broke": sum(r["outcome"] == "broke" for r in scored)}


def execution_summary(evaluation: dict) -> dict | None:
    """The manifest's `execution`: base and tuned pass rate and mean score over the answers that could be scored,
    how many could not, and the sandbox mode and Landlock level they ran under (None: no answers were run)."""
    if not evaluation.get("execution"):
        return None
    keys = ("pass_rate", "mean_score", "isolation", "landlock", "answers", "unscorable")
    return {k: {m: evaluation["execution"][k].get(m) for m in keys} for k in ("base", "tuned")}


def execution_scores(model, tokenizer, prompts: list[dict], samples: int, seed: int, max_new_tokens: int) -> dict:
    """Base (adapter off) and tuned: `samples` sampled answers (seeded) to each prompt, each run by the checker on
    the prompt's host: pass rate (freed space), mean score, and the outcome mix (checker.tally: over the answers
    that could be scored, the others counted apart)."""
    result = {"prompts": len(prompts), "samples": samples, "rows": []}
    answers = base_and_tuned(model, tokenizer, [p["prompt"] for p in prompts], max_new_tokens, CODE_SAMPLING, seed,
                             samples, label="sample")
    hosts = [p["host"] for p in prompts for _ in range(samples)] * 2
    every = checker.check_many([(checker.code_of(a), h) for a, h in zip(answers["base"] + answers["tuned"], hosts)],
                               label="check base+tuned")
    half = len(every) // 2
    for name, checks in (("base", every[:half]), ("tuned", every[half:])):
        result[name] = checker.tally(checks) | {"isolation": checks[0].isolation,
                                                "landlock": max(c.landlock for c in checks)}
        for i, (c, answer) in enumerate(zip(checks, answers[name])):
            p = prompts[i // samples]
            result["rows"].append({"model": name, "prompt": p["prompt"][-1]["content"],
                                   "sample": i % samples, "outcome": c.outcome, "score": c.score,
                                   "freed_bytes": c.freed_bytes, "reason": c.reason, "answer": answer[:SHOWN_CHARS]}
                                  | ({"seen": p["seen"]} if "seen" in p else {}))
    for name in ("base", "tuned"):
        new = new_text_scores(result, name)
        if new:
            result[name]["new_prompts"] = new
    return result


SHOWN_CHARS = 1200  # of each answer kept in evaluation.json (the report shows a few side by side)
FENCE = "````"  # around an answer in report.md: the answer's own ``` blocks stay inside it


def side_by_side(execution: dict, prompts: int = 3) -> list[str]:
    """report.md's story: for the first few held-out prompts, the base's and the tuned model's answer, each with
    what the checker made of it (a passing answer when the model has one, else its first)."""
    rows = execution.get("rows", [])
    lines = []
    for prompt in list(dict.fromkeys(r["prompt"] for r in rows))[:prompts]:
        lines += [f"**{prompt}**", ""]
        for name in ("base", "tuned"):
            mine = [r for r in rows if r["model"] == name and r["prompt"] == prompt and "answer" in r]
            if not mine:
                continue
            r = next((x for x in mine if checker.passed(x["outcome"])), mine[0])
            what = {"freed": f"freed {r['freed_bytes'] / (1 << 20):,.0f} MB, score {r['score']:+.3f}",
                    "no_effect": "ran, freed nothing", "broke": f"deleted what must be kept: {r['reason']}"[:160],
                    "failed": f"failed: {r['reason']}"[:160],
                    checker.UNSCORABLE: f"not scored: {r['reason']}"[:160]}[r["outcome"]]
            passed = sum(checker.passed(x["outcome"]) for x in mine)
            lines += [f"{name} (answer {r['sample'] + 1} of {len(mine)}; {passed} of {len(mine)} passed): {what}", "",
                      FENCE, r["answer"] or "(empty)", FENCE, ""]
    return lines


def evaluate(model, tokenizer, held: list[dict], probes: list[dict], max_length: int, seed: int,
             exec_prompts: list[dict] | None = None, samples: int = 4, max_new_tokens: int = 256) -> dict:
    """Everything report.md shows, from the model as it stands (adapter on) and the base (adapter off).
    held: pairs, or KTO examples (their likelihood gap, and the accuracy of the pairs they hold). exec_prompts:
    prompts whose sampled answers the checker runs (execution_scores)."""
    result = {}
    if exec_prompts:
        result["execution"] = execution_scores(model, tokenizer, exec_prompts, samples, seed, max_new_tokens)
    if held and formats.is_example(held[0]):
        result["held_out_kto"] = example_likelihoods(model, tokenizer, held, max_length)
        pairs = formats.preference_pairs(held)  # a held-out run's desirable against its undesirable answers
        if pairs:
            result["held_out"] = held_out_accuracy(model, tokenizer, pairs, max_length)
    elif held:
        result["held_out"] = held_out_accuracy(model, tokenizer, held, max_length)
    if held:
        single = [r for r in held if isinstance(r["prompt"], list) and r["prompt"][-1]["role"] == "user"][:3]
        if single:
            questions = [r["prompt"][-1]["content"] for r in single]
            answers = base_and_tuned(model, tokenizer, [[{"role": "user", "content": q}] for q in questions], 64,
                                     None, None)
            base, tuned = answers["base"], answers["tuned"]
            result["examples"] = [{"prompt": q, "base": b, "tuned": t} for q, b, t in zip(questions, base, tuned)]
    if probes:
        result["probes"] = run_probes(model, tokenizer, probes, seed)
    return result


def summary_lines(evaluation: dict) -> list[str]:
    """What a run prints of its evaluation: held-out examples (KTO), the checker's pass rates, preference accuracy."""
    out = []
    if "held_out_kto" in evaluation:
        b, t = evaluation["held_out_kto"]["base"], evaluation["held_out_kto"]["tuned"]
        gap = lambda v: "n/a" if v is None else f"{v:+.3f}"  # noqa: E731
        out.append(f"held-out examples: desirable minus undesirable log-likelihood {gap(b['gap'])} -> "
                   f"{gap(t['gap'])} nats/token ({b['desirable']['examples']} desirable, "
                   f"{b['undesirable']['examples']} undesirable)")
    if "execution" in evaluation:
        b, t = evaluation["execution"]["base"], evaluation["execution"]["tuned"]
        out.append(f"checker on held-out prompts: pass rate {b['pass_rate']:.3f} -> {t['pass_rate']:.3f}, mean score "
                   f"{b['mean_score']:+.4f} -> {t['mean_score']:+.4f}"
                   + (f"; on the {t['new_prompts']['prompts']} prompts no training record has: pass rate "
                      f"{b['new_prompts']['pass_rate']:.3f} -> {t['new_prompts']['pass_rate']:.3f}"
                      if "new_prompts" in t and "new_prompts" in b else ""))
    if "held_out" in evaluation:
        b, t = evaluation["held_out"]["base"], evaluation["held_out"]["tuned"]
        out.append(f"held-out preference accuracy {b['accuracy']:.3f} -> {t['accuracy']:.3f} "
                   f"(margin {b['mean_margin']:.2f} -> {t['mean_margin']:.2f} nats) on {b['pairs']} pairs")
    return out


def write_report(directory: Path, title: str, evaluation: dict, metrics: list[dict]) -> None:
    """evaluation.json, the training curves and report.md into directory."""
    plots = plot_metrics(metrics, directory)
    if evaluation.get("execution"):
        plots.insert(0, plot_execution(evaluation["execution"], directory))
    kit.atomic_write_json(directory / "evaluation.json", evaluation)
    kit.atomic_write_text(directory / "report.md", report_markdown(title, evaluation, plots, metrics))


# ---------------------------------------------------------------------------------------------
# The receiving end of a handoff (entrypoint.py chat / eval / merge): a finished run, or its tarball.
# ---------------------------------------------------------------------------------------------


def chat(path: str, prompts: list[str], compare: bool = False, max_new_tokens: int = 128) -> int:
    """Answer each prompt (or lines typed at the terminal) with base + adapter; --compare adds the base."""
    with tempfile.TemporaryDirectory(prefix="chat-") as tmp:
        run_dir, cfg = runs.open_run(path, tmp)
        model, tokenizer = models.load_run(run_dir, cfg)
        interactive = not prompts
        if interactive:
            print(f"[chat] {run_dir.name} on {cfg['model_name_or_path']}; an empty line or Ctrl-D ends", flush=True)
        while True:
            if interactive:
                try:
                    prompt = input("> ").strip()
                except EOFError:
                    break
                if not prompt:
                    break
            elif prompts:
                prompt = prompts.pop(0)
                print(f"> {prompt}")
            else:
                break
            if compare:
                with model.disable_adapter():
                    print(f"[base]  {generate(model, tokenizer, [prompt], max_new_tokens)[0]}")
            print(f"[tuned] {generate(model, tokenizer, [prompt], max_new_tokens)[0]}", flush=True)
    return 0


def held_out_data(source: str, cfg: dict, every: bool) -> tuple[list[dict], list[dict]]:
    """(pairs, prompts the checker scores) to evaluate a finished run on: its held-out share of its own data
    (every=False; and of its --eval_prompts, where that file is still here), or all of another file. A file of
    prompts or run logs (GRPO's data) gives prompts only."""
    if methods.holds_prompts(methods.first_record(source)):
        rows = [methods.prompt_record(r) for r in methods.load_prompts(source)[0]]
        return [], [{k: v for k, v in r.items() if k != formats.RUN_KEY} for r in rows
                    if every or formats.held_out(r, cfg["eval_fraction"])]
    columns = {} if every else formats.parse_columns(cfg.get("columns", ""))  # another file: its own shape
    pairs, _ = formats.load_pairs(source, cfg["skip_invalid"], columns, 0.0 if every else cfg.get("min_score_gap", 0.0))
    held = pairs if every else [r for r in pairs if formats.held_out(r, cfg["eval_fraction"])]
    prompts = []
    if not every and cfg.get("eval_prompts") and Path(cfg["eval_prompts"]).is_file():
        prompts = [r for r in checker.load_prompts(cfg["eval_prompts"]) if formats.held_out_prompt(r, cfg["eval_fraction"])]
    return held, prompts


def evaluate_run(path: str, data: str = "", out_dir: str | None = None) -> Path:
    """Re-run the evaluation of a finished run (directory or tarball) into <run>-eval/: on the run's
    own held-out pairs (recomputed from its data file), or on every pair of another file."""
    with tempfile.TemporaryDirectory(prefix="eval-") as tmp:
        run_dir, cfg = runs.open_run(path, tmp)
        source = data or cfg["data"]
        if not Path(source).exists() and not formats.is_hub_id(source):
            raise UserError(f"the run's data file {source} is not here; pass another with DATA=")
        held, prompts = held_out_data(source, cfg, every=bool(data))
        model, tokenizer = models.load_run(run_dir, cfg)
        evaluation = evaluate(model, tokenizer, held, load_probes(cfg["probes"]), cfg["max_length"], cfg["seed"],
                              prompts, cfg.get("eval_samples", 4), cfg.get("eval_max_new_tokens", 256))
        dest = Path(out_dir or Path(cfg["output_dir"]) / f"{run_dir.name}-eval")
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        metrics = runs.read_metrics(run_dir)
        what = (f"all {len(held) or len(prompts)} {'pairs' if held else 'prompts'} of {data}" if data else
                f"its {len(held)} held-out pairs" + (f" and {len(prompts)} held-out prompts" if prompts else ""))
        write_report(partial, f"{run_dir.name}: evaluated on {what}", evaluation | {"data": source, "pairs": len(held)},
                     metrics)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(partial, dest)
    print(f"[eval] {dest}/report.md", flush=True)
    return dest


def merge(path: str, out_dir: str | None = None, dtype: str = "bfloat16", tolerance: float = 1e-3) -> Path:
    """Merge the adapter into the base it trained against and save a standalone model directory.

    The base is the one the run trained against, in float32 (models.trained_base: a 4-bit base's dequantised
    weights, never re-quantised), and the LoRA deltas are merged in float32; the merged logits must match
    base + adapter (unmerged, the trained model) within `tolerance` on a few probes, or nothing is kept. Then
    the model is cast to `dtype`, saved, reloaded with plain AutoModelForCausalLM, and the rounding's effect
    recorded (max logit difference, top-1 agreement against the trained model).
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="merge-") as tmp:
        run_dir, cfg = runs.open_run(path, tmp)
        dest = Path(out_dir or Path(cfg["output_dir"]) / f"{run_dir.name}-merged")
        tokenizer = AutoTokenizer.from_pretrained(run_dir)
        model = PeftModel.from_pretrained(models.trained_base(cfg), run_dir).eval()
        probes = tokenizer(MERGE_PROBES, return_tensors="pt", padding=True)
        with torch.no_grad():
            unmerged = model(**probes.to(model.device)).logits.cpu()
            merged = model.merge_and_unload()
            merged_fp32 = merged(**probes.to(merged.device)).logits.cpu()
        probes = probes.to("cpu")
        mask = probes["attention_mask"].bool()
        merge_error = (merged_fp32 - unmerged)[mask].abs().max().item()
        if merge_error > tolerance:
            raise UserError(f"merged logits differ from base + adapter by {merge_error:.2e} (> {tolerance}); "
                            "nothing saved")
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        merged.to(getattr(torch, dtype)).save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        reloaded = AutoModelForCausalLM.from_pretrained(partial, dtype=torch.float32).eval()
        with torch.no_grad():
            merged_logits = reloaded(**probes).logits
        report = {
            "dtype": dtype, "tolerance": tolerance, "float32_merge_max_abs_diff": merge_error,
            "base": "dequantised 4-bit weights" if cfg["load_in_4bit"] else "the base's weights",
            "max_abs_diff_vs_unmerged": (merged_logits - unmerged)[mask].abs().max().item(),
            "top1_agreement_vs_unmerged": (merged_logits.argmax(-1) == unmerged.argmax(-1))[mask].float().mean().item(),
            "probes": MERGE_PROBES}
        kit.atomic_write_json(partial / "merge_report.json", report)
        kit.atomic_write_text(partial / "README.md", (
            f"# {dest.name}\n\n{cfg['model_name_or_path']} with the LoRA adapter of run {run_dir.name} merged in "
            f"(into {report['base']}, the weights it trained against, in float32; saved as {dtype}). Loads with "
            f"`AutoModelForCausalLM.from_pretrained`.\n\n"
            f"Check against the trained model (base + adapter) on {len(MERGE_PROBES)} probes: the float32 merge "
            f"differs by at most {merge_error:.1e} in the logits (tolerance {tolerance}); after the cast to {dtype}, "
            f"by {report['max_abs_diff_vs_unmerged']:.3f}, with top-1 agreement "
            f"{report['top1_agreement_vs_unmerged']:.3f}; see merge_report.json.\n\n"
            f"Adapter card:\n\n" + (run_dir / "README.md").read_text()))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(partial, dest)
    print(f"[merge] {dest}: float32 merge within {merge_error:.1e} of the trained model; as {dtype}: max |logit "
          f"diff| {report['max_abs_diff_vs_unmerged']:.3f}, top-1 agreement {report['top1_agreement_vs_unmerged']:.3f}",
          flush=True)
    return dest
