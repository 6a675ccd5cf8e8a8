"""Preference pairs the model makes for itself: SPIN and self-rewarding (the `spin` and `self-reward`
subcommands of build_pairs.py, which is how to run them).

    python build_pairs.py spin data/sft.jsonl --model M -o pairs.jsonl --report report.json
    python build_pairs.py self-reward data/prompts.jsonl --model M [--judge_model J] --candidates 4 \\
        [--judge probs|generate] [--judge_template FILE --reward_pattern 'Score: {reward}'] -o pairs.jsonl

SPIN (Chen et al. 2024): the reference answer is chosen, the model's own answer (greedy, or sampled
with --temperature) rejected; where the two are the same there is nothing to learn, so the pair is
dropped and counted. Self-rewarding (Yuan et al. 2024): the model samples --candidates answers per
prompt, a judge (the same model unless --judge_model) scores each with an LLM-as-judge prompt, and
the best is paired with the worst when their scores differ by at least --min_margin.

Judge modes. `generate`: the judge writes a judgement and the score is parsed with --reward_pattern
('Score: {reward}' -> the last "Score: <number>" in the text); judgements that do not parse, or give
a score outside [--score_min, --score_max], are counted and left out; --judgements N averages N sampled
judgements. `probs` (default): the judge's answer is started with the pattern's text before {reward}
("Score: ") and the score is the expected value of its next-token distribution over the allowed
integer scores; it always gives a score. A 135M model rarely writes "Score: N" when asked to judge,
so `generate` leaves the bundled demo with almost no pairs; see docs/self-made-pairs.md.

M and J are a model directory or hub id, or a finished run (directory or .tar.gz): the base as it
was trained (4-bit NF4) with the run's adapter, through the same loading code as train_dpo.py.
"""

from __future__ import annotations

import math
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dpokit.core import kit, runs
from dpokit.data import supervised
from dpokit.model import models
from dpokit.data.formats import BadRow, Pair, PairWriter, jsonl_rows, messages

DEFAULT_TEMPLATE = "data/judge_template.txt"
REWARD = "{reward}"
NUMBER = r"([-+]?\d+(?:\.\d+)?)"


# ---------------------------------------------------------------------------------------------
# Options: one dataclass per subcommand.
# ---------------------------------------------------------------------------------------------

@dataclass
class SpinConfig:
    """Every option of `build_pairs.py spin`."""

    sft: str = kit.field("", 'prompts with reference answers, JSONL: OpenAI\'s supervised rows {"messages": [...]} '
                         '(each assistant message of weight 1 a reference; supervised.py) or {"prompt": ..., '
                         '"completion": ...} (text or messages)')
    model: str = kit.field("", "model that answers: model directory, hub id, or a finished run (dir or .tar.gz)")
    output: str = kit.field("pairs.jsonl", "where the pairs go, JSONL; - writes standard output", short="-o")
    report: str | None = kit.field(None, "also write the summary here as JSON")
    format: str = kit.field("trl", "trl (with meta) or openai", choices=("trl", "openai"))
    max_new_tokens: int = kit.field(64, "tokens per generated answer")
    temperature: float = kit.field(0.0, "0 = greedy answers; above 0, sampled with this temperature and top_p")
    top_p: float = kit.field(1.0, "nucleus sampling share when temperature > 0")
    batch_size: int = kit.field(8, "prompts per generate call")
    max_examples: int = kit.field(0, "use only the first N examples; 0 = all")
    seed: int = kit.field(0, "sampling seed")

    def problems(self) -> list[str]:
        p = common_problems(self, self.sft, "the SFT file (prompts with reference answers)")
        return p


