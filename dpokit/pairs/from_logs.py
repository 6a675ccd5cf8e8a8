"""Turn an agent's run logs (JSONL, one run per line) into DPO preference pairs (or KTO examples) by the retraining rules.

    python build_pairs.py data/runs.jsonl -o pairs.jsonl --report report.json

A run: {"run_id", "prompt": [msgs, or [msg, tag] pairs], "strategy", "attempts": [{"code", "ran", "space_freed"}],
"tools"?}; an agent's tool calls and their results in the prompt (OpenAI's shapes) and its tools list reach the
pairs unchanged. An attempt *succeeded* when it ran and scored > 0 (`--score_key`, default space_freed). Per run:
  never_ran, never_succeeded  no pair of its own (its strategy can still be a cross_run rejected)
  mixed                       strategy -> best successful code  vs  each failed attempt's code (meta.rejected_broke
                              when that attempt deleted what must be kept: its outcome "broke", or its error
                              starting "deleted or changed what must be kept", as attempts.py logs it)
  first_try_strategy          run's prompt -> strategy          vs  a garbled strategy
  first_try_code              strategy -> best code             vs  garbled code that never compiles
  cross_run                   shared prompt -> best run's strategy vs each never-succeeded run's strategy
  near_miss                   strategy -> a passing answer      vs  the same code aimed further up, which deleted what
                              must be kept (an attempt marked `made`, `from` the answer: attempts.py --widen;
                              rejected_broke; never counted as one of the agent's attempts)
`-` as input reads standard input; `-o -` writes standard output. `-o` is short for --output, and
--dashed-names work as well as --underscored_names. The summary goes to standard error. Logs over 4 MB are
parsed and garbled by one worker process per CPU core (up to 4), in blocks put back in order: the same output
(`--workers 1`: this process alone).

Unpaired examples for KTO (TRL's KTOTrainer) instead of pairs: every run is used, nothing is garbled:

    python build_pairs.py data/runs.jsonl --emit kto -o examples.jsonl

  kto_strategy  run's prompt -> strategy        desirable when something succeeded (first_try, mixed), else not
  kto_code      strategy -> each distinct code  desirable when it succeeded; undesirable ones: max_pairs_per_run a run
One line each: {"prompt": [msgs], "completion": [{"role": "assistant", ...}], "label": true|false, "meta": {...}}.

Pairs the model makes for itself (Self-Rewarding LMs and SPIN; the model loads in 4-bit like training):

    python build_pairs.py spin data/sft.jsonl --model M -o pairs.jsonl
    python build_pairs.py self-reward data/prompts.jsonl --model M [--judge_model J] --candidates 4 \
        [--judge probs|generate --judge_template FILE --reward_pattern 'Score: {reward}']

  spin         reference answer (chosen)  vs  the model's own answer (rejected); identical ones dropped
  self_reward  the model's candidates, scored by a judge prompt: best vs worst when they differ by min_margin
M (and J) is a model directory or hub id, or a finished run (directory or .tar.gz): its base + adapter.
`python build_pairs.py spin --help` (or self-reward --help) lists their options.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import random
import sys
import warnings
from array import array
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

from dpokit.core import kit
from dpokit.data import runlogs
from dpokit.data.formats import Example, Pair, PairWriter, digest_and_line
from dpokit.data.runlogs import Attempt, Run, _parse_line, open_runs, prompts_from_logs
from dpokit.model import models
from dpokit.pairs import self_pairs

RULES = ("mixed", "first_try_strategy", "first_try_code", "cross_run", "near_miss")
KTO_RULES = ("kto_strategy", "kto_code")  # --emit kto
SUBCOMMANDS = ("spin", "self-reward")  # anything else is the run-log file (the default, unchanged)
OUTCOMES = ("first_try", "mixed", "never_succeeded", "never_ran")
GARBLE_TRIES = 20  # rule-garbling rounds before the always-failing fallback
MODEL_TEMPERATURE = 1.5  # "high-temperature garbled output", as the retraining document puts it
MODEL_TRIES = 3  # samples per answer before the rules garbler stands in
# --workers: each worker parses, garbles and encodes blocks of runs (~90 us of CPU a run on the bench mix, a third
# of it compile()) while this process dedups, writes, keeps the cross-run index and moves the blocks (~20 us).
# On by default for files over AUTO_WORKERS_BYTES: on 2 idle cores, 100k bench runs took 8.0 s in one process and
# 4.8 s with 2 workers (1M: 47.7 s, 21,000 runs/s); with another job busy on both cores, 2 workers ran at 0.8x.
MAX_WORKERS = 4
AUTO_WORKERS_BYTES = 4 << 20  # below this (~2,700 bench runs, ~0.2 s) starting workers costs more than it saves
MAX_WARNINGS = 10  # skipped-line messages shown with --skip_invalid; the rest are only counted


@dataclass
class PairsConfig:
    """Every option of build_pairs.py; the field names are the flags (`--max_pairs_per_run 4`)."""

    runs: str = kit.field("", "run logs, JSONL with one run per line; - reads standard input")
    extra_runs: str = kit.field("", "more run log files, comma-separated, read after RUNS as if appended to it: an "
                                "earlier round's attempts (attempts.py), the agent's other logs")
    output: str = kit.field("pairs.jsonl", "where the pairs go, JSONL; - writes standard output", short="-o")
    report: str | None = kit.field(None, "also write the summary here as JSON")
    format: str = kit.field("trl", "trl: prompt/chosen/rejected/meta (what train_dpo.py reads); "
                            "openai: OpenAI preference fine-tuning (no meta)", choices=("trl", "openai"))
    emit: str = kit.field("dpo", "dpo: preference pairs by the rules above; kto: unpaired examples for TRL's "
                          "KTOTrainer, the strategy and each distinct code of every run labelled desirable (it "
                          "succeeded) or not, nothing garbled", choices=("dpo", "kto"))
    score_key: str = kit.field(runlogs.SCORE_KEY, "attempt key holding the score; succeeded = ran and score > 0")
    max_pairs_per_run: int = kit.field(4, "mixed runs: at most this many failed attempts per run, earliest first "
                                       "(--emit kto: undesirable code examples per run)")
    cross_run: bool = kit.field(True, "runs sharing a prompt compete: best strategy vs never-succeeded ones "
                                 "(--no_cross_run turns it off)")
    max_pairs_per_prompt: int = kit.field(4, "cross_run: at most this many pairs per distinct prompt")
    garble: str = kit.field("rules", "rejected answer for first-try runs: rules (deterministic edits) or "
                            f"model (sample --model at temperature {MODEL_TEMPERATURE})", choices=("rules", "model"))
    model: str | None = kit.field(None, "causal LM directory for --garble model")
    seed: int = kit.field(0, "garbling seed; the same input and seed give byte-identical output")
    skip_invalid: bool = kit.field(False, "skip and count bad lines instead of stopping at the first one")
    prompts: str = kit.field("", "also write each run's code-asking prompt and the host it names here (JSONL: "
                             "prompt, host, run_id): what train_dpo.py --eval_prompts runs through the checker and "
                             "--method grpo trains on")
    workers: int = kit.field(0, "processes that parse and garble while this one writes (1: this process alone; 0: "
                             f"one per CPU core, up to {MAX_WORKERS}, for inputs over {AUTO_WORKERS_BYTES >> 20} MB); "
                             "the output is the same")

    def sources(self) -> list[str]:
        """RUNS, then each --extra_runs file, in the order they are read."""
        return [self.runs, *(x.strip() for x in self.extra_runs.split(",") if x.strip())]

    def problems(self) -> list[str]:
        out = []
        if not self.runs:
            out.append("give the run log file to read (or - for standard input)")
        if "-" in self.sources()[1:]:
            out.append("--extra_runs are files: only RUNS may be - (standard input)")
        for name in ("max_pairs_per_run", "max_pairs_per_prompt"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.score_key:
            out.append("score_key must not be empty")
        if self.workers < 0:
            out.append(f"workers must be 0 (one per CPU core) or more, got {self.workers}")
        if self.garble == "model" and not self.model:
            out.append("--garble model needs --model PATH (a causal LM directory)")
        if self.model and self.garble != "model":
            out.append("--model is only used with --garble model")
        if self.emit == "kto" and self.format == "openai":
            out.append("--emit kto writes TRL's unpaired format (prompt/completion/label); --format openai has none")
        if self.emit == "kto" and self.garble == "model":
            out.append("--garble model is only used with --emit dpo (--emit kto garbles nothing)")
        if self.emit == "kto" and not self.cross_run:
            out.append("--no_cross_run is only used with --emit dpo (--emit kto makes no cross-run pairs)")
        if self.emit == "kto" and self.max_pairs_per_prompt != PairsConfig.max_pairs_per_prompt:
            out.append("--max_pairs_per_prompt is only used with --emit dpo (--emit kto makes no cross-run pairs)")
        if self.prompts and self.runs == "-":
            out.append("--prompts reads the run logs a second time: give a file, not standard input")
        same_file = self.runs not in ("", "-") and self.output != "-" and \
            os.path.abspath(self.runs) == os.path.abspath(self.output)
        if same_file:
            out.append("the output would overwrite the input")
        return out


# ---------------------------------------------------------------------------------------------
# Run records: parse and check one line's object.
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# The rules.
# ---------------------------------------------------------------------------------------------

def outcome(run: Run) -> str:
    """first_try (every attempt succeeded), mixed, never_succeeded (something ran) or never_ran: of the agent's own
    attempts (a `made` variant of the best one is paired apart: made_pairs)."""
    ok = [a.succeeded for a in run.attempts if not a.made]
    if ok and all(ok):
        return "first_try"
    if any(ok):
        return "mixed"
    return "never_succeeded" if any(a.ran for a in run.attempts) else "never_ran"


def best_attempt(run: Run) -> Attempt | None:
    """The successful attempt with the highest score, the earliest on ties; None if none succeeded."""
    best = None
    for a in run.attempts:
        if a.succeeded and not a.made and (best is None or a.score > best.score):
            best = a
    return best


def made_pairs(run: Run, seen: set) -> list[Pair]:
    """Each passing answer against the made variant of it that deleted what must be kept (attempts.py --widen: the
    same code aimed further up; `from` names the answer), beside whatever the run's own attempts make and outside
    max_pairs_per_run: a near miss that differs from the chosen answer in its path alone, rejected_broke for
    --broke_weight's term."""
    ask = [{"role": "user", "content": run.strategy}]
    out = []
    for a in run.attempts:
        origin = run.attempts[a.origin] if a.made and a.origin is not None else None
        if origin and a.broke and origin.succeeded and not origin.made and a.code.strip() not in seen:
            seen.add(a.code.strip())
            out.append(Pair(ask, origin.code, a.code, _meta(run.run_id, "near_miss", origin.score, a.score,
                                                            rejected_broke=True)))
    return out


