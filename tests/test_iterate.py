"""iterate.py: plan validation and chaining order (no model), then a two-stage plan on the bundled model."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dpokit.train import evaluate
from dpokit.data import runlogs
from dpokit.data import formats
from dpokit.apps import iterate
from dpokit.core import kit
from dpokit.model import models
from dpokit.core import runs

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / models.BUNDLED_MODEL_DIR


def write(tmp_path, text, name="plan.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


PLAN = """\
name: t
train: {max_steps: 1}
stages:
  - kind: spin
    data: DATA
    pairs: {max_new_tokens: 8}
  - kind: self_reward
    data: DATA
    train: {learning_rate: 1.0e-4}
"""


# ------------------------------------------------------------------ validation: FILE:LINE, all problems at once

def test_bad_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "name: t\nstages:\n  - kind: spin\n   data: x\n")
    with pytest.raises(kit.UserError) as e:
        iterate.load_plan(path)
    assert e.value.path == path and e.value.line == 4 and "not valid YAML" in str(e.value)


def test_every_stage_problem_is_reported_with_its_line(tmp_path):
    data = write(tmp_path, "{}\n", "d.jsonl")
    path = write(tmp_path, f"""\
name: t
stages:
  - kind: spin
    data: {data}
    pairs: {{candidates: 4}}
  - kind: spn
    data: {data}
  - kind: dpo
    data: {data}
    pairs: {{max_new_tokens: 8}}
    train: {{beta: 0.2, run_name: x}}
