"""Build the kit's image and run its jobs in a container, through the Docker SDK (Docker, or podman's socket).

    python launcher.py build [--base_image IMG] [--torch_variant cpu|cuda] [--tag T]
    python launcher.py train --data pairs.jsonl [--gpus all] [--model DIR|HUB_ID] [--run_name R] [-- train_dpo flags]
    python launcher.py train --logs runs.jsonl ...   # builds the pairs in a container first, then trains on them
    python launcher.py pairs --logs runs.jsonl       # only the pairs -> artifacts/pairs/<name>.pairs.jsonl
    python launcher.py check [--gpus all]            # the pre-flight in the image (preflight.py): GPU, driver, shm, ...
    python launcher.py shell [-- -c 'command']       # bash in the image, with the same mounts
    python launcher.py prune                         # stopped kit containers, dangling/superseded kit images
    python launcher.py train ... --dry_run           # print the equivalent docker commands, run nothing
    python launcher.py train --gpus 8 --nnodes 2 --node_rank 1 --master_addr 10.0.0.1 ...  # machine 1 of 2
    make build | make train RUNNER=docker GPUS=all DATA=pairs.jsonl [DRY_RUN=1] | make prune | make shell

The engine is whatever DOCKER_HOST points at (default: the local Docker socket). The image is
IMAGE:TAG, TAG defaulting to a hash of the Dockerfile, requirements.txt, the scripts, certs/ and the
build args, so any change rebuilds. In the container the data file is mounted read-only at
/data/<name>, the output directory at /artifacts and the HF cache at /cache/huggingface, the job
runs as the caller's uid:gid (files on the host are the caller's), HF_TOKEN is passed at run time
only when set, and the container is removed when it ends. Ctrl-C or SIGTERM stops the container
(`docker stop`: the run saves a checkpoint and is marked cancelled); the same command resumes it.
With several processes (--gpus N, --nproc, --nnodes, --dist) the container runs `entrypoint.py launch`
(scaleout.py: accelerate launch over N processes, one per GPU); with several machines it uses the host's
network (`--network host`: the rendezvous port and NCCL need the machines' own addresses).
Before `docker run` with a local engine, the host's driver is read (nvidia-smi) against the image's CUDA (the
lock's), and a GPU host without --gpus is refused unless the job has --allow_cpu: one sentence each, exit 1.
Builds pass SOURCE_DATE_EPOCH (the commit time of the lock), so a rebuild from the same lock gives the same
layers where the builder honours it.
Exit status: the job's own (0, 1 failed, 2 bad input, 143 cancelled), 1 when the host cannot run it, or 2 when
no engine answers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
import signal
import sys
from pathlib import Path

from dpokit.core import kit
from dpokit.sandbox import seccomp_profile
from dpokit.model import preflight
from dpokit.apps import scaleout
from dpokit.core.kit import UserError, field

KIT_LABEL = "dpo-kit"  # every image and container the kit makes carries `dpo-kit=1`; prune filters on it
ROOT = kit.ROOT
TAG_INPUTS = ("Dockerfile", "requirements*.txt", "*.py", "dpokit/**/*.py", "templates/*", "data/*", "configs/*",
              "certs/*.crt")  # what the image is made of
PASS_ENV = ("HF_TOKEN", "HF_ENDPOINT", "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY",  # passed at run time when set
            "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG")  # several machines: which interface to use
STOP_TIMEOUT = 300  # seconds `docker stop` waits for the checkpoint before SIGKILL
IN_DATA, IN_ARTIFACTS, IN_HF, IN_MODELS, IN_KIT = "/data", "/artifacts", "/cache/huggingface", "/models", "/opt/kit"


@dataclasses.dataclass
class LaunchConfig:
    action: str = field("train", "build | train | pairs | check | shell | prune",
                        choices=("build", "train", "pairs", "check", "shell", "prune"))
    image: str = field(KIT_LABEL, "image repository name")
    tag: str = field("", "image tag (default: hash of Dockerfile, requirements.txt, scripts, certs/ and build args)")
    base_image: str = field("", "build arg BASE_IMAGE (default: the Dockerfile's CUDA runtime image)")
    torch_variant: str = field("cuda", "build arg TORCH_VARIANT: cuda = whole lock, cpu = without CUDA wheels",
                               choices=("cuda", "cpu"))
    extras: str = field("export", "build arg EXTRAS: export (make export's llama.cpp), deepspeed (DIST=zero2|zero3), "
                                  "vllm (the GPU variant: make serve's answers through vLLM), space-separated; none: "
                                  "none of them")
    data: str = field("", "preference pairs on the host (JSONL), mounted read-only")
    logs: str = field("data/runs.jsonl", "agent run logs on the host, used when --data is not given")
    extra_runs: str = field("", "more run log files on the host, comma-separated, mounted read-only and read after "
                            "--logs when the pairs are built (build_pairs.py --extra_runs): earlier rounds' attempts")
    method: str = field("", "kto: train KTO (run logs become unpaired examples, build_pairs --emit kto; a pairs "
                        "file is unpaired); grpo: sample answers to the logs' prompts, scored by the checker (the "
                        "logs are the data); dpo; '' = what the data holds", choices=("", "dpo", "kto", "grpo"))
    output_dir: str = field("artifacts", "host directory mounted at /artifacts (runs, tarballs, pairs)")
    model: str = field("", "host model directory or GGUF file (mounted read-only), or hub id; empty = bundled in "
                           "the image")
    run_name: str = field("", "run name (the same name resumes)")
    rounds: str = field("", "train: a plan in the image (iterate.py; configs/rounds.yaml) run on the logs instead of "
                        "one training: its pairs, then the model's own scored attempts (make train ROUNDS=1 on the "
                        "bundled model); not with --data or several processes")
    gpus: str = field("", "GPUs for the container: all (one process sees them all), a count N (N processes, "
                      "one per GPU), or device ids like 0,1 (one process each); empty = none")
    nproc: int | None = field(None, "training processes in the container (default: one per GPU that --gpus counts)")
    nnodes: int = field(1, "machines taking part; each runs the same command with its own --node_rank")
    node_rank: int = field(0, "this machine's index, 0 .. nnodes-1")
    master_addr: str = field("", "address of machine 0 (needed when nnodes > 1)")
    master_port: int = field(29500, "rendezvous port on machine 0")
    dist: str = field("ddp", "ddp | zero2 | zero3 | fsdp (configs/<dist>.yaml)", choices=tuple(scaleout.DIST_CONFIGS))
    user: str = field("", "uid:gid the job runs as (default: the caller's, so host files are theirs)")
    shm_size: str = field("8g", "/dev/shm size (DataLoader workers and NCCL need more than Docker's 64m)")
    hf_cache: str = field("", "host HF cache mounted writable (default: $HF_HOME or ~/.cache/huggingface)")
    sandbox: str = field("kit", "what model-written code runs under in the container: kit = the image's seccomp "
                         "profile (Docker's default plus bubblewrap's namespaces and mounts: seccomp_profile.py) and, "
                         "where the engine runs AppArmor, apparmor=unconfined (Docker's AppArmor profile denies the "
                         "mounts bubblewrap makes), so answers run in bwrap mode; runtime = the engine's defaults (no "
                         "namespaces: limits mode, where an answer naming a host path cannot be scored)",
                         choices=("kit", "runtime"))
    prune: bool = field(True, "after train: remove stopped kit containers and dangling/superseded kit images")
    rebuild: bool = field(False, "train: build even when IMAGE:TAG exists")
    dry_run: bool = field(False, "print the equivalent docker commands and run nothing")

    def problems(self) -> list[str]:
        p = []
        if self.gpus and not (self.gpus == "all" or self.gpus.isdigit()
                              or all(x.strip().isdigit() for x in self.gpus.split(","))):
            p.append(f"--gpus {self.gpus!r}: expected all, a count, or device ids like 0,1")
        if self.user and not all(x.isdigit() for x in self.user.split(":")):
            p.append(f"--user {self.user!r}: expected numeric uid or uid:gid")
        if self.rounds and (self.data or self.method not in ("", "dpo") or scaleout.is_distributed(dist_config(self))):
            p.append("--rounds runs a plan on run logs in one process: not with --data, --method kto|grpo or "
                     "several processes")
        return p + [x for x in dist_config(self).problems() if not x.startswith("--gpus")]


# ---------------------------------------------------------------------------------------------
# Pure helpers: what to build and run, from the config. No engine, no file writes.
# ---------------------------------------------------------------------------------------------

def compute_tag(files: dict[str, bytes], build_args: dict[str, str]) -> str:
    """12 hex digits of sha256 over the image's inputs (sorted path + content) and its build args."""
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(f"{path}\0{len(files[path])}\0".encode() + files[path])
    for key in sorted(build_args):
        h.update(f"{key}={build_args[key]}\0".encode())
    return h.hexdigest()[:12]


