"""The model's own attempts as run logs: the retraining process applied to the model itself. Sample answers to each
training run's code prompt (its strategy) from a model, run each with the checker on the run's host, and write the
results as run logs in build_pairs.py's input format: the run's prompt and strategy, and one attempt per answer with
`ran`, `error` and `space_freed`, as the agent's environment logged its own attempts. build_pairs.py's rules then
make the next round's pairs from them (mixed, first-try garbled, cross-run).

    python attempts.py data/runs.jsonl --model artifacts/<run> --output attempts.jsonl [--samples 4]
    python attempts.py attempts.jsonl --rescore --output rescored.jsonl   # the checker as it is now, no model
    make iterate PLAN=configs/rounds.yaml      # the `attempts` stage: these logs, then build_pairs, then training

Runs held out of training (train_dpo.py's split: a hash of the run id, --eval_fraction) are never attempted: their
prompts stay unseen, for the checker's held-out score. Each run written keeps its run id (so it stays on its side
of the split), adds `round` and the model that wrote it, and each attempt keeps the answer as sampled (`answer`)
beside the code that ran (`code`: its first ```python block, else all of it) and the checker's `outcome`.
An answer that deleted what must be kept ran and freed nothing useful: `space_freed` 0, its `error` says what broke.
When the checker changes, --rescore runs every attempt of such a file again and writes it with the new outcomes
(the answers, rounds and models as they were), printing how many outcomes changed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections import Counter
from pathlib import Path

from dpokit.core import kit
from dpokit.data import formats, runlogs
from dpokit.model import models
from dpokit.scoring import checker
from dpokit.pairs import self_pairs, widen
from dpokit.core.kit import field


@dataclasses.dataclass
class AttemptsConfig:
    logs: str = field("", "run logs whose runs' code prompts the model attempts (build_pairs.py's input)")
    model: str = field("", "the model that attempts them: a finished run (directory or .tar.gz) or a base model")
    output: str = field("attempts.jsonl", "where the attempts go, as run logs (JSONL)", short="-o")
    report: str | None = field(None, "also write the summary (outcome counts) here as JSON")
    samples: int = field(4, "answers sampled per prompt")
    max_new_tokens: int = field(256, "longest answer, in tokens")
    temperature: float = field(0.7, "sampling temperature (the checker's held-out score samples at 0.7 too)")
    top_p: float = field(0.95, "nucleus sampling's probability mass")
    seed: int = field(0, "sampling seed")
    eval_fraction: float = field(0.2, "the training run's held-out share: those runs are never attempted")
    round: int = field(1, "the round these attempts belong to (written into each run)")
    widen: bool = field(False, "beside each passing answer, log the same code aimed one folder up (or further: "
                        "widen.py) where the checker says it deletes what must be kept, marked `made`: the next "
                        "round's pairs then hold that near miss as a rejected answer (--broke_weight)")
    rescore: bool = field(False, "the logs are attempts (this tool's output): run each again with the checker as it "
                          "is now and write them with its outcomes; no model")

    def problems(self) -> list[str]:
        p = [] if self.logs else ["give the run logs whose prompts are attempted"]
        if self.rescore and self.model:
            p.append("--rescore runs the logged attempts again: give no --model")
        p += [] if self.model or self.rescore else ["--model is required (a finished run or a base model)"]
        if self.samples < 1 or self.max_new_tokens < 1 or self.round < 1:
            p.append("--samples, --max_new_tokens and --round must be at least 1")
        if not 0 < self.temperature or not 0 < self.top_p <= 1:
            p.append("--temperature must be positive and --top_p in (0, 1]")
        if not 0 <= self.eval_fraction <= 0.5:
            p.append(f"--eval_fraction must be in [0, 0.5] (got {self.eval_fraction})")
        return p


# ---------------------------------------------------------------------------------------------
# Pure: which runs are attempted, and the checker's results as run logs (tested without a model).
# ---------------------------------------------------------------------------------------------

def training_runs(runs, eval_fraction: float) -> list:
    """One run per distinct (strategy, host) among those not held out, in file order."""
    out, seen = [], set()
    for run in runs:
        key = (run.strategy.strip(), runlogs.host_of_run(run))
        if key not in seen and not formats.held_out({formats.RUN_KEY: run.run_id}, eval_fraction):
            seen.add(key)
            out.append(run)
    return out


def attempt_record(answer: str, code: str, check) -> dict:
    """One attempt as the environment logs it: ran, error, space_freed (bytes), and the checker's outcome."""
    ran = check.outcome != "failed"
    error = None if checker.ran(check.outcome) else (
        f"{runlogs.BROKE_ERROR}: {', '.join(check.broken[:3])}" if check.outcome == "broke"
        else check.reason or "failed")
    return {"code": code, "ran": ran, "error": error,
            "space_freed": check.freed_bytes if checker.passed(check.outcome) else 0 if ran else None,
            "outcome": check.outcome, "answer": answer}


