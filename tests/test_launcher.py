"""launcher.py: the pure helpers (tag, labels, prune choice, run spec, docker command) on worked examples, then
a few tests against a real engine (DOCKER_HOST, e.g. podman's socket in CI), skipped when none answers.

    .venv/bin/python -m pytest -q tests/test_launcher.py
"""

import dataclasses
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dpokit.core import kit
from dpokit.apps import launcher
from dpokit.apps.launcher import LaunchConfig

ROOT = Path(__file__).resolve().parent.parent
PATHS = {"output": "/home/u/kit/artifacts", "hf": "/home/u/.cache/huggingface", "data": "/home/u/pairs.jsonl",
         "model": ""}


def test_compute_tag_follows_content_paths_and_build_args():
    files = {"requirements.txt": b"torch==2.13.0\n", "train_dpo.py": b"print(1)\n"}
    tag = launcher.compute_tag(files, {"TORCH_VARIANT": "cuda"})
    assert len(tag) == 12 and int(tag, 16) >= 0
    assert launcher.compute_tag(dict(reversed(files.items())), {"TORCH_VARIANT": "cuda"}) == tag  # order-free
    assert launcher.compute_tag({**files, "train_dpo.py": b"print(2)\n"}, {"TORCH_VARIANT": "cuda"}) != tag
    assert launcher.compute_tag({**files, "kit.py": b""}, {"TORCH_VARIANT": "cuda"}) != tag  # a new empty file
    assert launcher.compute_tag(files, {"TORCH_VARIANT": "cpu"}) != tag
    # content moving between files is a change too (lengths are hashed with the paths)
    assert launcher.compute_tag({"a": b"xy", "b": b""}, {}) != launcher.compute_tag({"a": b"x", "b": b"y"}, {})


def test_tag_for_uses_the_given_tag_or_the_repository_files():
    assert launcher.tag_for(LaunchConfig(tag="v1")) == "v1"
    cuda, cpu = launcher.tag_for(LaunchConfig()), launcher.tag_for(LaunchConfig(torch_variant="cpu"))
    assert cuda != cpu and launcher.tag_for(LaunchConfig()) == cuda


def test_labels_and_filter_name_the_kit():
    assert launcher.label_filter() == {"label": ["dpo-kit=1"]}
    labels = launcher.image_labels("abc123-dirty", "0123456789ab")
    assert labels["dpo-kit"] == "1" and labels["org.opencontainers.image.revision"] == "abc123-dirty"
    assert "org.opencontainers.image.revision" not in launcher.image_labels(None, "t")


def test_normalize_ref_drops_registry_prefixes():
    assert launcher.normalize_ref("localhost/dpo-kit:abc") == "dpo-kit:abc"
    assert launcher.normalize_ref("docker.io/library/dpo-kit:abc") == "dpo-kit:abc"
    assert launcher.normalize_ref("ghcr.io/me/dpo-kit:abc") == "ghcr.io/me/dpo-kit:abc"


def test_superseded_keeps_current_foreign_and_retagged_images():
    images = {
        "sha256:old": ["localhost/dpo-kit:111111111111"],        # an older kit build: goes
        "sha256:cur": ["localhost/dpo-kit:222222222222"],        # the current one: stays
        "sha256:both": ["dpo-kit:333", "dpo-kit:222222222222"],  # also tagged current: stays
        "sha256:mine": ["dpo-kit:444", "myteam/derived:1"],      # the user retagged it: stays
        "sha256:none": [],                                        # dangling: images.prune's job
        "sha256:old2": ["docker.io/library/dpo-kit:555"],        # Docker's spelling: goes
    }
    assert launcher.superseded(images, "dpo-kit", "dpo-kit:222222222222") == ["sha256:old", "sha256:old2"]


def test_gpu_request_for_all_a_count_and_ids():
    assert launcher.gpu_request("") is None
    assert launcher.gpu_request("all") == {"driver": "nvidia", "count": -1, "device_ids": None,
                                           "capabilities": [["gpu"]]}
    assert launcher.gpu_request("2")["count"] == 2
    assert launcher.gpu_request("0, 3")["device_ids"] == ["0", "3"]


def test_config_problems_are_reported_together():
    with pytest.raises(kit.UserError) as e:
        kit.parse_config(LaunchConfig, ["train", "--gpus", "some", "--user", "me"], "", positional="action")
    assert "--gpus 'some'" in str(e.value) and "--user 'me'" in str(e.value)


