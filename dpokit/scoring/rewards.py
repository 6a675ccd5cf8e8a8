"""GRPO's reward functions: the kit's checker, or any agent's own, in TRL's reward-function signature.

    python train_dpo.py --method grpo --data prompts.jsonl                       # checker,ran (the default)
    python train_dpo.py --method grpo --data prompts.jsonl --reward mypkg.grading:score
    python train_dpo.py --method grpo --data prompts.jsonl --reward_cmd "python grade.py"

`--reward` names reward functions, comma-separated, weighted by `--reward_weights` (TRL's names):

  checker          checker.py's score of the answer's code, run on the prompt's host in the sandbox (-1..1)
  ran              1 when that code ran to the end without an error (the environment's "compiles and runs",
                   whether or not it freed space), else 0: the step before freeing space, which a small model
                   reaches long before it frees any (a group whose answers all score 0 teaches GRPO nothing)
  MODULE:FUNCTION  a Python function with TRL's signature, `f(prompts, completions, **kwargs) -> list[float]`
                   (kwargs: the prompt file's other columns, e.g. `host`); MODULE is importable or a .py path

`--reward_grader GRADER` adds one of OpenAI's reinforcement fine-tuning graders (JSON, or a .json file), evaluated
by graders.py as the service's /graders/run evaluates it: string_check, text_similarity, python (`def grade(sample,
item) -> float`, run in the sandbox like the checker's code: the grader's source is data the kit was sent, not
code the user wrote here), score_model and label_model (a judge at --judge_base_url), multi; or the kit's own
checker by name (a python grader named checker or ran with an empty source). `item` is the prompt row's other
fields (the jobs service keeps them).

`--reward_cmd CMD` adds a program: it reads one completion on stdin (the prompt as JSON in $KIT_PROMPT, the host
in $KIT_HOST) and prints a number; a non-zero exit or no number stops the run (failed, resumable), saying so. It is the user's own
grader, run in a fresh temporary directory with a timeout; model-written code reaches the sandbox only through
the checker (or through what the grader itself does).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import shlex
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dpokit.sandbox import sandbox
from dpokit.scoring import checker, graders
from dpokit.core.kit import UserError

BUILT_IN = graders.KIT_GRADERS
RAN_WEIGHT = 0.1  # ran's default weight: running code is worth less than freeing space (checker: up to 1)
CMD_TIMEOUT = 120  # seconds for one --reward_cmd call


def names(spec: str) -> list[str]:
    """--reward's comma-separated names."""
    return [s.strip() for s in spec.split(",") if s.strip()]


def weights(spec: str) -> list[float]:
    """--reward_weights as floats ('' = TRL's default: 1 each). ValueError on a bad number."""
    return [float(w) for w in spec.split(",") if w.strip()]


def default_weights(spec: str, cmd: str = "", grader: str = "") -> list[float]:
    """--reward_weights when not given: 1 for each reward function, RAN_WEIGHT for ran."""
    return [RAN_WEIGHT if n == "ran" else 1.0 for n in names(spec)] + [1.0] * (bool(cmd.strip()) + bool(grader))


def parse_grader(spec: str, ends: "graders.Endpoints | None" = None) -> dict:
    """--reward_grader: JSON text or a .json file -> the grader (ValueError saying what is wrong)."""
    text = spec
    if not spec.lstrip().startswith("{"):
        try:
            text = Path(spec).read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read {spec}: {e.strerror}") from None
    try:
        grader = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    return grader_problem(grader, ends) or grader


def grader_problem(grader, ends: "graders.Endpoints | None" = None) -> dict:
    """Raise ValueError (graders.GraderError, naming the field) for a grader the kit cannot evaluate with these
    endpoints; returns {} (so parse_grader can `or` it)."""
    try:
        graders.check(grader, ends)
    except graders.GraderError as e:
        raise graders.GraderError(f"{e.field}: {e}" if e.field else str(e), e.field) from None
    return {}


