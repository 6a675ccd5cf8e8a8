"""scaleout.py: the accelerate launch command, effective batch, failure status and the accelerate configs on
worked examples; then two real CPU processes (gloo) on a tiny Llama against one process with the same global batch,
and a rank killed mid-run that status.json names before the same command resumes.

    .venv/bin/python -m pytest -q tests/test_scaleout.py [-m "not integration"]
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dpokit.core import ranks
from dpokit.core import runs
from dpokit.apps import scaleout
from dpokit.core import kit
from dpokit.apps.scaleout import DistConfig

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "models" / "SmolLM2-135M-Instruct"


# ------------------------------------------------------------------ pure helpers, no model

def test_accelerate_command_for_one_machine_with_four_gpus():
    cmd = scaleout.accelerate_command(DistConfig(gpus="4"), "train_dpo.py", ["--data", "p.jsonl"])
    assert cmd == ["accelerate", "launch", "--num_processes", "4", "--num_machines", "1", "--main_process_port",
                   "29500", "--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "train_dpo.py", "--data", "p.jsonl"]


def test_accelerate_command_for_the_second_of_two_machines_counts_processes_over_both():
    cfg = DistConfig(nproc=8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29501)
    cmd = scaleout.accelerate_command(cfg, "/opt/kit/train_dpo.py", [])
    assert cmd[:12] == ["accelerate", "launch", "--num_processes", "16", "--num_machines", "2", "--machine_rank",
                        "1", "--main_process_ip", "10.0.0.1", "--main_process_port", "29501"]
    assert "--multi_gpu" in cmd and cmd[-1] == "/opt/kit/train_dpo.py"


def test_accelerate_command_with_gpu_ids_and_with_a_sharding_config():
    ids = scaleout.accelerate_command(DistConfig(gpus="0, 3"), "t.py", [])
    assert ids[ids.index("--num_processes") + 1] == "2" and ids[ids.index("--gpu_ids") + 1] == "0,3"
    zero2 = scaleout.accelerate_command(DistConfig(nproc=4, dist="zero2"), "t.py", [], configs_dir="/k/configs")
    assert zero2[zero2.index("--config_file") + 1] == "/k/configs/zero2.yaml" and "--multi_gpu" not in zero2
    # a single process with DIST=zero3 still goes through accelerate (DeepSpeed's engine); plain ddp does not
    assert scaleout.is_distributed(DistConfig(dist="zero3")) and not scaleout.is_distributed(DistConfig())


def test_processes_per_node_from_nproc_or_gpus():
    assert scaleout.processes_per_node(None, "") == 1
    assert scaleout.processes_per_node(None, "all") == 1  # GPUS=all: every GPU visible, one process (as before)
    assert scaleout.processes_per_node(None, "4") == 4
    assert scaleout.processes_per_node(None, "1,2,5") == 3
    assert scaleout.processes_per_node(2, "all") == 2  # NPROC wins


def test_effective_batch_makes_one_gpu_and_four_equivalent():
    assert ranks.effective_batch_size(2, 4, 2) == 16
    assert ranks.effective_batch_size(8, 1, 2) == ranks.effective_batch_size(2, 4, 2)


def test_world_from_torchrun_variables():
    assert ranks.world_from_env({}) == {"rank": 0, "local_rank": 0, "world_size": 1, "nodes": 1}
    env = {"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert ranks.world_from_env(env) == {"rank": 9, "local_rank": 1, "world_size": 16, "nodes": 2}


def test_failure_status_names_the_first_failing_rank():
    records = [{"rank": 0, "error": "RuntimeError: gloo: Connection reset by peer", "at": 20.0},
               {"rank": 3, "error": "torch.OutOfMemoryError: CUDA out of memory", "at": 10.0}]
    # the launcher saw rank 3 fail first: its own words are the error; rank 0 only lost its peer
    got = scaleout.failure_status(records, {"rank": 3, "exitcode": 1}, 1)
    assert got == {"rank": 3, "error": "torch.OutOfMemoryError: CUDA out of memory", "failed_ranks": [0, 3],
                   "exit_code": 1}
    # killed before it could write anything: the launcher's exit code says how
    killed = scaleout.failure_status(records[:1], {"rank": 1, "exitcode": -9}, 137)
    assert killed["rank"] == 1 and "SIGKILL" in killed["error"] and killed["failed_ranks"] == [0, 1]
    # no launcher information (e.g. another machine's rank): the earliest record
    assert scaleout.failure_status(records, None, 1)["rank"] == 3
    assert scaleout.failure_status([], None, 1)["rank"] is None


def test_config_problems_are_reported_together():
    with pytest.raises(kit.UserError) as e:
        kit.parse_config(DistConfig, ["--nproc", "0", "--nnodes", "2", "--node_rank", "2", "--master_port", "0"], "")
    text = str(e.value)
    assert "--nproc (NPROC) must be at least 1 (got 0)" in text
    assert "--node_rank (NODE_RANK) must be in 0..1 for 2 machine(s) (got 2)" in text
    assert "--master_addr (MASTER_ADDR) is required" in text and "--master_port (MASTER_PORT)" in text
    assert "GPUS) 0: no GPUs" in str(pytest.raises(kit.UserError, kit.parse_config, DistConfig, ["--gpus", "0"], "").value)


@pytest.mark.parametrize("name", ["zero2", "zero3", "fsdp"])
def test_accelerate_accepts_every_key_of_the_dist_configs(name):
    """DeepSpeed and GPUs are not here: check that accelerate parses each file, knows every nested key as a
    launch option, and turns it into the launcher it would run (not run here)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    path = ROOT / scaleout.DIST_CONFIGS[name]
    load_config_from_file(str(path))  # raises on unknown top-level keys
    raw = yaml.safe_load(path.read_text())
    parser = launch_command_parser()
    known = {a.dest for a in parser._actions}
    nested = raw.get("deepspeed_config") or raw.get("fsdp_config")
    assert nested and set(nested) <= known, set(nested) - known
    args = parser.parse_args(scaleout.accelerate_command(DistConfig(nproc=4, dist=name), "t.py", [],
                                                            configs_dir=str(ROOT / "configs"))[2:])
    args, _, _ = _validate_launch_command(args)
    assert args.num_processes == 4
    if name == "fsdp":
        assert args.use_fsdp and args.fsdp_version == 2
    else:
        assert args.use_deepspeed and int(args.zero_stage) == int(name[-1])