def test_run_spec_for_train_mounts_data_read_only_and_runs_as_the_caller():
    cfg = LaunchConfig(run_name="try1", gpus="all")
    spec = launcher.run_spec(cfg, "dpo-kit:abc", PATHS, ["--max_steps", "2"], "1000:1000",
                             {"HF_TOKEN": "hf_secret", "HOME": "/home/u", "HTTPS_PROXY": ""})
    assert spec["command"] == ["train", "--data", "/data/pairs.jsonl", "--output_dir", "/artifacts",
                               "--run_name", "try1", "--max_steps", "2"]
    assert spec["mounts"] == [
        {"source": "/home/u/kit/artifacts", "target": "/artifacts", "read_only": False},
        {"source": "/home/u/.cache/huggingface", "target": "/cache/huggingface", "read_only": False},
        {"source": "/home/u/pairs.jsonl", "target": "/data/pairs.jsonl", "read_only": True}]
    assert spec["user"] == "1000:1000" and spec["shm_size"] == "8g" and spec["entrypoint"] is None
    assert spec["environment"] == {"HF_TOKEN": "hf_secret"}  # only the pass-through names that are set
    assert spec["gpus"]["count"] == -1 and spec["labels"]["dpo-kit"] == "1"


def test_run_spec_mounts_a_local_model_and_passes_a_hub_id():
    local = launcher.run_spec(LaunchConfig(model="/m/Qwen"), "i:t", {**PATHS, "model": "/m/Qwen"}, [], "0:0", {})
    assert {"source": "/m/Qwen", "target": "/models/Qwen", "read_only": True} in local["mounts"]
    assert local["command"][-2:] == ["--model_name_or_path", "/models/Qwen"]
    hub = launcher.run_spec(LaunchConfig(model="org/name"), "i:t", PATHS, [], "0:0", {})
    assert hub["command"][-2:] == ["--model_name_or_path", "org/name"] and len(hub["mounts"]) == 3


def test_a_gguf_file_as_the_model_is_mounted_as_a_file(tmp_path):
    """make export's GGUF trains again in the image (MODEL=run-q8_0.gguf): the file itself is mounted read-only."""
    gguf = tmp_path / "run-q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    cfg = LaunchConfig(model=str(gguf), output_dir=str(tmp_path / "out"), dry_run=True)
    paths = launcher.host_paths(cfg, {})
    assert paths["model"] == str(gguf)
    spec = launcher.run_spec(cfg, "i:t", {**PATHS, "model": paths["model"]}, [], "0:0", {})
    assert {"source": str(gguf), "target": "/models/run-q8_0.gguf", "read_only": True} in spec["mounts"]
    assert spec["command"][-2:] == ["--model_name_or_path", "/models/run-q8_0.gguf"]
    assert launcher.host_paths(LaunchConfig(model=str(tmp_path / "absent.gguf"), output_dir=str(tmp_path),
                                            dry_run=True), {})["model"] == ""


def test_job_commands_for_pairs_check_and_shell():
    assert launcher.job_command(LaunchConfig(action="pairs"), "/data/runs.jsonl", [], "") == [
        "pairs", "/data/runs.jsonl", "-o", "/artifacts/pairs/runs.pairs.jsonl",
        "--report", "/artifacts/pairs/runs.pairs.report.json", "--prompts", "/artifacts/pairs/runs.prompts.jsonl"]
    assert launcher.job_command(LaunchConfig(action="pairs", method="kto"), "/data/runs.jsonl", [], "") == [
        "pairs", "/data/runs.jsonl", "-o", "/artifacts/pairs/runs.kto.jsonl",
        "--report", "/artifacts/pairs/runs.kto.report.json", "--prompts", "/artifacts/pairs/runs.prompts.jsonl",
        "--emit", "kto"]  # every run, unpaired
    assert launcher.job_command(LaunchConfig(method="kto"), "/data/runs.kto.jsonl", [], "")[-2:] == ["--method", "kto"]
    assert launcher.job_command(LaunchConfig(), "/artifacts/pairs/runs.pairs.jsonl", [], "",
                                "/artifacts/pairs/runs.prompts.jsonl")[-2:] == [
        "--eval_prompts", "/artifacts/pairs/runs.prompts.jsonl"]  # the checker scores the held-out runs' prompts


