"""slurm.py: the sbatch script, SLURM's answers and what a job's end means, on worked examples (no SLURM needed); then,
marked `slurm`, against a real one-node cluster (.ci/slurm-cluster.sh; make test-slurm starts it): the jobs service
with --runner slurm driven by the openai SDK (a job succeeds, one is paused, resumed and cancelled, the service is
stopped and killed -9 mid-job), and make train RUNNER=slurm against the same training run locally.

    .venv/bin/python -m pytest -q tests/test_slurm.py -m "not slurm"      # the pure part (make test runs it)
    make test-slurm                                                      # starts the cluster, runs the rest
"""

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from dpokit.service import jobs
from dpokit.core import runs
from dpokit.service import serve
from dpokit.service import service as service_app
from dpokit.service import slurm
from dpokit.service.slurm import SlurmConfig
from test_serve import TRAIN_ARGS, Service, job_log, needs_model, openai_pairs, wait_for

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ pure helpers, no SLURM

def test_one_node_script_runs_train_dpo_once_with_the_flags_the_local_runner_uses(tmp_path):
    flags = ["--data", "/shared/p.jsonl", "--output_dir", "/shared/art", "--run_name", "ftjob-1", "--beta", "0.2"]
    text = slurm.sbatch_script(SlurmConfig(partition="gpu", account="lab", time="1:00:00"), "ftjob-1",
                               "/shared/art/serve/jobs/ftjob-1/train.log", flags, "/kit/.venv/bin/python", "/kit")
    directives = [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == ["--job-name=dpo-kit-ftjob-1", "--output=/shared/art/serve/jobs/ftjob-1/train.log",
                          "--open-mode=append", "--nodes=1", "--ntasks-per-node=1", "--partition=gpu",
                          "--account=lab", "--time=1:00:00", "--signal=TERM@300", "--requeue"]
    assert text.splitlines()[-1] == ("srun --kill-on-bad-exit=1 --ntasks-per-node=1 /kit/.venv/bin/python "
                                     "/kit/train_dpo.py --data /shared/p.jsonl --output_dir /shared/art --run_name "
                                     "ftjob-1 --beta 0.2")
    assert jobs.train_command(serve.ServeConfig(), flags, "/kit/.venv/bin/python")[2:] == flags  # the same flags
    script = tmp_path / "train.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", script]).returncode == 0  # a script bash reads


def test_two_nodes_of_four_gpus_launch_accelerate_on_each_node_with_its_place_in_the_allocation():
    text = slurm.sbatch_script(SlurmConfig(nodes=2, gpus_per_node="4", cpus_per_task=32, requeue=False,
                                           sbatch_args="--qos=high --constraint=a100"),
                               "r1", "/s/log", ["--data", "/s/p.jsonl", "--run_name", "r1"], "py", "/kit")
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=4\n#SBATCH --cpus-per-task=32\n" \
           "#SBATCH --no-requeue\n#SBATCH --qos=high\n#SBATCH --constraint=a100\n" in text
    assert 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert text.splitlines()[-1] == (
        "srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c 'exec py /kit/scaleout.py --nproc 4 --nnodes "
        "\"$SLURM_NNODES\" --node_rank \"$SLURM_NODEID\" --master_addr \"$MASTER_ADDR\" --master_port \"$MASTER_PORT\" "
        "-- --data /s/p.jsonl --run_name r1'")


def test_the_kits_image_runs_through_apptainer_or_pyxis_with_the_shared_directories_at_the_same_paths():
    flags = ["--data", "/s/d/p.jsonl", "--output_dir", "/s/art"]
    sif = slurm.sbatch_script(SlurmConfig(container="/s/dpo-kit.sif", gpus_per_node="1"), "r", "/s/log", flags,
                              "py", "/kit", ["/s/art", "/s/d"])
    assert sif.splitlines()[-1] == ("srun --kill-on-bad-exit=1 --ntasks-per-node=1 apptainer exec --nv --bind "
                                    "/s/art:/s/art,/s/d:/s/d --pwd /opt/kit /s/dpo-kit.sif python "
                                    "/opt/kit/train_dpo.py --data /s/d/p.jsonl --output_dir /s/art")
    pyxis = slurm.sbatch_script(SlurmConfig(container="registry#lab/dpo-kit:1.0", container_runtime="pyxis"), "r",
                                "/s/log", flags, "py", "/kit", ["/s/art"])
    assert pyxis.splitlines()[-1].startswith(
        "srun --kill-on-bad-exit=1 --ntasks-per-node=1 '--container-image=registry#lab/dpo-kit:1.0' "
        "--container-mounts=/s/art:/s/art --container-workdir=/opt/kit python /opt/kit/train_dpo.py")