""")
    with pytest.raises(kit.UserError) as e:
        iterate.load_plan(path)
    msg = str(e.value)
    assert f"{path}:3: stage 1 (spin): pairs option(s) 'candidates'" in msg  # a self-reward option
    assert f"{path}:6: stage 2: unknown kind 'spn'; expected one of dpo, spin, self_reward, sft" in msg
    assert f"{path}:8: stage 3 (dpo): pairs option(s) 'max_new_tokens': no pairs options" in msg
    assert f"{path}:8: stage 3 (dpo): train option(s) 'run_name'" in msg  # the runner names runs


def test_missing_data_file_and_missing_stages(tmp_path):
    path = write(tmp_path, "name: t\nstages:\n  - kind: dpo\n    data: nope.jsonl\n")
    with pytest.raises(kit.UserError) as e:
        iterate.check_data(*iterate.load_plan(path), path)
    assert e.value.line == 3 and "nope.jsonl not found" in str(e.value)
    with pytest.raises(kit.UserError, match="nope.jsonl not found"):
        iterate.main([path, "--output_dir", str(tmp_path / "out")])
    with pytest.raises(kit.UserError, match="--logs missing.jsonl: no such file"):
        iterate.main([path, "--output_dir", str(tmp_path / "out"), "--logs", "missing.jsonl"])
    with pytest.raises(kit.UserError, match="stages must be a non-empty list"):
        iterate.load_plan(write(tmp_path, "name: t\n", "p2.yaml"))


def test_plan_errors_exit_2_without_a_traceback(tmp_path):
    path = write(tmp_path, "name: t\nstages:\n  - kind: nope\n    data: x\n")
    result = subprocess.run([sys.executable, str(ROOT / "entrypoint.py"), "iterate", path], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr and f"{path}:3:" in result.stderr


# ------------------------------------------------------------------ chaining order

def test_each_stage_starts_from_the_previous_one_and_names_follow_content(tmp_path):
    data = write(tmp_path, "{}\n", "d.jsonl")
    plan, lines = iterate.load_plan(write(tmp_path, PLAN.replace("DATA", data)))
    stages = iterate.chain(plan, lines, {data: "a" * 64})
    assert [(s.index, s.kind, s.line) for s in stages] == [(1, "spin", 4), (2, "self_reward", 7)]
    assert stages[0].parent is None and stages[1].parent == stages[0].run_name
    assert stages[1].train == {"max_steps": 1, "learning_rate": 1e-4}  # the stage's own options on top
    assert stages[0].run_name.startswith("t-1-spin-") and stages[1].run_name.startswith("t-2-self_reward-")
    # Changing stage 1 (its data or options) renames it and, through the parent, stage 2; same plan, same names.
    again = iterate.chain(plan, lines, {data: "a" * 64})
    assert [s.run_name for s in again] == [s.run_name for s in stages]
    changed = iterate.chain(plan, lines, {data: "b" * 64})
    assert changed[0].run_name != stages[0].run_name and changed[1].run_name != stages[1].run_name
    plan["stages"][1]["train"] = {"learning_rate": 2e-4}
    later = iterate.chain(plan, lines, {data: "a" * 64})
    assert later[0].run_name == stages[0].run_name and later[1].run_name != stages[1].run_name


def test_the_command_line_puts_its_logs_seed_name_and_train_flags_in_place_of_the_plans():
    import yaml

    plan = yaml.safe_load((ROOT / "configs" / "rounds.yaml").read_text())
    got = iterate.overridden(plan, "r-s3", 3, ("/logs.jsonl", "/w/runs.pairs.jsonl", "/w/runs.prompts.jsonl"),
                             {"learning_rate": 1e-3, "num_train_epochs": 2.0})
    assert got["name"] == "r-s3" and got["train"]["seed"] == 3 and got["train"]["learning_rate"] == 1e-3
    kinds = [st["kind"] for st in got["stages"]]
    assert kinds == [st["kind"] for st in plan["stages"]] and "attempts" in kinds and "dpo" in kinds
    for st in got["stages"]:
        assert st["data"] == {"dpo": "/w/runs.pairs.jsonl", "attempts": "/logs.jsonl"}[st["kind"]]
        assert st["pairs"].get("seed", 3) == 3  # the attempts are sampled with the seed
        assert st["train"]["num_train_epochs"] == 2.0  # a flag wins over a stage's own option too
    assert [st["train"].get("eval_prompts") for st in got["stages"]] == [None] * (len(kinds) - 1) + [
        "/w/runs.prompts.jsonl"]  # only the last stage is scored
    assert plan["stages"][-1]["train"]["eval_prompts"] == "artifacts/pairs/runs.prompts.jsonl"  # not changed in place
    assert plan["stages"][-1]["train"]["num_train_epochs"] == 1
    same = iterate.overridden(plan)
    assert same == {**plan, "stages": [{**st, "pairs": st.get("pairs", {}), "train": st.get("train", {})}
                                       for st in plan["stages"]]}  # nothing given: the plan as written
    assert not iterate.plan_problems(got, [1, 2])

    assert iterate.train_flags(["--learning_rate", "1e-3", "--seed", "7", "--no_fused_ops"]) == {
        "learning_rate": 1e-3, "seed": 7, "fused_ops": False}
    assert iterate.train_flags([]) == {}
    with pytest.raises(kit.UserError, match="--output_dir: set by iterate.py"):
        iterate.train_flags(["--output_dir", "x"])


def test_make_train_runs_a_round_by_default_the_recipe_once_with_rounds_0_and_refuses_rounds_1_where_it_cannot():
    def dry(*args, code=0):
        out = subprocess.run(["make", "-n", "--no-print-directory", "train", "RUNNER=local", *args], cwd=ROOT,
                             capture_output=True, text=True)
        assert out.returncode == code, out.stderr
        return " ".join(out.stdout.replace("\\\n", " ").split()) if code == 0 else out.stderr

    for rounds in (dry("RUN=x", "ARGS=--seed 2"), dry("ROUNDS=1", "RUN=x", "ARGS=--seed 2")):
        assert "entrypoint.py iterate configs/rounds.yaml --logs data/runs.jsonl --extra_runs data/attempts.jsonl," \
            "data/attempts-round2.jsonl --output_dir artifacts --name x" in rounds and "-- --seed 2" in rounds \
            and "train_dpo.py" not in rounds  # stage 1 trains on make train's pairs: the logs, then the attempts
    once = dry("ROUNDS=0")  # the recipe alone, on the demo logs and the bundled model's earlier attempts after them
    assert "build_pairs.py data/runs.jsonl --extra_runs data/attempts.jsonl,data/attempts-round2.jsonl -o " \
        "artifacts/pairs/runs.pairs.jsonl" \
        in once and "train_dpo.py" in once and "--config configs/demo.yaml" in once
    assert "iterate" not in once and "--extra_runs" not in dry("ROUNDS=0", "ATTEMPTS=")
    assert "--extra_runs" not in dry("LOGS=data/sft.jsonl")  # another agent's logs: only the demo's own attempts
    assert "ROUNDS=2: expected 1" in dry("ROUNDS=2", code=2)
    for alone, why, said in (("DATA=pairs.jsonl", "DATA=", False), ("METHOD=kto", "METHOD=kto", False),
                             ("MODEL=random:tiny", "MODEL=", False), ("NPROC=2", "several processes", True),
                             ("RUNNER=slurm", "RUNNER=slurm", True)):
        # where a round cannot run, ROUNDS=1 is refused (not quietly trained as one run) ...
        assert f"ROUNDS=1 does not run with {why}" in dry("ROUNDS=1", alone, code=2), alone
        # ... and the default trains once there, saying so where a round was what make train would have run
        out = subprocess.run(["make", "-n", "--no-print-directory", "train", "RUNNER=local", alone], cwd=ROOT,
                             capture_output=True, text=True)
        assert out.returncode == 0 and "iterate" not in out.stdout, (alone, out.stderr)
        assert ("training the recipe once" in out.stdout) == said, (alone, out.stdout[:300])


def test_sft_pairs():
    from dpokit.pairs import from_logs
    from dpokit.data import supervised

    ask = [{"role": "user", "content": "Q"}]
    call = {"id": "c1", "type": "function", "function": {"name": "du", "arguments": {"path": "/"}}}
    tools = [{"type": "function", "function": {"name": "du"}}]
    words, calls = from_logs.sft_pairs([supervised.Example(1, ask, {"role": "assistant", "content": "the answer is four"}),
                                      supervised.Example(2, ask, {"role": "assistant", "content": "",
                                                                  "tool_calls": [call]}, tools)], 0)
    assert words["chosen"] == [{"role": "assistant", "content": "the answer is four"}] and "tools" not in words
    assert words["rejected"][0]["content"] != "the answer is four"
    # a call alone: chosen is the call, rejected the call garbled as text (never trained on, but it differs)
    assert calls["prompt"] == ask and calls["chosen"][0]["tool_calls"] == [call] and calls["tools"] == tools
    assert calls["rejected"][0]["content"] not in ("", 'du({"path": "/"})') and "tool_calls" not in calls["rejected"][0]
    assert formats.normalise(calls, "trl_conversational") == calls  # the pairs file reads back as it was written


def test_an_sft_stage_trains_every_weighted_answer_of_openais_rows(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "1"},
                                             {"role": "user", "content": "b"},
                                             {"role": "assistant", "content": "2", "weight": 0},
                                             {"role": "user", "content": "c"},
                                             {"role": "assistant", "content": "3"}]}) + "\n")
    stage = iterate.Stage(1, "sft", str(data), {}, {}, 4, run_name="t-1-sft-x")
    out, report = iterate.build_stage_pairs(stage, "unused", tmp_path, "plan.yaml")
    assert report == {"examples": 2, "rows": 1, "context_only": 1, "pairs_written": 2}
    pairs, _ = formats.load_pairs(out)
    assert [(len(p["prompt"]), p["chosen"][0]["content"]) for p in pairs] == [(1, "1"), (5, "3")]


# ------------------------------------------------------------------ the real thing: SPIN then self-reward

@pytest.mark.integration
@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="bundled model not converted (make model)")
def test_two_stage_plan_runs_to_a_tarball_and_stage_two_reference_is_stage_one(tmp_path, monkeypatch):
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": q, "completion": a}) + "\n" for q, a in [
        ("How do I clear apt's cache?", "Run `sudo apt-get clean`."),
        ("What is 12 times 12?", "144."),
        ("Name the capital of France.", "Paris.")]))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "How do I find big files on Linux?"}\n{"prompt": "What is 7 plus 8?"}\n')
    plan = write(tmp_path, f"""\