def build_args(cfg: LaunchConfig, epoch: str | None = None) -> dict[str, str]:
    """The build's --build-arg values. epoch: SOURCE_DATE_EPOCH, left out of the tag (the lock it follows is in it)."""
    args = {"TORCH_VARIANT": cfg.torch_variant, **({"SOURCE_DATE_EPOCH": epoch} if epoch else {})}
    if cfg.base_image:
        args["BASE_IMAGE"] = cfg.base_image
    args["EXTRAS"] = "" if cfg.extras == "none" else cfg.extras
    return args


def image_labels(revision: str | None, tag: str) -> dict[str, str]:
    """Labels added at build time (the Dockerfile carries the static ones, including the kit label)."""
    labels = {KIT_LABEL: "1", f"{KIT_LABEL}.tag": tag, "org.opencontainers.image.version": tag}
    if revision:
        labels["org.opencontainers.image.revision"] = revision
    return labels


def label_filter() -> dict:
    """The filter every prune and listing uses: only what the kit made."""
    return {"label": [f"{KIT_LABEL}=1"]}


def normalize_ref(ref: str) -> str:
    """`localhost/dpo-kit:x` (podman) and `docker.io/library/dpo-kit:x` both name `dpo-kit:x`."""
    for prefix in ("localhost/", "docker.io/library/", "docker.io/"):
        if ref.startswith(prefix):
            return ref[len(prefix):]
    return ref


