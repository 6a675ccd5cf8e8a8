"""Train on a SLURM cluster: a run becomes an sbatch script the kit writes (readable, re-runnable by hand with
`sbatch`), submitted once and followed through squeue and sacct until it ends; the jobs service's `--runner slurm`.

    python slurm.py [--partition gpu --account a --time 4:00:00 --nodes 2 --gpus_per_node 8] -- --data pairs.jsonl \
        [train_dpo.py flags]                            # submit, print the job's log as it grows, exit as the run did
    python slurm.py --dry_run -- --data pairs.jsonl     # write the sbatch script and print it; submit nothing
    make train RUNNER=slurm DATA=pairs.jsonl [GPUS=8 NNODES=2] [SLURM_ARGS="--partition gpu --time 4:00:00"]
    make serve RUNNER=slurm [SLURM_ARGS=...]            # serve.py --runner slurm --slurm_args="..."

The script runs train_dpo.py with the same flags the local runner uses (one `srun` task; with several GPUs or nodes,
scaleout.py on each node: `accelerate launch` across the allocation, machine 0 from $SLURM_JOB_NODELIST), from the
kit's .venv or in its container image (apptainer or pyxis). The kit's checkout, the data and --output_dir must be on a
filesystem every node mounts. SLURM's output file is the run's log. Where files go:

    <output_dir>/slurm/<run>/train.sbatch, train.log     make train RUNNER=slurm (the run itself: <output_dir>/<run>)
    <output_dir>/serve/jobs/<job id>/train.sbatch, train.log    the service's jobs

A SLURM job's end, as the kit reads it (`outcome`): the run complete -> succeeded; a cancel -> `scancel` (SIGTERM to
every process, then the cluster's KillWait to save a checkpoint): cancelled; a pause -> `scancel --signal=TERM`
(the training saves a checkpoint and stops): paused, and resume submits again from the checkpoint; PREEMPTED or
NODE_FAIL without SLURM's own requeue: submitted again, resuming the same run (after --max_resubmits losses in a row
with no step trained between them: paused); a time limit: paused at its checkpoint.
With `--requeue` (the default) SLURM requeues a preempted job itself under the same id, and its script resumes the run.
Everything above the "Edges" line is pure: tested without SLURM.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from dpokit.core import kit, runs
from dpokit.train import config
from dpokit.service import jobs
from dpokit.core.kit import UserError, field
from dpokit.service.jobs import now

ROOT = kit.ROOT
NAME_PREFIX = "dpo-kit-"  # a SLURM job's name is this + the run name: how a lost job id is found again
TIME_LIMIT = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2}|UNLIMITED)$")
WORD = re.compile(r"^[A-Za-z0-9_.,:@+-]+$")  # a partition, account or image reference: nothing a script would expand
# SLURM's states (squeue %T, sacct State), by what they mean for the run
LIVE = jobs.SLURM_WAITING + ("RUNNING", "COMPLETING", "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED")
LOST_NODE = ("PREEMPTED", "NODE_FAIL", "BOOT_FAIL")  # not the run's fault: submitted again, it resumes


@dataclasses.dataclass
class SlurmConfig:
    nodes: int = field(1, "nodes for each run (one launcher task per node; accelerate across them)")
    gpus_per_node: str = field("", "GPUs on each node (#SBATCH --gpus-per-node), one training process per GPU; "
                               "'' = none requested (the CPU)")
    partition: str = field("", "#SBATCH --partition ('' = the cluster's default)")
    account: str = field("", "#SBATCH --account ('' = yours by default)")
    time: str = field("", "time limit, SLURM's format (4:00:00, 1-12:00:00; '' = the partition's). The training "
                      "gets SIGTERM --stop_seconds before it, saves a checkpoint and is paused, resumable")
    stop_seconds: int = field(300, "with --time: seconds before the limit at which SLURM sends the training SIGTERM")
    cpus_per_task: int = field(0, "#SBATCH --cpus-per-task (0 = not set: the cluster's default)")
    container: str = field("", "run the training in this image instead of the kit's .venv: a .sif file (apptainer) "
                           "or an image reference (pyxis/enroot); the kit's image has the kit at /opt/kit")
    container_runtime: str = field("apptainer", "how the cluster runs containers", choices=("apptainer", "pyxis"))
    requeue: bool = field(True, "#SBATCH --requeue: a preempted or failed node's job is requeued by SLURM under its id")
    max_resubmits: int = field(3, "the service: a job that lost its node (PREEMPTED, NODE_FAIL, BOOT_FAIL, not "
                               "requeued by SLURM) is submitted again, up to this many times in a row without a "
                               "step trained in between; then it is paused at its checkpoint, for resume")
    sbatch_args: str = field("", "more sbatch options, each written into the script as an #SBATCH line "
                             "(--sbatch_args='--qos=high --constraint=a100')")
    python: str = field("", "the kit's Python on the nodes ('' = this one, the .venv's); ignored with --container")
    poll_seconds: float = field(10.0, "how often squeue is asked about the runs it follows")
    dry_run: bool = field(False, "write the sbatch script and print it; submit nothing")

    def problems(self) -> list[str]:
        p = []
        if self.nodes < 1:
            p.append(f"--nodes must be at least 1 (got {self.nodes})")
        if self.gpus_per_node and not self.gpus_per_node.isdigit():
            p.append(f"--gpus_per_node {self.gpus_per_node!r}: expected a count")
        if self.time and not TIME_LIMIT.match(self.time):
            p.append(f"--time {self.time!r}: expected SLURM's time format (minutes, H:MM:SS or D-HH:MM:SS)")
        for name in ("partition", "account", "container"):
            value = getattr(self, name)
            if value and not WORD.match(value.replace("/", "")):
                p.append(f"--{name} {value!r}: letters, digits and _.,:@+-/ only")
        try:
            extra = shlex.split(self.sbatch_args)
        except ValueError as e:
            extra = []
            p.append(f"--sbatch_args: {e}")
        if any(not a.startswith("-") or "\n" in a for a in extra):
            p.append("--sbatch_args: each option as one word with its value after = (--qos=high), no newlines")
        if self.poll_seconds <= 0 or min(self.stop_seconds, self.cpus_per_task, self.max_resubmits) < 0:
            p.append("--poll_seconds must be positive, --stop_seconds, --cpus_per_task and --max_resubmits not "
                     "negative")
        return p


# ---------------------------------------------------------------------------------------------
# Pure helpers: the script, the names, the parsing of SLURM's answers, what a job's end means.
# ---------------------------------------------------------------------------------------------

def job_name(run_name: str) -> str:
    return f"{NAME_PREFIX}{run_name}"


def distributed(cfg: SlurmConfig) -> bool:
    """More than one training process: scaleout.py (accelerate launch) on each node."""
    return cfg.nodes > 1 or int(cfg.gpus_per_node or 0) > 1


def training_command(cfg: SlurmConfig, train_args: list[str], python: str, kit_dir: str) -> str:
    """The shell command each node's task runs: train_dpo.py, or scaleout.py with this node's place in the
    allocation ($SLURM_NNODES, $SLURM_NODEID, $MASTER_ADDR, $MASTER_PORT are expanded on the node)."""
    flags = shlex.join(train_args)
    if not distributed(cfg):
        return f"{shlex.quote(python)} {shlex.quote(kit_dir + '/train_dpo.py')} {flags}"
    return (f"{shlex.quote(python)} {shlex.quote(kit_dir + '/scaleout.py')} --nproc {int(cfg.gpus_per_node or 1)} "
            '--nnodes "$SLURM_NNODES" --node_rank "$SLURM_NODEID" --master_addr "$MASTER_ADDR" '
            f'--master_port "$MASTER_PORT" -- {flags}')


def container_prefix(cfg: SlurmConfig, binds: list[str]) -> tuple[list[str], str]:
    """(srun's own options, the command prefix) that run a task in cfg.container, with binds (the shared
    directories: data, output) at the same paths inside, so every path in the flags holds there too."""
    if not cfg.container:
        return [], ""
    mounts = ",".join(f"{b}:{b}" for b in binds)
    if cfg.container_runtime == "pyxis":
        return [f"--container-image={cfg.container}", f"--container-mounts={mounts}",
                "--container-workdir=/opt/kit"], ""
    gpu = "--nv " if cfg.gpus_per_node else ""
    return [], f"apptainer exec {gpu}--bind {shlex.quote(mounts)} --pwd /opt/kit {shlex.quote(cfg.container)} "


def sbatch_script(cfg: SlurmConfig, run_name: str, log: str, train_args: list[str], python: str, kit_dir: str,
                  binds: list[str] = ()) -> str:
    """The whole sbatch script for one run. train_args: train_dpo.py's, with absolute --data and --output_dir
    and the run's --run_name (a requeued or resubmitted job resumes the same run)."""
    in_image = bool(cfg.container)
    kit_dir, python = ("/opt/kit", "python") if in_image else (kit_dir, python)
    opts = [f"--job-name={job_name(run_name)}", f"--output={log}", "--open-mode=append", f"--nodes={cfg.nodes}",
            "--ntasks-per-node=1"]
    opts += [f"--gpus-per-node={cfg.gpus_per_node}"] if cfg.gpus_per_node else []
    opts += [f"--cpus-per-task={cfg.cpus_per_task}"] if cfg.cpus_per_task else []
    opts += [f"--partition={cfg.partition}"] if cfg.partition else []
    opts += [f"--account={cfg.account}"] if cfg.account else []
    opts += [f"--time={cfg.time}"] if cfg.time else []
    opts += [f"--signal=TERM@{cfg.stop_seconds}"] if cfg.time and cfg.stop_seconds else []
    opts += ["--requeue" if cfg.requeue else "--no-requeue", *shlex.split(cfg.sbatch_args)]
    srun_opts, prefix = container_prefix(cfg, list(binds))
    srun = shlex.join(["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", *srun_opts])
    command = prefix + training_command(cfg, train_args, python, kit_dir)
    task = command if not distributed(cfg) else f"bash -c {shlex.quote('exec ' + command)}"
    return "\n".join([
        "#!/bin/bash",
        f"# dpo-kit: train run {run_name} on SLURM (written by slurm.py). Re-run by hand: sbatch <this file>; the same",
        "# run resumes from its last checkpoint. Its log is the --output file below.",
        *(f"#SBATCH {o}" for o in opts),
        "set -euo pipefail",
        f"cd {shlex.quote(str(ROOT) if not in_image else kit_dir)}",
        "export PYTHONUNBUFFERED=1",
        "# Machine 0 of the allocation hosts accelerate's rendezvous, on a port of this job's own",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        'echo "[slurm] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST: $(date -Is)"',
        "# scancel and preemption signal the training itself; this shell waits for it to save its checkpoint",
        "trap 'echo \"[slurm] SIGTERM: the training saves a checkpoint and stops\"' TERM",
        f"{srun} {task}",
        "",
    ])