def run_record(run, attempts: list[dict], round_: int, model: str) -> dict:
    """A run of the model's attempts at `run`'s strategy: its prompt (with its tags) and strategy, the attempts."""
    tags = run.tags or [None] * len(run.messages)
    prompt = [{**m, "tag": t} if t else dict(m) for m, t in zip(run.messages, tags)]
    return {"run_id": run.run_id, "round": round_, "model": model, "prompt": prompt, "strategy": run.strategy,
            **({"tools": run.tools} if run.tools else {}), "attempts": attempts}


def near_misses(records: list[dict]) -> list[tuple[int, int, str, str]]:
    """(run index, attempt index, variant code, what was widened) for every widened variant of each distinct passing
    answer of each run."""
    out = []
    for i, r in enumerate(records):
        seen = set()
        for j, a in enumerate(r["attempts"]):
            if checker.passed(a["outcome"]) and not a.get("made") and a["code"].strip() not in seen:
                seen.add(a["code"].strip())
                out += [(i, j, code, note) for code, note in widen.widened(a["code"])]
    return out


def made_attempt(code: str, note: str, origin: int, check) -> dict:
    """A widened variant as a logged attempt: what the checker found it did, `made` saying it is not the model's
    answer, and `from`, the index of the passing attempt it widens (build_pairs pairs the two)."""
    return {**attempt_record(code, code, check), "made": f"widened: {note}", "from": origin}


def with_near_misses(records: list[dict], misses: list[tuple[int, int, str, str]], checks: list) -> tuple[list, int]:
    """Each run's records with, for each passing answer, the nearest of its variants that deleted what must be kept
    appended (in widen.widened's order: nearest first), and how many were."""
    first = {}  # (run, answer) -> its nearest broke variant; misses come in run, answer, nearest-first order
    for (i, j, code, note), check in zip(misses, checks):
        if check.outcome == "broke":
            first.setdefault((i, j), made_attempt(code, note, j, check))
    added = [[] for _ in records]
    for (i, _), made in first.items():
        added[i].append(made)
    return [{**r, "attempts": r["attempts"] + extra} if extra else r for r, extra in zip(records, added)], len(first)


def changes(before: list[dict], after: list[dict]) -> Counter:
    """(old outcome, new outcome) -> how many attempts moved, between two versions of the same attempts."""
    return Counter((a["outcome"], b["outcome"]) for r, s in zip(before, after)
                   for a, b in zip(r["attempts"], s["attempts"]) if a["outcome"] != b["outcome"])


def summary(records: list[dict], empty: int = 0, unscorable: int = 0) -> dict:
    """Outcome counts over every answer (an empty one failed, and is not in the logs: a log's code is never empty;
    one the sandbox's limits mode could not score is not in them either, and is counted apart, out of the rate)."""
    outcomes = Counter(a["outcome"] for r in records for a in r["attempts"] if not a.get("made"))
    outcomes["failed"] += empty
    runs_ok = sum(any(checker.passed(a["outcome"]) and not a.get("made") for a in r["attempts"]) for r in records)
    n = sum(outcomes.values())
    return {"runs": len(records), "attempts": n, "empty_answers": empty, "unscorable": unscorable,
            "outcomes": {k: v for k, v in outcomes.items() if v},
            "pass_rate": checker.pass_rate(outcomes.elements()) or 0.0,
            "runs_with_a_pass": runs_ok}


# ---------------------------------------------------------------------------------------------
# Side effects: sample, check, write.
# ---------------------------------------------------------------------------------------------

