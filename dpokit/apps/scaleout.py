"""Train data-parallel over several processes, GPUs and machines: `accelerate launch` runs train_dpo.py once per
process, and this wrapper names the failing rank in the run's status.json when one fails.

    python scaleout.py --nproc 4 -- --data pairs.jsonl [train_dpo flags]      # 4 processes (GPUs) on this machine
    python scaleout.py --nproc 8 --nnodes 2 --node_rank 1 --master_addr 10.0.0.1 -- --data pairs.jsonl
    python scaleout.py --nproc 4 --dist zero2 -- ...     # DeepSpeed ZeRO-2 (configs/zero2.yaml; needs deepspeed)
    python scaleout.py ... --dry_run                     # print the accelerate launch command, run nothing
    make train GPUS=4 | make train NPROC=2 (CPU processes, gloo) | make train GPUS=8 NNODES=2 NODE_RANK=1 MASTER_ADDR=...
    (in the container: entrypoint.py launch ...; launcher.py builds that command for RUNNER=docker)

--nproc is processes per machine (default: the count given by --gpus, else 1); accelerate's --num_processes is
the total over all machines. Without a GPU the processes train on the CPU over gloo. Every process runs the same
train_dpo.py; only global rank 0 writes the run directory, status.json, the manifest and the tarball. The wrapper
runs accelerate's own launcher (torch.distributed.run underneath) in this process, so when a process fails it
learns which global rank failed first and with what exit code, and writes status `failed` with `"rank": N`.

Everything above the "Edges" line is pure and standard-library only: launcher.py imports it on a host without torch.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shlex
import signal
import sys
from pathlib import Path

from dpokit.core import kit, ranks, runs
from dpokit.train import training
from dpokit.train.config import run_dir_for, split_args
from dpokit.core.kit import UserError, field

ROOT = kit.ROOT
DIST_CONFIGS = {"ddp": None, "zero2": "configs/zero2.yaml", "zero3": "configs/zero3.yaml", "fsdp": "configs/fsdp.yaml"}
SHUTDOWN_TIMEOUT = 120  # seconds torchrun lets the other ranks save a checkpoint after a signal before SIGKILL
@dataclasses.dataclass
class DistConfig:
    nproc: int | None = field(None, "processes on this machine (default: as many as --gpus names, else 1)")
    gpus: str = field("", "GPUs on this machine: a count, ids like 0,1 (CUDA_VISIBLE_DEVICES), or all; "
                      "empty = every visible one (or the CPU)")
    nnodes: int = field(1, "machines taking part (each runs this same command with its own --node_rank)")
    node_rank: int = field(0, "this machine's index, 0 .. nnodes-1; machine 0 hosts the rendezvous and writes the run")
    master_addr: str = field("", "address of machine 0 that the others reach (needed when nnodes > 1)")
    master_port: int = field(29500, "TCP port on machine 0 for the rendezvous")
    dist: str = field("ddp", "ddp = plain data parallel (each process a whole model); zero2 / zero3 = DeepSpeed; "
                      "fsdp = PyTorch FSDP (configs/<dist>.yaml)", choices=tuple(DIST_CONFIGS))
    dry_run: bool = field(False, "print the accelerate launch command and run nothing")

    def problems(self) -> list[str]:
        p = []
        if self.nproc is not None and self.nproc < 1:
            p.append(f"--nproc (NPROC) must be at least 1 (got {self.nproc})")
        if self.gpus and not (self.gpus == "all" or all(x.strip().isdigit() for x in self.gpus.split(","))):
            p.append(f"--gpus (GPUS) {self.gpus!r}: expected all, a count, or device ids like 0,1")
        elif self.gpus == "0":
            p.append("--gpus (GPUS) 0: no GPUs; leave GPUS empty to train on the CPU")
        if self.nnodes < 1:
            p.append(f"--nnodes (NNODES) must be at least 1 (got {self.nnodes})")
        elif not 0 <= self.node_rank < self.nnodes:
            p.append(f"--node_rank (NODE_RANK) must be in 0..{self.nnodes - 1} for {self.nnodes} machine(s) "
                     f"(got {self.node_rank})")
        if self.nnodes > 1 and not self.master_addr:
            p.append("--master_addr (MASTER_ADDR) is required with more than one machine: the address of machine 0")
        if not 0 < self.master_port < 65536:
            p.append(f"--master_port (MASTER_PORT) must be a TCP port 1..65535 (got {self.master_port})")
        if self.dist not in DIST_CONFIGS:
            p.append(f"--dist (DIST) {self.dist!r}: expected one of {', '.join(DIST_CONFIGS)}")
        return p


# ---------------------------------------------------------------------------------------------
# Pure helpers: tested without a model.
# ---------------------------------------------------------------------------------------------

def processes_per_node(nproc: int | None, gpus: str) -> int:
    """--nproc when given; else one process per GPU named by --gpus (4 -> 4, "0,3" -> 2); else (all, none) 1."""
    if nproc is not None:
        return nproc
    if gpus.isdigit():
        return int(gpus)
    if "," in gpus:
        return len([g for g in gpus.split(",") if g.strip()])
    return 1


def is_distributed(cfg: DistConfig) -> bool:
    """Whether the job needs accelerate launch at all (one plain process otherwise)."""
    return processes_per_node(cfg.nproc, cfg.gpus) > 1 or cfg.nnodes > 1 or cfg.dist != "ddp"


def accelerate_command(cfg: DistConfig, script: str, script_args: list[str], accelerate: str = "accelerate",
                       configs_dir: str = "configs") -> list[str]:
    """`accelerate launch ...` for this machine. accelerate counts processes over all machines
    (--num_processes = per machine x machines); --multi_gpu is its name for torchrun-style data parallel,
    which on a machine without CUDA runs on the CPU over gloo."""
    per_node = processes_per_node(cfg.nproc, cfg.gpus)
    cmd = [accelerate, "launch", "--num_processes", str(per_node * cfg.nnodes), "--num_machines", str(cfg.nnodes)]
    if cfg.nnodes > 1:
        cmd += ["--machine_rank", str(cfg.node_rank), "--main_process_ip", cfg.master_addr]
    cmd += ["--main_process_port", str(cfg.master_port)]
    if cfg.gpus and "," in cfg.gpus:
        cmd += ["--gpu_ids", ",".join(g.strip() for g in cfg.gpus.split(","))]
    if DIST_CONFIGS.get(cfg.dist):
        cmd += ["--config_file", f"{configs_dir}/{Path(DIST_CONFIGS[cfg.dist]).name}"]
    elif per_node * cfg.nnodes > 1:
        cmd += ["--multi_gpu"]
    # Precision comes from train_dpo's own flags (TrainingArguments bf16/fp16); no dynamo.
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    return cmd + [script, *script_args]


def failure_status(records: list[dict], first_failure: dict | None, exit_code: int) -> dict:
    """status.json fields for a failed distributed run.

    records: what failing ranks wrote ({"rank", "error", "at" (epoch seconds)}); first_failure: what the
    launcher saw first ({"rank", "exitcode"}) or None. The root cause is the launcher's first failure
    (it also sees ranks killed before they could write anything: -9 is SIGKILL, often out of memory),
    else the earliest record; the other ranks usually fail only because a peer went away."""
    by_rank = {r["rank"]: r for r in records}
    if first_failure is not None:
        rank = first_failure["rank"]
        code = first_failure.get("exitcode")
        error = by_rank[rank]["error"] if rank in by_rank else (
            f"process exited with {code}" + (f" (killed by signal {-code}"
                                              + (": SIGKILL, often out of memory)" if code == -9 else ")")
                                              if isinstance(code, int) and code < 0 else ""))
    elif records:
        first = min(records, key=lambda r: r["at"])
        rank, error = first["rank"], first["error"]
    else:
        rank, error = None, f"accelerate launch exited with status {exit_code}; no rank recorded an error"
    return {"rank": rank, "error": error, "failed_ranks": sorted({*by_rank, *([rank] if rank is not None else [])}),
            "exit_code": exit_code}


# ---------------------------------------------------------------------------------------------
# Edges: run accelerate's launcher and own the final status.
# ---------------------------------------------------------------------------------------------

def write_failure(partial: Path, summary: dict, since: str) -> None:
    """Turn the run's status to failed, naming the rank (rank 0 may have been killed before it could); only
    when this launch got as far as touching the run (status written at or after `since`, ISO UTC seconds):
    a refused resume must not mark someone's earlier run failed."""
    old = runs.read_json(partial / "status.json")
    if not any(h["at"] >= since for h in old.get("history", [])):
        return
    if old.get("state") == "cancelled" and summary["rank"] is None:
        return  # a signal stopped it and rank 0 saved a checkpoint: resumable, not failed
    runs.write_status(partial, old.get("run_name", partial.name.removesuffix(".partial")), "failed", **summary)