def _meta(run_id: str, rule: str, chosen_score, rejected_score, tags=None, **extra) -> dict:
    meta = {"run_id": run_id, "rule": rule, "chosen_score": chosen_score, "rejected_score": rejected_score, **extra}
    if tags is not None:
        meta["tags"] = list(tags)
    return meta


def pairs_for_run(run: Run, cfg: PairsConfig, garbler=None, stats: Counter | None = None, kind: str | None = None,
                  best: Attempt | None = None) -> list[Pair]:
    """Rules 1-3 for one run. `stats` (if given) counts skipped same-code and capped attempts. `kind` and `best`
    are outcome(run) and best_attempt(run), when the caller has them already."""
    garbler = garbler or RuleGarbler(cfg.seed)
    stats = Counter() if stats is None else stats
    if kind is None:
        kind, best = outcome(run), best_attempt(run)
    ask = [{"role": "user", "content": run.strategy}]  # rules 2 and 3b: the strategy asks for the code
    if kind == "first_try":
        return [Pair(run.messages, run.strategy, garbler.garble(run.strategy, "text", run.run_id, run.messages),
                     _meta(run.run_id, "first_try_strategy", best.score, None, run.tags), run.tools),
                Pair(ask, best.code, garbler.garble(best.code, "code", run.run_id, ask),
                     _meta(run.run_id, "first_try_code", best.score, None))] + made_pairs(run, {best.code.strip()})
    if kind != "mixed":
        return []  # rule 1: nothing succeeded, nothing to choose
    pairs, seen = [], {best.code.strip()}
    for a in run.attempts:
        if a.succeeded or a.made:
            continue
        if a.code.strip() in seen:  # the same code as the chosen (or an earlier rejected) teaches nothing
            stats["same_code_skipped"] += 1
        elif len(pairs) == cfg.max_pairs_per_run:
            stats["pairs_capped"] += 1
        else:
            seen.add(a.code.strip())
            extra = {"rejected_broke": True} if a.broke else {}  # train_dpo --broke_weight reads it
            pairs.append(Pair(ask, best.code, a.code, _meta(run.run_id, "mixed", best.score, a.score, **extra)))
    return pairs + made_pairs(run, seen)


