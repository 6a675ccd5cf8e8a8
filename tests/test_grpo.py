"""GRPO (--method grpo): the reward functions on real code run by the checker, the option checks and TRL mapping,
the prompts GRPO reads, and a real 4-bit run on the bundled model that stops, resumes and hands off."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dpokit.core import kit
from dpokit.train import methods, trainers
from dpokit.scoring import rewards
from dpokit.core import runs
from dpokit.train import training
from dpokit.core.kit import UserError

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
needs_model = pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="bundled model not converted (make model)")
HOST = "Host ci-runner-03, Ubuntu 22.04.4 LTS, Python 3.10.12, user ci (no sudo, member of docker)."
FREES = "```python\nimport shutil, os\nshutil.rmtree(os.path.expanduser('~/.cache/pip'), ignore_errors=True)\nprint(1)\n```"
RUNS_NOTHING = "```python\nprint('nothing to do')\n```"
PROSE = "Sure! To free space you could remove the pip cache."
DELETES_DATA = "```python\nimport shutil, os\nshutil.rmtree(os.path.expanduser('~'), ignore_errors=True)\n```"


# ------------------------------------------------------------------ rewards, no model


def test_checker_and_ran_rewards_score_real_code_run_once_per_answer():
    checked = rewards.Checked()
    score, ran = rewards.checker_rewards(checked)
    completions = [[{"role": "assistant", "content": c}] for c in (FREES, RUNS_NOTHING, PROSE, DELETES_DATA)]
    prompts = [[{"role": "user", "content": "Remove pip's download cache"}]] * 4
    logged = {}
    got = score(prompts, completions, host=[HOST] * 4, log_metric=lambda k, v: logged.setdefault(k, v))
    assert got[0] > 0 and got[1] == 0 and got[2] == 0 and got[3] == -1  # freed, no_effect, failed, broke
    assert logged == {"pass_rate": 0.25, "ran_rate": 0.5, "broke_rate": 0.25, "unscorable_rate": 0.0}
    assert ran(prompts, completions, host=[HOST] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert len(checked.cache) == 4  # ran reused the checker's runs: each answer ran once


def test_in_limits_mode_an_answer_at_the_hosts_paths_gets_no_reward_rather_than_a_zero(monkeypatch, capsys):
    """None from every reward function: TRL 1.14 leaves such an answer out of its group's baseline, advantage 0."""
    from dpokit.sandbox import sandbox

    if sandbox.why_not("limits"):
        pytest.skip("limits mode does not run here")
    monkeypatch.setenv(sandbox.ENV, "limits")
    score, ran = rewards.checker_rewards(rewards.Checked())
    wipes = "```python\nimport shutil\nshutil.rmtree('/home/ci/projects', ignore_errors=True)\n```"
    completions = [[{"role": "assistant", "content": c}] for c in (FREES, wipes)]
    prompts = [[{"role": "user", "content": "Free space"}]] * 2
    logged = {}
    got = score(prompts, completions, host=[HOST] * 2, log_metric=lambda k, v: logged.setdefault(k, v))
    assert got[0] > 0 and got[1] is None and ran(prompts, completions, host=[HOST] * 2) == [1.0, None]
    assert logged["unscorable_rate"] == 0.5 and logged["pass_rate"] == 1.0  # of the answers that could be scored
    assert "1 of 2 answers could not be scored in limits mode" in capsys.readouterr().out