def problems(spec: str, cmd: str, weights_spec: str, grader: str = "", ends: "graders.Endpoints | None" = None
             ) -> list[str]:
    """What is wrong with --reward / --reward_cmd / --reward_grader / --reward_weights, before any model loads
    (ends: where the grader's judge and embeddings are)."""
    p = []
    funcs = names(spec)
    if not funcs and not cmd.strip() and not grader:
        p.append("--reward names no reward function and there is no --reward_cmd or --reward_grader")
    if grader:
        try:
            parse_grader(grader, ends)
        except ValueError as e:
            p.append(f"--reward_grader: {e}")
    for name in funcs:
        if name in BUILT_IN:
            continue
        if ":" not in name:
            p.append(f"--reward {name!r}: expected checker, ran or MODULE:FUNCTION")
            continue
        try:
            load_function(name)
        except Exception as e:  # noqa: BLE001 - the user's module, imported: whatever it raises is its problem to report
            p.append(f"--reward {name}: {type(e).__name__}: {e}")
    if cmd.strip():
        try:
            argv = shlex.split(cmd)
        except ValueError as e:
            argv = None
            p.append(f"--reward_cmd: {e}")
        if argv == []:
            p.append("--reward_cmd is empty")
    try:
        w = weights(weights_spec)
    except ValueError:
        p.append(f"--reward_weights {weights_spec!r}: expected numbers separated by commas")
    else:
        n = len(funcs) + bool(cmd.strip()) + bool(grader)
        if w and len(w) != n:
            p.append(f"--reward_weights gives {len(w)} weights for {n} reward functions")
    return p


def load_function(spec: str):
    """MODULE:FUNCTION (an importable module, or a .py file's path) -> the function."""
    module, _, function = spec.rpartition(":")
    if module.endswith(".py"):
        path = Path(module)
        if not path.is_file():
            raise OSError(f"no such file {module}")
        loaded = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)
    fn = getattr(mod, function)
    if not callable(fn):
        raise TypeError(f"{spec} is not a function")
    return fn


def _text(completion) -> str:
    """A completion as text: TRL passes a string, or a list of messages (conversational prompts)."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if m.get("role") == "assistant")


def _prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else " ".join(m.get("content") or "" for m in prompt)


CACHE_SIZE = 4096  # (code, host) results kept across steps: a step's own are always all there


class Checked:
    """Each (code, host) run once by the checker, shared by the checker and ran rewards of one batch; answers run
    a few at a time (each is a sandboxed process, mostly waiting on the file system)."""

    def __init__(self, workers: int = 0, wall_seconds: float = 20.0):
        self.workers = workers or min(4, os.cpu_count() or 1)
        self.wall_seconds = wall_seconds
        self.cache: dict = {}
        self.unscorable = self.answers = 0  # answers limits mode could not score, of all the checker's

    def results(self, prompts, completions, hosts) -> list:
        keys = [(checker.code_of(_text(c)), h or _prompt_text(p) or checker.CheckConfig.host)
                for p, c, h in zip(prompts, completions, hosts)]
        found = {k: self.cache[k] for k in dict.fromkeys(keys) if k in self.cache}
        todo = [k for k in dict.fromkeys(keys) if k not in found]
        limits = sandbox.Limits(wall_seconds=self.wall_seconds)
        found |= dict(zip(todo, checker.check_many(todo, limits, self.workers)))
        if len(self.cache) + len(todo) > CACHE_SIZE:  # the checker and ran rewards of a step share it: keep it small
            self.cache.clear()
        self.cache.update((k, found[k]) for k in todo)
        return [found[k] for k in keys]

    def say_unscorable(self, results: list) -> None:
        """A line each time answers go unscored (limits mode: host paths it cannot plant), with the running count:
        GRPO then learns from the others only, and the log says how many."""
        n = sum(r.outcome == checker.UNSCORABLE for r in results)
        self.unscorable += n
        self.answers += len(results)
        if n:
            print(f"[reward] {n} of {len(results)} answers could not be scored in {results[0].isolation} mode "
                  f"({self.unscorable} of {self.answers} so far): no reward, no advantage", flush=True)


def checker_rewards(checked: Checked):
    """(checker, ran): TRL reward functions over one shared Checked."""
    def checker_score(prompts, completions, host=None, log_metric=None, **kwargs):
        results = checked.results(prompts, completions, host or [None] * len(prompts))
        if log_metric is not None:  # TRL averages them per logged step: the progress line's pass rate
            t = checker.tally(results)  # rates over the answers that could be scored (0 when none could)
            log_metric("pass_rate", t["pass_rate"] or 0.0)
            log_metric("ran_rate", t["ran_rate"] or 0.0)
            log_metric("broke_rate", t["broke"] / max(t["scored"], 1))
            log_metric("unscorable_rate", t["unscorable"] / len(results))
        checked.say_unscorable(results)
        return [r.score for r in results]  # None where limits mode could not score it: TRL leaves it out (no advantage)

    def ran(prompts, completions, host=None, **kwargs):
        results = checked.results(prompts, completions, host or [None] * len(prompts))
        return [None if r.outcome == checker.UNSCORABLE else 1.0 if checker.ran(r.outcome) else 0.0
                for r in results]

    checker_score.__name__ = "checker"
    return checker_score, ran


def command_reward(cmd: str):
    """--reward_cmd: the program's number for each completion (stdin: the completion; $KIT_PROMPT, $KIT_HOST)."""
    argv = shlex.split(cmd)

    def reward_cmd(prompts, completions, host=None, **kwargs):
        out = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            env = dict(os.environ, KIT_PROMPT=json.dumps(prompt, ensure_ascii=False),
                       KIT_HOST=(host[i] if host else "") or "")
            with tempfile.TemporaryDirectory(prefix="dpo-kit-reward-") as tmp:
                try:
                    done = subprocess.run(argv, input=_text(completion), capture_output=True, text=True, env=env,
                                          cwd=tmp, timeout=CMD_TIMEOUT)
                except (OSError, subprocess.TimeoutExpired) as e:
                    raise UserError(f"--reward_cmd {cmd!r}: {e}") from None
            if done.returncode != 0:
                raise UserError(f"--reward_cmd {cmd!r} exited {done.returncode}: {done.stderr.strip()[-300:]}")
            try:
                out.append(float(done.stdout.strip().split()[-1]))
            except (ValueError, IndexError):
                raise UserError(f"--reward_cmd {cmd!r} printed no number (got {done.stdout.strip()[-100:]!r})") from None
        return out

    return reward_cmd