@dataclass
class SelfRewardConfig:
    """Every option of `build_pairs.py self-reward`."""

    prompts: str = kit.field("", 'prompts, JSONL: {"prompt": "..."} or {"prompt": [messages]} or '
                             '{"messages": [...]} (a trailing assistant answer is ignored)')
    model: str = kit.field("", "policy that samples: model directory, hub id, or a finished run (dir or .tar.gz)")
    judge_model: str = kit.field("", "judge model (same kinds); default: the policy judges itself")
    output: str = kit.field("pairs.jsonl", "where the pairs go, JSONL; - writes standard output", short="-o")
    report: str | None = kit.field(None, "also write the summary here as JSON")
    format: str = kit.field("trl", "trl (with meta) or openai", choices=("trl", "openai"))
    candidates: int = kit.field(4, "answers sampled per prompt")
    temperature: float = kit.field(0.8, "sampling temperature of the candidates")
    top_p: float = kit.field(0.95, "nucleus sampling share of the candidates")
    max_new_tokens: int = kit.field(64, "tokens per candidate")
    judge: str = kit.field("probs", "probs: expected score from the judge's next-token probabilities after the "
                           "pattern's prefix (always parses); generate: parse --reward_pattern from a written "
                           "judgement", choices=("probs", "generate"))
    judge_template: str = kit.field(DEFAULT_TEMPLATE, "judge prompt with {prompt} and {response} "
                                    "(default: the self-rewarding paper's additive 5-point prompt)")
    reward_pattern: str = kit.field("Score: {reward}", "where the score is in the judgement; {reward} is a number")
    score_min: float = kit.field(0.0, "lowest valid score (the additive template: 0)")
    score_max: float = kit.field(5.0, "highest valid score (the additive template: 5)")
    judgements: int = kit.field(1, "judgements averaged per candidate (generate: sampled with --judge_temperature)")
    judge_temperature: float = kit.field(0.7, "sampling temperature of judgements when --judgements > 1")
    judge_max_new_tokens: int = kit.field(128, "tokens per written judgement (generate)")
    min_margin: float = kit.field(0.5, "pair best and worst only when their scores differ by at least this")
    batch_size: int = kit.field(8, "sequences per generate / forward call")
    max_examples: int = kit.field(0, "use only the first N prompts; 0 = all")
    seed: int = kit.field(0, "sampling seed")

    def problems(self) -> list[str]:
        p = common_problems(self, self.prompts, "the prompts file")
        if self.candidates < 2:
            p.append(f"--candidates must be at least 2 (got {self.candidates}): best and worst need two")
        if self.judgements < 1 or self.judge_max_new_tokens < 1:
            p.append("--judgements and --judge_max_new_tokens must be at least 1")
        if self.judge == "probs" and self.judgements > 1:
            p.append("--judgements > 1 needs --judge generate (probs is deterministic: every judgement is the same)")
        if self.temperature <= 0:
            p.append(f"--temperature must be positive for sampled candidates (got {self.temperature})")
        if not self.score_min < self.score_max:
            p.append(f"--score_min {self.score_min} must be below --score_max {self.score_max}")
        if self.judge == "probs" and not (self.score_min.is_integer() and self.score_max.is_integer()):
            p.append("--judge probs reads integer scores: --score_min and --score_max must be whole numbers")
        if self.min_margin < 0:
            p.append(f"--min_margin must not be negative (got {self.min_margin})")
        try:
            compile_reward_pattern(self.reward_pattern)
        except ValueError as e:
            p.append(f"--reward_pattern: {e}")
        return p


def common_problems(cfg, source: str, what: str) -> list[str]:
    p = []
    if not source:
        p.append(f"give {what} to read")
    if not cfg.model:
        p.append("--model is required (a model directory, hub id, or finished run)")
    for name in ("max_new_tokens", "batch_size"):
        if getattr(cfg, name) < 1:
            p.append(f"--{name} must be at least 1 (got {getattr(cfg, name)})")
    if cfg.temperature < 0 or not 0 < cfg.top_p <= 1 or cfg.max_examples < 0:
        p.append("--temperature must not be negative, --top_p in (0, 1], --max_examples not negative")
    return p


# ---------------------------------------------------------------------------------------------
# Pure logic: reading examples, the reward pattern, scores, best/worst pairing. No model.
# ---------------------------------------------------------------------------------------------

