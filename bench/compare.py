"""Which method makes the agent's code better? The base, the recipe, DPO, KTO, GRPO and rounds on the same run logs,
over several seeds, each scored by running its sampled answers to the held-out runs' prompts through the checker.

    make compare                        # 3 seeds x 6 arms on the demo logs (hours): bench/results-methods.{md,json}
    .venv/bin/python bench/compare.py [--seeds 1,2,3] [--arms "dpo=dpo; kto=kto"] [--logs data/runs.jsonl]
                                      [--out bench/results-methods] [--unseen bench/unseen-runs.jsonl]
                                      [-- TRAIN_FLAGS...]

An arm is NAME=METHOD [train_dpo.py flags], arms separated by ';'. The default arms: `rounds` (what `make train`
runs on the bundled model: configs/rounds.yaml, the recipe, then the model's own scored attempts), `recipe` (its first
stage alone, `make train ROUNDS=0`: configs/demo.yaml on the pairs of the logs and --extra_runs after them),
`dpo-no-sft` (the same recipe with DPO's preference loss instead of the chosen answers' likelihood), `kto` and
`grpo` (`make train METHOD=...`), and `sft-grpo`
(the recipe, then GRPO from its adapter: configs/sft-grpo.yaml). Every
DPO, KTO or GRPO run is one `train_dpo.py` with the arm's flags, TRAIN_FLAGS (every arm) and the seed, on what
build_pairs.py makes of the logs (pairs for DPO, --emit kto examples for KTO, the logs' own prompts for GRPO), and
the same held-out runs (the split is by run). A `rounds` arm's one argument is a plan, run by `iterate.py --logs
LOGS --seed SEED -- TRAIN_FLAGS` (its `dpo` stages on the logs' pairs, its `attempts` stages on the logs, every
stage trained and sampled with the seed, --extra_runs given to it as to the other arms); its last stage is the run
read back. A run's report's execution
section is read back: `--eval_samples` sampled answers (seeded) to each
held-out prompt from the base (adapter off) and from the tuned model, each run on the prompt's host. The base's
numbers come from every run; with the same seed they are the same samples, so they are shown once per seed.
With --unseen (make compare's UNSEEN, bench/unseen-runs.jsonl on the demo logs), each row's run is also scored on
run logs no arm trained on or attempted (`entrypoint.py eval RUN FILE`), base and tuned, and the tables show those
numbers beside the held-out ones: whether what a run learned carries over to other tasks, hosts and users.

A comparison takes hours, so it can be made in parts: a row already in OUT.json is kept, not trained again, when its
seed, arm and inputs are the same (the arm's method and flags, the flags after `--`, and the bytes of the logs, the
extra runs, the config the arm names and every file under data/: `inputs_digest`). Each row names the commit and date it was
trained at. `--only recipe,kto` trains only those arms in this call (a part of the hours), and `--seeds 1` only
that seed (the other seeds' rows are kept as they are); `--rerun` trains every row again. A row whose inputs changed is trained again, or left out under `--only`: no stale row is shown.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dpokit.core import kit  # noqa: E402
from dpokit.data import runlogs  # noqa: E402


DEFAULT_ARMS = ("rounds=rounds configs/rounds.yaml; recipe=dpo --config configs/demo.yaml; "
                "dpo-no-sft=dpo --config configs/demo.yaml --loss_type sigmoid; "
                "kto=kto --eval_steps 1000; grpo=grpo; sft-grpo=rounds configs/sft-grpo.yaml")
# kto: no held-out loss during training (at train_dpo.py's 5 steps, 42 evaluations were half of a 36-minute run on
# 2 cores; they change nothing trained, and the report has the held-out accuracy), as configs/rounds.yaml's stages
METHODS = ("dpo", "kto", "grpo", "rounds")
# The make command each default arm is (the table says which one `make train` runs).
MAKE_COMMANDS = {"recipe": "make train ROUNDS=0", "grpo": "make train METHOD=grpo",
                 "rounds": "make train, the default", "sft-grpo": "make train ROUNDS_PLAN=configs/sft-grpo.yaml"}


def arm_line(arm: str, method: str, flags: list[str]) -> str:
    """The header's line for an arm: what it runs, and the make command it is when it is a default arm unchanged."""
    run = (f"iterate.py {flags[0]} --logs LOGS --seed SEED" if method == "rounds"
           else f"train_dpo.py --method {method} {' '.join(flags)}".rstrip())
    make = MAKE_COMMANDS.get(arm) if (arm, method, flags) in parse_arms(DEFAULT_ARMS) else None
    return f"- `{arm}`" + (f" ({make})" if make else "") + f": `{run}`\n"