def test_slurm_options_are_checked_before_anything_is_written(monkeypatch, tmp_path):
    problems = SlurmConfig(nodes=0, gpus_per_node="all", time="soon", partition="gpu\n#SBATCH --x",
                           sbatch_args="qos=high").problems()
    assert len(problems) == 5, problems
    assert SlurmConfig(time="1-12:00:00", partition="gpu", account="my-lab", sbatch_args="--qos=high").problems() == []
    assert serve.ServeConfig(slurm_args="--nodes 2").problems() == ["--slurm_args is for --runner slurm"]
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without SLURM's commands
    assert serve.ServeConfig(runner="slurm", slurm_args="--time 5x").problems() == [
        "--slurm_args: --time '5x': expected SLURM's time format (minutes, H:MM:SS or D-HH:MM:SS)",
        "--runner slurm: sbatch is not on the PATH (run the service on a machine of the cluster, such as a login node)"]


def test_slurms_answers_parsed():
    assert slurm.parse_job_id("4242\n") == "4242" and slurm.parse_job_id("17;cluster-a\n") == "17"
    with pytest.raises(ValueError):
        slurm.parse_job_id("sbatch: error: Batch job submission failed")
    assert slurm.parse_states("12|RUNNING\n12.batch|RUNNING\n13|CANCELLED by 0\n") == {"12": "RUNNING",
                                                                                      "13": "CANCELLED"}
    assert [slurm.exit_status(x) for x in ("0:0", "143:0", "0:9", "2:0", "")] == [0, 143, 137, 2, None]


@pytest.mark.parametrize("rc, stderr, confirmed", [
    (0, "", True),
    (1, "scancel: error: Kill job error on job id 77: Invalid job id specified", True),  # gone: nothing left to stop
    (1, "scancel: error: Kill job error on job id 77: Job/step already completing or completed", True),
    (1, "scancel: error: Kill job error on job id 77: Socket timed out on send/recv operation", False),
    (124, "scancel did not answer in 60s", False),  # _run's timeout
])
def test_a_stop_counts_as_sent_only_once_slurm_confirmed_it(rc, stderr, confirmed):
    assert slurm.scancel_confirmed(subprocess.CompletedProcess(["scancel", "77"], rc, "", stderr)) is confirmed


@pytest.mark.parametrize("state, complete, run_state, stop, expected", [
    ("COMPLETED", True, "succeeded", None, "succeeded"),
    ("CANCELLED", True, "succeeded", "cancel", "succeeded"),  # it finished before the cancel reached it
    ("CANCELLED", False, "cancelled", "cancel", "cancelled"),
    ("FAILED", False, "cancelled", "pause", "paused"),  # scancel --signal=TERM: the training exits 143
    ("CANCELLED", False, "running", None, "cancelled"),  # someone's scancel
    ("PREEMPTED", False, "cancelled", None, "resubmit"),
    ("NODE_FAIL", False, "running", None, "resubmit"),
    ("TIMEOUT", False, "cancelled", None, "paused"),
    ("FAILED", False, "cancelled", None, "paused"),  # SIGTERM --stop_seconds before the time limit
    ("FAILED", False, "failed", None, "reap"),  # the run's own error, as a local job's
    ("OUT_OF_MEMORY", False, "running", None, "reap"),
    (None, False, None, None, "reap"),  # no record anywhere: the run's status and log say what happened
])
def test_what_the_end_of_a_slurm_job_means_for_the_service(state, complete, run_state, stop, expected):
    assert slurm.outcome(state, complete, run_state, stop) == expected


@pytest.mark.parametrize("count, last_step, step, expected", [
    (0, None, None, 1),  # the first loss, before a step
    (0, None, 7, 1),
    (1, 7, 7, 2),  # lost again with no step trained in between
    (2, 7, 7, 3),
    (3, 7, 9, 1),  # it trained since the last loss: a preemptible partition's job goes on
    (2, None, None, 3),
])
def test_node_losses_in_a_row_count_only_those_with_no_step_trained_in_between(count, last_step, step, expected):
    assert slurm.losses_in_a_row(count, last_step, step) == expected