def launch(cfg: DistConfig, train_args: list[str]) -> int:
    """Run train_dpo.py in every process through accelerate's launcher; on failure, name the rank."""
    train_cfg, train_args, partial = run_dir_for(train_args, cfg.dist)
    if not is_distributed(cfg):  # one plain process: nothing to launch
        print(f"[launch] one process: {shlex.join(['python', 'train_dpo.py', *train_args])}", flush=True)
        if cfg.dry_run:
            return 0

        return training.exit_code(training.run(train_cfg))
    cmd = accelerate_command(cfg, str(ROOT / "train_dpo.py"), train_args, configs_dir=str(ROOT / "configs"))
    print(f"[launch] {shlex.join(['accelerate', *cmd[1:]])}", flush=True)
    if cfg.dry_run:
        return 0
    if cfg.dist.startswith("zero"):
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise UserError(f"DIST={cfg.dist} needs DeepSpeed: pip install -r requirements-deepspeed.txt "
                            "(or build the image with EXTRAS=deepspeed)")
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(cmd[2:])
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT))
    since = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    try:
        launch_command(args)
        return 0
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        first = {"rank": rank, "exitcode": failure.exitcode}
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # killed by signal N: 128 + N
    except KeyboardInterrupt:
        return 128 + signal.SIGINT  # torchrun has stopped the ranks; rank 0 saved a checkpoint (cancelled)
    except Exception as e:  # noqa: BLE001 - torchrun's SignalException and friends
        if type(e).__name__ == "SignalException":
            return 128 + int(getattr(e, "sigval", signal.SIGTERM))
        raise
    if cfg.node_rank == 0 and partial.is_dir():  # machine 0 owns the run directory
        records = [json.loads(p.read_text()) for p in sorted((partial / ranks.FAILURES_DIR).glob("rank-*.json"))]
        summary = failure_status(records, first, code)
        write_failure(partial, summary, since)
        root = next((r for r in records if r["rank"] == summary["rank"]), {})
        print(f"[launch] failed: rank {summary['rank']}: {summary['error']}\n[launch] state kept in {partial}; "
              f"the same command resumes from the last checkpoint", file=sys.stderr)
        if root.get("user_error"):
            return kit.EXIT_USAGE
    return code


def main(argv=None) -> int:
    own, train_args = split_args(list(sys.argv[1:] if argv is None else argv))
    cfg = kit.parse_config(DistConfig, own, __doc__)
    return launch(cfg, train_args)


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