def parse_arms(spec: str) -> list[tuple[str, str, list[str]]]:
    """'NAME=METHOD flags; ...' -> [(name, method, flags)]: what each arm trains, in order."""
    import shlex

    arms = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, eq, rest = part.partition("=")
        words = shlex.split(rest)
        if not eq or not name.strip() or not words:
            raise kit.UserError(f"--arms: {part!r} is not NAME=METHOD [flags]")
        if words[0] not in METHODS:
            raise kit.UserError(f"--arms: {part!r}: the method is one of {', '.join(METHODS)}")
        if words[0] == "rounds" and len(words) != 2:
            raise kit.UserError(f"--arms: {part!r}: a rounds arm takes one plan file "
                                "(rounds=rounds configs/rounds.yaml)")
        if words[0] == "rounds" and not (ROOT / words[1]).is_file():
            raise kit.UserError(f"--arms: {part!r}: no plan file {ROOT / words[1]}")
        missing = [c for c in named_configs(words[0], words[1:]) if not (ROOT / c).is_file()]
        if missing:
            raise kit.UserError(f"--arms: {part!r}: no config file {ROOT / missing[0]}")
        arms.append((name.strip(), words[0], words[1:]))
    if len({a[0] for a in arms}) != len(arms):
        raise kit.UserError(f"--arms: a name is used twice in {spec!r}")
    return arms


@dataclasses.dataclass
class CompareConfig:
    seeds: str = kit.field("1,2,3", "training and sampling seeds")
    arms: str = kit.field(DEFAULT_ARMS, "what to train: NAME=METHOD [train_dpo.py flags], separated by ';'")
    logs: str = kit.field("data/runs.jsonl", "agent run logs")
    extra_runs: str = kit.field("", "more run log files read after --logs when the pairs are built (build_pairs.py "
                                "--extra_runs, comma-separated): make compare passes make train's ATTEMPTS")
    out: str = kit.field("bench/results-methods", "writes OUT.md and OUT.json")
    work: str = kit.field("", "where the runs go (default: artifacts/bench-compare)")
    eval_samples: int = kit.field(8, "sampled answers to each held-out prompt, base and tuned, in every arm (as "
                                  "configs/demo.yaml has it)")
    rerun: bool = kit.field(False, "train every row (under --only: every row of those arms) again, even one OUT.json "
                            "has for the same seed, arm and inputs")
    only: str = kit.field("", "train only these arms (comma-separated names) in this call; the others' rows are kept "
                          "where OUT.json has them on the same inputs, and left out where not")
    unseen: str = kit.field("", "run logs no arm trains on (bench/unseen-runs.jsonl: other tasks, hosts and users): "
                            "each row's base and tuned answers to their prompts are scored too, as `make eval RUN=... "
                            "DATA=...` scores them, and the tables show them beside the held-out ones")


def inputs_digest(method: str, flags: list[str], extra: list[str], files: list[Path]) -> str:
    """What a row's numbers depend on besides the code: the arm's method and flags, the flags every arm gets, and
    the bytes of the given files (input_files: the logs, the extra runs, the arm's config, data/), in order."""
    h = hashlib.sha256(json.dumps([method, list(flags), list(extra)]).encode())
    for f in files:
        h.update(f"\0{f.name}\0".encode() + f.read_bytes())
    return h.hexdigest()