@pytest.mark.parametrize("status, slurm_state, shown", [
    ("running", "PENDING", "queued"),  # with SLURM, waiting for its nodes
    ("running", "REQUEUED", "queued"),
    ("running", "RUNNING", "running"),
    ("running", "SUSPENDED", "running"),
    ("running", None, "running"),  # a local child process
    ("queued", None, "queued"),
    ("paused", "PENDING", "paused"),
    ("succeeded", None, "succeeded"),
])
def test_the_apis_say_queued_while_slurm_holds_a_job_waiting_for_nodes(status, slurm_state, shown):
    assert jobs.public_status({"status": status, "slurm_state": slurm_state}) == shown


def test_a_held_run_lock_names_its_holders_pid_and_host(tmp_path):
    assert runs.lock_text(tmp_path, "r") is None
    with runs.RunLock(tmp_path, "r"):
        words = runs.holder_words(runs.lock_text(tmp_path, "r"))
        assert words == f"pid {os.getpid()} on {socket.gethostname()}"
        assert runs.lock_holder(tmp_path, "r") == os.getpid()
    assert runs.lock_text(tmp_path, "r") is None and runs.holder_words("") == "pid ?"


def test_an_older_serve_db_gains_the_slurm_and_deletion_columns_and_keeps_its_jobs(tmp_path):
    db = sqlite3.connect(tmp_path / "serve.db")
    db.execute("CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, status TEXT)")
    db.execute("INSERT INTO jobs (id, status) VALUES ('ftjob-old', 'queued')")
    db.commit()
    db.close()
    store = jobs.Store(tmp_path)
    assert store.job("ftjob-old") == {"seq": 1, "id": "ftjob-old", "status": "queued", "slurm_job_id": None,
                                      "submitted_at": None, "slurm_state": None, "resubmits": 0,
                                      "resubmit_step": None, "model_deleted": None}
    store.update_job("ftjob-old", slurm_job_id="12")
    assert jobs.Store(tmp_path).job("ftjob-old")["slurm_job_id"] == "12"  # opened again: nothing added twice


# ------------------------------------------------------------------ the service's side of SLURM's answers, no SLURM

def fake_slurm(tmp_path: Path, monkeypatch, **bodies: str) -> Path:
    """SLURM's commands as bash scripts first on the PATH, each with its body (one not given prints nothing and
    exits 0: no job known); every call is appended to the returned calls.log. For answers a real cluster gives only
    now and then (a timeout, an odd reply, a race), on the real scheduler and store."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in ("sbatch", "squeue", "sacct", "scontrol", "scancel"):
        (bin_dir / name).write_text(f'#!/bin/bash\necho "{name} $*" >> {calls}\n{bodies.get(name, "")}\n')
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    calls.touch()
    return calls


def slurm_scheduler(out: Path) -> tuple[slurm.SlurmScheduler, jobs.Store]:
    """The service's SLURM scheduler on out (not started: the test ticks it), and its store."""
    cfg = serve.ServeConfig(runner="slurm", output_dir=str(out), train_args=TRAIN_ARGS,
                            slurm_args="--poll_seconds 0.01")
    return slurm.SlurmScheduler(cfg, jobs.Store(out / "serve")), jobs.Store(out / "serve")


def add_job(store: jobs.Store, status: str, **values) -> str:
    job_id = jobs.new_id("ftjob")
    store.insert("jobs", {"id": job_id, "created_at": jobs.now(), "api": "openai", "status": status, "model": "m",
                          "base": "m", "method": {"type": "dpo"}, "flags": [], "result_files": [], **values})
    return job_id