def test_the_reward_cache_never_loses_a_steps_results_past_its_size(monkeypatch):
    """64 answers a step, each new: past CACHE_SIZE distinct answers the cache is emptied, and the step that crosses
    it still gets all 64 of its own results (it once raised KeyError there). The checker is stubbed: what is tested
    is the bookkeeping, at the scale of thousands of answers."""
    from dpokit.scoring import checker

    monkeypatch.setattr(checker, "check", lambda code, host, limits=None: checker.Check(
        "freed", len(code) / 1000, 1, [], "", "stub", ""))
    checked = rewards.Checked(workers=2)
    score, _ = rewards.checker_rewards(checked)
    for step in range(rewards.CACHE_SIZE // 64 + 3):
        completions = [f"```python\nprint({step * 64 + i})\n```" for i in range(64)]
        got = score([[{"role": "user", "content": "x"}]] * 64, completions, host=[HOST] * 64)
        assert got == [len(checker.code_of(c)) / 1000 for c in completions]
        assert len(checked.cache) <= rewards.CACHE_SIZE


def test_a_python_grader_that_prints_a_lot_keeps_its_score_and_a_nan_or_an_error_is_no_score_and_says_why():
    from dpokit.scoring import graders

    hi = graders.sample_of("hi")
    chatty = "def grade(sample, item):\n    print('x' * (1 << 20))\n    return 0.75\n"
    assert graders.python_run(chatty, hi, {}) == (0.75, None)
    value, why = graders.python_run("def grade(sample, item):\n    return float('nan')\n", hi, {})
    assert value is None and "not a finite number" in why
    value, why = graders.python_run("def grade(sample, item):\n    raise ValueError('no answer here')\n", hi, {})
    assert value is None and "ValueError: no answer here" in why


def test_reward_specs_are_checked_before_anything_loads(tmp_path):
    assert rewards.problems("checker,ran", "", "") == []
    assert rewards.default_weights("checker,ran") == [1.0, rewards.RAN_WEIGHT]
    assert rewards.default_weights("checker", "python g.py") == [1.0, 1.0]
    assert "expected checker, ran or MODULE:FUNCTION" in " ".join(rewards.problems("speed", "", ""))
    assert "ModuleNotFoundError" in " ".join(rewards.problems("no_such_module:f", "", ""))
    assert "no such file" in " ".join(rewards.problems(f"{tmp_path}/missing.py:f", "", ""))
    assert "gives 1 weights for 2 reward functions" in " ".join(rewards.problems("checker,ran", "", "1"))
    assert "expected numbers" in " ".join(rewards.problems("checker", "", "one"))
    assert "names no reward function" in " ".join(rewards.problems("", "", ""))
    grader = tmp_path / "grader.py"
    grader.write_text("def length(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n")
    assert rewards.problems(f"{grader}:length", "", "") == []
    fn = rewards.reward_functions(f"checker,{grader}:length")[1]
    assert fn(prompts=["p", "p"], completions=["ab", "abcd"]) == [2.0, 4.0]


def test_a_reward_command_reads_the_completion_and_its_number_is_the_reward(tmp_path):
    script = tmp_path / "grade.py"
    script.write_text("import os, sys\ntext = sys.stdin.read()\nprint(len(text) + (100 if os.environ['KIT_HOST'] else 0))\n")
    fn = rewards.command_reward(f"{sys.executable} {script}")
    assert fn(prompts=["p", "q"], completions=["abc", "de"], host=["h", ""]) == [103.0, 2.0]
    bad = tmp_path / "bad.py"
    bad.write_text("print('no number here')\n")
    with pytest.raises(UserError, match="printed no number"):
        rewards.command_reward(f"{sys.executable} {bad}")(prompts=["p"], completions=["x"])


# ------------------------------------------------------------------ options, data, TRL mapping


@pytest.mark.parametrize("skip", [True, False])
def test_a_batch_whose_groups_all_scored_alike_is_logged_without_signal_and_skipped_with_skip_alike(skip):
    """compute_loss of the kit's GRPOTrainer on a batch with zero advantages everywhere: kit/signal 0, and with
    skip_alike a zero loss whose backward leaves the trainable weights' gradients at zero (no forward of the policy,
    so no TRL input is read but the advantages). Without it, TRL's own loss runs (here: on a batch it cannot read)."""
    import collections

    import torch

    cls = trainers.grpo_trainer_class()
    trainer = object.__new__(cls)
    trainer._metrics = {"train": collections.defaultdict(list)}
    trainer.kit_skip_alike = skip
    trainer.accelerator = type("Accelerator", (), {"num_processes": 1})()
    model = torch.nn.Linear(3, 2)
    model.train()
    alike = {"advantages": torch.tensor([1e-9, -1e-9, 0.0, 0.0])}  # rounding, not a signal
    if skip:
        loss = trainer.compute_loss(model, alike)
        loss.backward()
        assert loss.item() == 0.0 and all(p.grad is not None and not p.grad.any() for p in model.parameters())
    else:
        with pytest.raises(AttributeError):  # TRL's loss reads what this bare trainer lacks
            trainer.compute_loss(model, alike)
    assert trainer._metrics["train"]["kit/signal"] == [0.0]
    with pytest.raises(AttributeError):  # a batch with a signal goes to TRL's loss whatever skip_alike says
        trainer.compute_loss(model, {"advantages": torch.tensor([0.5, -0.5, 0.0, 0.0])})
    assert trainer._metrics["train"]["kit/signal"] == [0.0, 1.0]


def test_grpo_options_map_onto_trl_with_whole_groups_per_step():
    cfg = training.TrainConfig(data="x", method="grpo", per_device_train_batch_size=3, num_generations=4,
                                max_completion_length=64, temperature=0.7)
    kwargs = methods.grpo_config_kwargs(cfg, "/tmp/ck", False, False)
    assert kwargs["per_device_train_batch_size"] == 12 and kwargs["num_generations"] == 4  # TRL counts answers
    assert kwargs["reward_weights"] == [1.0, rewards.RAN_WEIGHT] and kwargs["beta"] == cfg.beta
    assert "max_length" not in kwargs and "precompute_ref_log_probs" not in kwargs
    from trl import GRPOConfig

    args = GRPOConfig(**kwargs)  # every key exists in TRL, and TRL's own checks pass (generation batch / group)
    assert args.generation_batch_size == 12 and args.temperature == 0.7 and args.max_completion_length == 64


def test_grpo_problems_are_reported_together():
    cfg = training.TrainConfig(data="x", method="grpo", num_generations=1, mix="0.2", reward="speed")
    problems = " ".join(cfg.problems())
    assert "--num_generations must be at least 2" in problems and "--mix is for DPO" in problems
    assert "--reward 'speed'" in problems
    assert "precompute" not in problems  # the default (DPO and KTO's reference once); GRPO's is online


def test_grpo_reads_run_logs_or_a_prompts_file_and_holds_out_by_run(tmp_path):
    rows, fmt = methods.load_prompts(str(ROOT / "data" / "runs.jsonl"))
    assert fmt == "run_logs" and len(rows) == 57 and all("Host " in r["host"] for r in rows)
    assert methods.holds_prompts(methods.first_record(str(ROOT / "data" / "runs.jsonl")))
    assert not methods.holds_prompts({"prompt": "q", "chosen": "a", "rejected": "b"})
    assert methods.holds_prompts({"prompt": "q", "host": "h"})
    data = training.formats.TrainingData(path="x", sha256="", format="", pairs=0, skipped={})
    cfg = training.TrainConfig(data=str(ROOT / "data" / "runs.jsonl"), method="grpo")
    train, held = methods.grpo_data(cfg, data)
    assert data.held_out == len(held) == 8 and len(train) == 49 and data.format == "run_logs"
    held_runs = {r["_run"] for r in held}
    assert not held_runs & {r["_run"] for r in train}  # a run's prompt is on one side only, as its pairs are
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "q", "host": "h"}\n{"prompt": 3, "host": "h"}\n')
    with pytest.raises(UserError) as e:
        methods.load_prompts(str(bad))
    assert str(e.value).startswith(f"{bad}:2:")