def superseded(images: dict[str, list[str]], repo: str, keep: str) -> list[str]:
    """Ids of kit images whose every tag is an older `repo:*` (not `keep`); images tagged elsewhere stay."""
    out = []
    for image_id, tags in images.items():
        names = [normalize_ref(t) for t in tags]
        if names and keep not in names and all(n.rsplit(":", 1)[0] == repo for n in names):
            out.append(image_id)
    return sorted(out)


def gpu_request(gpus: str) -> dict | None:
    """`--gpus` as a device request: all -> Count -1, "2" -> Count 2, "0,1" -> DeviceIDs."""
    if not gpus:
        return None
    if gpus == "all" or gpus.isdigit():
        return {"driver": "nvidia", "count": -1 if gpus == "all" else int(gpus), "device_ids": None,
                "capabilities": [["gpu"]]}
    return {"driver": "nvidia", "count": 0, "device_ids": [x.strip() for x in gpus.split(",")],
            "capabilities": [["gpu"]]}


def dist_config(cfg: LaunchConfig) -> scaleout.DistConfig:
    """The container's view: docker exposes the chosen GPUs renumbered from 0, so only the process count goes in."""
    return scaleout.DistConfig(nproc=scaleout.processes_per_node(cfg.nproc, cfg.gpus), nnodes=cfg.nnodes,
                                  node_rank=cfg.node_rank, master_addr=cfg.master_addr, master_port=cfg.master_port,
                                  dist=cfg.dist)


def launch_flags(d: scaleout.DistConfig) -> list[str]:
    """entrypoint.py launch's flags for a distributed config (defaults left out)."""
    out = ["--nproc", str(d.nproc)]
    if d.nnodes > 1:
        out += ["--nnodes", str(d.nnodes), "--node_rank", str(d.node_rank), "--master_addr", d.master_addr]
    if d.master_port != 29500:
        out += ["--master_port", str(d.master_port)]
    return out + (["--dist", d.dist] if d.dist != "ddp" else [])


def pairs_output(logs_in: str, method: str = "") -> str:
    """Where the pairs (KTO: examples) built from run logs go, in the container (as `make pairs` names them)."""
    return f"{IN_ARTIFACTS}/pairs/{Path(logs_in).name.rsplit('.', 1)[0]}.{'kto' if method == 'kto' else 'pairs'}.jsonl"


def prompts_output(logs_in: str) -> str:
    """Where the logs' code-asking prompts go beside the pairs (the checker's held-out evaluation reads them)."""
    return f"{IN_ARTIFACTS}/pairs/{Path(logs_in).name.rsplit('.', 1)[0]}.prompts.jsonl"