def test_a_job_whose_sbatch_answers_without_an_id_fails_saying_so_and_the_next_job_is_submitted(tmp_path,
                                                                                                monkeypatch):
    calls = fake_slurm(tmp_path, monkeypatch, sbatch=f'if [ -e {tmp_path}/answered ]; then echo 4242; else touch '
                       f'{tmp_path}/answered; echo "sbatch: the queue is busy, your job will be submitted"; fi')
    out, data = tmp_path / "art", tmp_path / "pairs.jsonl"
    data.write_text(openai_pairs(2))
    (out / "serve").mkdir(parents=True)
    store = jobs.Store(out / "serve")
    first, second = (add_job(store, "queued", data=str(data)) for _ in range(2))
    scheduler, _ = slurm_scheduler(out)
    scheduler.tick()  # before: ValueError out of every tick, the first job running with no SLURM id for ever
    job = store.job(first)
    assert (job["status"], job["slurm_job_id"], job["error"]["code"]) == ("failed", None, "slurm_submit_failed")
    assert job["error"]["message"] == ("the service failed while submitting it to SLURM: ValueError: sbatch printed "
                                       "no job id: 'sbatch: the queue is busy, your job will be submitted'")
    assert f"squeue -h --name dpo-kit-{first} -o %i|%T" in calls.read_text()  # looked for by name before it failed
    assert (store.job(second)["status"], store.job(second)["slurm_job_id"]) == ("running", "4242")


@pytest.mark.parametrize("kind, asked", [
    ("cancel", ["scancel 77", "scancel 77"]),
    # a pending job is cancelled first; the SIGTERM, once SLURM took it, is never sent twice
    ("pause", ["scancel --state=PENDING 77", "scancel --state=PENDING 77", "scancel --state=RUNNING --signal=TERM 77"]),
])
def test_a_stop_scancel_failed_on_is_asked_again_until_slurm_confirms_it(tmp_path, monkeypatch, kind, asked):
    calls = fake_slurm(tmp_path, monkeypatch, squeue='echo "77|RUNNING"', scancel=(
        f'if [ ! -e {tmp_path}/refused ]; then touch {tmp_path}/refused; echo "scancel: error: Kill job error on job '
        'id 77: Socket timed out on send/recv operation" >&2; exit 1; fi'))
    out = tmp_path / "art"
    (out / "serve").mkdir(parents=True)
    job_id = add_job(jobs.Store(out / "serve"), "running", slurm_job_id="77")
    scheduler, store = slurm_scheduler(out)  # follows SLURM job 77 again
    service_app.Service(scheduler.cfg).request_stop(store.job(job_id), kind)
    for _ in range(3):
        scheduler.tick()
    assert [c for c in calls.read_text().splitlines() if c.startswith("scancel")] == asked


@pytest.mark.parametrize("stop, status", [(None, "running"), ("cancel", "cancelled"), ("pause", "paused")])
def test_a_stop_asked_while_a_lost_nodes_job_is_looked_up_is_kept_not_erased_by_its_resubmission(
        tmp_path, monkeypatch, stop, status):
    calls = fake_slurm(tmp_path, monkeypatch, sbatch="echo 78", scontrol='echo "JobId=77 JobState=NODE_FAIL '
                       'Reason=NodeFail ExitCode=0:0"')  # squeue says nothing: job 77 has left the queue
    out, data = tmp_path / "art", tmp_path / "pairs.jsonl"
    data.write_text(openai_pairs(2))
    (out / "serve").mkdir(parents=True)
    job_id = add_job(jobs.Store(out / "serve"), "running", slurm_job_id="77", data=str(data))
    scheduler, store = slurm_scheduler(out)
    svc, final_state = service_app.Service(scheduler.cfg), slurm.final_state

    def asked_meanwhile(slurm_id):  # the user's stop comes in while the scheduler asks SLURM how job 77 ended
        if stop:
            svc.request_stop(store.job(job_id), stop)
        return final_state(slurm_id)

    monkeypatch.setattr(slurm, "final_state", asked_meanwhile)
    scheduler.tick()  # job 77 ended NODE_FAIL: queued again and, in the same poll, submitted again, unless stopped
    job = store.job(job_id)
    assert (job["status"], job["stop_request"]) == (status, None)
    assert ("sbatch" in calls.read_text()) == (stop is None)
    messages = [r["message"] for r in store.query("SELECT message FROM events WHERE job_id = ?", job_id)]
    assert any("ended NODE_FAIL: submitted again" in m for m in messages) == (stop is None), messages


# ------------------------------------------------------------------ a real one-node cluster