def parse_job_id(sbatch_output: str) -> str:
    """`sbatch --parsable` prints <id> or <id>;<cluster>."""
    text = sbatch_output.strip().splitlines()[-1] if sbatch_output.strip() else ""
    job_id = text.split(";")[0].strip()
    if not job_id.isdigit():
        raise ValueError(f"sbatch printed no job id: {sbatch_output.strip()!r}")
    return job_id


def parse_states(text: str) -> dict[str, str]:
    """squeue -h -o '%i|%T' or sacct -n -P -o JobID,State lines -> {job id: state} (CANCELLED by 0 -> CANCELLED;
    a job's steps, 12.batch, skipped)."""
    states = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 2 and parts[0].isdigit():
            states[parts[0]] = parts[1].split()[0] if parts[1].strip() else ""
    return states


def exit_status(exit_code: str) -> int | None:
    """sacct's ExitCode `code:signal` as a shell's status: 143:0 -> 143, 0:9 (killed by SIGKILL) -> 137."""
    code, _, sig = exit_code.partition(":")
    if not code.isdigit():
        return None
    return 128 + int(sig) if sig.isdigit() and int(sig) and not int(code) else int(code)


def outcome(state: str | None, complete: bool, run_state: str | None, stop: str | None) -> str:
    """What the service makes of a SLURM job that has left the queue, from SLURM's final state (None when the
    cluster no longer knows it), whether the run is complete, status.json's state and the service's stop request:
    succeeded, cancelled, paused, resubmit, or reap (the local rules: the exit code and status.json's error)."""
    if complete:
        return "succeeded"
    if stop in ("cancel", "pause"):
        return {"cancel": "cancelled", "pause": "paused"}[stop]
    if state == "CANCELLED":
        return "cancelled"  # scancel from outside the service
    if state in LOST_NODE:
        return "resubmit"
    if state in ("TIMEOUT", "DEADLINE") or run_state == "cancelled":
        return "paused"  # a signal stopped the training at a checkpoint (the time limit, scancel --signal)
    return "reap"