name: e2e
model: {MODEL}
train: {{max_length: 128, lora_r: 4, lora_alpha: 8, eval_fraction: 0, probes: "", save_steps: 50}}
stages:
  - kind: spin
    data: {sft}
    pairs: {{max_new_tokens: 12}}
    train: {{max_steps: 3, learning_rate: 5.0e-3, per_device_train_batch_size: 3}}
  - kind: self_reward
    data: {prompts}
    pairs: {{candidates: 2, max_new_tokens: 12, min_margin: 0}}
    train: {{max_steps: 1, per_device_train_batch_size: 8}}
""")
    monkeypatch.chdir(ROOT)
    out = tmp_path / "art"
    assert iterate.main([plan, "--output_dir", str(out)]) == 0
    summary = json.loads((out / "e2e.lineage.json").read_text())
    s1, s2 = (out / s["run_name"] for s in summary["stages"])
    tarball = Path(summary["tarball"])
    assert tarball == out / f"{s2.name}.tar.gz"
    manifest = runs.verify_tarball(tarball)  # the handoff checks out and carries the lineage
    assert "lineage.json" in manifest["files"] and manifest["init_adapter"]["run_name"] == s1.name
    lineage = json.loads((s2 / "lineage.json").read_text())
    assert [(x["kind"], x["parent"]) for x in lineage] == [("spin", None), ("self_reward", s1.name)]
    assert lineage[1]["pairs_report"]["judge_mode"] == "probs" and lineage[0]["pairs_report"]["pairs_written"] >= 1

    # Stage 2's reference is stage 1's tuned model: TRL logs the policy's log-prob and beta * (policy -
    # reference); the policy starts at the reference, so the rewards are 0 and the reference log-prob is
    # the logged one. It must equal stage 1's tuned model's, and differ from the base's.
    first = json.loads((s2 / "metrics.jsonl").read_text().splitlines()[0])
    assert first["rewards/chosen"] == pytest.approx(0, abs=1e-4)
    from dpokit.data import formats

    pairs, _ = formats.load_pairs(lineage[1]["pairs"])
    model, tok = models.load_run(s1, json.loads((s1 / "config.json").read_text()))
    toks = [evaluate.tokenize_pair(tok, r, 128) for r in pairs]

    def mean_chosen():
        rows = evaluate.completion_logps(model, [t[0] for t in toks], [t[1] for t in toks], tok.pad_token_id)
        return sum(lp for lp, _ in rows) / len(rows)

    tuned = mean_chosen()
    with model.disable_adapter():
        base = mean_chosen()
    assert abs(tuned - base) > 0.5  # stage 1 moved the model, so the check below can tell them apart
    assert first["logps/chosen"] - first["rewards/chosen"] / 0.1 == pytest.approx(tuned, abs=0.05)

    handoff = out / "e2e.tar.gz"  # the last stage's tarball under the plan's name, with its own checksum
    assert Path(summary["handoff"]) == handoff and runs.verify_tarball(handoff)["run_name"] == s2.name
    assert (out / "e2e.tar.gz.sha256").read_text() == f"{summary['tarball_sha256']}  e2e.tar.gz\n"
    assert runs.open_run(out / "e2e", tmp_path)[0] == s2  # `make eval RUN=e2e`: the plan's name is its last run

    # The same plan again: both stages are complete and skipped.
    mtime = tarball.stat().st_mtime
    assert iterate.main([plan, "--output_dir", str(out)]) == 0
    assert tarball.stat().st_mtime == mtime


def test_trainable_adapter_starts_at_the_reference_or_at_the_checkpoint(tmp_path):
    """sync_trainable_adapter_ on a toy PEFT model with TRL's layout: 'default' trained, 'ref' frozen."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    torch.manual_seed(0)
    toy = torch.nn.Sequential(torch.nn.Linear(4, 4))
    config = LoraConfig(r=2, target_modules=["0"], init_lora_weights=False)
    model = get_peft_model(toy, config)
    model.add_adapter("ref", config)  # what DPOTrainer does for a PeftModel given without peft_config
    params = dict(model.named_parameters())
    ref_a, default_a = params["base_model.model.0.lora_A.ref.weight"], params["base_model.model.0.lora_A.default.weight"]
    default_a.data = default_a.data.bfloat16().float() + 0.01  # rounded and off, as after TRL's bfloat16 cast
    assert not torch.equal(default_a, ref_a)
    models.sync_trainable_adapter_(model, "")  # fresh start: exactly the reference
    assert torch.equal(default_a, ref_a) and default_a.data_ptr() != ref_a.data_ptr()
    # Resume: the trained adapter comes from the checkpoint root (what PEFT saves for 'default').
    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    saved = {"base_model.model.0.lora_A.weight": torch.full((2, 4), 0.5),
             "base_model.model.0.lora_B.weight": torch.full((4, 2), -0.5)}
    save_file(saved, ckpt / "adapter_model.safetensors")
    models.sync_trainable_adapter_(model, str(ckpt))
    assert torch.equal(default_a, torch.full((2, 4), 0.5)) and not torch.equal(ref_a, default_a)