def named_configs(method: str, flags: list[str]) -> list[str]:
    """The config files an arm reads: a rounds arm's plan, another's `--config FILE` (train_dpo.py reads no other)."""
    if method == "rounds":
        return flags[:1]
    return [f.split("=", 1)[1] if "=" in f else nxt
            for f, nxt in zip(flags, flags[1:] + [""]) if f == "--config" or f.startswith("--config=")]


def input_files(logs: str, extra_runs: str, configs: list[str]) -> list[Path]:
    """The files inputs_digest reads: the logs, the extra runs, the arm's named configs, then every file under
    data/ (the mix, the probes, what a config names there), sorted. A config no arm names (another arm's recipe) is
    not an input: editing configs/demo.yaml retrains the arms that read it, not KTO's or GRPO's."""
    named = [Path(logs)] + [Path(x.strip()) for x in extra_runs.split(",") if x.strip()]
    return named + [ROOT / c for c in configs] + sorted(f for f in (ROOT / "data").rglob("*") if f.is_file())


def kept_row(old: list[dict], seed: int, arm: str, digest: str, mode: str | None = None) -> dict | None:
    """The row of an earlier comparison for this seed and arm, if it was trained on the same inputs and its answers
    were scored in a mode that scores alike (a limits-mode row is never kept as a bwrap one, nor the other way)."""
    return next((r for r in old if r.get("seed") == seed and r.get("method") == arm and r.get("digest") == digest
                 and (mode is None or same_mode(mode, row_mode(r)))), None)


def same_mode(a: str, b: str) -> bool:
    """Two sandbox modes that score every answer alike: the same one, or bwrap and unshare (both plant the host at
    its real paths; tests/test_checker.py re-scores the bundled attempts in each). limits is only itself."""
    return a == b or {a, b} <= {"bwrap", "unshare"}


def row_mode(row: dict) -> str:
    """The sandbox mode a row's answers were scored in ('?' for a row from before the kit recorded it)."""
    return (row.get("tuned") or {}).get("isolation") or "?"


def spread(values: list[dict], key: str) -> dict:
    """Mean and sample standard deviation over seeds of one number of each run's scores, and how many runs had it
    (None: no answer of that run could be scored)."""
    xs = [v[key] for v in values if v.get(key) is not None]
    return {"mean": statistics.fmean(xs) if xs else float("nan"), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "n": len(xs)}


def summarize(rows: list[dict]) -> dict:
    """Per method (and the base): mean and sample standard deviation over seeds of the held-out mean checker score
    and pass rate. rows: {seed, method, base: {mean_score, pass_rate}, tuned: {...}}."""
    out = {}
    first = {}
    for r in rows:
        first.setdefault(r["seed"], r["base"])
    arms = {"base": list(first.values())}
    for r in rows:
        arms.setdefault(r["method"], []).append(r["tuned"])
    for name, values in arms.items():
        out[name] = {}
        for key in ("mean_score", "pass_rate"):
            out[name][key] = spread(values, key)
        out[name]["broke"] = sum(v.get("outcomes", {}).get("broke", 0) for v in values)
        out[name]["unscorable"] = sum(v.get("outcomes", {}).get("unscorable", 0) for v in values)
        out[name]["modes"] = sorted({v.get("isolation") or "?" for v in values})
    unseen = {}
    for r in rows:
        if r.get("unseen"):
            unseen.setdefault("base", {}).setdefault(r["seed"], r["unseen"]["base"])
            unseen.setdefault(r["method"], {})[r["seed"]] = r["unseen"]["tuned"]
    for name, by_seed in unseen.items():
        values = list(by_seed.values())
        out[name]["unseen"] = {"mean_score": spread(values, "mean_score"), "pass_rate": spread(values, "pass_rate"),
                               "broke": sum(v.get("outcomes", {}).get("broke", 0) for v in values)}
    return out