def run_dist(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, str(ROOT / "scaleout.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout, env={**os.environ, **(env or {})})


def test_dry_run_prints_the_command_with_a_fixed_run_name_and_writes_nothing(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "2+2=", "chosen": " 4", "rejected": " 5"}\n')
    out = run_dist("--nproc", 2, "--dry_run", "--", "--data", data, "--output_dir", tmp_path / "a")
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("[launch] accelerate launch --num_processes 2 --num_machines 1 ")
    assert f"train_dpo.py --data {data} --output_dir {tmp_path}/a --run_name " in line  # every rank: one name
    single = run_dist("--gpus", "all", "--dry_run", "--", "--data", data, "--run_name", "x")  # GPUS=all: 1 process
    assert single.returncode == 0 and single.stdout == f"[launch] one process: python train_dpo.py --data {data} --run_name x\n"
    assert not (tmp_path / "a").exists()


def test_user_mistakes_are_one_error_before_any_process_starts(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b"}\n')
    out = run_dist("--nproc", 2, "--", "--data", bad, "--output_dir", tmp_path / "a")
    assert out.returncode == 2 and out.stderr.strip() == f"{bad}:1: missing field 'rejected'"
    out = run_dist("--nproc", 2, "--dist", "zero3", "--", "--data", bad)
    assert out.returncode == 2 and "DIST=zero3 shards full-precision weights" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "a").exists()


# ------------------------------------------------------------------ integration: real processes, tiny model

def free_port() -> int:
    with socket.socket() as s:  # other jobs share this machine: never assume 29500 is free
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Llama (hidden 64, 3.2M parameters, mostly the embeddings) with the bundled model's tokenizer and
    chat template, random weights from a fixed seed: real transformers/bitsandbytes/peft/TRL code, seconds per step."""
    if not (BUNDLED / "config.json").exists():
        pytest.skip("bundled model not converted (make model): its tokenizer is used")
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    dest = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    tok = AutoTokenizer.from_pretrained(BUNDLED)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def pairs_file(path: Path, copies: int = 1) -> Path:
    from test_train_dpo import pairs_in

    path.write_text("".join(json.dumps(r) + "\n" for r in pairs_in("trl_conversational") * copies))
    return path


def train_args(tiny, data, out, name, *extra):
    return ["--data", data, "--model_name_or_path", tiny, "--output_dir", out, "--run_name", name,
            "--max_length", 64, "--lora_r", 4, "--lora_alpha", 8, "--learning_rate", 5e-3, "--eval_fraction", 0,
            "--probes", "", *extra]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.integration
def test_two_cpu_processes_match_one_with_the_same_global_batch(tmp_path, tiny):
    """4 pairs; one step = the whole set: 1 process x 4 per device vs 2 processes (gloo) x 2 per device. The 4-bit
    kernels themselves (--no_dequantize_on_cpu) run under DDP: frozen NF4 weights, LoRA gradients all-reduced."""
    from safetensors.torch import load_file

    data = pairs_file(tmp_path / "p.jsonl")
    common = ["--max_steps", 3, "--no_dequantize_on_cpu"]
    commands = {  # side by side: the wall time is mostly imports
        "one": [str(ROOT / "train_dpo.py"), *train_args(tiny, data, tmp_path / "one", "r",
                                                         "--per_device_train_batch_size", 4, *common)],
        "two": [str(ROOT / "scaleout.py"), "--nproc", 2, "--master_port", free_port(), "--",
                *train_args(tiny, data, tmp_path / "two", "r", "--per_device_train_batch_size", 2, *common)]}
    procs = {k: subprocess.Popen([sys.executable, *map(str, v)], cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for k, v in commands.items()}
    outputs = {k: p.communicate(timeout=300) for k, p in procs.items()}  # reads both pipes: no full-pipe stall
    one, two = (subprocess.CompletedProcess(procs[k].args, procs[k].returncode, *outputs[k]) for k in ("one", "two"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "[batch] 4 pairs per optimiser step = 2 per device x 2 process(es) on 1 machine(s)" in two.stdout
    assert "[batch] 4 pairs per optimiser step = 4 per device x 1 process(es)" in one.stdout

    a, b = losses(tmp_path / "one" / "r"), losses(tmp_path / "two" / "r")
    assert len(a) == len(b) == 3 and a[-1] < a[0]  # it trained
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)
    wa, wb = (load_file(tmp_path / d / "r" / "adapter_model.safetensors") for d in ("one", "two"))
    assert wa.keys() == wb.keys() and max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4

    # one copy of everything, written by rank 0 alone: one run directory, one tarball, one status history
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["r", "r.tar.gz", "r.tar.gz.sha256"]
    status = json.loads((tmp_path / "two" / "r" / "status.json").read_text())
    assert [h["state"] for h in status["history"]] == ["pending", "running", "succeeded"]
    assert not (tmp_path / "two" / "r" / ranks.FAILURES_DIR).exists()
    manifest = json.loads((tmp_path / "two" / "r" / "manifest.json").read_text())
    assert manifest["distributed"] == {"processes": 2, "nodes": 1, "effective_batch_size": 4}
    assert manifest["files"] == runs.file_hashes(tmp_path / "two" / "r")
    assert "4 pairs per step (2 per device x 2 process(es)" in (tmp_path / "two" / "r" / "README.md").read_text()


def rank_pid(marker: str, rank: int) -> int | None:
    """The pid of the training process with this RANK among those started with `marker` in their environment."""
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"KIT_TEST_MARKER={marker}".encode() in env and f"RANK={rank}".encode() in env:
            return int(proc.name)
    return None


@pytest.mark.integration
def test_a_killed_rank_is_named_in_the_status_and_the_same_command_resumes(tmp_path, tiny):
    data = pairs_file(tmp_path / "p.jsonl", copies=3)  # 12 pairs, 1 per device x 2: 6 steps an epoch
    args = ["--nproc", 2, "--master_port", free_port(), "--",
            *train_args(tiny, data, tmp_path / "art", "k", "--per_device_train_batch_size", 1, "--max_steps", 16,
                        "--save_steps", 2)]
    marker = f"{os.getpid()}-{time.time()}"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scaleout.py"), *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "KIT_TEST_MARKER": marker})
    partial = tmp_path / "art" / "k.partial"
    deadline = time.time() + 240
    while not list(partial.glob("checkpoints/checkpoint-*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    pid = rank_pid(marker, 1)
    assert pid is not None, proc.communicate()[0][-3000:]
    os.kill(pid, signal.SIGKILL)  # what the OOM killer does: the rank cannot write a word
    log = proc.communicate(timeout=240)[0]
    assert proc.returncode == 128 + signal.SIGKILL, log[-3000:]
    status = json.loads((partial / "status.json").read_text())
    assert status["state"] == "failed" and status["rank"] == 1 and "SIGKILL" in status["error"], status
    assert "[launch] failed: rank 1:" in log and not (tmp_path / "art" / "k").exists()

    again = run_dist(*args, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming k from {partial}/checkpoints/checkpoint-" in again.stdout
    run_dir = tmp_path / "art" / "k"
    history = [h["state"] for h in json.loads((run_dir / "status.json").read_text())["history"]]
    assert history == ["pending", "running", "failed", "pending", "running", "succeeded"]
    assert [json.loads(r)["step"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(r)] == list(range(1, 17))
    assert sorted(p.name for p in (tmp_path / "art").iterdir()) == ["k", "k.tar.gz", "k.tar.gz.sha256"]