def make(cfg: AttemptsConfig) -> dict:
    t0 = time.monotonic()
    runs = training_runs(runlogs.read_runs(cfg.logs), cfg.eval_fraction)
    if not runs:
        raise kit.UserError("no run to attempt (every run is held out, or the file has none)", cfg.logs)
    model, tok, what = self_pairs.load_generator(cfg.model)
    print(f"[attempts] round {cfg.round}: {cfg.samples} answers to each of {len(runs)} training runs' prompts from "
          f"{what}", flush=True)
    prompts = [[{"role": "user", "content": r.strategy}] for r in runs]
    answers = models.generate(model, tok, prompts, cfg.max_new_tokens, {"temperature": cfg.temperature,
                              "top_p": cfg.top_p}, cfg.seed, n=cfg.samples, label="attempts: sample")
    del model
    hosts = [runlogs.host_of_run(r) for r in runs for _ in range(cfg.samples)]
    codes = [checker.code_of(a) for a in answers]
    checks = checker.check_many(list(zip(codes, hosts)), label="attempts: check")
    scored = [c.outcome != checker.UNSCORABLE for c in checks]  # limits mode: not the environment's result
    records = [run_record(run, [attempt_record(answers[j], codes[j], checks[j])
                                for j in range(i * cfg.samples, (i + 1) * cfg.samples) if codes[j].strip() and scored[j]],
                          cfg.round, cfg.model) for i, run in enumerate(runs)]
    empty = sum(not c.strip() for c in codes)
    unscorable = sum(bool(c.strip()) and not s for c, s in zip(codes, scored))
    widened_runs = 0
    if cfg.widen:
        misses = near_misses(records)
        found = checker.check_many([(code, runlogs.host_of_run(runs[i])) for i, _, code, _ in misses],
                                   label="attempts: near misses") if misses else []
        records, widened_runs = with_near_misses(records, misses, found)
    kit.atomic_write_text(Path(cfg.output), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    result = {"logs": cfg.logs, "model": cfg.model, "output": cfg.output, "round": cfg.round,
              "samples": cfg.samples, **summary(records, empty, unscorable), "isolation": checks[0].isolation,
              **({"near_misses": widened_runs} if cfg.widen else {}),
              "seconds": round(time.monotonic() - t0, 1)}  # loading, sampling and checking: a round's cost
    if cfg.report:
        kit.atomic_write_json(cfg.report, result)
    print(f"[attempts] round {cfg.round}: {result['attempts']} answers, outcomes "
          f"{', '.join(f'{k} {v}' for k, v in sorted(result['outcomes'].items()))}; pass rate "
          f"{result['pass_rate']:.3f}; {result['runs_with_a_pass']} of {len(runs)} runs passed at least once"
          + (f"; {widened_runs} passing answers gained a near miss (the same code aimed further up, which deleted "
             "what must be kept)" if cfg.widen else "") + f" -> {cfg.output}", flush=True)
    if unscorable:
        print(f"[attempts] WARNING: {unscorable} of {len(codes)} answers could not be scored in {checks[0].isolation} "
              "mode (they name or reach host paths it cannot plant) and are left out of the logs", flush=True)
    return result


def rescore(cfg: AttemptsConfig) -> dict:
    """Every attempt of an attempts file run again by the checker as it is now; the file rewritten with its outcomes."""
    runs = list(runlogs.read_runs(cfg.logs))
    lines = [(n, line) for n, line in enumerate(Path(cfg.logs).read_text(encoding="utf-8").splitlines(), start=1)
             if line.strip()]
    records = [json.loads(line) for _, line in lines]  # read_runs has refused what is not a run
    for (line, _), record in zip(lines, records):
        if "round" not in record or not all("outcome" in a for a in record["attempts"]):
            raise kit.UserError("not attempts.py's output: each run needs its round and each attempt its outcome",
                                cfg.logs, line)
    items = [(a["code"], runlogs.host_of_run(run)) for run, r in zip(runs, records) for a in r["attempts"]]
    found = iter(checker.check_many(items, label="rescore: check"))
    unscorable = 0

    def again(a: dict) -> dict:  # an attempt limits mode cannot score keeps the outcome it was logged with
        nonlocal unscorable
        check = next(found)
        unscorable += check.outcome == checker.UNSCORABLE
        if check.outcome == checker.UNSCORABLE:
            return a
        return attempt_record(a.get("answer", a["code"]), a["code"], check) | {k: a[k] for k in ("made", "from") if k in a}

    after = [{**r, "attempts": [again(a) for a in r["attempts"]]} for r in records]
    kit.atomic_write_text(Path(cfg.output), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in after))
    moved = changes(records, after)
    result = {"logs": cfg.logs, "output": cfg.output, "changed": {f"{a} -> {b}": n for (a, b), n in moved.items()},
              **summary(after, unscorable=unscorable)}
    if cfg.report:
        kit.atomic_write_json(cfg.report, result)
    print(f"[attempts] re-scored {result['attempts']} answers: {sum(moved.values())} outcomes changed"
          f"{' (' + ', '.join(f'{k} {v}' for k, v in sorted(result['changed'].items())) + ')' if moved else ''}; "
          f"pass rate {result['pass_rate']:.3f} -> {cfg.output}"
          + (f"; {unscorable} could not be scored in this sandbox mode and keep their logged outcome" if unscorable
             else ""), flush=True)
    return result


def main(argv=None) -> int:
    cfg = kit.parse_config(AttemptsConfig, argv, __doc__, positional="logs")
    rescore(cfg) if cfg.rescore else make(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