# ------------------------------------------------------------------ a real run


def tiny_prompts(path: Path) -> Path:
    """Six prompts, each a strategy and its host (two held out by their run ids at the default eval_fraction 0.2)."""
    logs = [json.loads(x) for x in (ROOT / "data" / "runs.jsonl").read_text().splitlines()]
    rows, _ = methods.load_prompts(str(ROOT / "data" / "runs.jsonl"))
    rows = [r for r in rows if r["run_id"] in {"run-0101", "run-0102", "run-0103", "run-0104", "run-0105", "run-0106"}]
    assert len(rows) == 6 and logs
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@needs_model
@pytest.mark.integration
def test_grpo_in_4bit_stops_on_sigterm_resumes_and_hands_off_a_tarball_that_verifies(tmp_path):
    from test_train_dpo import check_complete_run, stopped_after_a_step

    data = tiny_prompts(tmp_path / "prompts.jsonl")
    grader = tmp_path / "grader.py"  # a reward that varies within every group, so each step moves the adapter
    grader.write_text("def shorter(prompts, completions, **kwargs):\n"
                      "    return [-len(c[-1]['content']) / 100 for c in completions]\n")

    def command(name):
        return [sys.executable, str(ROOT / "train_dpo.py"), "--method", "grpo", "--data", data,
                "--output_dir", tmp_path / "art", "--run_name", name, "--max_steps", 3, "--save_steps", 100,
                "--num_generations", 2, "--max_completion_length", 16, "--per_device_train_batch_size", 1,
                "--reward", f"checker,ran,{grader}:shorter", "--lora_r", 4, "--learning_rate", 5e-3,
                "--eval_samples", 1, "--eval_max_new_tokens", 16, "--probes", ""]

    args = command("g")
    log = stopped_after_a_step(args, tmp_path / "art" / "g.partial")
    assert "prompts, GRPO (2 answers each" in log and "of which 4-bit" in log and "reward " in log
    status = json.loads((tmp_path / "art" / "g.partial" / "status.json").read_text())
    assert status["state"] == "cancelled" and 1 <= status["step"] < 3

    out = subprocess.run(list(map(str, args)), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"checkpoint-{status['step']}" in out.stdout
    run_dir = tmp_path / "art" / "g"
    check_complete_run(run_dir, steps=3)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"reward"' in x]
    assert len(rows) == 3 and all("pass_rate" in r and r["time/generation"] > 0 for r in rows)
    assert any(r["reward_std"] > 0 for r in rows)  # the length reward differs within a group
    assert all(r["kit/signal"] == 1.0 for r in rows)  # so every step had a signal, and none was skipped
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    execution = evaluation["execution"]
    assert execution["prompts"] == 2 and execution["samples"] == 1 and set(execution["base"]["outcomes"]) <= {
        "failed", "no_effect", "freed", "broke"}
    report = (run_dir / "report.md").read_text()
    assert "Reward per step (GRPO)" in report and "Answers run by the checker" in report
    assert "**3 of 3 steps had a signal.**" in report
    assert (run_dir / "execution.png").exists() and (run_dir / "reward.png").exists()
    assert "LoRA GRPO adapter" in (run_dir / "README.md").read_text()
    manifest = runs.verify_tarball(run_dir.with_name("g.tar.gz"))
    assert manifest["method"] == "grpo" and manifest["execution"]["base"]["pass_rate"] == execution["base"]["pass_rate"]
    assert "4 GRPO prompts" in runs.describe_run(manifest) and "checker:" in runs.describe_run(manifest)
    line = next(x for x in runs.runs_table(tmp_path / "art").splitlines() if x.startswith("g "))
    assert " grpo " in line and f"{execution['base']['mean_score']:+.3f} -> " in line
    data_json = json.loads((run_dir / "data.json").read_text())
    assert data_json["method"] == "grpo" and data_json["held_out"] == 2 and data_json["pairs_trained"] == 4
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(MODEL), run_dir)  # the adapter loads in PEFT
    from dpokit.train import evaluate  # make eval: the run's held-out prompts scored again by the checker

    again = json.loads((evaluate.evaluate_run(str(run_dir), "", str(tmp_path / "re")) / "evaluation.json").read_text())
    assert again["execution"]["prompts"] == 2 and again["execution"]["samples"] == 1
    # make eval RUN=g DATA=<run logs it never saw>: every run's prompt, on its own host, base against tuned
    first = json.loads((ROOT / "data" / "runs.jsonl").read_text().splitlines()[0])
    unseen = [("Host build-07, Debian 12, Python 3.11.2, user jenkins (no sudo).", "Delete Gradle's caches"),
              ("Host db-01, Rocky Linux 9.3, Python 3.9.18, user root.", "Vacuum the journal to 200M"),
              ("Host dev-laptop, Fedora 39, Python 3.12.1, user alice (sudo).", "Clear npm's cache")]
    logs = tmp_path / "unseen.jsonl"
    logs.write_text("".join(json.dumps({
        "run_id": f"unseen-{i}", "strategy": strategy, "attempts": [{"code": "print(0)", "ran": True}],
        "prompt": [first["prompt"][0], {"role": "user", "content": host + "\n$ df -h /"}, *first["prompt"][2:]]}) + "\n"
        for i, (host, strategy) in enumerate(unseen)))
    other = json.loads((evaluate.evaluate_run(str(run_dir), str(logs), str(tmp_path / "unseen")) /
                        "evaluation.json").read_text())["execution"]
    assert other["prompts"] == 3 and sorted((r["model"], r["prompt"]) for r in other["rows"]) == sorted(
        (m, s) for m in ("base", "tuned") for _, s in unseen)
    assert "evaluated on all 3 prompts of" in (tmp_path / "unseen" / "report.md").read_text()
    # Stopped and resumed, it trained what the same command trains uninterrupted (sampling's RNG is checkpointed)
    whole = subprocess.run(list(map(str, command("whole"))), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert kit.sha256_file(run_dir / "adapter_model.safetensors") == kit.sha256_file(
        tmp_path / "art" / "whole" / "adapter_model.safetensors")


def test_reinforcement_rows_become_prompt_rows_with_their_item_and_a_bad_line_is_a_file_line_error(tmp_path):
    from dpokit.service import jobs

    rft = tmp_path / "rft.jsonl"
    rft.write_text('{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}\n\n'
                   '{"prompt": "Clear pip", "host": "Host h"}\n')
    rows, lines = jobs.rft_rows(str(rft))
    assert rows == [{"prompt": [{"role": "user", "content": "2+2?"}], "host": "", "item": {"answer": "4"}},
                    {"prompt": "Clear pip", "host": "Host h", "item": {}}] and lines == [1, 3]
    rft.write_bytes(b'{"messages": [{"role": "user", "content": "x"}], "a": 1}\n' + b"{" * 100000 + b"\n")
    with pytest.raises(UserError, match="malformed JSON") as e:
        jobs.rft_rows(str(rft))
    assert (e.value.path, e.value.line) == (str(rft), 2)
    for messages in ("[]", '"2+2?"'):  # OpenAI's rows hold a list of messages
        rft.write_text('{"prompt": "Clear pip"}\n{"messages": %s, "answer": "4"}\n' % messages)
        with pytest.raises(UserError, match="messages must be a non-empty list") as e:
            jobs.rft_rows(str(rft))
        assert (e.value.path, e.value.line) == (str(rft), 2)


def test_a_step_whose_answers_all_went_unscored_leaves_a_gap_in_the_reward_plot(tmp_path):
    """A grader that failed on every answer of a step (a judge whose replies did not parse) logs its reward as
    null: the report's plot skips that step instead of failing the finished run."""
    from dpokit.train import evaluate

    metrics = [{"step": 1, "loss": 0.1, "reward": None, "reward_std": None},
               {"step": 2, "loss": 0.2, "reward": 0.5, "reward_std": 0.1}]
    assert evaluate.plot_metrics(metrics, tmp_path) == ["loss.png", "reward.png"]
    assert (tmp_path / "reward.png").stat().st_size > 0