def losses_in_a_row(count: int, last_step: int | None, step: int | None) -> int:
    """Node losses in a row, this one counted: count (those before it) goes on unless the run trained a step
    since the last loss (step, the run's step now, past last_step, its step then), when the count starts again.
    A preemptible partition's job that trains between preemptions is submitted again for ever; one whose node
    dies before it trains a step stops after --max_resubmits."""
    return 1 if step is not None and (last_step is None or step > last_step) else count + 1


# ---------------------------------------------------------------------------------------------
# Edges: sbatch, squeue, sacct, scancel.
# ---------------------------------------------------------------------------------------------

def slurm_env() -> dict:
    """The environment a job is submitted with (sbatch exports it to the job): the service's API key stays here."""
    return {k: v for k, v in os.environ.items() if k != "DPO_KIT_API_KEY"}


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=slurm_env())
    except FileNotFoundError:
        raise UserError(f"{cmd[0]} is not on the PATH: run this on a machine of the SLURM cluster (a login node)") \
            from None
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"{cmd[0]} did not answer in {timeout:.0f}s")


def submit(script: Path) -> str:
    """sbatch the script; its job id. A refusal (no such partition, account, time limit too long) is a UserError."""
    done = _run(["sbatch", "--parsable", str(script)])
    if done.returncode != 0:
        raise UserError(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
    return parse_job_id(done.stdout)


def live_states(job_ids: list[str]) -> dict[str, str] | None:
    """{id: state} for the jobs still in SLURM's queue (pending, running, completing); a job missing from the
    answer has left it. None when squeue could not answer (the controller busy or down): nothing is concluded."""
    if not job_ids:
        return {}
    done = _run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i|%T"])
    if done.returncode != 0:
        return {} if "Invalid job id" in done.stderr else None  # one id, already gone from the controller
    return {k: v for k, v in parse_states(done.stdout).items() if v in LIVE}


def final_state(job_id: str) -> tuple[str | None, int | None]:
    """(state, exit status) of a job that has left the queue: the controller's (scontrol keeps a finished job for
    MinJobAge seconds), else accounting's (sacct; a state it has not caught up with yet is not taken), else
    (None, None)."""
    done = _run(["scontrol", "show", "job", job_id])
    found = dict(re.findall(r"(JobState|ExitCode)=(\S+)", done.stdout)) if done.returncode == 0 else {}
    if found.get("JobState") and found["JobState"] not in LIVE:
        return found["JobState"], exit_status(found.get("ExitCode", ""))
    done = _run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,State,ExitCode"])
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        parts = line.split("|")
        if parts[0] == job_id and len(parts) >= 3 and parts[1].split()[0] not in LIVE:
            return parts[1].split()[0], exit_status(parts[2])
    return None, None


def find_jobs(run_name: str, since: int | None = None) -> list[str]:
    """SLURM job ids named for this run: live ones (squeue), and with since (epoch seconds) ones sacct recorded
    from then on. How a job submitted just before the service died, its id unrecorded, is found again."""
    done = _run(["squeue", "-h", "--name", job_name(run_name), "-o", "%i|%T"])
    found = list(parse_states(done.stdout)) if done.returncode == 0 else []
    if since is not None:
        start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since - 60))
        done = _run(["sacct", "-X", "-n", "-P", "--name", job_name(run_name), "-S", start, "-o", "JobID,State"])
        found += [j for j in parse_states(done.stdout) if j not in found] if done.returncode == 0 else []
    return sorted(found, key=int)