def extra_runs(cfg: LaunchConfig) -> list[str]:
    """--extra_runs' files, in order."""
    return [x.strip() for x in cfg.extra_runs.split(",") if x.strip()]


def job_command(cfg: LaunchConfig, data_in: str, extra: list[str], model_in: str, eval_prompts: str = "") -> list[str]:
    """The entrypoint command for the action, with container paths."""
    if cfg.action == "pairs":
        out = pairs_output(data_in, cfg.method)
        more = [f"{IN_DATA}/extra-{i}-{Path(x).name}" for i, x in enumerate(extra_runs(cfg))]
        return ["pairs", data_in, "-o", out, "--report", out[:-len(".jsonl")] + ".report.json",
                "--prompts", prompts_output(data_in), *(["--emit", "kto"] if cfg.method == "kto" else []),
                *(["--extra_runs", ",".join(more)] if more else []), *extra]
    if cfg.action == "check":  # the pre-flight for what train would run: its GPUs, processes and output mount
        nproc = dist_config(cfg).nproc
        return ["check", *(["--require_gpu"] if cfg.gpus else []), *(["--nproc", str(nproc)] if nproc > 1 else []),
                "--output_dir", IN_ARTIFACTS, *extra]
    if cfg.action == "shell":
        return extra
    if cfg.rounds:  # iterate.py on the logs: it builds the pairs itself; the plan and its model are in the image
        more = [f"{IN_DATA}/extra-{i}-{Path(x).name}" for i, x in enumerate(extra_runs(cfg))]
        return ["iterate", cfg.rounds, "--logs", data_in, "--output_dir", IN_ARTIFACTS,
                *(["--extra_runs", ",".join(more)] if more else []),
                *(["--name", cfg.run_name] if cfg.run_name else []), "--", *extra]
    cmd = ["--data", data_in, "--output_dir", IN_ARTIFACTS]
    if model_in:
        cmd += ["--model_name_or_path", model_in]
    if cfg.run_name:
        cmd += ["--run_name", cfg.run_name]
    if cfg.method:
        cmd += ["--method", cfg.method]
    if eval_prompts:
        cmd += ["--eval_prompts", eval_prompts]
    d = dist_config(cfg)
    if scaleout.is_distributed(d):  # accelerate launch in the container, one process per GPU
        return ["launch", *launch_flags(d), "--", *cmd, *extra]
    return ["train", *cmd, *extra]


def run_spec(cfg: LaunchConfig, ref: str, paths: dict[str, str], extra: list[str], user: str,
             env: dict[str, str]) -> dict:
    """Everything `docker run` needs, as plain data. `paths`: absolute host paths (data, output, hf, model)."""
    mounts = [{"source": paths["output"], "target": IN_ARTIFACTS, "read_only": False},
              {"source": paths["hf"], "target": IN_HF, "read_only": False}]
    data_in = ""
    if paths.get("data"):
        data_in = f"{IN_DATA}/{Path(paths['data']).name}"
        mounts.append({"source": paths["data"], "target": data_in, "read_only": True})
    if cfg.action == "pairs" or (cfg.action == "train" and cfg.rounds):  # the pairs are built in this container
        mounts += [{"source": os.path.abspath(x), "target": f"{IN_DATA}/extra-{i}-{Path(x).name}", "read_only": True}
                   for i, x in enumerate(extra_runs(cfg))]
    model_in = cfg.model
    if paths.get("model"):
        model_in = f"{IN_MODELS}/{Path(paths['model']).name}"
        mounts.append({"source": paths["model"], "target": model_in, "read_only": True})
    return {
        "image": ref,
        "entrypoint": ["/bin/bash"] if cfg.action == "shell" else None,
        "command": job_command(cfg, data_in, extra, model_in, paths.get("eval_prompts", "")),
        "user": user,
        "mounts": mounts,
        "environment": {k: env[k] for k in PASS_ENV if env.get(k)},
        "gpus": gpu_request(cfg.gpus),
        "network": "host" if cfg.nnodes > 1 and cfg.action == "train" else None,  # other machines reach this one
        "shm_size": cfg.shm_size,
        "labels": {KIT_LABEL: "1", f"{KIT_LABEL}.action": cfg.action},
        "security_opt": [],  # sandbox_options(): filled once the image (and its profile) is there
    }