def _kto_meta(run_id: str, rule: str, score, kind: str, tags=None) -> dict:
    meta = {"run_id": run_id, "rule": rule, "score": score, "outcome": kind}
    if tags is not None:
        meta["tags"] = list(tags)
    return meta


def examples_for_run(run: Run, cfg: PairsConfig, stats: Counter | None = None, kind: str | None = None,
                     best: Attempt | None = None) -> list[Example]:
    """--emit kto: the run's strategy and each distinct code it tried, each one unpaired example labelled by
    whether it worked; nothing garbled, no run left out. A code tried again counts once (desirable if any try
    succeeded: then its best-scoring try stands for it, else its first); undesirable codes are capped at
    max_pairs_per_run, earliest first, so one run with many failures does not dominate. `stats`, `kind` and
    `best` as for pairs_for_run."""
    stats = Counter() if stats is None else stats
    if kind is None:
        kind, best = outcome(run), best_attempt(run)
    if best is None:
        scores = [a.score for a in run.attempts if a.score is not None]
        score = max(scores) if scores else None
    else:
        score = best.score
    examples = [Example(run.messages, run.strategy, kind in ("first_try", "mixed"),
                        _kto_meta(run.run_id, "kto_strategy", score, kind, run.tags), run.tools)]
    codes = {}  # code.strip() -> the try that stands for it
    for a in run.attempts:
        if a.made:
            continue  # not the agent's try (attempts.py --widen): its near miss is a DPO pair alone
        key = a.code.strip()
        first = codes.get(key)
        if first is None:
            codes[key] = a
            continue
        stats["same_code_skipped"] += 1
        if a.succeeded and (not first.succeeded or a.score > first.score):
            codes[key] = a
    ask = [{"role": "user", "content": run.strategy}]  # as pairs_for_run: the strategy asks for the code
    failures = 0
    for a in codes.values():
        if not a.succeeded:
            if failures == cfg.max_pairs_per_run:
                stats["pairs_capped"] += 1
                continue
            failures += 1
        examples.append(Example(ask, a.code, a.succeeded, _kto_meta(run.run_id, "kto_code", a.score, kind)))
    return examples