def test_grpo_in_the_container_trains_on_the_logs_themselves(tmp_path, capsys):
    """No pairs step: train_dpo.py --method grpo reads the run logs' prompts (and has no --eval_prompts to add)."""
    logs = tmp_path / "runs.jsonl"
    logs.write_text(Path("data/runs.jsonl").read_text())
    assert launcher.main(["train", "--dry_run", "--tag", "t", "--logs", str(logs), "--method", "grpo",
                          "--output_dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "# pairs" not in out and "--method grpo" in out and "/data/runs.jsonl" in out and "--eval_prompts" not in out
    assert launcher.main(["train", "--dry_run", "--tag", "t", "--logs", str(logs), "--output_dir", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "# pairs" in out and "--eval_prompts /artifacts/pairs/runs.prompts.jsonl" in out
    assert launcher.job_command(LaunchConfig(action="check", gpus="all"), "", [], "") == [
        "check", "--require_gpu", "--output_dir", "/artifacts"]
    assert launcher.job_command(LaunchConfig(action="check", gpus="4"), "", [], "") == [
        "check", "--require_gpu", "--nproc", "4", "--output_dir", "/artifacts"]  # /dev/shm and MIG depend on it
    assert launcher.job_command(LaunchConfig(action="check"), "", [], "") == ["check", "--output_dir", "/artifacts"]
    assert launcher.job_command(LaunchConfig(action="shell"), "", ["-c", "id"], "") == ["-c", "id"]


def test_docker_run_cli_names_every_flag_and_never_prints_a_secret():
    spec = launcher.run_spec(LaunchConfig(gpus="all"), "dpo-kit:abc", PATHS, [], "1000:1000",
                             {"HF_TOKEN": "hf_secret"})
    line = launcher.docker_run_cli(spec, "all")
    assert line == ("docker run --rm --gpus all --user 1000:1000 --shm-size 8g "
                    "-v /home/u/kit/artifacts:/artifacts -v /home/u/.cache/huggingface:/cache/huggingface "
                    "-v /home/u/pairs.jsonl:/data/pairs.jsonl:ro -e HF_TOKEN "
                    "--label dpo-kit=1 --label dpo-kit.action=train "
                    "dpo-kit:abc train --data /data/pairs.jsonl --output_dir /artifacts")
    assert "hf_secret" not in line
    ids = launcher.docker_run_cli(launcher.run_spec(LaunchConfig(gpus="0,1"), "i:t", PATHS, [], "0:0", {}), "0,1")
    assert shlex.split(ids)[3:5] == ["--gpus", '"device=0,1"']


def test_build_args_carry_source_date_epoch_outside_the_tag():
    cfg = LaunchConfig()
    assert launcher.build_args(cfg, "1767225600") == {"TORCH_VARIANT": "cuda", "SOURCE_DATE_EPOCH": "1767225600",
                                                      "EXTRAS": "export"}  # make export's llama.cpp, by default
    assert launcher.build_args(cfg) == {"TORCH_VARIANT": "cuda", "EXTRAS": "export"}  # what the tag hashes
    assert launcher.build_args(LaunchConfig(extras="none"))["EXTRAS"] == ""  # the CI smoke's image: neither
    epoch = launcher.lock_epoch()
    assert epoch is None or epoch.isdigit()  # the commit time of requirements.txt's last change
    out = run_launcher("build", "--tag", "t", "--dry_run")
    assert out.returncode == 0 and out.stdout.startswith("docker build -t dpo-kit:t --build-arg TORCH_VARIANT=cuda")
    assert (f"--build-arg SOURCE_DATE_EPOCH={epoch} " in out.stdout) == bool(epoch)


def test_engine_errors_about_gpus_are_one_sentence():
    assert launcher.engine_is_local("") and launcher.engine_is_local("unix:///run/podman/podman.sock")
    assert not launcher.engine_is_local("ssh://me@gpu-vm") and not launcher.engine_is_local("tcp://10.0.0.2:2376")
    toolkit = launcher.engine_error('could not select device driver "nvidia" with capabilities: [[gpu]]', "13.0")
    assert toolkit.startswith("the engine cannot give the container a GPU") and "nvidia-ctk runtime configure" in toolkit
    driver = launcher.engine_error(
        "failed to create task for container: failed to create shim task: OCI runtime create failed: runc create "
        "failed: unable to start container process: error during container init: error running hook #0: error "
        "running hook: exit status 1, stdout: , stderr: Auto-detected mode as 'legacy'\nnvidia-container-cli: "
        "requirement error: unsatisfied condition: cuda>=13.0, please update your driver to a newer version, or "
        "use an earlier cuda container: unknown", "13.0")
    assert driver == ("the host's NVIDIA driver is older than the image's CUDA needs (nvidia-container-cli: "
                      "unsatisfied condition: cuda>=13.0): upgrade the driver to 580 or newer")
    assert launcher.engine_error("No such image: dpo-kit:x", "13.0") is None


def run_launcher(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "launcher.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=120)


def test_sandbox_options_pass_the_profile_by_content_or_path_and_turn_apparmor_off_only_where_it_runs():
    kit_cfg, runtime = launcher.LaunchConfig(), launcher.LaunchConfig(sandbox="runtime")
    assert launcher.sandbox_options(kit_cfg, "/a/seccomp.json", False) == ["seccomp=/a/seccomp.json"]
    assert launcher.sandbox_options(kit_cfg, "/a/seccomp.json", True, "{}") == ["seccomp={}", "apparmor=unconfined"]
    assert launcher.sandbox_options(runtime, "/a/seccomp.json", True) == []


def test_dry_run_prints_pairs_then_train_without_any_engine(tmp_path):
    out = run_launcher("train", "--output_dir", str(tmp_path / "a"), "--hf_cache", str(tmp_path / "hf"),
                       "--gpus", "all", "--tag", "t1", "--dry_run", "--", "--max_steps", "2",
                       env={"DOCKER_HOST": "unix:///nonexistent.sock"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # the kit's seccomp profile first: read out of the image, then given to every container
    assert lines[:2] == ["# the kit's seccomp profile, out of the image:",
                         f"docker run --rm --entrypoint cat dpo-kit:t1 /opt/kit/seccomp.json > {tmp_path}/a/seccomp.json"]
    lines = lines[2:]
    assert [line for line in lines if line.startswith("#")] == ["# pairs", "# gpu check", "# train"]
    assert lines[3].endswith("check --require_gpu --output_dir /artifacts --no_triton")  # Triton: train's own pre-flight
    assert f"{ROOT}/data/runs.jsonl:/data/runs.jsonl:ro" in lines[1]
    assert all(f"--security-opt seccomp={tmp_path}/a/seccomp.json" in line for line in lines if line.startswith("docker"))
    assert lines[-1].endswith(f"-v {tmp_path}/a/pairs/runs.pairs.jsonl:/data/runs.pairs.jsonl:ro --label dpo-kit=1 "
                              "--label dpo-kit.action=train --security-opt seccomp=" + f"{tmp_path}/a/seccomp.json"
                              + (" --security-opt apparmor=unconfined" if launcher.host_apparmor() else "")
                              + " dpo-kit:t1 train --data /data/runs.pairs.jsonl "
                              "--output_dir /artifacts --eval_prompts /artifacts/pairs/runs.prompts.jsonl --max_steps 2")
    assert not (tmp_path / "a").exists()  # a dry run writes nothing
    runtime = run_launcher("train", "--output_dir", str(tmp_path / "a"), "--tag", "t1", "--dry_run", "--sandbox",
                           "runtime", env={"DOCKER_HOST": "unix:///nonexistent.sock"})
    assert "--security-opt" not in runtime.stdout and "seccomp.json" not in runtime.stdout  # the engine's defaults


def test_missing_data_is_a_user_error_before_any_engine():
    out = run_launcher("train", "--data", "nope.jsonl", "--dry_run")
    assert out.returncode == 2 and out.stderr.strip() == "nope.jsonl: no such file (the data to mount)"


def test_no_engine_is_one_sentence_and_exit_2(tmp_path):
    pytest.importorskip("docker")
    out = run_launcher("prune", env={"DOCKER_HOST": f"unix://{tmp_path}/none.sock"})
    assert out.returncode == 2
    assert out.stderr.startswith(f"error: no container engine answers at unix://{tmp_path}/none.sock")
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# Against a real engine (DOCKER_HOST): skipped, saying why, when none answers. Like `make prune`, these
# remove stopped containers and dangling images that carry the kit label on that engine, nothing else.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client():
    docker = pytest.importorskip("docker")
    try:
        c = docker.from_env(timeout=60)
        c.ping()
    except docker.errors.DockerException as e:
        pytest.skip(f"no container engine answers at {os.environ.get('DOCKER_HOST', 'the default socket')}: "
                    f"{str(e).splitlines()[0][:100]}")
    return c


def scratch_image(client, tmp_path, ref, label: bool):
    """A tiny image built FROM scratch (no registry needed), with or without the kit label."""
    ctx = tmp_path / ref.replace(":", "_").replace("/", "_")
    ctx.mkdir()
    (ctx / "hello.txt").write_text(ref)
    (ctx / "Dockerfile").write_text(f"FROM scratch\n{'LABEL dpo-kit=1' if label else 'LABEL other=1'}\n"
                                    "COPY hello.txt /hello.txt\n")
    image, _ = client.images.build(path=str(ctx), tag=ref, rm=True)
    return image


def test_prune_removes_superseded_kit_images_and_nothing_else(client, tmp_path):
    old = scratch_image(client, tmp_path, "dpo-kit-test:old", label=True)
    cur = scratch_image(client, tmp_path, "dpo-kit-test:cur", label=True)
    foreign = scratch_image(client, tmp_path, "dpo-kit-test-foreign:1", label=False)
    try:
        launcher.prune(client, "dpo-kit-test", "dpo-kit-test:cur")
        left = {i.id for i in client.images.list()}
        assert old.id not in left and cur.id in left and foreign.id in left
    finally:
        for image in (cur, foreign):
            client.images.remove(image.id, force=True)


def test_build_streams_and_labels_the_image(client, tmp_path, monkeypatch, capsys):
    (tmp_path / "Dockerfile").write_text("FROM scratch\nLABEL dpo-kit=1\nARG TORCH_VARIANT\nCOPY x /x\n")
    (tmp_path / "x").write_text("x")
    monkeypatch.setattr(launcher, "ROOT", tmp_path)
    launcher.build(client, LaunchConfig(torch_variant="cpu"), "dpo-kit-test:built")
    try:
        labels = client.images.get("dpo-kit-test:built").labels
        assert labels["dpo-kit"] == "1" and labels["dpo-kit.tag"] == "built"
        assert "[launcher] built dpo-kit-test:built" in capsys.readouterr().out
    finally:
        client.images.remove("dpo-kit-test:built", force=True)


# ---------------------------------------------------------------------------------------------
# Several GPUs and machines: the container runs `entrypoint.py launch` (scaleout.py), one process per GPU.
# ---------------------------------------------------------------------------------------------

def test_gpus_as_a_count_means_that_many_processes_and_all_keeps_one():
    one = launcher.run_spec(LaunchConfig(gpus="all"), "i:t", PATHS, [], "0:0", {})
    assert one["command"][:1] == ["train"] and one["network"] is None  # GPUS=all: as before
    four = launcher.run_spec(LaunchConfig(gpus="4", run_name="r"), "i:t", PATHS, ["--max_steps", "2"], "0:0", {})
    assert four["command"] == ["launch", "--nproc", "4", "--", "--data", "/data/pairs.jsonl", "--output_dir",
                               "/artifacts", "--run_name", "r", "--max_steps", "2"]
    assert four["gpus"]["count"] == 4
    ids = launcher.run_spec(LaunchConfig(gpus="2,3"), "i:t", PATHS, [], "0:0", {})
    assert ids["command"][:3] == ["launch", "--nproc", "2"]  # docker renumbers devices 2,3 as 0,1 inside
    cpu = launcher.run_spec(LaunchConfig(nproc=2, dist="zero2"), "i:t", PATHS, [], "0:0", {})
    assert cpu["command"][:5] == ["launch", "--nproc", "2", "--dist", "zero2"] and cpu["gpus"] is None


def test_second_machine_uses_host_network_and_names_the_rendezvous():
    cfg = LaunchConfig(gpus="8", nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29501)
    spec = launcher.run_spec(cfg, "dpo-kit:t", PATHS, [], "1000:1000", {})
    assert spec["network"] == "host"
    assert spec["command"][:12] == ["launch", "--nproc", "8", "--nnodes", "2", "--node_rank", "1", "--master_addr",
                                    "10.0.0.1", "--master_port", "29501", "--"]
    line = launcher.docker_run_cli(spec, "8")
    assert "--gpus 8 --user 1000:1000 --shm-size 8g --network host " in line
    assert launcher.run_spec(dataclasses.replace(cfg, action="pairs"), "i:t", PATHS, [], "0:0", {})["network"] is None


def test_distributed_mistakes_are_reported_with_the_others():
    with pytest.raises(kit.UserError) as e:
        kit.parse_config(LaunchConfig, ["train", "--nnodes", "2", "--node_rank", "2", "--nproc", "0"], "",
                         positional="action")
    assert "NODE_RANK) must be in 0..1" in str(e.value) and "MASTER_ADDR) is required" in str(e.value)
    assert "NPROC) must be at least 1 (got 0)" in str(e.value)


def test_make_train_in_the_container_builds_the_same_pairs_and_runs_rounds_as_it_does_locally(tmp_path):
    def dry(*args):
        out = subprocess.run(["make", "--no-print-directory", "train", "RUNNER=docker", "DRY_RUN=1", f"OUT={tmp_path}/a",
                              "TAG=t1", f"PYTHON={sys.executable}", *args], capture_output=True, text=True, cwd=ROOT,
                             timeout=120, env={**os.environ, "DOCKER_HOST": "unix:///nonexistent.sock"})
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    lines = dry("ROUNDS=1", "RUN=r1", "ARGS=--seed 2")
    assert dry("RUN=r1", "ARGS=--seed 2") == lines  # a round is make train's default, in the container too
    assert "# pairs" not in lines  # iterate.py builds the pairs itself
    train = lines[lines.index("# train") + 1]
    assert " -v " in train and "/data/runs.jsonl:ro" in train.replace("'", "")
    assert f"{ROOT}/data/attempts.jsonl:/data/extra-0-attempts.jsonl:ro" in train.replace("'", "")
    assert train.endswith("dpo-kit:t1 iterate configs/rounds.yaml --logs /data/runs.jsonl --output_dir /artifacts "
                          "--extra_runs /data/extra-0-attempts.jsonl,/data/extra-1-attempts-round2.jsonl "
                          "--name r1 -- --seed 2")  # the plan and the bundled model are the image's own; stage 1's
    # pairs are make train's: the logs, then the bundled attempts
    one = dry("ROUNDS=0")
    assert one[one.index("# train") + 1].endswith("--config configs/demo.yaml")
    pairs = one[one.index("# pairs") + 1]  # the demo's logs and, after them, the model's own earlier attempts
    assert f"{ROOT}/data/attempts.jsonl:/data/extra-0-attempts.jsonl:ro" in pairs.replace("'", "")
    assert f"{ROOT}/data/attempts-round2.jsonl:/data/extra-1-attempts-round2.jsonl:ro" in pairs.replace("'", "")
    assert "--extra_runs /data/extra-0-attempts.jsonl,/data/extra-1-attempts-round2.jsonl" in pairs
    assert "--extra_runs" not in dry("ROUNDS=0", "ATTEMPTS=")[one.index("# pairs") + 1]
    with pytest.raises(kit.UserError, match="--rounds runs a plan on run logs in one process"):
        kit.parse_config(LaunchConfig, ["train", "--rounds", "configs/rounds.yaml", "--data", "p.jsonl"], "",
                         positional="action")


def test_make_dry_run_prints_the_second_machines_command_without_an_engine(tmp_path):
    out = subprocess.run(["make", "--no-print-directory", "train", "GPUS=8", "NNODES=2", "NODE_RANK=1",
                          "MASTER_ADDR=10.0.0.1", "RUNNER=docker", "DRY_RUN=1", f"OUT={tmp_path}/a", "TAG=t1",
                          f"PYTHON={sys.executable}"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "DOCKER_HOST": "unix:///nonexistent.sock"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "make: several processes or nodes: training the recipe once" in lines[0]  # not make train's round
    train = lines[lines.index("# train") + 1]
    assert train.startswith("docker run --rm --gpus 8 ") and " --network host " in train
    assert train.endswith("dpo-kit:t1 launch --nproc 8 --nnodes 2 --node_rank 1 --master_addr 10.0.0.1 -- "
                          "--data /data/runs.pairs.jsonl --output_dir /artifacts --eval_prompts /artifacts/pairs/runs.prompts.jsonl "
                          "--config configs/demo.yaml")  # the bundled model's recipe (run from the image's /opt/kit)
    assert lines[-1] == ("# accelerate launch --num_processes 16 --num_machines 2 --machine_rank 1 --main_process_ip "
                         "10.0.0.1 --main_process_port 29500 --multi_gpu --mixed_precision no --dynamo_backend no "
                         "/opt/kit/train_dpo.py --data /data/runs.pairs.jsonl --output_dir /artifacts "
                         "--eval_prompts /artifacts/pairs/runs.prompts.jsonl --config configs/demo.yaml")
    assert not (tmp_path / "a").exists()
    bad = subprocess.run(["make", "train", "DIST=zero4", "RUNNER=docker", "DRY_RUN=1"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "DIST=zero4: expected ddp, zero2, zero3 or fsdp" in bad.stderr