def unseen_cells(unseen: dict | None) -> str:
    """A per-seed row's three unseen-logs cells (score, pass rate, answers deleting kept files; base → tuned), each
    after a ' | '; 'n/a' for a row scored before --unseen was given."""
    if not unseen:
        return " | n/a" * 3
    base, tuned = unseen["base"], unseen["tuned"]
    cells = [f"{kit.num(base[k], f)} → {kit.num(tuned[k], f)}" for k, f in (("mean_score", "+.4f"), ("pass_rate", ".3f"))]
    cells.append(f"{base.get('outcomes', {}).get('broke', 0)} → {tuned.get('outcomes', {}).get('broke', 0)}")
    return "".join(f" | {c}" for c in cells)


def table(rows: list[dict], summary: dict) -> str:
    lines = ["| method | held-out mean checker score | pass rate | answers that deleted kept files, all seeds | seeds "
             "| sandbox mode (answers it could not score) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['mean_score']['mean']:+.4f} ± {s['mean_score']['std']:.4f} | "
                     f"{s['pass_rate']['mean']:.3f} ± {s['pass_rate']['std']:.3f} | {s.get('broke', 0)} | "
                     f"{s['mean_score']['n']} | {', '.join(s.get('modes', ['?']))}"
                     + (f" ({s['unscorable']} unscorable)" if s.get("unscorable") else "") + " |")
    unseen = any(r.get("unseen") for r in rows)
    if unseen:
        lines += ["", f"On the unseen logs ({next(r['unseen']['file'] for r in rows if r.get('unseen'))}: no arm "
                  "trained on or attempted them):", "",
                  "| method | unseen mean checker score | pass rate | answers that deleted kept files, all seeds | seeds |",
                  "| --- | --- | --- | --- | --- |"]
        for name, s in summary.items():
            u = s.get("unseen")
            if u:
                lines.append(f"| {name} | {u['mean_score']['mean']:+.4f} ± {u['mean_score']['std']:.4f} | "
                             f"{u['pass_rate']['mean']:.3f} ± {u['pass_rate']['std']:.3f} | {u['broke']} | "
                             f"{u['mean_score']['n']} |")
    lines += ["", "| seed | method | sandbox | base score | tuned score | base pass | tuned pass | tuned outcomes | "
              + ("unseen score, base → tuned | unseen pass, base → tuned | unseen deleting kept files, base → tuned | "
                 if unseen else "")
              + "steps | minutes (run start to handoff; rounds: its stages', summed) | trained at (commit, date, device) |",
              "| --- " * (14 if unseen else 11) + "|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['method']} | {row_mode(r)} | {kit.num(r['base']['mean_score'], '+.4f')} | "
                     f"{kit.num(r['tuned']['mean_score'], '+.4f')} "
                     f"| {kit.num(r['base']['pass_rate'], '.3f')} | {kit.num(r['tuned']['pass_rate'], '.3f')} | "
                     + ", ".join(f"{k} {v}" for k, v in sorted(r["tuned"]["outcomes"].items()))
                     + (unseen_cells(r.get("unseen")) if unseen else "")
                     + f" | {r['steps']} | {r['minutes']:.1f} | {(r.get('commit') or '?')[:7]} {r.get('date', '?')}"
                     + f" {r.get('device') or ''}".rstrip() + " |")
    return "\n".join(lines)


def grpo_signal(metrics: list[dict]) -> dict:
    """What a GRPO run had to learn from, from its metrics.jsonl rows: steps, steps where every answer of every
    group scored the same (zero advantage: nothing learned), and the training answers' mean reward, ran and pass
    rates."""
    steps = [m for m in metrics if "reward" in m]
    n = max(len(steps), 1)
    flat = [m["kit/signal"] == 0 if "kit/signal" in m else m.get("reward_std", 0.0) == 0.0 for m in steps]
    return {"steps": len(steps), "flat_steps": sum(flat),
            "reward": sum(m["reward"] for m in steps) / n, "ran_rate": sum(m.get("ran_rate", 0.0) for m in steps) / n,
            "pass_rate": sum(m.get("pass_rate", 0.0) for m in steps) / n}