@pytest.mark.integration
@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="bundled model not converted (make model)")
def test_an_attempts_stage_writes_the_models_scored_attempts_as_run_logs_and_trains_on_their_pairs(tmp_path,
                                                                                                     monkeypatch):
    from dpokit.pairs import attempts
    from dpokit.data import formats

    logs = tmp_path / "runs.jsonl"
    lines = (ROOT / "data" / "runs.jsonl").read_text().splitlines()
    logs.write_text("\n".join(lines[:6]) + "\n")
    plan = write(tmp_path, f"""\
name: rounds
model: {MODEL}
train: {{max_length: 128, lora_r: 4, lora_alpha: 8, probes: "", save_steps: 50, eval_samples: 1,
         eval_max_new_tokens: 8}}
stages:
  - kind: dpo
    data: not-here.pairs.jsonl
  - kind: attempts
    data: not-here.jsonl
    pairs: {{samples: 2, max_new_tokens: 12}}
""")
    monkeypatch.chdir(ROOT)
    out = tmp_path / "art"
    # the plan's data is not there: --logs puts the logs' pairs and the logs themselves in its place
    assert iterate.main([plan, "--output_dir", str(out), "--logs", str(logs), "--name", "mine", "--seed", "3",
                         "--", "--max_steps", "1"]) == 0
    summary = json.loads((out / "mine.lineage.json").read_text())
    first, stage = summary["stages"]
    assert summary["overrides"] == {"logs": str(logs), "extra_runs": None, "seed": 3, "name": "mine",
                                    "train": {"max_steps": 1}}
    assert first["data"] == str(out / "mine" / "runs.pairs.jsonl") and stage["data"] == str(logs)
    assert stage["parent"] == first["run_name"] and runs.verify_tarball(out / "mine.tar.gz")
    report = stage["pairs_report"]
    tried = out / "mine" / f"{stage['run_name']}.attempts.jsonl"
    records = [json.loads(x) for x in tried.read_text().splitlines()]
    wanted = attempts.training_runs(runlogs.read_runs(str(logs)), 0.2)
    assert [r["run_id"] for r in records] == [r.run_id for r in wanted]  # held-out runs are never attempted
    assert not any(formats.held_out({formats.RUN_KEY: r["run_id"]}, 0.2) for r in records)
    assert sum(report["outcomes"].values()) == report["attempts"] == 2 * len(wanted)
    assert report["seconds"] > 0  # the round's sampling and checking, counted in make compare's minutes
    assert all(r["round"] == 1 and r["model"] == str(out / first["run_name"]) for r in records)  # stage 1's
    final = json.loads((out / stage["run_name"] / "evaluation.json").read_text())
    assert final["execution"]["samples"] == 1  # the last stage is scored on the logs' held-out prompts
    assert list(runlogs.read_runs(str(tried)))  # build_pairs.py reads them back
    assert report["logs_used"] == [str(logs), str(tried)] and report["pairs_written"] >= 1


