"""Run a plan of training rounds: each stage starts from the previous stage's adapter and uses it, frozen, as its reference.

    python iterate.py data/plan.yaml [--output_dir artifacts] [--logs runs.jsonl [--extra_runs a.jsonl,...]]
                      [--seed N] [--name N] [-- FLAGS]
    make iterate [PLAN=plan.yaml]
    make rounds | make train ROUNDS=1   # configs/rounds.yaml on LOGS (the demo's by default)

--logs puts agent run logs in place of the plan's data (its `dpo` stages train on their pairs, its `attempts`
and `grpo` stages take their prompts, the last stage's report scores their held-out prompts); FLAGS after `--` are
train_dpo.py options for every stage, over the plan's (`-- --learning_rate 1e-3`).

A plan is YAML: a `name`, an optional base `model`, `train` options for every stage (train_dpo.py's
names) and a list of `stages`, in any order, each with a `kind`, its `data`, and its own `pairs`
(build_pairs options) and `train` options on top. A `train` mapping may name a config file (`config:
configs/demo.yaml`, as `--config` takes): its options come first and the mapping's own override them. A stage's
`learning_rate: default` (any option) takes the option's own default back from the plan's `train`.

  dpo          train on a pairs file as it is
  spin         pairs from `build_pairs.py spin` on an SFT file, answered by the current model
  self_reward  pairs from `build_pairs.py self-reward` on a prompts file, sampled and judged by the current model
  sft          plain SFT on an SFT file, OpenAI's supervised rows (supervised.py): every assistant message of
               weight 1 trained with TRL's SFT loss (the reference answer's NLL)
  attempts     the current model's own attempts at run logs' training prompts, each run by the checker and
               written as run logs (attempts.py); build_pairs.py makes the pairs from the logs, the earlier
               rounds' attempts and this one's. `pairs:` takes attempts.py's options (samples, temperature, ...)
  grpo         GRPO (train_dpo.py --method grpo) on run logs or a prompts file: answers sampled from the current
               model, scored by running them (the checker by default), from the last stage's adapter; its
               `train:` takes GRPO's options (num_generations, reward, ...). Its report scores the data's own
               held-out runs.

Stage i trains `<name>-<i>-<kind>-<hash>` in the output directory with `--init_adapter` = stage i-1's
run (stage 1 starts from a fresh LoRA on the base); the hash covers the stage, its data and its
parent, so editing a stage re-runs it and everything after it, and a re-run of the same plan skips
the stages already complete. Built pairs and their reports go to `<output_dir>/<name>/`; every run
carries lineage.json (the stages that led to it), and the last stage's tarball, also as <output_dir>/<name>.tar.gz,
is the handoff.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

from dpokit.core import kit
from dpokit.data import supervised
from dpokit.model import models
from dpokit.pairs import attempts, from_logs, self_pairs
from dpokit.train import config, methods, training

KINDS = ("dpo", "spin", "self_reward", "sft", "attempts", "grpo")
PLAN_KEYS = {"name", "model", "train", "stages"}
STAGE_KEYS = {"kind", "data", "pairs", "train"}
# Options the runner sets itself: a plan giving them would be silently overridden.
RUNNER_TRAIN_OPTIONS = {"data", "output_dir", "run_name", "init_adapter", "lineage", "model_name_or_path"}
RUNNER_PAIRS_OPTIONS = {"sft", "prompts", "model", "output", "report", "format", "logs", "round", "eval_fraction"}


@dataclasses.dataclass
class IterateConfig:
    plan: str = kit.field("data/plan.yaml", "the plan (YAML): name, model, train options, stages")
    output_dir: str = kit.field("artifacts", "where the stages' runs (and <name>/ with their pairs) go")
    logs: str = kit.field("", "agent run logs in place of the plan's data: its `dpo` stages train on the pairs "
                          "build_pairs.py makes of them, its `attempts` stages attempt their runs' prompts, and the "
                          "last stage's report scores their held-out runs' prompts with the checker ('' = the plan's)")
    extra_runs: str = kit.field("", "more run log files, comma-separated, read after --logs wherever pairs are built "
                                "from them (build_pairs.py --extra_runs: earlier rounds' attempts); the runs attempted "
                                "and GRPO's prompts are --logs' own")
    seed: int = kit.field(-1, "every stage's training seed and its attempts' sampling seed (-1 = the plan's)")
    name: str = kit.field("", "the plan's name in place of its own: the prefix of its runs' names")

    def problems(self) -> list[str]:
        bad = self.name and ("/" in self.name or self.name.startswith("."))
        p = [f"--name must be a plain name (it prefixes the run names), got {self.name!r}"] if bad else []
        return p + (["--extra_runs goes with --logs (it adds to their pairs)"] if self.extra_runs and not self.logs
                    else [])


@dataclasses.dataclass(frozen=True)
class Stage:
    index: int  # 1-based
    kind: str
    data: str
    pairs: dict
    train: dict
    line: int  # where the stage starts in the plan file
    run_name: str = ""
    parent: str | None = None  # the previous stage's run name; None = fresh LoRA on the base


# ---------------------------------------------------------------------------------------------
# Pure: plan validation and chaining order (tested without a model).
# ---------------------------------------------------------------------------------------------

def option_names(kind: str) -> tuple[set, set]:
    """(train option names, pairs option names) a stage of this kind accepts."""
    train = {f.name for f in dataclasses.fields(config.TrainConfig)} - RUNNER_TRAIN_OPTIONS
    pairs = set()
    if kind in ("spin", "self_reward", "attempts"):
        cls = {"spin": self_pairs.SpinConfig, "self_reward": self_pairs.SelfRewardConfig,
               "attempts": attempts.AttemptsConfig}[kind]
        pairs = {f.name for f in dataclasses.fields(cls)} - RUNNER_PAIRS_OPTIONS
    return train, pairs


def plan_problems(plan, stage_lines: list[int]) -> list[tuple[int, str]]:
    """Every problem of a decoded plan as (line, message), all at once."""
    if not isinstance(plan, dict):
        return [(1, "a plan is a mapping with name, stages and optionally model and train")]
    p = [(1, f"unknown key {k!r}; expected {', '.join(sorted(PLAN_KEYS))}") for k in sorted(set(plan) - PLAN_KEYS)]
    name = plan.get("name")
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        p.append((1, f"name must be a plain name (it prefixes the run names), got {name!r}"))
    if "model" in plan and not isinstance(plan["model"], str):
        p.append((1, "model must be a model directory or hub id"))
    train_all = plan.get("train", {})
    if not isinstance(train_all, dict):
        p.append((1, "train must be a mapping of train_dpo.py options"))
        train_all = {}
    stages = plan.get("stages")
    if not isinstance(stages, list) or not stages:
        return p + [(1, "stages must be a non-empty list")]
    allowed_train = option_names("dpo")[0] | {"config"}  # config: an included file (included)
    p += [(1, f"train: unknown or runner-set option {k!r}") for k in sorted(set(train_all) - allowed_train)]
    for i, st in enumerate(stages):
        line = stage_lines[i] if i < len(stage_lines) else 1
        where = f"stage {i + 1}"
        if not isinstance(st, dict):
            p.append((line, f"{where}: a stage is a mapping with kind and data"))
            continue
        p += [(line, f"{where}: unknown key {k!r}; expected {', '.join(sorted(STAGE_KEYS))}")
              for k in sorted(set(st) - STAGE_KEYS)]
        kind = st.get("kind")
        if kind not in KINDS:
            p.append((line, f"{where}: unknown kind {kind!r}; expected one of {', '.join(KINDS)}"))
            continue
        if not isinstance(st.get("data"), str) or not st.get("data"):
            p.append((line, f"{where}: data (a file) is required"))
        train_ok, pairs_ok = option_names(kind)
        train_ok = train_ok | {"config"}
        for key, allowed in (("train", train_ok), ("pairs", pairs_ok)):
            value = st.get(key, {})
            if not isinstance(value, dict):
                p.append((line, f"{where}: {key} must be a mapping of options"))
            elif bad := sorted(set(value) - allowed):
                what = "no pairs options (its data is used as it is)" if not allowed else "unknown or runner-set"
                p.append((line, f"{where} ({kind}): {key} option(s) {', '.join(map(repr, bad))}: {what}"))
    return p


def chain(plan: dict, stage_lines: list[int], data_sha256: dict[str, str]) -> list[Stage]:
    """The stages in plan order, each named and linked to its parent (the previous stage's run).

    A run name ends in a hash of the stage (kind, data content, options), the base model and the
    parent's run name, so a changed stage changes its name and every later one."""
    stages, parent = [], None
    base = plan.get("model", "")
    for i, st in enumerate(plan["stages"], 1):
        train = {**plan.get("train", {}), **st.get("train", {})}
        train = {k: v for k, v in train.items() if v != "default"}  # `default`: the config's own, not the plan's
        if st["kind"] == "grpo":  # the plan-wide DPO recipe (loss_type: sft, mix, ...) is not GRPO's; its own are

            train = {k: v for k, v in train.items() if k not in methods.DPO_ONLY or k in st.get("train", {})}
        ident = json.dumps([st["kind"], data_sha256[st["data"]], st.get("pairs", {}), train, base, parent],
                           sort_keys=True)
        name = f"{plan['name']}-{i}-{st['kind']}-{hashlib.sha256(ident.encode()).hexdigest()[:8]}"
        stages.append(Stage(i, st["kind"], st["data"], dict(st.get("pairs", {})), train, stage_lines[i - 1],
                            name, parent))
        parent = name
    return stages


def lineage_entry(stage: Stage, data_sha: str, pairs: str, pairs_sha: str, report: dict | None) -> dict:
    keep = ("examples", "context_only", "prompts", "candidates", "judge_mode", "judgements", "judgements_parsed",
            "judgements_unparsable", "judgements_out_of_range", "pairs_written", "dropped_same_as_reference",
            "attempts", "outcomes", "pass_rate", "runs_with_a_pass", "seconds", "logs_used", "pairs_by_rule",
            "unscorable", "isolation")
    return {"stage": stage.index, "kind": stage.kind, "data": stage.data, "data_sha256": data_sha,
            "pairs": pairs, "pairs_sha256": pairs_sha, "run_name": stage.run_name, "parent": stage.parent,
            "pairs_report": {k: report[k] for k in keep if k in report} if report else None}


def overridden(plan: dict, name: str = "", seed: int = -1, logs: tuple[str, str, str] | None = None,
               train: dict | None = None) -> dict:
    """The plan with what the command line gives in place of its own: its name; the seed of every stage's training
    and of its attempts; logs = (run logs, the pairs build_pairs.py made of them, their prompts): `dpo` stages on
    those pairs, `attempts` stages on those logs, and the last stage scored on those prompts (the checker's held-out
    score; earlier stages are not); train: train_dpo.py options over every stage's own."""
    stages = []
    for i, stage in enumerate(plan["stages"]):
        stage = {**stage, "pairs": dict(stage.get("pairs") or {}), "train": {**(stage.get("train") or {}),
                                                                           **(train or {})}}
        if logs and stage["kind"] == "dpo":
            stage["data"] = logs[1]
        elif logs and stage["kind"] in ("attempts", "grpo"):
            stage["data"] = logs[0]
        if stage["kind"] == "attempts" and seed >= 0:
            stage["pairs"]["seed"] = seed
        if logs and i == len(plan["stages"]) - 1 and stage["kind"] != "grpo":  # GRPO scores its logs' held-out runs
            stage["train"]["eval_prompts"] = logs[2]
        elif logs:
            stage["train"].pop("eval_prompts", None)
        stages.append(stage)
    top = {**(plan.get("train") or {}), **(train or {}), **({"seed": seed} if seed >= 0 else {})}
    return {**plan, "name": name or plan["name"], "train": top, "stages": stages}


def train_flags(argv: list[str], source: str = "iterate.py --") -> dict:
    """train_dpo.py flags (after `--`) as the options they set, checked as a plan's are; a runner-set one is an
    error (the runner sets it for each stage)."""
    cls = config.TrainConfig
    args = vars(kit.build_parser(cls, "").parse_args(kit.normalise_argv(cls, argv)))  # only the flags given
    config_file = args.pop("config", None)
    values = {**(kit.coerce(cls, kit._read_config_file(config_file), config_file) if config_file else {}), **args}
    if taken := sorted(set(values) & RUNNER_TRAIN_OPTIONS):
        raise kit.UserError(f"{', '.join('--' + t for t in taken)}: set by iterate.py for each stage, not a flag "
                            "for every stage", source)
    return values


# ---------------------------------------------------------------------------------------------
# Side effects: read the plan, build each stage's pairs, train, record the lineage.
# ---------------------------------------------------------------------------------------------

def load_plan(path: str) -> tuple[dict, list[int]]:
    """The decoded plan and the line where each stage starts; YAML errors as FILE:LINE."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise kit.UserError(f"cannot read the plan: {e.strerror}", path) from None
    try:
        node = yaml.compose(text)
        plan = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise kit.UserError(f"not valid YAML: {getattr(e, 'problem', e)}", path,
                            mark.line + 1 if mark else None) from None
    lines = []
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == "stages" and isinstance(value, yaml.SequenceNode):
                lines = [item.start_mark.line + 1 for item in value.value]
    if isinstance(plan, dict):
        plan = with_included_configs(plan, path)
    problems = plan_problems(plan, lines)
    if problems:
        raise kit.UserError("bad plan:\n" + "\n".join(f"{path}:{line}: {msg}" for line, msg in problems))
    return plan, lines


def included(train, source: str):
    """A plan's `train` mapping with the options of the config file it names (`config:`) beneath its own."""
    if not isinstance(train, dict) or "config" not in train:
        return train
    rest = {k: v for k, v in train.items() if k != "config"}
    values = kit.coerce(config.TrainConfig, kit._read_config_file(str(train["config"])), str(train["config"]))
    if taken := sorted(set(values) & RUNNER_TRAIN_OPTIONS):
        raise kit.UserError(f"{train['config']}: {', '.join(taken)}: set by iterate.py for each stage, not in an "
                            "included config", source)
    return {**values, **rest}


def with_included_configs(plan: dict, path: str) -> dict:
    """The plan with each `train` mapping's included config (included) expanded."""
    stages = plan.get("stages")
    if isinstance(stages, list):
        stages = [{**st, "train": included(st["train"], path)} if isinstance(st, dict) and "train" in st else st
                  for st in stages]
    return {**plan, **({"train": included(plan["train"], path)} if "train" in plan else {}),
            **({"stages": stages} if "stages" in plan else {})}


def check_data(plan: dict, lines: list[int], path: str) -> None:
    """Every stage's data file is there (after --logs put its pairs and logs in place of the plan's)."""
    for st, line in zip(plan["stages"], lines):
        if not Path(st["data"]).is_file():
            raise kit.UserError(f"stage data {st['data']} not found", path, line)


def logs_data(logs: str, folder: Path, extra_runs: str = "") -> tuple[str, str, str]:
    """(logs, pairs, prompts): build_pairs.py's pairs of the run logs (and of extra_runs after them) and their runs'
    prompts, in the plan's folder (built again on every run: the same logs give the same pairs, so complete stages
    are found again)."""
    if not Path(logs).is_file():
        raise kit.UserError(f"--logs {logs}: no such file")
    stem = Path(logs).name.rsplit(".", 1)[0]
    pairs, prompts = folder / f"{stem}.pairs.jsonl", folder / f"{stem}.prompts.jsonl"
    extra = ["--extra_runs", extra_runs] if extra_runs else []
    if from_logs.main([logs, *extra, "-o", str(pairs), "--report", str(folder / f"{stem}.pairs.report.json"),
                         "--prompts", str(prompts)]) != 0:
        raise kit.UserError(f"--logs {logs}: build_pairs.py made no pairs of them (its report says why)")
    return logs, str(pairs), str(prompts)


def attempt_logs(stage: Stage, earlier: list[Stage], folder: Path, extra_runs: str = "") -> list[Path]:
    """The run logs an attempts stage's pairs are built from: its data, the --extra_runs files (earlier rounds'
    attempts), every earlier attempts stage's logs, its own."""
    extra = [Path(x.strip()) for x in extra_runs.split(",") if x.strip()]
    return [Path(stage.data), *extra, *(folder / f"{st.run_name}.attempts.jsonl" for st in earlier
                                        if st.kind == "attempts"), folder / f"{stage.run_name}.attempts.jsonl"]


def build_attempts_pairs(stage: Stage, earlier: list[Stage], policy: str, folder: Path, plan_path: str,
                         out: Path, report: Path, extra_runs: str = "") -> None:
    """attempts.py's logs of the policy's answers, then build_pairs.py on every log so far."""
    logs = attempt_logs(stage, earlier, folder, extra_runs)
    mine = logs[-1]
    summary_file = mine.with_suffix(".json")
    if not (mine.exists() and summary_file.exists()):
        acfg = kit.config_from(attempts.AttemptsConfig, {
            **stage.pairs, "logs": stage.data, "model": policy, "output": str(mine), "report": str(summary_file),
            "round": sum(st.kind == "attempts" for st in earlier) + 1,
            "eval_fraction": stage.train.get("eval_fraction", config.TrainConfig.eval_fraction)},
            f"{plan_path}:{stage.line}")
        attempts.make(acfg)
    combined = folder / f"{stage.run_name}.logs.jsonl"
    kit.atomic_write_text(combined, "".join(p.read_text(encoding="utf-8") for p in logs))
    if from_logs.main([str(combined), "-o", str(out), "--report", str(report)]) != 0:
        raise kit.UserError(f"stage {stage.index} (attempts) made no pairs; see {report}")
    merged = {**json.loads(report.read_text()), **json.loads(summary_file.read_text()),
              "logs_used": [str(p) for p in logs]}
    kit.atomic_write_json(report, merged)


def build_stage_pairs(stage: Stage, policy: str, folder: Path, plan_path: str,
                      earlier: list[Stage] = (), extra_runs: str = "") -> tuple[str, dict | None]:
    """The stage's pairs file (built once; an existing one is reused so a resumed run sees the same data)."""
    if stage.kind in ("dpo", "grpo"):  # a pairs file, or GRPO's run logs / prompts, as they are
        return stage.data, None
    out = folder / f"{stage.run_name}.pairs.jsonl"
    report = folder / f"{stage.run_name}.pairs.report.json"
    if out.exists() and report.exists():
        print(f"[iterate] stage {stage.index}: reusing {out}", flush=True)
        return str(out), json.loads(report.read_text())
    if stage.kind == "attempts":
        build_attempts_pairs(stage, list(earlier), policy, folder, plan_path, out, report, extra_runs)
        return str(out), json.loads(report.read_text())
    if stage.kind == "sft":
        data = supervised.read(stage.data)
        records = from_logs.sft_pairs(data.examples, 0)
        kit.atomic_write_text(report, json.dumps({"examples": len(data.examples), "rows": data.rows,
                                                  "context_only": data.context_only,
                                                  "pairs_written": len(records)}) + "\n")
        kit.atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        return str(out), json.loads(report.read_text())

    cls, source = (self_pairs.SpinConfig, "sft") if stage.kind == "spin" else (self_pairs.SelfRewardConfig, "prompts")
    cfg = kit.config_from(cls, {**stage.pairs, source: stage.data, "model": policy, "output": str(out),
                                "report": str(report)}, f"{plan_path}:{stage.line}")
    if not self_pairs.make(cfg)["pairs_written"]:
        raise kit.UserError(f"stage {stage.index} ({stage.kind}) made no pairs; see {report}")
    return str(out), json.loads(report.read_text())


def stage_config(st: Stage, pairs: str, out: Path, base: str, plan_path: str, lineage: str = ""):
    """The TrainConfig a stage trains with, its problems raised as `PLAN:LINE: ...`."""
    options = {**st.train, "data": pairs, "output_dir": str(out), "run_name": st.run_name,
               "model_name_or_path": base, "lineage": lineage}
    if st.parent:
        options["init_adapter"] = str(out / st.parent)
    if st.kind == "sft":
        options["loss_type"] = "sft"
    if st.kind == "grpo":
        options["method"] = "grpo"
    return kit.config_from(config.TrainConfig, options, f"{plan_path}:{st.line}")


def run_plan(cfg: IterateConfig, train: dict | None = None) -> Path:
    """Every stage of the plan in order (complete ones found again), with cfg's and `train`'s (train_dpo.py
    options for every stage) overrides; the last stage's tarball."""
    plan, lines = load_plan(cfg.plan)
    out = Path(cfg.output_dir)
    folder = out / (cfg.name or plan["name"])
    folder.mkdir(parents=True, exist_ok=True)
    seed = cfg.seed if cfg.seed >= 0 else (train or {}).get("seed", -1)  # `-- --seed N` seeds the attempts too
    plan = overridden(plan, cfg.name, seed, logs_data(cfg.logs, folder, cfg.extra_runs) if cfg.logs else None, train)
    check_data(plan, lines, cfg.plan)
    base = plan.get("model", models.BUNDLED_MODEL_DIR)
    shas = {st["data"]: kit.sha256_file(st["data"]) for st in plan["stages"]}
    stages = chain(plan, lines, shas)
    for st in stages:  # every stage's options checked before the first trains (not when a late one starts)
        stage_config(st, st.data, out, base, cfg.plan)
    lineage = []
    for st in stages:
        run_dir = out / st.run_name
        done = run_dir.is_dir() and (run_dir / "manifest.json").exists()
        print(f"[iterate] stage {st.index}/{len(stages)} {st.kind} on {st.data} -> {st.run_name} "
              f"(parent: {st.parent or 'base ' + base}){' already complete' if done else ''}", flush=True)
        if done:
            lineage = json.loads((run_dir / "lineage.json").read_text())
            continue
        policy = str(out / st.parent) if st.parent else base
        pairs, report = build_stage_pairs(st, policy, folder, cfg.plan, stages[:st.index - 1], cfg.extra_runs)
        lineage = lineage + [lineage_entry(st, shas[st.data], pairs, kit.sha256_file(pairs), report)]
        lineage_file = folder / f"{st.run_name}.lineage.json"
        kit.atomic_write_json(lineage_file, lineage)
        done = training.run(stage_config(st, pairs, out, base, cfg.plan, str(lineage_file)))
        if done.state != "succeeded" or not (run_dir / "manifest.json").exists():
            raise kit.UserError(f"stage {st.index} ({st.run_name}) did not finish ({done.state}); "
                                "run the same plan again to resume it")
    final = out / f"{stages[-1].run_name}.tar.gz"
    digest = final.with_name(final.name + ".sha256").read_text().split()[0]
    handoff = handoff_copy(final, out / f"{plan['name']}.tar.gz", digest)
    summary = {"plan": cfg.plan, "plan_sha256": kit.sha256_file(cfg.plan), "base_model": base,
               "overrides": {"logs": cfg.logs or None, "extra_runs": cfg.extra_runs or None,
                             "seed": seed if seed >= 0 else None, "name": cfg.name or None, "train": train or {}},
               "stages": lineage,
               "final_run": stages[-1].run_name, "tarball": str(final), "tarball_sha256": digest,
               "handoff": str(handoff)}
    kit.atomic_write_json(out / f"{plan['name']}.lineage.json", summary)
    print(f"[iterate] {len(stages)} stages done; handoff: {handoff} (the last stage's {final.name}; lineage.json "
          f"inside; {out / (plan['name'] + '.lineage.json')})", flush=True)
    return handoff


def handoff_copy(tarball: Path, dest: Path, digest: str) -> Path:
    """The last stage's tarball also under the plan's name (a hard link where the file system allows, else a copy;
    renamed into place), with its own .sha256: `make train RUN=x` hands off <output_dir>/x.tar.gz whatever the
    stages are called."""
    import shutil

    partial = dest.with_name(dest.name + ".partial")
    partial.unlink(missing_ok=True)
    try:
        os.link(tarball, partial)
    except OSError:
        shutil.copyfile(tarball, partial)
    os.replace(partial, dest)
    kit.atomic_write_text(f"{dest}.sha256", f"{digest}  {dest.name}\n")
    return dest


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    cfg = kit.parse_config(IterateConfig, argv[:cut], __doc__, positional="plan")
    run_plan(cfg, train_flags(argv[cut + 1:]))
    return 0


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