def profile_path(cfg: LaunchConfig) -> str:
    """Where the kit's seccomp profile, read out of the image, is written on the host for `docker run`."""
    return os.path.join(os.path.abspath(cfg.output_dir), "seccomp.json")


def host_apparmor() -> bool:
    """Whether this machine's kernel runs AppArmor (a dry run's guess at a local engine's; a real run asks the
    engine)."""
    try:
        return Path("/sys/module/apparmor/parameters/enabled").read_text().strip() == "Y"
    except OSError:
        return False


def sandbox_options(cfg: LaunchConfig, path: str, apparmor: bool, content: str | None = None) -> list[str]:
    """docker run's --security-opt values for --sandbox: the profile by its content (the Docker API's form) or by
    its path (the docker CLI's, and podman's API), and AppArmor off where the engine runs it. [] for runtime."""
    if cfg.sandbox != "kit":
        return []
    return [f"seccomp={content if content is not None else path}"] + (["apparmor=unconfined"] if apparmor else [])


def docker_run_cli(spec: dict, gpus: str = "", interactive: bool = False) -> str:
    """The same job as a plain `docker run` line (secrets by name only: `-e HF_TOKEN` reads the caller's)."""
    args = ["docker", "run", "--rm", *(["-it"] if interactive else [])]
    if gpus:
        args += ["--gpus", gpus if gpus == "all" or gpus.isdigit() else f'"device={gpus}"']
    args += ["--user", spec["user"], "--shm-size", spec["shm_size"]]
    if spec.get("network"):
        args += ["--network", spec["network"]]
    for m in spec["mounts"]:
        args += ["-v", f"{m['source']}:{m['target']}" + (":ro" if m["read_only"] else "")]
    for key in spec["environment"]:
        args += ["-e", key]
    for key, value in spec["labels"].items():
        args += ["--label", f"{key}={value}"]
    for opt in spec.get("security_opt", []):  # the profile by its path, as the docker CLI takes it
        args += ["--security-opt", opt]
    if spec["entrypoint"]:
        args += ["--entrypoint", spec["entrypoint"][0]]
    return shlex.join([*args, spec["image"], *spec["command"]])


def docker_build_cli(ref: str, args: dict[str, str], labels: dict[str, str]) -> str:
    out = ["docker", "build", "-t", ref]
    for key, value in args.items():
        out += ["--build-arg", f"{key}={value}"]
    for key, value in labels.items():
        out += ["--label", f"{key}={value}"]
    return shlex.join([*out, str(ROOT)])


def engine_is_local(docker_host: str) -> bool:
    """Does DOCKER_HOST name an engine on this machine (whose GPUs nvidia-smi here describes)?"""
    return not docker_host or docker_host.startswith(("unix://", "npipe://"))


def engine_error(message: str, image_cuda: str | None) -> str | None:
    """One sentence for what the engine says when it cannot give the container a GPU; None for anything else."""
    if "could not select device driver" in message:
        return ("the engine cannot give the container a GPU (could not select device driver \"nvidia\"): install "
                "the NVIDIA Container Toolkit and restart the engine (sudo nvidia-ctk runtime configure "
                "--runtime=docker && sudo systemctl restart docker)")
    m = re.search(r"unsatisfied condition: (cuda\s*>=\s*[\d.]+)", message)
    if m:
        floor = preflight.driver_floor(image_cuda)[0] if image_cuda else None
        return (f"the host's NVIDIA driver is older than the image's CUDA needs (nvidia-container-cli: unsatisfied "
                f"condition: {m[1]}): upgrade the driver" + (f" to {floor.split('.')[0]} or newer" if floor else ""))
    return None


# ---------------------------------------------------------------------------------------------
# Edges: files on the host, and the engine.
# ---------------------------------------------------------------------------------------------

def tag_for(cfg: LaunchConfig) -> str:
    files = {p.relative_to(ROOT).as_posix(): p.read_bytes()
             for pattern in TAG_INPUTS for p in ROOT.glob(pattern) if p.is_file()}
    return cfg.tag or compute_tag(files, build_args(cfg))