def stop(job_id: str, kind: str) -> bool:
    """cancel: scancel (SLURM sends SIGTERM, then SIGKILL after the cluster's KillWait; the job is CANCELLED);
    pause: scancel --signal=TERM to a running job (the training saves a checkpoint and stops; the job ends with
    its status), and a job still pending, which has nothing to save, is cancelled (a signal would not reach it).
    True once SLURM confirmed it (or the job has already ended); False when scancel failed or timed out (the
    controller busy or down): the caller asks again. A pause cancels a pending job first, so one that starts in
    between still gets the signal, and the SIGTERM comes last: a retry never repeats one SLURM took (a second
    could cut the training's checkpoint short)."""
    commands = [["scancel", job_id]] if kind == "cancel" else [
        ["scancel", "--state=PENDING", job_id], ["scancel", "--state=RUNNING", "--signal=TERM", job_id]]
    return all(scancel_confirmed(_run(command)) for command in commands)


def scancel_confirmed(done: subprocess.CompletedProcess) -> bool:
    """scancel did what it was asked, or there is nothing left to ask: the job has already ended, or SLURM no
    longer knows it."""
    return done.returncode == 0 or any(s in done.stderr for s in ("Invalid job id", "already completing or completed"))


def write_script(cfg: SlurmConfig, workdir: Path, run_name: str, train_args: list[str]) -> Path:
    """<workdir>/train.sbatch for this run (written to a temporary name, then renamed); the log beside it."""
    output_dir = train_args[train_args.index("--output_dir") + 1]
    data = train_args[train_args.index("--data") + 1]
    binds = sorted({str(Path(output_dir).resolve()), str(Path(data).resolve().parent)})
    text = sbatch_script(cfg, run_name, str(workdir / "train.log"), train_args, cfg.python or sys.executable,
                         str(ROOT), binds)
    path = workdir / "train.sbatch"
    kit.atomic_write_text(path, text)
    path.chmod(0o755)
    return path