@pytest.fixture(scope="module")
def cluster():
    if os.environ.get("DPO_KIT_SLURM_UNAVAILABLE"):  # make test-slurm: .ci/slurm-cluster.sh said why
        pytest.skip(f"SLURM cannot start here: {os.environ['DPO_KIT_SLURM_UNAVAILABLE']}")
    if not shutil.which("sbatch"):
        pytest.skip("no sbatch on the PATH: make test-slurm installs SLURM and starts a one-node cluster "
                    "(.ci/slurm-cluster.sh)")
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.skip("sinfo did not answer in 30 s: no SLURM controller (make test-slurm starts one)")
    if done.returncode != 0 or not {"idle", "mixed", "allocated"} & set(done.stdout.split()):
        pytest.skip(f"SLURM does not answer here ({(done.stderr or done.stdout).strip()[-200:]}); make test-slurm "
                    "starts a one-node cluster (.ci/slurm-cluster.sh)")
    return True


def sacct(name: str) -> list[tuple[str, str]]:
    """(SLURM job id, state) of every job SLURM's accounting has under this name."""
    done = subprocess.run(["sacct", "-X", "-n", "-P", "--name", name, "-S", "now-1days", "-E", "now+1days", "-o",
                           "JobID,State"],  # -E: a job held pending until later is in the window too
                          capture_output=True, text=True, check=True, timeout=120)
    return [(i, s.split()[0]) for i, s in (line.split("|") for line in done.stdout.splitlines() if line)]


def slurm_service(out: Path, slurm_args: str = "") -> tuple[Service, object]:
    """serve.py --runner slurm on the test cluster, and an openai client of it."""
    from openai import OpenAI

    svc = Service(out, None, "--runner", "slurm", f"--slurm_args=--poll_seconds 1 {slurm_args}".rstrip())
    return svc, OpenAI(base_url=f"{svc.url}/v1", api_key="unused", max_retries=0)


def upload_pairs(client, path: Path, n: int) -> str:
    """n OpenAI preference pairs written to path and uploaded: the file id."""
    path.write_text(openai_pairs(n))
    return client.files.create(file=open(path, "rb"), purpose="fine-tune").id


def metrics_steps(client, job_id: str) -> list[int]:
    return [e.data["step"] for e in client.fine_tuning.jobs.list_events(job_id, limit=100) if e.type == "metrics"]