def grpo_runs(work: Path, run_dir: Path, method: str) -> list[Path]:
    """The GRPO runs behind a row: a grpo arm's run, a rounds arm's `grpo` stages (iterate's lineage), in order."""
    if method == "grpo":
        return [run_dir]
    if method != "rounds":
        return []
    return [work / st["run_name"] for st in json.loads((run_dir / "lineage.json").read_text()) if st.get("kind") == "grpo"]


def unseen_scores(run_dir: Path, unseen: str) -> dict:
    """The run's base and tuned answers to every prompt of the unseen logs, scored by the checker (entrypoint.py eval
    RUN FILE, into <run>-eval/): {file, base, tuned, prompts, samples} as the held-out evaluation has them."""
    cmd = [sys.executable, str(ROOT / "entrypoint.py"), "eval", str(run_dir), unseen]
    print(f"[compare] {run_dir.name}: {' '.join(cmd[1:])}", flush=True)
    if subprocess.run(cmd, cwd=ROOT).returncode:
        raise kit.UserError(f"{run_dir.name}: entrypoint.py eval on {unseen} failed: its output is above")
    execution = json.loads((run_dir.with_name(run_dir.name + "-eval") / "evaluation.json").read_text())["execution"]
    return {"file": unseen, **{k: execution[k] for k in ("base", "tuned", "prompts", "samples")}}


def findings(rows: list[dict]) -> list[str]:
    """Sentences the numbers say on their own: whether any arm freed space, and GRPO's learning signal."""
    out = []
    if all(not r[arm]["pass_rate"] for r in rows for arm in ("base", "tuned")):
        out.append("No held-out answer of any model, base or tuned, in any run freed space.")
    for r in rows:
        g = r.get("grpo")
        if g:
            out.append(f"{r['method']} seed {r['seed']}: in {g['flat_steps']} of its {g['steps']} GRPO steps every sampled answer "
                       f"scored the same (no advantage, nothing learned); over all its training answers the mean reward "
                       f"was {g['reward']:.4f}, {g['ran_rate']:.3f} of them ran and {g['pass_rate']:.3f} freed space.")
    return out


def plan(old: list[dict], seeds: list[int], arms: list, only: set, rerun: bool, digests: dict,
         mode: str | None = None) -> list[tuple]:
    """What this call does, in order: (seed, arm, row) keeps an earlier row trained on the same inputs, (seed, arm,
    None) trains. The given seeds' arms (under --only, those arms) train unless kept; earlier rows of other arms, and
    of seeds not given, are kept where their inputs match and otherwise left out (--rerun: the arms that train here
    are trained again)."""
    out = []
    for seed in seeds + sorted({r["seed"] for r in old} - set(seeds)):
        for arm in arms:
            training = (not only or arm[0] in only) and seed in seeds
            row = None if rerun and training else kept_row(old, seed, arm[0], digests[arm[0]], mode)
            if row or training:
                out.append((seed, arm, row))
    return out


def run_rounds(plan_file: str, name: str, seed: int, logs: str, work: Path,
               extra: list[str] = (), extra_runs: str = "") -> tuple[Path, int]:
    """iterate.py on the arm's plan with the compared logs and this seed (--logs, --seed: every stage trained and
    sampled with it, the last one scored on the logs' held-out prompts; complete stages are found again, not trained
    again): the last stage's run directory, and the steps of every stage."""
    cmd = [sys.executable, str(ROOT / "iterate.py"), str(ROOT / plan_file), "--logs", logs, "--seed", str(seed),
           *(["--extra_runs", extra_runs] if extra_runs else []), "--name", name, "--output_dir", str(work),
           *(["--", *extra] if extra else [])]
    print(f"[compare] {name}: {' '.join(cmd[1:])}", flush=True)
    code = subprocess.run(cmd, cwd=ROOT).returncode
    if code:
        raise kit.UserError(f"{name}: iterate.py {plan_file} failed (exit {code}): its output is above; the same "
                            "make compare finds the complete stages again")
    lineage = json.loads((work / f"{name}.lineage.json").read_text())
    steps = sum(json.loads((work / st["run_name"] / "manifest.json").read_text())["steps"]
                for st in lineage["stages"])
    return work / lineage["final_run"], steps