def compile_reward_pattern(pattern: str) -> re.Pattern:
    """'Score: {reward}' -> a regex matching 'Score: 4' (or 'score:4.5'), the number in group 1.

    The text around {reward} is literal; any run of whitespace in it matches any (or no)
    whitespace, and case is ignored: a judge that writes 'score:  4' still counts."""
    if pattern.count(REWARD) != 1:
        raise ValueError(f"{pattern!r} must contain {REWARD} exactly once")
    before, after = pattern.split(REWARD)

    def literal(text):
        return r"\s*".join(re.escape(part) for part in re.split(r"\s+", text))

    return re.compile(literal(before) + NUMBER + literal(after), re.IGNORECASE)


def parse_reward(text: str, regex: re.Pattern, lo: float, hi: float) -> tuple[float | None, str]:
    """(score, 'ok') from the last match in a judgement; (None, 'unparsable') without one;
    (None, 'out_of_range') when the number lies outside [lo, hi]."""
    matches = regex.findall(text)
    if not matches:
        return None, "unparsable"
    value = float(matches[-1])
    if not (math.isfinite(value) and lo <= value <= hi):
        return None, "out_of_range"
    return value, "ok"


def average(scores) -> float | None:
    """Mean of the valid judgements of one candidate; None when none was valid."""
    valid = [s for s in scores if s is not None]
    return sum(valid) / len(valid) if valid else None


def expected_score(probs: dict[int, float]) -> tuple[float, float]:
    """(expected score, probability mass on the allowed scores) from the judge's next-token
    probabilities of each allowed score; renormalised over the allowed ones."""
    mass = sum(probs.values())
    return sum(s * p for s, p in probs.items()) / mass, mass


def best_and_worst(texts: list[str], scores: list[float | None], min_margin: float):
    """Indices (best, worst) of the scored candidates, or (None, reason).

    Identical answers count once (the earliest); ties go to the earliest candidate on both ends;
    reason is 'too_few_scored' (fewer than two distinct scored answers) or 'too_close' (best minus
    worst below min_margin, which includes every answer scoring the same)."""
    seen, scored = set(), []
    for i, (t, s) in enumerate(zip(texts, scores)):
        key = t.strip()
        if s is None or not key or key in seen:
            continue
        seen.add(key)
        scored.append((i, s))
    if len(scored) < 2:
        return None, "too_few_scored"
    best = max(scored, key=lambda x: (x[1], -x[0]))
    worst = min(scored, key=lambda x: (x[1], x[0]))
    if best[1] - worst[1] < min_margin or best[0] == worst[0]:
        return None, "too_close"
    return best[0], worst[0]


def _messages(value, what: str, bad) -> list[dict]:
    """A prompt as text messages (a string is one user message), validated as pair files' messages are."""
    if isinstance(value, str):
        if not value.strip():
            raise bad(f"{what} is empty")
        return [{"role": "user", "content": value}]
    try:
        msgs = messages(value, what)
    except ValueError as e:
        raise bad(str(e)) from None
    if any("tool_calls" in m or m["role"] == "tool" for m in msgs):
        raise bad(f"{what}: the model answers these prompts in text; one with tool calls or tool results is not read")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def parse_prompt(obj, bad) -> list:
    """One prompts-file record -> the prompt's messages, ending with a user turn: {"prompt": text or messages},
    or {"messages": [...]} whose trailing assistant answer, if any, is left out."""
    if not isinstance(obj, dict):
        raise bad("expected a JSON object")
    if "messages" in obj:
        prompt = _messages(obj["messages"], "messages", bad)
        if prompt[-1]["role"] == "assistant":
            prompt.pop()
    elif "prompt" in obj:
        prompt = _messages(obj["prompt"], "prompt", bad)
    else:
        raise bad(f"expected \"messages\" or \"prompt\" (keys: {', '.join(sorted(obj)) or 'none'})")
    if not prompt or prompt[-1]["role"] != "user":
        raise bad("the prompt must end with a user message")
    return prompt