def test_a_grpo_stage_takes_the_logs_leaves_the_plans_dpo_recipe_and_scores_its_own_held_out_runs(tmp_path):
    """Supervised first, then RL: a `grpo` stage trains train_dpo.py --method grpo from the last stage's adapter on
    run logs (configs/sft-grpo.yaml: the bundled model's recipe, then GRPO). The plan-wide DPO recipe (loss_type:
    sft, mix, distinct_chosen) is not passed to it, a stage's own options are (and GRPO then refuses them); --logs
    gives it the logs; its report scores the logs' own held-out runs, so no --eval_prompts is put on it."""
    from dpokit.train import methods
    import yaml

    data = write(tmp_path, "{}\n", "d.jsonl")
    plan, lines = iterate.load_plan(write(tmp_path, f"""\
name: g
train: {{loss_type: sft, mix: "0.2", distinct_chosen: true, learning_rate: 2.0e-3, num_train_epochs: 3}}
stages:
  - kind: dpo
    data: {data}
  - kind: grpo
    data: {data}
    train: {{num_generations: 4, learning_rate: 2.0e-4, num_train_epochs: 1}}
"""))
    assert not iterate.plan_problems(plan, lines)
    dpo, grpo = iterate.chain(plan, lines, {data: "a" * 64})
    assert dpo.train == {"loss_type": "sft", "mix": "0.2", "distinct_chosen": True, "learning_rate": 2e-3,
                         "num_train_epochs": 3}
    assert grpo.train == {"learning_rate": 2e-4, "num_train_epochs": 1, "num_generations": 4}
    assert grpo.parent == dpo.run_name
    plan["stages"][1]["train"]["mix"] = "0.1"  # given by the stage itself: passed on, for GRPO to refuse
    assert iterate.chain(plan, lines, {data: "a" * 64})[1].train["mix"] == "0.1"
    got = iterate.overridden(plan, logs=("/logs.jsonl", "/w/runs.pairs.jsonl", "/w/runs.prompts.jsonl"))
    assert [st["data"] for st in got["stages"]] == ["/w/runs.pairs.jsonl", "/logs.jsonl"]
    assert [st["train"].get("eval_prompts") for st in got["stages"]] == [None, None]
    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    later, chained = {}, {}
    for name, kinds in (("sft-grpo.yaml", ["dpo", "grpo"]), ("rounds.yaml", ["dpo", "attempts"]),
                        ("rounds-grpo.yaml", ["dpo", "attempts", "grpo"])):
        bundled, lines = iterate.load_plan(str(ROOT / "configs" / name))  # the recipe first, as make train trains it
        assert not iterate.plan_problems(bundled, lines) and [st["kind"] for st in bundled["stages"]] == kinds
        chained[name] = iterate.chain(bundled, lines, {st["data"]: "a" * 64 for st in bundled["stages"]})
        first, later[name] = chained[name][0], chained[name][-1]
        assert all(first.train[k] == demo[k] for k in ("loss_type", "learning_rate", "mix", "num_train_epochs",
                                                       "distinct_chosen")), name
    rl = later["sft-grpo.yaml"]
    # `learning_rate: default` (and num_train_epochs): the config's own default, not the included recipe's
    assert not set(rl.train) & set(methods.DPO_ONLY) and not {"learning_rate", "num_train_epochs"} & set(rl.train)
    assert later["rounds.yaml"].train["learning_rate"] == 2e-4 and later["rounds.yaml"].train["eval_samples"] == 8
    # rounds-grpo.yaml: make train's round as configs/rounds.yaml trains it, then GRPO as sft-grpo.yaml's
    round_, then_rl = chained["rounds-grpo.yaml"][1], later["rounds-grpo.yaml"]
    assert all(round_.train[k] == later["rounds.yaml"].train[k] for k in ("learning_rate", "num_train_epochs",
                                                                          "broke_weight", "loss_type", "mix"))
    assert round_.pairs == chained["rounds.yaml"][1].pairs
    assert {k: v for k, v in then_rl.train.items() if k not in ("seed",)} == \
        {k: v for k, v in rl.train.items() if k not in ("seed",)}