@needs_model
@pytest.mark.slurm
def test_service_on_slurm_a_job_succeeds_as_one_slurm_job_and_another_pauses_resumes_and_cancels(cluster, tmp_path):
    out = tmp_path / "art"
    svc, client = slurm_service(out)
    try:
        small, longer = tmp_path / "small.jsonl", tmp_path / "longer.jsonl"
        small.write_text(openai_pairs(4))
        longer.write_text(openai_pairs(8))
        f = client.files.create(file=open(small, "rb"), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(model="SmolLM2-135M-Instruct", training_file=f.id, method={
            "type": "dpo", "dpo": {"hyperparameters": {"batch_size": 2}}})
        job = wait_for(lambda: client.fine_tuning.jobs.retrieve(job.id), lambda j: j.status in jobs.TERMINAL)
        assert job.status == "succeeded", (job.error, job_log(out, job.id)[-3000:])
        assert runs.verify_tarball(out / f"{job.id}.tar.gz")["run_name"] == job.id
        ((slurm_id, state),) = sacct(f"dpo-kit-{job.id}")
        assert state == "COMPLETED"
        script = out / "serve" / "jobs" / job.id / "train.sbatch"
        assert f"#SBATCH --output={out / 'serve' / 'jobs' / job.id / 'train.log'}" in script.read_text()
        assert f"[slurm] job {slurm_id} " in job_log(out, job.id)  # SLURM's output file is the job's log
        messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100)]
        assert f"Submitted as SLURM job {slurm_id} ({script})" in messages

        f = client.files.create(file=open(longer, "rb"), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(model="SmolLM2-135M-Instruct", training_file=f.id, method={
            "type": "dpo", "dpo": {"hyperparameters": {"batch_size": 1}}})
        wait_for(lambda: metrics_steps(client, job.id), lambda s: len(s) >= 1, what="a first step")
        client.fine_tuning.jobs.pause(job.id)  # scancel --signal=TERM: a checkpoint, then the SLURM job ends
        wait_for(lambda: client.fine_tuning.jobs.retrieve(job.id).status, lambda s: s == "paused", what="the pause")
        paused_at = client.fine_tuning.jobs.checkpoints.list(job.id).data[0].step_number
        assert [s for _, s in sacct(f"dpo-kit-{job.id}")] == ["FAILED"]  # the training's own exit status: 143
        client.fine_tuning.jobs.resume(job.id)  # submitted again; the same run resumes
        wait_for(lambda: metrics_steps(client, job.id), lambda s: max(s) > paused_at, what="a step after resume")
        client.fine_tuning.jobs.cancel(job.id)  # scancel: SIGTERM, a checkpoint within KillWait
        job = wait_for(lambda: client.fine_tuning.jobs.retrieve(job.id), lambda j: j.status in jobs.TERMINAL)
        assert job.status == "cancelled", (job.error, job_log(out, job.id)[-3000:])
        assert client.fine_tuning.jobs.checkpoints.list(job.id).data[0].step_number > paused_at
        assert [s for _, s in sacct(f"dpo-kit-{job.id}")] == ["FAILED", "CANCELLED"]
        assert runs.read_json(out / f"{job.id}.partial" / "status.json")["state"] == "cancelled"
        assert job_log(out, job.id).count("[run] resuming") == 1
    finally:
        svc.stop()


@needs_model
@pytest.mark.slurm
def test_service_stopped_and_killed_mid_job_follows_the_same_slurm_job_to_succeeded(cluster, tmp_path):
    out = tmp_path / "art"
    svc, client = slurm_service(out)
    try:
        f = upload_pairs(client, tmp_path / "pairs.jsonl", 6)
        job = client.fine_tuning.jobs.create(model="SmolLM2-135M-Instruct", training_file=f,
                                             method={"type": "dpo", "dpo": {"hyperparameters": {"batch_size": 1}}})
        wait_for(lambda: metrics_steps(client, job.id), lambda s: len(s) >= 1, what="a first step")
        svc.stop(signal.SIGTERM)  # SLURM's job runs on
        ((slurm_id, state),) = sacct(f"dpo-kit-{job.id}")
        assert state == "RUNNING"
        svc.start()
        before = max(metrics_steps(client, job.id))
        wait_for(lambda: metrics_steps(client, job.id), lambda s: max(s) > before, what="a step after the restart")
        svc.stop(signal.SIGKILL)
        wait_for(lambda: sacct(f"dpo-kit-{job.id}"), lambda jobs_: jobs_[0][1] == "COMPLETED",
                 what="the SLURM job to finish while the service is down")
        svc.start()  # picks up the job that finished while it was down
        job = wait_for(lambda: client.fine_tuning.jobs.retrieve(job.id), lambda j: j.status in jobs.TERMINAL)
        assert job.status == "succeeded", (job.error, job_log(out, job.id)[-3000:])
        assert sacct(f"dpo-kit-{job.id}") == [(slurm_id, "COMPLETED")]  # one SLURM job, never submitted twice
        assert sorted(metrics_steps(client, job.id)) == [1, 2, 3, 4, 5, 6]  # each step said once
        messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100)]
        assert messages.count(f"The service restarted: following SLURM job {slurm_id} again") == 2
        assert "[run] resuming" not in job_log(out, job.id)  # the training itself never stopped
    finally:
        svc.stop()