def host_paths(cfg: LaunchConfig, env: dict[str, str]) -> dict[str, str]:
    """Absolute host paths to mount; the writable ones are made now, so they belong to the caller."""
    data = cfg.data or (cfg.logs if cfg.action in ("train", "pairs") else "")
    for path in [data] if data else []:
        if not Path(path).is_file():
            raise UserError("no such file (the data to mount)", path)
    for path in extra_runs(cfg) if cfg.action in ("train", "pairs") and not cfg.data else []:
        if not Path(path).is_file():
            raise UserError("no such file (--extra_runs: run logs to mount)", path)
    paths = {"output": os.path.abspath(cfg.output_dir),
             "hf": os.path.abspath(cfg.hf_cache or env.get("HF_HOME") or Path.home() / ".cache" / "huggingface"),
             "data": os.path.abspath(data) if data else "",
             "model": os.path.abspath(cfg.model) if cfg.model and (Path(cfg.model).is_dir() or (
                 cfg.model.lower().endswith(".gguf") and Path(cfg.model).is_file())) else ""}
    if not cfg.dry_run:
        for key in ("output", "hf"):
            Path(paths[key]).mkdir(parents=True, exist_ok=True)
    return paths


def image_cuda(cfg: LaunchConfig) -> str | None:
    """The CUDA the image's torch is built for (the lock's CUDA runtime wheel); None for the cpu variant."""
    return preflight.lock_cuda((ROOT / "requirements.txt").read_text()) if cfg.torch_variant == "cuda" else None