def data_for(method: str, logs: str, work: Path, extra_runs: str = "") -> tuple[str, str]:
    """(training data, eval prompts) for a method, built once per method from the logs (and extra_runs after them,
    as make train builds them)."""
    prompts = work / "pairs" / "runs.prompts.jsonl"
    if method == "grpo":
        return logs, ""
    out = work / "pairs" / f"runs.{'kto' if method == 'kto' else 'pairs'}.jsonl"
    if not out.exists():
        subprocess.run([sys.executable, str(ROOT / "build_pairs.py"), logs, "-o", str(out), "--prompts", str(prompts),
                        *(["--extra_runs", extra_runs] if extra_runs else []),
                        *(["--emit", "kto"] if method == "kto" else [])], check=True, cwd=ROOT)
    return str(out), str(prompts)


def run_minutes(work: Path, run_dir: Path, method: str) -> float:
    """Minutes from the run's start to its handoff; for rounds, each stage's own minutes summed (iterate's lineage):
    a stage complete from an earlier call is found again, so the span from the first stage's start would count the
    hours between calls. An attempts stage's sampling and checking, before its training, counts where its lineage
    entry records their `seconds` (attempts.py)."""
    stages = json.loads((run_dir / "lineage.json").read_text()) if method == "rounds" else [{"run_name": run_dir.name}]

    def minutes(stage: dict) -> float:
        m = json.loads((work / stage["run_name"] / "manifest.json").read_text())
        span = (dt.datetime.fromisoformat(m["finished_at"]) - dt.datetime.fromisoformat(m["started_at"])).total_seconds()
        return (span + ((stage.get("pairs_report") or {}).get("seconds") or 0)) / 60
    return sum(minutes(st) for st in stages)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    cfg = kit.parse_config(CompareConfig, argv[:argv.index("--")] if "--" in argv else argv, __doc__)
    extra = ["--eval_samples", str(cfg.eval_samples), *extra]
    work = Path(cfg.work or ROOT / "artifacts" / "bench-compare")
    (work / "pairs").mkdir(parents=True, exist_ok=True)
    out_json = Path(cfg.out + ".json")
    old = json.loads(out_json.read_text()).get("rows", []) if out_json.is_file() else []
    more = ",".join(str(Path(x.strip()).resolve()) for x in cfg.extra_runs.split(",") if x.strip())
    only = {x.strip() for x in cfg.only.split(",") if x.strip()}
    unknown = only - {a[0] for a in parse_arms(cfg.arms)}
    if unknown:
        raise kit.UserError(f"--only {', '.join(sorted(unknown))}: not an arm ({', '.join(a[0] for a in parse_arms(cfg.arms))})")
    rows = []
    arms = parse_arms(cfg.arms)
    if cfg.unseen and not runlogs.prompts_from_logs(cfg.unseen):  # FILE:LINE for a bad line, before hours of training
        raise kit.UserError("no run in it to ask the runs' models", cfg.unseen)
    unseen = [Path(cfg.unseen)] if cfg.unseen else []  # a row is kept only where it was scored on the same unseen logs
    digests = {arm: inputs_digest(method, flags, extra, input_files(str(Path(cfg.logs).resolve()), more,
                                                                     named_configs(method, flags)) + unseen)
               for arm, method, flags in arms}
    from dpokit.sandbox import sandbox

    mode = sandbox.isolation()  # this machine's: a row scored in another mode is trained and scored again
    todo = plan(old, [int(s) for s in cfg.seeds.split(",")], arms, only, cfg.rerun, digests, mode)
    for i, (seed, (arm, method, flags), row) in enumerate(todo):
        name, t0, digest = f"{arm}-s{seed}", time.time(), digests[arm]
        if row:
            print(f"[compare] {name}: kept, trained at {(row.get('commit') or '?')[:7]} on {row.get('date')} "
                  "on the same inputs (--rerun trains it again)", flush=True)
            rows.append(row)
            continue
        if method == "rounds":
            run_dir, steps = run_rounds(flags[0], name, seed, str(Path(cfg.logs).resolve()), work, extra, more)
        else:
            data, prompts = data_for(method, str(Path(cfg.logs).resolve()), work, more)
            cmd = [sys.executable, str(ROOT / "train_dpo.py"), "--data", data, "--method", method, "--seed",
                   str(seed), "--output_dir", str(work), "--run_name", name, "--probes", "",
                   *(["--eval_prompts", prompts] if prompts else []), *extra, *flags]
            print(f"[compare] {name}: {' '.join(cmd[2:])}", flush=True)
            code = subprocess.run(cmd, cwd=ROOT).returncode
            if code:
                print(f"[compare] {name} failed (exit {code}): its output is above; the finished runs in {work} "
                      "are found again by the next make compare", file=sys.stderr)
                return code
            run_dir, steps = work / name, json.loads((work / name / "manifest.json").read_text())["steps"]
        evaluation = json.loads((run_dir / "evaluation.json").read_text())["execution"]
        rows.append({"seed": seed, "method": arm, "trained": " ".join([method, *flags]),
                     "base": evaluation["base"], "tuned": evaluation["tuned"],
                     "prompts": evaluation["prompts"], "samples": evaluation["samples"],
                     "steps": steps, "minutes": run_minutes(work, run_dir, method),
                     "this_call_s": time.time() - t0, "digest": digest, "commit": kit.git_commit(ROOT),
                     "date": dt.date.today().isoformat(),
                     "device": json.loads((run_dir / "manifest.json").read_text()).get("device")})
        if cfg.unseen:
            rows[-1]["unseen"] = unseen_scores(run_dir, cfg.unseen)
        for grpo_run in grpo_runs(work, run_dir, method)[-1:]:  # a plan's GRPO stage too (sft-grpo)
            rows[-1]["grpo"] = grpo_signal([json.loads(line) for line in
                                            (grpo_run / "metrics.jsonl").read_text().splitlines() if line.strip()])
        done = rows + [r for _, _, r in todo[i + 1:] if r]  # an interrupted call loses no kept row
        kit.atomic_write_json(out_json, {"rows": done, "summary": summarize(done)})
    if not rows:
        raise kit.UserError(f"nothing to tabulate: --only {cfg.only!r} names none of the arms "
                            f"({', '.join(a[0] for a in parse_arms(cfg.arms))}) and {out_json} has no row to keep")
    order = {a[0]: k for k, a in enumerate(arms)}
    rows.sort(key=lambda r: (r["seed"], order.get(r["method"], len(order))))  # seed by seed, arms in their order
    summary = summarize(rows)
    shown = [a for a in arms if any(r["method"] == a[0] for r in rows)]
    missing = [a[0] for a in arms if a not in shown]
    head = (f"# Held-out checker scores: base, {', '.join(a[0] for a in shown)} on {cfg.logs}\n\n"
            + "".join(arm_line(*a) for a in shown)
            + (f"- not run on these inputs yet: {', '.join(missing)} (`make compare ARGS=\"--only "
               f"{','.join(missing)}\"` adds them; the rows above are kept)\n" if missing else "") + "\n"
            f"{rows[0]['samples']} sampled answers to each of {rows[0]['prompts']} held-out prompts per model and seed, "
            f"each run on its prompt's host by checker.py (score: bytes freed over the plantable junk, -1 for "
            f"deleting what must be kept; pass: it freed space). Mean ± standard deviation over seeds "
            f"{','.join(map(str, sorted({r['seed'] for r in rows})))} (each arm's count in its row); "
            "`python bench/compare.py` wrote this.\n\n" + "".join(f"- {line}\n" for line in findings(rows))
            + "\n")
    kit.atomic_write_text(Path(cfg.out + ".md"), head + table(rows, summary) + "\n")
    kit.atomic_write_json(out_json, {"rows": rows, "summary": summary})
    print(table(rows, summary))
    return 0


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