@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="bundled model not converted (make model)")
def test_supervised_then_grpo_from_its_adapter_runs_to_a_tarball(tmp_path, monkeypatch):
    logs = tmp_path / "runs.jsonl"
    logs.write_text("\n".join((ROOT / "data" / "runs.jsonl").read_text().splitlines()[:8]) + "\n")
    plan = write(tmp_path, f"""\
name: rl
model: {MODEL}
train: {{max_length: 128, lora_r: 4, lora_alpha: 8, probes: "", save_steps: 50, eval_samples: 1,
         eval_max_new_tokens: 8, loss_type: sft, max_steps: 1}}
stages:
  - kind: dpo
    data: not-here.pairs.jsonl
  - kind: grpo
    data: not-here.jsonl
    train: {{num_generations: 2, max_completion_length: 8, per_device_train_batch_size: 1, reward: ran}}
""")
    monkeypatch.chdir(ROOT)
    out = tmp_path / "art"
    assert iterate.main([plan, "--output_dir", str(out), "--logs", str(logs)]) == 0
    summary = json.loads((out / "rl.lineage.json").read_text())
    first, rl = summary["stages"]
    assert rl["kind"] == "grpo" and rl["data"] == str(logs) and rl["parent"] == first["run_name"]
    manifest = runs.verify_tarball(out / "rl.tar.gz")
    assert manifest["method"] == "grpo" and manifest["init_adapter"]["run_name"] == first["run_name"]
    config = json.loads((out / rl["run_name"] / "config.json").read_text())
    assert config["loss_type"] == "sigmoid" and config["init_adapter"] == str(out / first["run_name"])
    assert json.loads((out / rl["run_name"] / "evaluation.json").read_text())["execution"]["samples"] == 1