def prompt_key(messages: list, tools: list | None = None) -> bytes:
    """sha256 of each role and content behind its length (tags ignored): one digest per distinct prompt, equal
    exactly when the roles and contents are, a third of the cost of hashing the canonical JSON (no quoting:
    1.7 us against 5.3 for the bench's 4 messages), and 32 bytes to send between processes. Tool calls, tool
    results and the tools list are part of the prompt: they go in as canonical JSON after their message."""
    text = "".join([f"{len(m['role'])}\0{m['role']}{len(m['content'])}\0{m['content']}"
                    + (_canon_json({k: v for k, v in m.items() if k not in ("role", "content")}) if len(m) > 2 else "")
                    for m in messages])
    if tools:
        text += "\0tools" + _canon_json(tools)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


_canon_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode


def index_record(run: Run, best: Attempt | None, kind: str) -> tuple:
    """What CrossRunIndex needs of a run besides its prompt: (group key, run_id, strategy, best score or None,
    highest score of a failed run or None, outcome); best and kind are best_attempt(run) and outcome(run)."""
    scores = [a.score for a in run.attempts if a.score is not None] if best is None else None
    return (prompt_key(run.messages, run.tools), run.run_id, run.strategy, None if best is None else best.score,
            max(scores) if scores else None, kind)


@dataclass
class _PromptGroup:
    messages: list
    tags: list | None
    tools: list | None
    best: tuple | None = None  # (run_id, strategy, score) of the best-scoring run so far
    failed: dict = dataclasses.field(default_factory=dict)  # strategy -> (run_id, strategy, score, outcome)
    overflow: int = 0  # failed strategies not kept: the cap (plus one spare) was full


class CrossRunIndex:
    """Rule 4: runs with the same prompt compete; the best run's strategy beats each never-succeeded one.

    Streams: one small record per distinct prompt (messages once, the best strategy, at most
    max_pairs + 1 failed strategies), never whole runs. Pairs come out in first-seen prompt order.
    """

    def __init__(self, max_pairs_per_prompt: int = 4):
        self.cap = max_pairs_per_prompt
        self.groups: dict[bytes, _PromptGroup] = {}
        self.recovered = Counter()  # failed runs that made it into a pair, by outcome
        self.capped = 0  # failed strategies left out by the per-prompt cap (counted by pairs())

    def add(self, run: Run, best: Attempt | None = None, kind: str | None = None) -> None:
        """Add one run; `best` and `kind` are best_attempt(run) and outcome(run), when the caller has them."""
        if kind is None:
            best, kind = best_attempt(run), outcome(run)
        self.add_record(index_record(run, best, kind), run.messages, run.tags, run.tools)

    def add_record(self, record: tuple, messages: list | None, tags: list | None, tools: list | None = None) -> None:
        """Add one run's index_record; messages, tags and tools (its prompt) may be None once a run with the
        same prompt was added: the group keeps those of its first run."""
        key, run_id, strategy, best_score, failed_score, kind = record
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = _PromptGroup(messages, tags, tools)
        if best_score is not None:
            if group.best is None or best_score > group.best[2]:  # strict: the earliest run wins ties
                group.best = (run_id, strategy, best_score)
        elif strategy.strip() not in group.failed:
            if len(group.failed) > self.cap:  # one spare slot: the final best may be among the failed
                group.overflow += 1
                return
            group.failed[strategy.strip()] = (run_id, strategy, failed_score, kind)

    def pairs(self):
        for group in self.groups.values():
            if group.best is None:
                continue
            best_id, best_strategy, best_score = group.best
            losers = [f for key, f in group.failed.items() if key != best_strategy.strip()]
            self.capped += group.overflow + max(0, len(losers) - self.cap)
            for run_id, strategy, score, kind in losers[:self.cap]:
                self.recovered[kind] += 1
                yield Pair(group.messages, best_strategy, strategy,
                           _meta(run_id, "cross_run", best_score, score, group.tags, chosen_run_id=best_id),
                           group.tools)


# ---------------------------------------------------------------------------------------------
# Garbling: the rejected answer for runs that worked first time.
# ---------------------------------------------------------------------------------------------