def grader_reward(spec: str, checked: "Checked", ends: "graders.Endpoints | None" = None):
    """--reward_grader as a TRL reward function (named after the grader): graders.run on each answer, as the
    service's /graders/run scores it; an answer whose grading failed (a python grader's error, a judge's reply
    that does not parse) is left unscored (None), and the step's log counts it."""
    ends = dataclasses.replace(ends or graders.Endpoints(), wall_seconds=checked.wall_seconds)
    grader = parse_grader(spec, ends)
    if grader["type"] == "python" and not grader["source"].strip():  # the kit's own, by name
        return dict(zip(BUILT_IN, checker_rewards(checked)))[grader["name"]]
    said = set()

    def grade(prompts, completions, item=None, log_metric=None, **kwargs):
        items = [json.loads(x) if isinstance(x, str) and x else (x or {}) for x in (item or [None] * len(prompts))]
        samples = [graders.sample_of(c) for c in completions]
        with ThreadPoolExecutor(checked.workers) as pool:  # sandboxed graders and judges mostly wait
            results = list(pool.map(lambda si: graders.run(grader, *si, ends), zip(samples, items)))
        for note in {n for r in results for n in r.notes if n.endswith(graders.METEOR_NOTE)} - said:
            print(f"[reward] {note}", flush=True)  # once per run: the deviation is the run's, not an answer's
            said.add(note)
        for r in results:
            for flag in sorted(k for k in graders.ERRORS if r.errors.get(k)) if r.failed else ():
                if flag not in said:  # the first of each kind, with what the judge said: why answers go unscored
                    said.add(flag)
                    print(f"[reward] {grade.__name__}: {flag} leaves an answer unscored ("
                          f"{r.judge_output!r} from the judge)" if r.judge_output is not None else
                          f"[reward] {grade.__name__}: {flag} leaves an answer unscored ({'; '.join(r.notes) or ''}"
                          f"{'; '.join(str(v) for k, v in r.errors.items() if k in graders.DETAILS and v)})",
                          flush=True)
        if log_metric is not None:
            log_metric("grader_errors", sum(r.failed for r in results) / len(results))
            if any(r.passed is not None for r in results):
                log_metric("grader_pass_rate", sum(bool(r.passed) for r in results) / len(results))
        return [None if r.failed else r.reward for r in results]

    grade.__name__ = str(grader.get("name") or grader["type"])
    return grade


def reward_functions(spec: str, cmd: str = "", wall_seconds: float = 20.0, grader: str = "",
                     ends: "graders.Endpoints | None" = None) -> list:
    """--reward, --reward_cmd and --reward_grader as TRL's reward_funcs, in that order (--reward_weights follows)."""
    checked = Checked(wall_seconds=wall_seconds)
    built = dict(zip(BUILT_IN, checker_rewards(checked)))
    funcs = [built[n] if n in built else load_function(n) for n in names(spec)]
    return funcs + ([command_reward(cmd)] if cmd.strip() else []) + ([grader_reward(grader, checked, ends)] if grader else [])