def follow(job_id: str, log: Path, offset: int, poll_seconds: float) -> str | None:
    """Print the job's log as it grows until the job leaves the queue; its final state. Ctrl-C: the training
    saves a checkpoint and stops (scancel --signal=TERM); a second Ctrl-C stops following, the job runs on."""
    signalled = False
    while True:
        try:
            time.sleep(poll_seconds)
            if log.exists():
                with open(log, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            live = live_states([job_id])
            if live is not None and job_id not in live:
                return final_state(job_id)[0]
        except KeyboardInterrupt:
            if signalled:
                print(f"\n[slurm] stopped following; job {job_id} runs on (scancel {job_id} stops it)", file=sys.stderr)
                return None
            stop(job_id, "pause")
            signalled = True
            print(f"\n[slurm] SIGTERM sent to job {job_id}: the training saves a checkpoint and stops; the same "
                  "command resumes it (Ctrl-C again: stop following)", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# The jobs service's scheduler with SLURM in place of child processes (serve.py --runner slurm).
# ---------------------------------------------------------------------------------------------

class SlurmScheduler(jobs.Scheduler):
    """A job is submitted once: it is marked running with its submission time, sbatch'd, and its SLURM job id
    stored before anything follows it (the APIs say queued while SLURM holds it waiting: jobs.public_status).
    squeue says when it has left the queue; sacct how it ended (`outcome`).
    The service stopping (SIGTERM, kill -9) leaves SLURM's jobs alone; started again, it follows each by its
    stored id (or, when the service died between sbatch and storing the id, finds it by its name), and jobs
    that ended meanwhile are reaped on the first poll."""

    def __init__(self, cfg, store):
        self.slurm = kit.parse_config(SlurmConfig, shlex.split(cfg.slurm_args), __doc__)
        self.slurm_jobs: dict[str, str] = {}  # the service's job id -> its SLURM job id
        self.states: dict[str, str] = {}  # the last SLURM state said in an event
        self.signalled: set[str] = set()
        self.next_poll = 0.0
        super().__init__(cfg, store)

    def recover_job(self, job: dict) -> None:
        slurm_id = job["slurm_job_id"]
        if slurm_id is None and job["submitted_at"]:  # sbatch ran; the service died before it stored the id
            found = find_jobs(job["id"], since=job["submitted_at"])
            slurm_id = found[-1] if found else None
            if slurm_id:
                self.store.update_job(job["id"], slurm_job_id=slurm_id)
        if slurm_id is None:
            return super().recover_job(job)  # never reached SLURM: back to the queue
        self.slurm_jobs[job["id"]] = slurm_id
        self.store.event(job["id"], f"The service restarted: following SLURM job {slurm_id} again",
                         data={"slurm_job_id": slurm_id})

    def active(self) -> int:
        return len(self.slurm_jobs)

    def launch(self, job: dict) -> bool:
        if self.run_locked(job):
            return False
        submitted = now()
        if not self.store.move(job["id"], ("queued",), status="running", waiting_on=None, slurm_job_id=None,
                               submitted_at=submitted):
            return True  # cancelled or paused a moment ago
        last = runs.last_checkpoint(runs.Run(self.out, job["id"]).checkpoints)
        script = write_script(self.slurm, self.store.jobs_dir / job["id"], job["id"], jobs.job_flags(self.cfg, job))
        try:
            slurm_id = submit(script)
        except Exception as e:  # noqa: BLE001 - refused (UserError); or sbatch timed out or answered without an
            # id, and the controller may have taken the job all the same: it is looked for by name before it fails
            found = find_jobs(job["id"], since=submitted)
            if not found:
                refused = isinstance(e, UserError)
                self.fail(job, "slurm_refused" if refused else "slurm_submit_failed",
                          str(e) if refused else jobs.surprise_message(e, "submitting it to SLURM"))
                return True
            slurm_id = found[-1]
        self.store.update_job(job["id"], slurm_job_id=slurm_id, slurm_state="PENDING")  # queued until it runs
        self.slurm_jobs[job["id"]] = slurm_id
        self.store.event(job["id"], (f"Resuming from {last.name}: s" if last else "S")
                         + f"ubmitted as SLURM job {slurm_id} ({script})", data={"slurm_job_id": slurm_id})
        return True

    def follow_running(self) -> None:
        for job_id, slurm_id in list(self.slurm_jobs.items()):
            with self.one_job(job_id, "following its SLURM job"):
                job = self.store.job(job_id)
                self.follow_metrics(job)
                if job["stop_request"] and job_id not in self.signalled and stop(slurm_id, job["stop_request"]):
                    self.signalled.add(job_id)  # once SLURM confirmed: a scancel that failed is sent again
        if time.monotonic() < self.next_poll or not self.slurm_jobs:
            return
        self.next_poll = time.monotonic() + self.slurm.poll_seconds
        live = live_states(list(self.slurm_jobs.values()))
        if live is None:  # squeue did not answer: nothing is concluded from silence
            return
        for job_id, slurm_id in list(self.slurm_jobs.items()):
            with self.one_job(job_id, "following its SLURM job"):
                state = live.get(slurm_id)
                if state is None:
                    self.ended(self.store.job(job_id), slurm_id)
                elif state != self.states.get(job_id):
                    self.states[job_id] = state
                    self.store.update_job(job_id, slurm_state=state)
                    self.store.event(job_id, f"SLURM job {slurm_id}: {state}",
                                     data={"slurm_job_id": slurm_id, "slurm_state": state})

    def abandon(self, job_id: str) -> None:
        """A job the service gives up on (`one_job`): its SLURM job, if it has one, is cancelled and no longer
        followed."""
        slurm_id = self.slurm_jobs.pop(job_id, None)
        self.states.pop(job_id, None)
        self.signalled.discard(job_id)
        if slurm_id is not None:
            stop(slurm_id, "cancel")

    def ended(self, job: dict, slurm_id: str) -> None:
        """The SLURM job has left the queue: what its end means for the service's job (`outcome`)."""
        del self.slurm_jobs[job["id"]]
        self.states.pop(job["id"], None)
        self.signalled.discard(job["id"])
        state, rc = final_state(slurm_id)
        self.follow_metrics(job)
        run = runs.Run(self.out, job["id"])
        status = runs.read_json((run.final if run.final.exists() else run.partial) / "status.json")
        what = outcome(state, run.final.exists(), status.get("state"), job["stop_request"])
        said = f"SLURM job {slurm_id} ended {state or '(no record: sacct and scontrol do not know it)'}"
        step = status.get("step")
        self.store.update_job(job["id"], slurm_state=None)
        values, level = None, "info"  # an end of SLURM's own, no stop asked: what the job becomes, and its event
        if what == "resubmit":
            n, most = losses_in_a_row(job["resubmits"] or 0, job["resubmit_step"], step), self.slurm.max_resubmits
            if n > most:
                values, level = {"status": "paused", "resubmits": 0, "resubmit_step": None}, "warn"
                message = (f"{said}, its node lost {n} time{'s' * (n > 1)} in a row with no step trained in between: "
                           f"not submitted again (--max_resubmits {most}); paused at its checkpoint (step {step}), "
                           "resume submits it again")
            else:
                values = {"status": "queued", "resubmits": n, "resubmit_step": step}
                message = (f"{said}: submitted again ({n} of at most {most} in a row without a step trained), it "
                           "resumes from its checkpoint")
        elif what == "paused" and not job["stop_request"]:
            values = {"status": "paused"}
            message = f"{said}: the training stopped with a checkpoint (step {step}); resume continues it"
        elif what == "cancelled" and not job["stop_request"]:
            values = {"status": "cancelled", "finished_at": now()}
            message = f"{said} (scancel outside the service); its checkpoint (step {step}) is kept"
        if values is not None:
            if self.store.move(job["id"], ("running",), unstopped=True, said=message, level=level, **values):
                return None
            job = self.store.job(job["id"])  # a cancel or pause came in since the job was read: it decides
        self.store.event(job["id"], said, data={"slurm_job_id": slurm_id, "slurm_state": state})
        self.reap(job, rc if rc is not None else 0 if state == "COMPLETED" else 1)

    def stop_all(self) -> None:
        """The service is stopping: SLURM's jobs run on, and the service follows them again when it starts. An
        export in progress (a process here) is stopped and queued again."""
        self.stop_export()
        for job_id, slurm_id in self.slurm_jobs.items():
            self.store.event(job_id, f"The service stopped; SLURM job {slurm_id} runs on")


def main(argv=None) -> int:
    own, train_args = config.split_args(list(sys.argv[1:] if argv is None else argv))
    cfg = kit.parse_config(SlurmConfig, own, __doc__)
    train_cfg, train_args, _ = config.run_dir_for(train_args, "ddp")  # checks the flags and data; fixes the name
    train_args = absolute_paths(train_args, train_cfg.data, train_cfg.output_dir)
    run = runs.Run(train_cfg.output_dir, train_cfg.run_name)
    workdir = Path(train_cfg.output_dir).resolve() / "slurm" / run.name
    workdir.mkdir(parents=True, exist_ok=True)
    script = write_script(cfg, workdir, run.name, train_args)
    if cfg.dry_run:
        print(script.read_text(), end="")
        print(f"[slurm] dry run: {script} written, nothing submitted")
        return 0
    log = workdir / "train.log"
    offset = log.stat().st_size if log.exists() else 0
    running = find_jobs(run.name)
    if running:  # never a second job for one run: follow the one SLURM has
        job_id = running[-1]
        print(f"[slurm] run {run.name} is already SLURM job {job_id}: following it (log {log})", flush=True)
    else:
        holder = runs.lock_text(train_cfg.output_dir, run.name)
        if holder is not None:
            raise UserError(f"run {run.name} is in use by {runs.holder_words(holder)}; wait for it, or choose "
                            "another RUN=")
        job_id = submit(script)
        print(f"[slurm] submitted {script} as job {job_id}; log {log}", flush=True)
    state = follow(job_id, log, offset, cfg.poll_seconds)
    if state is None:
        return 130
    status = runs.read_json((run.final if run.final.exists() else run.partial) / "status.json")
    print(f"[slurm] job {job_id} ended {state or '(no record in sacct)'}; run {run.name}: {status.get('state')}",
          flush=True)
    if run.final.exists() and status.get("state") == "succeeded":
        return 0
    if status.get("state") == "cancelled":
        print(f"[slurm] resume with the same command (RUN={run.name})", file=sys.stderr)
        return 143
    return kit.EXIT_USAGE if str(status.get("error") or "").startswith(("bad options", "run ")) else 1


def absolute_paths(train_args: list[str], data: str, output_dir: str) -> list[str]:
    """--data and --output_dir first and absolute (the script runs from the kit's directory, maybe on another
    machine); the flags' other spellings (--data=x, --output-dir x) dropped."""
    rest, skip = [], False
    for a in train_args:
        if skip:
            skip = False
        elif a in ("--data", "--output_dir", "--output-dir"):
            skip = True
        elif not a.startswith(("--data=", "--output_dir=", "--output-dir=")):
            rest.append(a)
    return ["--data", str(Path(data).resolve()), "--output_dir", str(Path(output_dir).resolve()), *rest]


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