def read_prompts(path: str, limit: int = 0) -> list[tuple[int, list]]:
    """(line, prompt) for every record of a prompts file; a bad line stops with FILE:LINE."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise kit.UserError(f"cannot read: {e.strerror}", path) from None
    out = []
    for n, obj in jsonl_rows(raw):
        def bad(message, n=n):
            return kit.UserError(message, path, n)
        if isinstance(obj, BadRow):
            raise bad(str(obj))
        out.append((n, parse_prompt(obj, bad)))
        if limit and len(out) == limit:
            break
    if not out:
        raise kit.UserError("no examples in the file", path)
    return out


def read_examples(path: str, limit: int = 0) -> list[tuple[int, list, str]]:
    """(line, prompt, reference answer) for each example of an SFT file, read as a supervised job reads it
    (supervised.py: one example per assistant message of weight 1). SPIN compares text answers, so an example with
    tools (a tools list, a call or a tool result) stops the read with its FILE:LINE."""
    out = []
    for ex in supervised.read(path, limit).examples:
        if not ex.text_only():
            raise kit.UserError("SPIN compares the model's text answer with the reference, and this row uses tools "
                                "(train on it with an sft stage or a supervised job)", path, ex.line)
        out.append((ex.line, ex.prompt, ex.answer["content"]))
    return out


def read_template(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise kit.UserError(f"cannot read the judge template: {e.strerror}", path) from None
    missing = [k for k in ("{prompt}", "{response}") if k not in text]
    if missing:
        raise kit.UserError(f"the judge template must contain {' and '.join(missing)}", path, 1)
    return text


def fill_template(template: str, prompt: list, response: str) -> str:
    """The judge's prompt: the user's last message and the candidate put in the template (plain
    replacement, so other braces in the template are left alone)."""
    return template.replace("{prompt}", prompt[-1]["content"]).replace("{response}", response)


def pattern_prefix(pattern: str) -> str:
    """The text the judge's answer is started with in probs mode: the pattern before {reward}."""
    return pattern.split(REWARD)[0]


# ---------------------------------------------------------------------------------------------
# The model: loaded as training loads it (4-bit NF4, the run's adapter), batched generation.
# ---------------------------------------------------------------------------------------------

def load_generator(path: str):
    """(model, tokenizer, description) for a model directory / hub id, or a finished run (base + adapter)."""
    import tempfile

    p = Path(path)
    if (p / "adapter_config.json").exists() or p.is_file():
        with tempfile.TemporaryDirectory(prefix="self-pairs-") as tmp:
            run_dir, cfg = runs.open_run(path, tmp)
            model, tok = models.load_run(run_dir, cfg)
        what = f"{cfg['model_name_or_path']} + adapter of run {run_dir.name}"
        opts = models.LoadOptions.of(cfg)
    else:
        from transformers import AutoTokenizer

        on_gpu, bf16_ok = models.device()
        opts = models.LoadOptions()  # as train_dpo.py loads a base by default: 4-bit NF4
        found = models.resolve_model_path(path)
        model = models.load_model(found, opts, on_gpu, bf16_ok).eval()
        if not on_gpu:
            models.dequantize_4bit_(model)  # the same values, without re-dequantising at every matmul
        tok = AutoTokenizer.from_pretrained(found)
        what = path
    tok.padding_side = "left"  # batches of prompts (the judge's too) end where the answer starts
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok, f"{what} ({'4-bit NF4' if opts.load_in_4bit else 'full precision'})"