def rng_for(seed: int, run_id: str, text: str) -> random.Random:
    """A generator fixed by (seed, run, text) alone: the same answer garbles the same way in any order."""
    digest = hashlib.sha256(f"{seed}\0{run_id}\0{text}".encode("utf-8", "surrogatepass")).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def compiles(code: str) -> bool:
    with warnings.catch_warnings():  # e.g. SyntaxWarning for "\d" must not reach the user's terminal
        warnings.simplefilter("ignore")
        try:
            compile(code, "<garbled>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError):
            return False
    return True


def _pick(items: list, rng: random.Random) -> int:
    filled = [i for i, s in enumerate(items) if s.strip()] or list(range(len(items)))
    return rng.choice(filled)


def _swap_adjacent(items, rng):
    if len(items) > 1:
        i = rng.randrange(len(items) - 1)
        items[i], items[i + 1] = items[i + 1], items[i]


def _drop_item(items, rng):
    if len(items) > 1:
        del items[_pick(items, rng)]


def _drop_char(items, rng):
    i = _pick(items, rng)
    if items[i]:
        j = rng.randrange(len(items[i]))
        items[i] = items[i][:j] + items[i][j + 1:]


def _stray_char(items, rng):
    i = _pick(items, rng)
    j = rng.randint(0, len(items[i]))
    items[i] = items[i][:j] + rng.choice("()[]{}:'\",=") + items[i][j:]


def _shuffle_words(lines, rng):
    i = _pick(lines, rng)
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    words = lines[i].split()
    rng.shuffle(words)
    lines[i] = indent + " ".join(words)


def _bad_indent(lines, rng):
    i = _pick(lines, rng)
    lines[i] = rng.choice([" ", "   ", "\t "]) + lines[i]


def _scramble_word(words, rng):
    i = _pick(words, rng)
    letters = list(words[i])
    rng.shuffle(letters)
    words[i] = "".join(letters)


def _repeat_word(words, rng):
    i = _pick(words, rng)
    words.insert(rng.randint(0, len(words)), words[i])


CODE_EDITS = (_swap_adjacent, _drop_item, _drop_char, _stray_char, _shuffle_words, _bad_indent)
TEXT_EDITS = (_swap_adjacent, _drop_item, _scramble_word, _repeat_word, _drop_char)


def garble_text(text: str, rng: random.Random) -> str:
    """A few word-level edits (swap, drop, scramble, repeat); always differs from `text`."""
    words = text.split()
    for _ in range(GARBLE_TRIES):
        out = list(words)
        for _ in range(rng.randint(2, 4)):
            rng.choice(TEXT_EDITS)(out, rng)
        out = " ".join(out).split()  # a word emptied by _drop_char goes, with its space
        if out and out != words:
            return " ".join(out)
    return text[::-1] + " ?"  # only a one-letter text gets here


def sft_pairs(examples, seed: int) -> list[dict]:
    """SFT examples (supervised.Example) as pairs, for an sft stage and a supervised job: chosen = the assistant
    message trained on (its words, its tool calls or both), with the prompt before it and the row's tools;
    rejected = its words garbled (a call written out as text when it has no words), never trained on (loss_type
    sft reads only the chosen side) but needed by the pair format, and scored by the held-out evaluation."""
    out = []
    for ex in examples:
        text = ex.answer["content"] if ex.answer["content"].strip() else call_text(ex.answer["tool_calls"])
        rng = rng_for(seed, str(ex.line), text)
        out.append({"prompt": ex.prompt, "chosen": [ex.answer],
                    "rejected": [{"role": "assistant", "content": garble_text(text, rng)}]}
                   | ({"tools": ex.tools} if ex.tools else {}))
    return out


def call_text(calls: list[dict]) -> str:
    """Tool calls written out as text: name(arguments as JSON), one after another."""
    return " ".join(f"{c['function']['name']}({json.dumps(c['function']['arguments'], ensure_ascii=False)})"
                    for c in calls)


def garble_code(code: str, rng: random.Random) -> str:
    """A few line- and character-level edits, repeated until the result no longer compiles."""
    body, tail = code.rstrip(), code[len(code.rstrip()):]  # keep the trailing newline: no give-away
    for _ in range(GARBLE_TRIES):
        lines = body.splitlines()
        for _ in range(rng.randint(2, 4)):
            rng.choice(CODE_EDITS)(lines, rng)
        out = "\n".join(lines).rstrip() + tail
        if out.strip() != body.strip() and not compiles(out):
            return out
    out = body + "\n)" + tail  # an unmatched ')' on a line of its own never compiles
    assert not compiles(out)
    return out


class RuleGarbler:
    """Deterministic garbling: the same (seed, run_id, text) always gives the same rejected answer."""

    fallbacks = 0

    def __init__(self, seed: int = 0):
        self.seed = seed

    def garble(self, text: str, kind: str, run_id: str, prompt: list) -> str:
        rng = rng_for(self.seed, run_id, text)
        return garble_code(text, rng) if kind == "code" else garble_text(text, rng)


def strip_fences(text: str) -> str:
    """The body of the first ``` fenced block, if the model wrapped its code in one."""
    if "```" not in text:
        return text.strip()
    body = text.split("```", 2)[1]
    return body.split("\n", 1)[1].strip() if "\n" in body else body.strip()


class ModelGarbler:
    """Rejected answers sampled from a causal LM at high temperature, as the retraining document describes.

    The model loads once, on first use. A sample counts if it differs from the original and, for
    code, does not compile; after MODEL_TRIES misses the rules garbler stands in (`fallbacks`).
    """

    def __init__(self, model_path: str, seed: int = 0):
        self.path, self.seed, self.fallbacks = model_path, seed, 0
        self.rules = RuleGarbler(seed)
        self._tokenizer = self._model = None

    def _load(self):
        if self._model is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.path)
                self._model = AutoModelForCausalLM.from_pretrained(self.path).eval()
            except OSError as e:
                raise kit.UserError(f"cannot load the garbling model: {e}", self.path) from None
        return self._tokenizer, self._model

    def _sample(self, prompt: list, max_new_tokens: int, seed: int) -> str:
        tok, model = self._load()
        return models.generate(model, tok, [prompt], max_new_tokens, seed=seed,
                               sampling={"temperature": MODEL_TEMPERATURE, "top_k": 0, "top_p": 1.0})[0]

    def garble(self, text: str, kind: str, run_id: str, prompt: list) -> str:
        tok, _ = self._load()
        max_new = min(256, len(tok(text).input_ids) * 3 // 2 + 16)  # room for an answer about as long
        base = rng_for(self.seed, run_id, text).getrandbits(31)
        for i in range(MODEL_TRIES):
            sample = self._sample(prompt, max_new, base + i)
            sample = strip_fences(sample) if kind == "code" else sample
            if sample and sample.strip() != text.strip() and not (kind == "code" and compiles(sample)):
                return sample
        self.fallbacks += 1
        return self.rules.garble(text, kind, run_id, prompt)


# ---------------------------------------------------------------------------------------------
# Output: canonical lines, duplicates dropped, streamed to a file renamed into place at the end.
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# CLI: read, apply the rules, write, summarise.
# ---------------------------------------------------------------------------------------------

BLOCK_BYTES = 1 << 19  # run logs read (and handed to a worker) at a time: ~350 runs of the bench's 1.5 KB


def read_blocks(f):
    """Yield (bytes, number of its first line) from a binary stream: whole lines, about BLOCK_BYTES at a time."""
    line_no, tail = 1, []
    while data := f.read(BLOCK_BYTES):
        end = data.rfind(b"\n") + 1
        if not end:  # a line longer than a block
            tail.append(data)
            continue
        block = b"".join([*tail, data[:end]])
        tail = [data[end:]]
        yield block, line_no
        line_no += block.count(b"\n")
    if b"".join(tail):
        yield b"".join(tail), line_no


@dataclass
class Block:
    """What process_block makes of one block of lines: plain lists, cheap to send between processes."""

    digests: array  # pair_digest (example_digest) of each pair (example), in order
    text: bytes  # their output lines, UTF-8, one after another
    ends: array  # where each line ends in text
    rules: list  # each pair's meta["rule"]
    records: list  # index_record of each run, when cross_run is on
    prompts: list  # beside each record: (messages, tags) the first time this process saw its prompt, else None
    outcomes: Counter
    stats: Counter
    skipped: list  # the message for each invalid line skipped (--skip_invalid)
    stop: tuple | None = None  # (raw line, line number) where processing stopped at an exception
    labels: list = dataclasses.field(default_factory=list)  # --emit kto: each example's label (pairs: none)
    sources: array = dataclasses.field(default_factory=lambda: array("I"))  # each line's run: its index in the block


def worker_count(cfg: PairsConfig) -> int:
    """How many worker processes to start: none (1) for model garbling (the model is loaded here), standard input
    or a small file in auto mode."""
    if cfg.garble == "model" or cfg.workers == 1:
        return 1
    if cfg.workers:
        return cfg.workers
    small = cfg.runs == "-" or not os.path.isfile(cfg.runs) or os.path.getsize(cfg.runs) < AUTO_WORKERS_BYTES
    return 1 if small else min(len(os.sched_getaffinity(0)), MAX_WORKERS)


def processed_blocks(f, cfg: PairsConfig, garbler, workers: int):
    """process_block of each block of f, in order: here, or by `workers` processes with at most two blocks each
    in flight (so memory stays flat; a pool's imap would read the whole input ahead)."""
    if workers == 1:
        shipped = set()
        for block, first_line in read_blocks(f):
            yield process_block(block, first_line, cfg, garbler, shipped)
        return
    import multiprocessing

    # fork: the workers start with this module and cfg as they are (nothing pickled); nothing is written yet
    with multiprocessing.get_context("fork").Pool(workers, _start_worker, (cfg,)) as pool:
        pending = deque()
        for block in read_blocks(f):
            pending.append(pool.apply_async(_worker_block, block))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


_worker = None  # in a worker process: (cfg, its RuleGarbler, the group keys whose prompt it has sent)


def _start_worker(cfg: PairsConfig) -> None:
    global _worker
    _worker = (cfg, RuleGarbler(cfg.seed), set())


def _worker_block(block: bytes, first_line: int) -> Block:
    cfg, garbler, shipped = _worker
    return process_block(block, first_line, cfg, garbler, shipped)


def process_block(block: bytes, first_line: int, cfg: PairsConfig, garbler, shipped: set, catch: bool = True) -> Block:
    """Rules 1-3 for each run in a block of lines, its pairs already encoded. Stops at the first exception (any
    but a bad line with --skip_invalid): `stop` says where, and the caller runs that line again (catch=False) to
    raise it. `shipped` holds the group keys whose prompt this process has already sent along. With --emit kto,
    examples_for_run stands in for the rules, and there is no cross-run index."""
    name = "<stdin>" if cfg.runs == "-" else cfg.runs
    kto, cross_run = cfg.emit == "kto", cfg.cross_run and cfg.emit == "dpo"
    out, lines = Block(array("Q"), b"", array("Q"), [], [], [], Counter(), Counter(), []), []
    n_runs = 0
    for line_no, raw in enumerate(io.BytesIO(block), start=first_line):  # BytesIO splits at b"\n" only, as a file does
        try:
            try:
                run = _parse_line(raw, name, line_no, cfg.score_key)
            except kit.UserError as e:
                if not cfg.skip_invalid:
                    raise
                out.skipped.append(f"{e} (skipped)")
                continue
            if run is None:
                continue
            kind, best = outcome(run), best_attempt(run)  # once, not in each rule
            if kto:
                pairs = examples_for_run(run, cfg, out.stats, kind, best)
            else:
                pairs = pairs_for_run(run, cfg, garbler, out.stats, kind, best)
            encoded = [digest_and_line(pair, cfg.format) for pair in pairs]
            encoded = [(digest, line.encode("utf-8")) for digest, line in encoded]
        except Exception:
            if not catch:
                raise
            out.stop = (raw, line_no)
            break
        out.outcomes[kind] += 1
        out.stats["attempts_missing_score"] += sum(a.ran and a.score is None for a in run.attempts)
        out.stats["mixed_without_pairs"] += kind == "mixed" and not pairs
        for pair, (digest, line) in zip(pairs, encoded):
            out.digests.append(digest)
            lines.append(line)
            out.ends.append((out.ends[-1] if out.ends else 0) + len(line))
            out.rules.append(pair.meta["rule"])
            out.sources.append(n_runs)
            if kto:
                out.labels.append(pair.label)
        n_runs += 1
        if cross_run:
            out.records.append(record := index_record(run, best, kind))
            out.prompts.append(None if record[0] in shipped else (run.messages, run.tags, run.tools))
            shipped.add(record[0])
    out.text = b"".join(lines)
    return out


def summarize(cfg: PairsConfig, stats: Counter, outcomes: Counter, recovered: Counter, writer: PairWriter,
              garbler) -> dict:
    if cfg.emit == "kto":
        return summarize_kto(cfg, stats, outcomes, writer)
    dropped = {k: outcomes[k] - recovered[k] for k in ("never_ran", "never_succeeded")}
    dropped["only_same_code"] = stats["mixed_without_pairs"]
    return {"input": cfg.runs, **({"extra_runs": cfg.sources()[1:]} if cfg.extra_runs else {}), "output": cfg.output,
            "format": cfg.format, "emit": "dpo", "seed": cfg.seed,
            "garble": cfg.garble,
            "runs_read": sum(outcomes.values()),
            "invalid_lines_skipped": stats["invalid_lines_skipped"],
            "runs_by_outcome": {k: outcomes[k] for k in OUTCOMES},
            # runs that gave a pair, their own or a cross_run one (a run whose pairs all duplicate earlier ones
            # still counts, where --emit kto's runs_used leaves it out): runs_read less runs_dropped
            "runs_used": sum(outcomes.values()) - sum(dropped.values()),
            "runs_dropped": dropped,
            "failed_runs_recovered_by_cross_run": sum(recovered.values()),
            "pairs_written": sum(writer.by_rule.values()),
            "pairs_by_rule": {k: writer.by_rule[k] for k in RULES},
            "duplicates_removed": writer.duplicates,
            "pairs_capped": stats["pairs_capped"],
            "cross_run_capped": stats["cross_run_capped"],
            "same_code_skipped": stats["same_code_skipped"],
            "attempts_missing_score": stats["attempts_missing_score"],
            "garble_fallbacks": garbler.fallbacks}


def summarize_kto(cfg: PairsConfig, stats: Counter, outcomes: Counter, writer: PairWriter) -> dict:
    """The --emit kto summary. Every run gives its strategy as an example, so a run is dropped only when all its
    examples duplicate ones written before (the same run logged twice)."""
    runs_read, used = sum(outcomes.values()), stats["runs_with_examples_written"]
    return {"input": cfg.runs, **({"extra_runs": cfg.sources()[1:]} if cfg.extra_runs else {}), "output": cfg.output,
            "format": cfg.format, "emit": "kto",
            "runs_read": runs_read,
            "invalid_lines_skipped": stats["invalid_lines_skipped"],
            "runs_by_outcome": {k: outcomes[k] for k in OUTCOMES},
            "runs_used": used,
            "runs_dropped": {"only_duplicates": runs_read - used},
            "examples_written": sum(writer.by_rule.values()),
            "examples_by_label": {"desirable": writer.by_label[True], "undesirable": writer.by_label[False]},
            "examples_by_rule": {k: writer.by_rule[k] for k in KTO_RULES},
            "duplicates_removed": writer.duplicates,
            "same_code_skipped": stats["same_code_skipped"],
            "undesirable_capped": stats["pairs_capped"],
            "attempts_missing_score": stats["attempts_missing_score"]}


def print_summary(s: dict) -> None:
    line = lambda d: ", ".join(f"{k} {v}" for k, v in d.items())  # noqa: E731
    if "prompts_written" in s:
        print(f"build_pairs: {s['prompts_written']['prompts']} code-asking prompts (with their hosts) to "
              f"{s['prompts_written']['path']}", file=sys.stderr)
    if s["emit"] == "kto":
        labels, dropped = s["examples_by_label"], s["runs_dropped"]["only_duplicates"]
        print(f"build_pairs: {s['runs_read']} runs read from {' + '.join([s['input'], *s.get('extra_runs', [])])} "
              f"({s['invalid_lines_skipped']} invalid lines skipped)\n"
              f"  runs by outcome:  {line(s['runs_by_outcome'])}\n"
              f"  examples written: {s['examples_written']} ({labels['desirable']} desirable, "
              f"{labels['undesirable']} undesirable) from {s['runs_used']} of {s['runs_read']} runs to {s['output']} "
              f"(kto): {line(s['examples_by_rule'])}\n"
              f"  left out:         {s['duplicates_removed']} duplicate examples, {s['same_code_skipped']} same-code "
              f"attempts, {s['undesirable_capped']} undesirable codes over max_pairs_per_run"
              + (f", {dropped} runs whose examples all duplicate earlier ones" if dropped else "") + "\n"
              f"  notes:            {s['attempts_missing_score']} attempts ran without a score", file=sys.stderr)
        return
    print(f"build_pairs: {s['runs_read']} runs read from {' + '.join([s['input'], *s.get('extra_runs', [])])} "
          f"({s['invalid_lines_skipped']} invalid lines skipped)\n"
          f"  runs by outcome: {line(s['runs_by_outcome'])}\n"
          f"  runs dropped:    {line(s['runs_dropped'])} "
          f"({s['failed_runs_recovered_by_cross_run']} failed runs recovered by cross_run)\n"
          f"  pairs written:   {s['pairs_written']} to {s['output']} ({s['format']}): {line(s['pairs_by_rule'])}\n"
          f"  left out:        {s['duplicates_removed']} duplicate pairs, {s['same_code_skipped']} same-code attempts, "
          f"{s['pairs_capped']} over max_pairs_per_run, {s['cross_run_capped']} over max_pairs_per_prompt\n"
          f"  notes:           {s['attempts_missing_score']} attempts ran without a score, "
          f"{s['garble_fallbacks']} model garbles fell back to rules", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:  # pairs the model makes for itself (self_pairs.py)

        return self_pairs.main(argv[0], argv[1:])
    cfg = kit.parse_config(PairsConfig, argv, __doc__, positional="runs")
    garbler = ModelGarbler(cfg.model, cfg.seed) if cfg.garble == "model" else RuleGarbler(cfg.seed)
    kto = cfg.emit == "kto"  # every run's strategy is an example already: no cross-run pairs
    index = CrossRunIndex(cfg.max_pairs_per_prompt) if cfg.cross_run and not kto else None
    stats, outcomes = Counter(), Counter()
    with PairWriter(cfg.output, cfg.format) as writer:
        for source in cfg.sources():  # each file as its own stream: errors name it and its own line
            part = dataclasses.replace(cfg, runs=source)
            with open_runs(source) as f:
                for out in processed_blocks(f, part, garbler, worker_count(part)):
                    for message in out.skipped:
                        stats["invalid_lines_skipped"] += 1
                        if stats["invalid_lines_skipped"] <= MAX_WARNINGS:
                            print(message, file=sys.stderr)
                    if out.stop:
                        process_block(*out.stop, part, garbler, set(), catch=False)
                        raise RuntimeError(f"line {out.stop[1]} failed once, then not again")
                    outcomes.update(out.outcomes)
                    stats.update(out.stats)
                    kept = writer.write_block(out)
                    if kto:
                        stats["runs_with_examples_written"] += len({r for r, keep in zip(out.sources, kept) if keep})
                    if index:
                        for record, prompt in zip(out.records, out.prompts):
                            index.add_record(record, *(prompt or (None, None, None)))
        if index:
            writer.write(index.pairs())
            stats["cross_run_capped"] = index.capped
        recovered = index.recovered if index else Counter()
        summary = summarize(cfg, stats, outcomes, recovered, writer, garbler)
        written = summary["examples_written" if kto else "pairs_written"]
        if written:
            writer.commit()
    if cfg.prompts and written:
        rows, seen = [], set()
        for source in cfg.sources():  # one row per (strategy, host), the first file's first
            for r in prompts_from_logs(source, cfg.score_key, cfg.skip_invalid):
                if (r["prompt"][0]["content"], r["host"]) not in seen:
                    seen.add((r["prompt"][0]["content"], r["host"]))
                    rows.append(r)
        kit.atomic_write_text(Path(cfg.prompts), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        summary["prompts_written"] = {"path": cfg.prompts, "prompts": len(rows)}
    print_summary(summary)
    if cfg.report:
        kit.atomic_write_json(cfg.report, summary)
    if not written:
        what = "no runs" if not summary["runs_read"] else "no usable run (nothing succeeded, or nothing to pair)"
        print(f"build_pairs: {what} in {summary['input']}; {cfg.output} not written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