@needs_model
@pytest.mark.slurm
def test_make_train_runner_slurm_gives_the_local_runs_adapter_and_its_lock_turns_a_second_job_away(cluster, tmp_path):
    run = f"r-{os.urandom(4).hex()}"  # SLURM's accounting keeps every earlier test's jobs: a name of its own
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(openai_pairs(6))
    args = f"{TRAIN_ARGS} --max_steps 4 --per_device_train_batch_size 1 --seed 3"
    # make train on the bundled model trains its recipe (configs/demo.yaml): the local run is given it by hand
    local = subprocess.run([sys.executable, "train_dpo.py", "--config", "configs/demo.yaml", "--data", pairs,
                            "--output_dir", tmp_path / "local", "--run_name", run, *args.split()], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
    assert local.returncode == 0, local.stderr[-3000:]
    out = tmp_path / "art"
    make = subprocess.Popen(["make", "train", "RUNNER=slurm", f"DATA={pairs}", f"OUT={out}", f"RUN={run}",
                             f"ARGS={args}", "SLURM_ARGS=--poll_seconds 1"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: sacct(f"dpo-kit-{run}"), lambda j: j and j[0][1] == "RUNNING", what="the SLURM job")
        wait_for(lambda: runs.lock_holder(out, run), lambda pid: pid is not None, what="the run's lock")
        script = out / "slurm" / run / "train.sbatch"
        second = subprocess.run(["sbatch", "--parsable", script], capture_output=True, text=True, check=True,
                                timeout=120)
        second_id = slurm.parse_job_id(second.stdout)  # by hand, while the first holds the run
        wait_for(lambda: dict(sacct(f"dpo-kit-{run}")).get(second_id), lambda s: s == "FAILED", what="the second job")
        output, _ = make.communicate(timeout=600)
    finally:
        if make.poll() is None:
            make.kill()
    assert make.returncode == 0, output[-3000:]
    assert "is in use by pid" in (out / "slurm" / run / "train.log").read_text()
    assert "[run] succeeded" in output and f"ended COMPLETED; run {run}: succeeded" in output  # the log, followed
    first_id = [i for i, _ in sacct(f"dpo-kit-{run}") if i != second_id]
    assert dict(sacct(f"dpo-kit-{run}")) == {first_id[0]: "COMPLETED", second_id: "FAILED"}
    adapter = "adapter_model.safetensors"
    assert (out / run / adapter).read_bytes() == (tmp_path / "local" / run / adapter).read_bytes()
    assert runs.verify_tarball(out / f"{run}.tar.gz")["run_name"] == run


@pytest.mark.slurm
def test_a_job_sbatch_took_before_the_service_died_unrecorded_is_found_by_its_name_not_submitted_again(cluster,
                                                                                                         tmp_path):
    out = tmp_path / "art"
    store = jobs.Store(out / "serve")
    job_id = jobs.new_id("ftjob")
    # What a kill -9 between sbatch and storing its answer leaves: running, submitted, no SLURM id.
    store.insert("jobs", {"id": job_id, "created_at": jobs.now(), "api": "openai", "status": "running",
                          "model": "m", "base": "m", "method": {"type": "dpo"}, "flags": [], "result_files": [],
                          "submitted_at": jobs.now()})
    done = subprocess.run(["sbatch", "--parsable", f"--job-name=dpo-kit-{job_id}", f"--output={tmp_path}/%j.out",
                           "--wrap", "sleep 6"], capture_output=True, text=True, check=True, timeout=120)
    slurm_id = slurm.parse_job_id(done.stdout)
    svc, _ = slurm_service(out)
    try:
        wait_for(lambda: store.job(job_id)["status"], lambda s: s in jobs.TERMINAL, what="the adopted job's end")
    finally:
        svc.stop()
    assert store.job(job_id)["slurm_job_id"] == slurm_id
    assert sacct(f"dpo-kit-{job_id}") == [(slurm_id, "COMPLETED")]  # adopted, never submitted a second time
    messages = [r["message"] for r in store.query("SELECT message FROM events WHERE job_id = ?", job_id)]
    assert messages[0] == f"The service restarted: following SLURM job {slurm_id} again"
    assert f"SLURM job {slurm_id} ended COMPLETED" in messages
    assert store.job(job_id)["status"] == "failed"  # a sleep trains nothing: the run is not there


@needs_model
@pytest.mark.slurm
def test_a_job_slurm_holds_pending_pauses_and_cancels_without_a_training(cluster, tmp_path):
    out = tmp_path / "art"
    svc, client = slurm_service(out, "--sbatch_args=--begin=now+1hour")
    try:
        f = upload_pairs(client, tmp_path / "pairs.jsonl", 2)
        job = client.fine_tuning.jobs.create(model="SmolLM2-135M-Instruct", training_file=f)
        events = lambda: [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100)]  # noqa: E731
        wait_for(events, lambda m: any(x.endswith(": PENDING") for x in m), what="SLURM to hold the job")
        assert client.fine_tuning.jobs.retrieve(job.id).status == "queued"  # with SLURM, not yet training
        assert "#SBATCH --begin=now+1hour" in (out / "serve" / "jobs" / job.id / "train.sbatch").read_text()
        client.fine_tuning.jobs.pause(job.id)  # a signal cannot reach a pending job: it is cancelled in SLURM
        wait_for(lambda: client.fine_tuning.jobs.retrieve(job.id).status, lambda s: s == "paused", what="the pause")
        client.fine_tuning.jobs.resume(job.id)
        wait_for(lambda: len(sacct(f"dpo-kit-{job.id}")), lambda n: n == 2, what="the second submission")
        client.fine_tuning.jobs.cancel(job.id)
        job = wait_for(lambda: client.fine_tuning.jobs.retrieve(job.id), lambda j: j.status in jobs.TERMINAL)
    finally:
        svc.stop()
    assert job.status == "cancelled"
    assert [s for _, s in sacct(f"dpo-kit-{job.id}")] == ["CANCELLED", "CANCELLED"]
    assert not (out / f"{job.id}.partial").exists()  # nothing ever trained


@needs_model
@pytest.mark.slurm
@pytest.mark.parametrize("max_resubmits", [1, 0])
def test_a_job_whose_node_is_lost_is_queued_again_or_past_its_cap_paused_and_resumes_to_succeeded(cluster, tmp_path,
                                                                                                 max_resubmits):
    out = tmp_path / "art"
    node = subprocess.run(["sinfo", "-h", "-o", "%N"], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()
    # --no_requeue: not SLURM's own requeue; the service submits again, up to --max_resubmits times
    svc, client = slurm_service(out, f"--no_requeue --max_resubmits {max_resubmits}")
    scontrol = lambda *a: subprocess.run(["scontrol", "update", f"NodeName={node}", *a],  # noqa: E731
                                         capture_output=True, text=True, check=True, timeout=120)
    try:
        f = upload_pairs(client, tmp_path / "pairs.jsonl", 6)
        job = client.fine_tuning.jobs.create(model="SmolLM2-135M-Instruct", training_file=f,
                                             method={"type": "dpo", "dpo": {"hyperparameters": {"batch_size": 1}}})
        wait_for(lambda: metrics_steps(client, job.id), lambda s: len(s) >= 1, what="a first step")
        try:
            scontrol("State=DOWN", "Reason=dpo-kit-test")  # the job's node lost: NODE_FAIL
            scontrol("State=DRAIN", "Reason=dpo-kit-test")  # and kept from new jobs when its slurmd registers again
            wait_for(lambda: sacct(f"dpo-kit-{job.id}"), lambda j: j[:1] and j[0][1] == "NODE_FAIL",
                     what="the lost job")
            shown = "queued" if max_resubmits else "paused"  # pending on the drained node, or not submitted again
            wait_for(lambda: client.fine_tuning.jobs.retrieve(job.id).status, lambda s: s == shown, what=shown)
        finally:
            scontrol("State=RESUME")
        if not max_resubmits:
            assert len(sacct(f"dpo-kit-{job.id}")) == 1
            client.fine_tuning.jobs.resume(job.id)
        job = wait_for(lambda: client.fine_tuning.jobs.retrieve(job.id), lambda j: j.status in jobs.TERMINAL)
        messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100)]
    finally:
        svc.stop()
    assert job.status == "succeeded", (job.error, job_log(out, job.id)[-3000:])
    assert [s for _, s in sacct(f"dpo-kit-{job.id}")] == ["NODE_FAIL", "COMPLETED"]
    said = ("ended NODE_FAIL: submitted again (1 of at most 1 in a row" if max_resubmits else
            "ended NODE_FAIL, its node lost 1 time in a row with no step trained in between: not submitted again")
    assert any(said in m for m in messages), messages
    assert job_log(out, job.id).count("[run] resuming") == 1


@needs_model
@pytest.mark.slurm
def test_a_job_sbatch_refuses_fails_saying_what_slurm_said(cluster, tmp_path):
    out = tmp_path / "art"
    svc, client = slurm_service(out, "--partition nosuch")
    try:
        f = upload_pairs(client, tmp_path / "pairs.jsonl", 2)
        job = client.fine_tuning.jobs.create(model="SmolLM2-135M-Instruct", training_file=f)
        job = wait_for(lambda: client.fine_tuning.jobs.retrieve(job.id), lambda j: j.status in jobs.TERMINAL)
    finally:
        svc.stop()
    assert job.status == "failed" and job.error.code == "slurm_refused", job.error
    assert "sbatch refused the job" in job.error.message and "partition" in job.error.message.lower()
    assert sacct(f"dpo-kit-{job.id}") == []