def test_the_logs_pairs_take_extra_run_files_after_them_and_extra_runs_needs_logs(tmp_path):
    """make train ROUNDS=1 builds stage 1's pairs as make train does: the logs, then the bundled attempts."""
    logs, attempts = str(ROOT / "data" / "runs.jsonl"), str(ROOT / "data" / "attempts.jsonl")
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    alone = iterate.logs_data(logs, tmp_path / "a")
    both = iterate.logs_data(logs, tmp_path / "b", attempts)
    report = json.loads((tmp_path / "b" / "runs.pairs.report.json").read_text())
    assert report["extra_runs"] == [attempts]
    count = lambda f: len(Path(f).read_text().splitlines())  # noqa: E731
    assert count(both[1]) > count(alone[1]) and count(both[2]) == count(alone[2])  # more pairs, the same prompts
    with pytest.raises(kit.UserError, match="--extra_runs goes with --logs"):
        kit.config_from(iterate.IterateConfig, {"extra_runs": "a.jsonl"}, "test")


def test_a_late_stage_that_refuses_an_option_given_for_every_stage_stops_the_plan_before_the_first_trains(tmp_path):
    """`make train ROUNDS=1 ARGS="--mix 0.3"` on a plan ending in GRPO: the option reaches every stage, and GRPO
    refuses it. That is said at the start, with the stage's line, not after the earlier stages have trained."""
    data = write(tmp_path, "{}\n", "d.jsonl")
    plan = write(tmp_path, f"""\
name: late
stages:
  - kind: dpo
    data: {data}
  - kind: grpo
    data: {data}
""")
    out = tmp_path / "art"
    cfg = kit.config_from(iterate.IterateConfig, {"plan": plan, "output_dir": str(out)}, "test")
    with pytest.raises(kit.UserError, match="--mix is for DPO; --method grpo does not take it") as e:
        iterate.run_plan(cfg, {"mix": "0.3"})
    assert str(e.value).startswith(f"{plan}:5: ")  # the grpo stage's line
    assert not [p for p in out.rglob("*") if p.is_dir() and p.name.startswith("late-")]  # no stage started


def test_an_attempts_stage_reads_its_logs_the_extra_runs_every_earlier_rounds_attempts_then_its_own(tmp_path):
    data = write(tmp_path, "{}\n", "d.jsonl")
    plan, lines = iterate.load_plan(write(tmp_path, f"""\
name: r
stages:
  - kind: dpo
    data: {data}
  - kind: attempts
    data: {data}
  - kind: attempts
    data: {data}
"""))
    first, a1, a2 = iterate.chain(plan, lines, {data: "a" * 64})
    folder = tmp_path / "r"
    got = iterate.attempt_logs(a2, [first, a1], folder, " x.jsonl, y.jsonl,")
    assert got == [Path(data), Path("x.jsonl"), Path("y.jsonl"), folder / f"{a1.run_name}.attempts.jsonl",
                   folder / f"{a2.run_name}.attempts.jsonl"]
    assert iterate.attempt_logs(a1, [first], folder) == [Path(data), folder / f"{a1.run_name}.attempts.jsonl"]