def lock_epoch() -> str | None:
    """SOURCE_DATE_EPOCH for a build: the commit time of the lock's last change (the same lock, the same time, so
    the same layers where the builder honours it; a code-only commit does not move it). None outside git."""
    import subprocess

    try:
        done = subprocess.run(["git", "log", "-1", "--format=%ct", "--", "requirements.txt"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip().isdigit() else None


def host_ready(cfg: LaunchConfig, extra: list[str]) -> bool:
    """The host's side of the pre-flight (nvidia-smi here against the image's CUDA), before anything is built or
    run; prints one sentence per problem. The container's own pre-flight checks the rest."""
    smi, failed, _ = preflight.read_nvidia_smi()
    found = preflight.host_findings(bool(cfg.gpus), cfg.action != "train" or "--allow_cpu" in extra, smi, failed,
                                    image_cuda(cfg))
    for x in found:
        print(f"error: {x.text}." if x.level == "fail" else f"[launcher] warning: {x.text}",
              file=sys.stderr if x.level == "fail" else sys.stdout)
    return not any(x.level == "fail" for x in found)


def engine():
    """A client for DOCKER_HOST's engine, or one clear sentence and exit 2."""
    try:
        import docker
    except ImportError:
        raise UserError("the launcher needs the Docker SDK for Python: pip install docker (make does this)") from None
    try:
        client = docker.from_env(timeout=600)
        client.ping()
        return client
    except docker.errors.DockerException as e:
        where = os.environ.get("DOCKER_HOST") or "the default Docker socket"
        raise UserError(f"no container engine answers at {where} ({str(e).splitlines()[0][:160]}); "
                        "start Docker, or point DOCKER_HOST at one (podman: unix:///run/podman/podman.sock), "
                        "or use RUNNER=local") from None


def build(client, cfg: LaunchConfig, ref: str) -> None:
    """Build IMAGE:TAG from this directory, streaming the build log."""
    args, labels = build_args(cfg, lock_epoch()), image_labels(kit.git_commit(ROOT), ref.rsplit(":", 1)[1])
    print(f"[launcher] building {ref} ({', '.join(f'{k}={v}' for k, v in args.items())})", flush=True)
    for chunk in client.api.build(path=str(ROOT), tag=ref, buildargs=args, labels=labels, rm=True,
                                  forcerm=True, decode=True):
        if "stream" in chunk:
            sys.stdout.write(chunk["stream"])
            sys.stdout.flush()
        if "error" in chunk:
            raise UserError(f"building {ref} failed: {chunk['error'].strip()}")
    print(f"[launcher] built {ref}", flush=True)


def run(client, spec: dict, cuda: str | None = None) -> int:
    """Run the job, stream its output, wait, remove the container; Ctrl-C/SIGTERM -> `docker stop`. cuda: the
    image's, named when the engine refuses the host's driver."""
    from docker.errors import APIError
    from docker.types import DeviceRequest, Mount

    gpus = spec["gpus"]
    try:
        container = client.containers.run(
            spec["image"], spec["command"], entrypoint=spec["entrypoint"], detach=True, user=spec["user"],
            mounts=[Mount(m["target"], m["source"], type="bind", read_only=m["read_only"]) for m in spec["mounts"]],
            environment=spec["environment"], shm_size=spec["shm_size"], labels=spec["labels"],
            network_mode=spec["network"], device_requests=[DeviceRequest(**gpus)] if gpus else None,
            security_opt=spec.get("engine_security_opt") or spec.get("security_opt") or None)
    except APIError as e:  # the GPU refused at start: one sentence (the created container goes with `prune`)
        sentence = engine_error(str(e.explanation or e), cuda)
        if sentence is None:
            raise
        raise UserError(sentence) from None
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM -> KeyboardInterrupt
    try:
        try:
            for line in container.logs(stream=True, follow=True):
                sys.stdout.write(line.decode("utf-8", "replace"))
                sys.stdout.flush()
        except KeyboardInterrupt:
            print(f"\n[launcher] stopping {container.short_id} (the run saves a checkpoint; the same command "
                  "resumes it)", flush=True)
            container.stop(timeout=STOP_TIMEOUT)
        return container.wait()["StatusCode"]
    finally:
        signal.signal(signal.SIGTERM, previous)
        container.remove(force=True)


def file_in_image(client, ref: str, path: str) -> bytes:
    """A file of the image, read from a container created (never started) for it, then removed."""
    import io
    import tarfile

    container = client.containers.create(ref, ["true"], labels={KIT_LABEL: "1", f"{KIT_LABEL}.action": "read"})
    try:
        stream, _ = container.get_archive(path)
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.getmembers()[0]
            return tar.extractfile(member).read()
    finally:
        container.remove(force=True)


def kit_sandbox(client, cfg: LaunchConfig, ref: str) -> tuple[list[str], list[str]]:
    """(--security-opt values as the docker CLI takes them, the same as this engine's API takes them) for --sandbox:
    the image's profile written to the host (profile_path), passed by content to Docker and by path to podman (its
    API reads a file); AppArmor off where the engine runs it. An image without the profile runs with the engine's
    defaults, said."""
    if cfg.sandbox != "kit":
        return [], []
    from docker.errors import APIError, ContainerError

    try:
        text = file_in_image(client, ref, seccomp_profile.IN_IMAGE).decode()
        json.loads(text)
    except (APIError, ContainerError, ValueError, KeyError) as e:
        print(f"[launcher] WARNING: {ref} has no readable {seccomp_profile.IN_IMAGE} ({str(e).strip()[:120]}): the "
              "container runs under the engine's default seccomp profile, and model-written code in limits mode "
              "(make build again)", file=sys.stderr, flush=True)
        return [], []
    path = profile_path(cfg)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    kit.atomic_write_text(Path(path), text)
    info = client.info()
    apparmor = any("name=apparmor" in str(o) for o in info.get("SecurityOptions") or [])
    podman = any("podman" in str(c.get("Name", "")).lower() for c in client.version().get("Components") or [])
    return sandbox_options(cfg, path, apparmor), sandbox_options(cfg, path, apparmor, None if podman else text)


def prune(client, repo: str, keep: str) -> None:
    """Remove stopped kit containers, dangling kit images and kit images superseded by `keep`."""
    from docker.errors import APIError

    gone = client.containers.prune(filters=label_filter()).get("ContainersDeleted") or []
    dangling = client.images.prune(filters={**label_filter(), "dangling": True}).get("ImagesDeleted") or []
    images = {i.id: i.tags for i in client.images.list(filters=label_filter())}
    removed = []
    for image_id in superseded(images, repo, normalize_ref(keep)):
        try:
            client.images.remove(image_id)
            removed.append(image_id)
        except APIError as e:  # in use by a running container, say
            print(f"[prune] kept {image_id[:19]}: {e.explanation}")
    try:
        cache = client.api.prune_builds(filters=label_filter()).get("SpaceReclaimed", 0)
    except (APIError, TypeError):
        cache = None  # podman's socket has no build-cache endpoint; its layers are the images above
    print(f"[prune] {len(gone)} stopped kit container(s), {len(dangling)} dangling and {len(removed)} superseded "
          f"kit image(s) removed; build cache: {'n/a' if cache is None else f'{cache:,} bytes freed'}; kept {keep}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    cfg = kit.parse_config(LaunchConfig, argv, __doc__, positional="action")
    tag = tag_for(cfg)
    ref = f"{cfg.image}:{tag}"
    if cfg.action in ("build", "prune"):
        if cfg.dry_run:
            print(docker_build_cli(ref, build_args(cfg, lock_epoch()), image_labels(None, tag)) if cfg.action == "build"
                  else f"docker container prune -f --filter label={KIT_LABEL}=1\n"
                       f"docker image prune -f --filter label={KIT_LABEL}=1\n"
                       f"# and docker rmi of every other {cfg.image}:* image with the label {KIT_LABEL}=1 (kept: {ref})")
            return 0
        client = engine()
        build(client, cfg, ref) if cfg.action == "build" else prune(client, cfg.image, ref)
        return 0

    env = dict(os.environ)
    user = cfg.user or f"{os.getuid()}:{os.getgid()}"
    paths = host_paths(cfg, env)
    jobs = []  # (what, spec)
    if cfg.action == "train" and not cfg.data and cfg.method != "grpo" and not cfg.rounds:  # logs -> pairs, then train
        pairs_cfg = dataclasses.replace(cfg, action="pairs")
        jobs.append(("pairs", run_spec(pairs_cfg, ref, paths, [], user, env)))
        built = Path(pairs_output(paths["data"], cfg.method)).relative_to(IN_ARTIFACTS)
        paths = {**paths, "data": str(Path(paths["output"]) / built), "eval_prompts": prompts_output(paths["data"])}
    if cfg.action == "train" and cfg.gpus:
        # the GPU side of the pre-flight, in one process before N train; Triton's test is train's (it knows the flags)
        jobs.append(("gpu check", run_spec(dataclasses.replace(cfg, action="check"), ref, paths, ["--no_triton"], user,
                                           env)))
    jobs.append((cfg.action, run_spec(cfg, ref, paths, extra, user, env)))

    if cfg.dry_run:
        if cfg.sandbox == "kit":
            print(f"# the kit's seccomp profile, out of the image:\n"
                  f"docker run --rm --entrypoint cat {ref} {seccomp_profile.IN_IMAGE} > {profile_path(cfg)}")
        for what, spec in jobs:
            spec["security_opt"] = sandbox_options(cfg, profile_path(cfg), host_apparmor())
            print(f"# {what}\n{docker_run_cli(spec, cfg.gpus, interactive=cfg.action == 'shell' and not extra)}")
        if jobs[-1][1]["command"][0] == "launch":  # what `entrypoint.py launch` runs in the container
            cmd = jobs[-1][1]["command"]
            inside = scaleout.accelerate_command(dist_config(cfg), f"{IN_KIT}/train_dpo.py", cmd[cmd.index("--") + 1:],
                                                    configs_dir=f"{IN_KIT}/configs")
            print(f"# in the container, `launch` runs (adding --run_name when none is given):\n# {shlex.join(inside)}")
        return 0
    if cfg.action in ("train", "check") and engine_is_local(env.get("DOCKER_HOST", "")) and not host_ready(cfg, extra):
        return preflight.EXIT_FAILED
    client = engine()
    if cfg.rebuild or not client.images.list(name=ref):
        build(client, cfg, ref)
    for _, spec in jobs:
        spec["security_opt"], spec["engine_security_opt"] = kit_sandbox(client, cfg, ref)
    if cfg.action == "shell" and not extra and sys.stdin.isatty():  # interactive: the docker CLI owns the TTY
        os.execvp("docker", shlex.split(docker_run_cli(jobs[-1][1], cfg.gpus, interactive=True)))
    status = 0
    for what, spec in jobs:
        print(f"[launcher] {what}: {docker_run_cli(spec, cfg.gpus)}", flush=True)
        status = run(client, spec, image_cuda(cfg))
        if status != 0:
            hint = " (the pre-flight above says what to do)" if what == "gpu check" else ""
            print(f"[launcher] {what} exited with status {status}{hint}", file=sys.stderr)
            break
    if cfg.action == "train" and cfg.prune:
        prune(client, cfg.image, ref)
    if status == 0 and cfg.action == "train":
        print(f"[launcher] done: {paths['output']}/ (adapter tarball and .sha256 beside the run directory)")
    return status


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