def sample(model, tok, prompts: list[list], n: int, max_new_tokens: int, temperature: float, top_p: float,
           seed: int, batch_size: int) -> list[list[str]]:
    """n answers per prompt (greedy when temperature is 0), batched with left padding; seeded per batch."""
    out = []
    step = max(1, batch_size // n)
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": 0} if temperature else None
    for b, i in enumerate(range(0, len(prompts), step)):
        texts = models.generate(model, tok, prompts[i:i + step], max_new_tokens, sampling, seed + b, n=n)
        out += [texts[j:j + n] for j in range(0, len(texts), n)]
    return out


def score_tokens(tok, prefix_text: str, lo: int, hi: int) -> dict[int, int]:
    """Token id of each allowed score right after the prefix; each must be one token there."""
    base = tok(prefix_text, add_special_tokens=False)["input_ids"]
    ids = {}
    for s in range(lo, hi + 1):
        full = tok(prefix_text + str(s), add_special_tokens=False)["input_ids"]
        if full[:len(base)] != base or len(full) != len(base) + 1:
            raise kit.UserError(f"--judge probs: score {s} is not a single token after {prefix_text[-20:]!r} for "
                                "this tokenizer; use --judge generate")
        ids[s] = full[-1]
    return ids


def judge_probs(model, tok, judge_prompts: list[str], prefix: str, lo: int, hi: int, batch_size: int):
    """(expected score, mass on allowed scores) per judge prompt, from one forward pass each."""
    import torch

    texts = models.prompt_texts(tok, [[{"role": "user", "content": q}] for q in judge_prompts], prefix)
    ids = score_tokens(tok, texts[0], lo, hi)
    out = []
    for i in range(0, len(texts), batch_size):
        batch = tok(texts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            logits = model(**batch.to(model.device)).logits[:, -1].float()
        probs = torch.softmax(logits, dim=-1)
        out += [expected_score({s: row[t].item() for s, t in ids.items()}) for row in probs]
    return out


def judge_generate(model, tok, judge_prompts: list[str], cfg: SelfRewardConfig):
    """Per judge prompt: [(score or None, status, text)] for cfg.judgements written judgements."""
    regex = compile_reward_pattern(cfg.reward_pattern)
    prompts = [[{"role": "user", "content": q}] for q in judge_prompts]
    temperature = cfg.judge_temperature if cfg.judgements > 1 else 0.0
    texts = sample(model, tok, prompts, cfg.judgements, cfg.judge_max_new_tokens, temperature, 1.0,
                   cfg.seed + 10_000, cfg.batch_size)
    return [[(*parse_reward(t, regex, cfg.score_min, cfg.score_max), t) for t in row] for row in texts]


# ---------------------------------------------------------------------------------------------
# The two commands.
# ---------------------------------------------------------------------------------------------

def spin(cfg: SpinConfig) -> dict:
    examples = read_examples(cfg.sft, limit=cfg.max_examples)
    model, tok, what = load_generator(cfg.model)
    print(f"spin: {len(examples)} examples from {cfg.sft}; answers by {what}", file=sys.stderr, flush=True)
    answers = sample(model, tok, [p for _, p, _ in examples], 1, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                     cfg.seed, cfg.batch_size)
    stats = Counter()
    with PairWriter(cfg.output, cfg.format) as writer:
        for (line, prompt, reference), [own] in zip(examples, answers):
            if not own.strip():
                stats["empty_answers"] += 1
            elif own.strip() == reference.strip():
                stats["same_as_reference"] += 1
            else:
                writer.write([Pair(prompt, reference, own, {"rule": "spin", "line": line})])
        summary = {"command": "spin", "input": cfg.sft, "output": cfg.output, "model": what,
                   "examples": len(examples), "pairs_written": sum(writer.by_rule.values()),
                   "dropped_same_as_reference": stats["same_as_reference"], "dropped_empty": stats["empty_answers"],
                   "duplicates_removed": writer.duplicates,
                   "generation": {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
                                  "top_p": cfg.top_p, "seed": cfg.seed}}
        if summary["pairs_written"]:
            writer.commit()
    return summary


def self_reward(cfg: SelfRewardConfig) -> dict:
    examples = read_prompts(cfg.prompts, limit=cfg.max_examples)
    template = read_template(cfg.judge_template)
    model, tok, what = load_generator(cfg.model)
    judge, judge_tok, judge_what = (model, tok, what) if cfg.judge_model in ("", cfg.model) else \
        load_generator(cfg.judge_model)
    prompts = [p for _, p in examples]
    print(f"self-reward: {len(prompts)} prompts x {cfg.candidates} candidates by {what}; judge {judge_what} "
          f"({cfg.judge})", file=sys.stderr, flush=True)
    candidates = sample(model, tok, prompts, cfg.candidates, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                        cfg.seed, cfg.batch_size)
    flat = [(i, j) for i, row in enumerate(candidates) for j in range(len(row))]
    judge_prompts = [fill_template(template, prompts[i], candidates[i][j]) for i, j in flat]
    stats = Counter()
    scores = [[None] * len(row) for row in candidates]
    if cfg.judge == "probs":
        results = judge_probs(judge, judge_tok, judge_prompts, pattern_prefix(cfg.reward_pattern),
                              int(cfg.score_min), int(cfg.score_max), cfg.batch_size)
        for (i, j), (score, mass) in zip(flat, results):
            scores[i][j] = score
        stats["judgements"] = len(results)
        stats["ok"] = len(results)
        mean_mass = sum(m for _, m in results) / len(results)
        examples_of_judgements = []
    else:
        results = judge_generate(judge, judge_tok, judge_prompts, cfg)
        for (i, j), row in zip(flat, results):
            stats.update(status for _, status, _ in row)
            stats["judgements"] += len(row)
            scores[i][j] = average(s for s, _, _ in row)
        mean_mass = None
        examples_of_judgements = [row[0][2] for row in results[:3]]
    with PairWriter(cfg.output, cfg.format) as writer:
        for (line, prompt), texts, row in zip(examples, candidates, scores):
            best, worst = best_and_worst(texts, row, cfg.min_margin)
            if best is None:
                stats["no_pair_" + worst] += 1
                continue
            writer.write([Pair(prompt, texts[best], texts[worst],
                               {"rule": "self_reward", "line": line, "chosen_score": round(row[best], 4),
                                "rejected_score": round(row[worst], 4)})])
        summary = {
            "command": "self-reward", "input": cfg.prompts, "output": cfg.output, "model": what, "judge": judge_what,
            "judge_mode": cfg.judge, "prompts": len(prompts), "candidates": sum(map(len, candidates)),
            "judgements": stats["judgements"], "judgements_parsed": stats["ok"],
            "judgements_unparsable": stats["unparsable"], "judgements_out_of_range": stats["out_of_range"],
            "candidates_scored": sum(s is not None for row in scores for s in row),
            "pairs_written": sum(writer.by_rule.values()),
            "prompts_without_pair": {"too_few_scored": stats["no_pair_too_few_scored"],
                                     "too_close": stats["no_pair_too_close"]},
            "min_margin": cfg.min_margin, "score_range": [cfg.score_min, cfg.score_max],
            "reward_pattern": cfg.reward_pattern, "mean_probability_on_scores": mean_mass,
            "scores": [[None if s is None else round(s, 3) for s in row] for row in scores],
            "judgement_examples": examples_of_judgements}
        if summary["pairs_written"]:
            writer.commit()
    return summary


def print_summary(s: dict) -> None:
    if s["command"] == "spin":
        print(f"spin: {s['examples']} examples -> {s['pairs_written']} pairs in {s['output']}; dropped "
              f"{s['dropped_same_as_reference']} where the model's answer equals the reference, "
              f"{s['dropped_empty']} empty answers", file=sys.stderr)
        return
    parsed = f"{s['judgements_parsed']}/{s['judgements']}"
    print(f"self-reward: {s['prompts']} prompts, {s['candidates']} candidates, {s['judgements']} judgements "
          f"({s['judge_mode']}): {parsed} parsed, {s['judgements_unparsable']} unparsable, "
          f"{s['judgements_out_of_range']} out of range; {s['candidates_scored']} candidates scored\n"
          f"  pairs written: {s['pairs_written']} to {s['output']}; prompts without a pair: "
          f"{s['prompts_without_pair']['too_few_scored']} too few scored, "
          f"{s['prompts_without_pair']['too_close']} best - worst < {s['min_margin']}", file=sys.stderr)


def make(cfg: SpinConfig | SelfRewardConfig) -> dict:
    """Run `spin` or `self_reward` (by the config's type), print the summary, write the report. Returns it."""
    summary = spin(cfg) if isinstance(cfg, SpinConfig) else self_reward(cfg)
    print_summary(summary)
    if cfg.report:
        kit.atomic_write_json(cfg.report, summary)
    if not summary["pairs_written"]:
        print(f"build_pairs {summary['command']}: no pairs; {cfg.output} not written", file=sys.stderr)
    return summary


def main(command: str, argv: list[str]) -> int:
    if command == "spin":
        cfg = kit.parse_config(SpinConfig, argv, __doc__, positional="sft")
    else:
        cfg = kit.parse_config(SelfRewardConfig, argv, __doc__, positional="prompts")
    return 0 if make(cfg)["pairs_written"] else 1
