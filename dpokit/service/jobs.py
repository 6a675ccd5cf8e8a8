"""The jobs behind serve.py: files, jobs and events in one SQLite file, and the scheduler that validates a
job's training file, starts its training as a separate process, follows its metrics and reaps it.

Used by serve.py (the HTTP side); nothing here imports FastAPI. `Store(root)` opens or creates
<root>/serve.db (WAL); `Scheduler(cfg, store).start()` runs the queue until `.stop_all()`. cfg: serve.py's
ServeConfig (the scheduler reads its runner, gpus, train_args, output_dir and timings). With --runner slurm the
service runs slurm.SlurmScheduler, this scheduler with SLURM jobs in place of child processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from dpokit.core import kit, runs
from dpokit.data import formats, runlogs, supervised
from dpokit.pairs import from_logs
from dpokit.train import config, methods
from dpokit.core.kit import UserError

ROOT = kit.ROOT
TERMINAL = ("succeeded", "failed", "cancelled")
# SLURM states (squeue %T) of a submitted job that waits for its nodes: nothing of it trains yet
SLURM_WAITING = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD")


def public_status(job: dict) -> str:
    """The status the APIs show: the store's, except that a job handed to SLURM is queued while SLURM holds it
    waiting for nodes (the store keeps it running: it is with a runner, and not the service's queue's)."""
    if job["status"] == "running" and job.get("slurm_state") in SLURM_WAITING:
        return "queued"
    return job["status"]


def new_id(prefix: str) -> str:
    """A random id (96 bits): nothing about one id tells another."""
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def user_error_message(e: UserError, filename: str) -> str:
    """A validation error naming the client's file and line, never the service's path."""
    return f"{filename}:{e.line}: {e.message}" if e.line else f"{filename}: {e.message}"


def surprise_message(e: Exception, doing: str) -> str:
    """A job's reason when the service failed on it unexpectedly: what it was doing, the exception's type and
    words on one line (an OSError's words without its filename: the service's paths are not the client's)."""
    words = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    words = " ".join(words.split())
    words = words if len(words) <= 300 else words[:297] + "..."
    return f"the service failed while {doing}: {type(e).__name__}" + (f": {words}" if words else "")


def input_kind(path: str | os.PathLike) -> str:
    """What a training file holds, by its first record: 'run_log' (build_pairs.py's input: a strategy and its
    attempts), 'sft' (messages ending with the assistant's answer) or 'pairs' (any pair format)."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    first = json.loads(raw)
                except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested past the parser's depth
                    return "pairs"  # formats.load_pairs reports the line
                if isinstance(first, dict) and "attempts" in first and "strategy" in first:
                    return "run_log"
                if isinstance(first, dict) and set(first) <= {"messages", "tools", "parallel_tool_calls", "functions"}:
                    return "sft"
                return "pairs"
    return "pairs"


def read_as_training(method: str, path: str) -> int:
    """A file read by the rules its method's training file is read by (OpenAI's validation file): SFT examples
    (supervised); pairs, unpaired examples or run logs (dpo). Raises UserError naming the line; returns the rows
    read. (Reinforcement: Scheduler.prompts_file, which checks them as the training reads them.)"""
    kind = input_kind(path)
    if method == "supervised":
        return len(supervised.read(path).examples)
    if kind == "run_log":
        return sum(1 for _ in runlogs.read_runs(path))
    return formats.load_pairs(path)[1]["pairs"]


def rft_rows(path: str) -> tuple[list[dict], list[int]]:
    """OpenAI's reinforcement rows ({"messages": [...], ...fields}) or the kit's prompts ({"prompt", "host"}) as
    the kit's prompt rows, the other fields as the item a grader reads; and each row's line in the file."""
    rows, lines = [], []
    for line_no, row in formats.jsonl_rows(Path(path).read_bytes()):
        if isinstance(row, formats.BadRow):
            raise UserError(str(row), path, line_no)
        if not isinstance(row, dict) or not ("messages" in row or "prompt" in row):
            raise UserError("a reinforcement row needs messages (the prompt) and the fields its grader reads",
                            path, line_no)
        if "messages" in row and not (isinstance(row["messages"], list) and row["messages"]):
            raise UserError("messages must be a non-empty list of messages (OpenAI's reinforcement rows)", path, line_no)
        prompt = row.pop("messages") if "messages" in row else row.pop("prompt")  # an empty prompt: refused with its line later
        host = row.pop("host", "") if isinstance(row.get("host", ""), str) else ""
        rows.append({"prompt": prompt, "host": host, "item": row.pop("item", row)})
        lines.append(line_no)
    return rows, lines


def train_command(cfg, flags: list[str], python: str = sys.executable) -> list[str]:
    """The process a job runs: train_dpo.py here, scaleout.py (accelerate) for several GPUs, launcher.py for
    the kit's container. flags: train_dpo.py's, with --data, --output_dir and --run_name."""
    if cfg.runner == "docker":
        args = dict(zip(flags[::2], flags[1::2]))  # the three the launcher takes itself come first in flags
        rest = flags[6:]
        return [python, str(ROOT / "launcher.py"), "train", "--data", args["--data"], "--output_dir",
                args["--output_dir"], "--run_name", args["--run_name"], *(["--gpus", cfg.gpus] if cfg.gpus else []),
                "--", *rest]
    if cfg.gpus and cfg.gpus not in ("all", "1"):
        return [python, str(ROOT / "scaleout.py"), "--gpus", cfg.gpus, "--", *flags]
    return [python, str(ROOT / "train_dpo.py"), *flags]


def job_flags(cfg, job: dict) -> list[str]:
    """train_dpo.py's flags for a job: where its data and run are, the service's --train_args, then the job's
    base, parent adapter (a fine-tuned model continues from its adapter) and hyperparameters."""
    import shlex

    parent = job["init_adapter"] and (f"/artifacts/{job['init_adapter']}" if cfg.runner == "docker"
                                      else str(Path(cfg.output_dir) / job["init_adapter"]))
    return ["--data", job["data"], "--output_dir", cfg.output_dir, "--run_name", job["id"], *shlex.split(cfg.train_args),
            "--model_name_or_path", job["base"], *(["--init_adapter", parent] if parent else []), *job["flags"]]


RESULT_COLUMNS = ("step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy",
                  "train_mean_token_accuracy", "full_valid_loss", "full_valid_mean_token_accuracy",
                  "train_reward_margin", "train_reward_accuracy", "valid_reward_margin", "valid_reward_accuracy")


def results_csv(rows: list[dict]) -> str:
    """OpenAI's results file: one CSV row per step (its columns first, the kit's reward margins after; a value the
    run did not log is empty), base64-encoded as OpenAI hands it back (base64.b64decode(content.text))."""
    import base64
    import csv
    import io

    steps: dict[int, dict] = {}
    for row in rows:
        if "train_runtime" in row or not isinstance(row.get("step"), int):
            continue
        _, data = metrics_event(row)
        out = steps.setdefault(row["step"], {"step": row["step"]})
        out.update({k: v for k, v in data.items() if k in RESULT_COLUMNS and k != "step"})
        if isinstance(row.get("mean_token_accuracy"), (int, float)):
            out["train_mean_token_accuracy"] = out["train_accuracy"] = row["mean_token_accuracy"]
        if isinstance(row.get("eval_mean_token_accuracy"), (int, float)):
            out["valid_mean_token_accuracy"] = row["eval_mean_token_accuracy"]
    text = io.StringIO()
    writer = csv.DictWriter(text, RESULT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(steps[k] for k in sorted(steps))
    return base64.b64encode(text.getvalue().encode()).decode()


def metrics_event(row: dict) -> tuple[str, dict]:
    """A metrics.jsonl row as an OpenAI metrics event: its message and data."""
    data = {"step": row["step"], "epoch": row.get("epoch")} | (
        {"total_steps": row["max_steps"]} if isinstance(row.get("max_steps"), int) else {})
    names = {"loss": "train_loss", "rewards/margins": "train_reward_margin",
             "rewards/accuracies": "train_reward_accuracy", "eval_loss": "valid_loss",
             "eval_rewards/margins": "valid_reward_margin", "eval_rewards/accuracies": "valid_reward_accuracy",
             "num_tokens": "trained_tokens", "learning_rate": "learning_rate"}
    data |= {new: row[old] for old, new in names.items() if isinstance(row.get(old), (int, float))}
    words = [f"{k}={data[k]:.4g}" for k in ("train_loss", "train_reward_margin", "train_reward_accuracy",
                                           "valid_loss") if k in data]
    return f"Step {row['step']}: {', '.join(words)}", data


# ---------------------------------------------------------------------------------------------
# The store: files, jobs and events in one SQLite file (WAL: readers never wait on the writer).
# ---------------------------------------------------------------------------------------------

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, bytes INTEGER, created_at INTEGER, filename TEXT,
    purpose TEXT, path TEXT);
CREATE TABLE IF NOT EXISTS jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, created_at INTEGER,
    api TEXT, status TEXT, model TEXT, base TEXT, init_adapter TEXT, training_file TEXT, validation_file TEXT,
    method TEXT, hyperparameters TEXT, flags TEXT, suffix TEXT, seed INTEGER, metadata TEXT, nip_config TEXT,
    fine_tuned_model TEXT, finished_at INTEGER, trained_tokens INTEGER, error TEXT, result_files TEXT,
    data TEXT, pid INTEGER, stop_request TEXT, metrics_step INTEGER DEFAULT 0, waiting_on INTEGER, estimated_finish INTEGER,
    slurm_job_id TEXT, submitted_at INTEGER, slurm_state TEXT, resubmits INTEGER DEFAULT 0, resubmit_step INTEGER);
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, job_id TEXT,
    created_at INTEGER, level TEXT, message TEXT, type TEXT, data TEXT);
CREATE INDEX IF NOT EXISTS events_job ON events (job_id, seq);
CREATE TABLE IF NOT EXISTS exports (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, job_id TEXT,
    created_at INTEGER, finished_at INTEGER, status TEXT, format TEXT, quant TEXT, force INTEGER, file_id TEXT,
    report TEXT, error TEXT, pid INTEGER);
"""
# Columns added since the first serve.db: added to an older database when the service opens it.
ADDED_COLUMNS = {"jobs": {"slurm_job_id": "TEXT", "submitted_at": "INTEGER", "slurm_state": "TEXT",
                          "resubmits": "INTEGER DEFAULT 0", "resubmit_step": "INTEGER",
                          "model_deleted": "INTEGER"}}  # when DELETE /v1/models/{model} took its model off the list
JSON_COLUMNS = ("method", "hyperparameters", "flags", "metadata", "nip_config", "error", "result_files", "report")


class Store:
    """The service's state. One connection per call (sqlite3 connections are cheap and not shared between
    threads); autocommit, so each statement is its own transaction."""

    def __init__(self, root: Path):
        self.root = root
        self.files_dir = root / "files"
        self.jobs_dir = root / "jobs"
        for d in (self.files_dir, self.jobs_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.path = root / "serve.db"
        with self.connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)
            for table, columns in ADDED_COLUMNS.items():
                have = {r["name"] for r in db.execute(f"PRAGMA table_info({table})")}
                for name, kind in columns.items():
                    if name not in have:
                        with contextlib.suppress(sqlite3.OperationalError):  # another service added it just now
                            db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")

    @contextlib.contextmanager
    def connect(self):
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.row_factory = sqlite3.Row
        try:
            yield db
        finally:
            db.close()

    @contextlib.contextmanager
    def transaction(self):
        """One connection whose statements commit together or not at all (a kill -9 in between keeps none)."""
        with self.connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def query(self, sql: str, *args) -> list[dict]:
        with self.connect() as db:
            return [self._row(r) for r in db.execute(sql, args).fetchall()]

    def execute(self, sql: str, *args) -> None:
        with self.connect() as db:
            db.execute(sql, args)

    @staticmethod
    def _row(row) -> dict:
        d = dict(row)
        for k in JSON_COLUMNS:
            if k in d and d[k] is not None:
                d[k] = json.loads(d[k])
        return d

    def insert(self, table: str, values: dict) -> None:
        with self.connect() as db:
            self._insert(db, table, values)

    @staticmethod
    def _insert(db, table: str, values: dict) -> None:
        values = {k: json.dumps(v) if k in JSON_COLUMNS and v is not None else v for k, v in values.items()}
        db.execute(f"INSERT INTO {table} ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
                   tuple(values.values()))

    def update_job(self, job_id: str, said: str | None = None, level: str = "info", **values) -> None:
        """The job's columns in values; with said, the event (at level) that says so, in the same transaction."""
        self.move(job_id, None, said=said, level=level, **values)

    def move(self, job_id: str, from_statuses: tuple | None, unstopped: bool = False, said: str | None = None,
             level: str = "info", **values) -> bool:
        """update_job only while the job is still in one of from_statuses (a cancel that came in between wins),
        and with unstopped, while no stop (cancel, pause) has been asked for either: one asked for since the job
        was read then decides, not the writer's older view. The event said is written only with the move."""
        values = {k: json.dumps(v) if k in JSON_COLUMNS and v is not None else v for k, v in values.items()}
        where = "" if from_statuses is None else f" AND status IN ({', '.join('?' * len(from_statuses))})"
        where += " AND stop_request IS NULL" if unstopped else ""
        with self.transaction() as db:
            cursor = db.execute(f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in values)} WHERE id = ?{where}",
                                (*values.values(), job_id, *(from_statuses or ())))
            moved = cursor.rowcount == 1
            if moved and said is not None:
                self._insert(db, "events", self._event_row(job_id, said, level))
            return moved

    def update_export(self, export_id: str, **values) -> None:
        values = {k: json.dumps(v) if k in JSON_COLUMNS and v is not None else v for k, v in values.items()}
        self.execute(f"UPDATE exports SET {', '.join(f'{k} = ?' for k in values)} WHERE id = ?", *values.values(),
                     export_id)

    def job(self, job_id: str) -> dict | None:
        rows = self.query("SELECT * FROM jobs WHERE id = ?", job_id)
        return rows[0] if rows else None

    def export(self, export_id: str) -> dict | None:
        rows = self.query("SELECT * FROM exports WHERE id = ?", export_id)
        return rows[0] if rows else None

    def file(self, file_id: str) -> dict | None:
        rows = self.query("SELECT * FROM files WHERE id = ?", file_id)
        return rows[0] if rows else None

    def event(self, job_id: str, message: str, level: str = "info", kind: str = "message", data=None) -> None:
        self.insert("events", self._event_row(job_id, message, level, kind, data))

    @staticmethod
    def _event_row(job_id: str, message: str, level: str = "info", kind: str = "message", data=None) -> dict:
        return {"id": new_id("ftevent"), "job_id": job_id, "created_at": now(), "level": level, "message": message,
                "type": kind, "data": json.dumps(data) if data is not None else None}

    def metrics_events(self, job_id: str, events: list[tuple[str, dict]], metrics_step: int,
                       estimated_finish: int | None) -> None:
        """The steps' metrics events and the job's metrics_step, in one transaction: a service killed between
        them would otherwise say a step again when it comes back (its metrics_step still before the step)."""
        with self.transaction() as db:
            for message, data in events:
                self._insert(db, "events", self._event_row(job_id, message, kind="metrics", data=data))
            db.execute("UPDATE jobs SET metrics_step = ?, estimated_finish = ? WHERE id = ?",
                       (metrics_step, estimated_finish, job_id))

    def add_file(self, filename: str, purpose: str, path: Path, size: int, file_id: str | None = None) -> dict:
        row = {"id": file_id or new_id("file"), "bytes": size, "created_at": now(), "filename": filename,
               "purpose": purpose, "path": str(path)}
        self.insert("files", row)
        return row


# ---------------------------------------------------------------------------------------------
# The scheduler: validates files, starts trainings as processes, follows their metrics, reaps them.
# ---------------------------------------------------------------------------------------------


TRAINING_NICENESS = 5  # a status request needs a millisecond of CPU; a training takes every core it can get


def _training_child() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The training gets SIGTERM when the service dies, even by kill -9: it saves a checkpoint and stops, and
    the service, started again, resumes it (Linux; elsewhere the training runs on to its end). It also runs
    at a lower CPU priority than the service, so a poll is answered at once on a machine the training keeps
    busy (a CPU, or a GPU box's data loading); the training loses only the little the service uses."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    with contextlib.suppress(OSError):
        os.nice(TRAINING_NICENESS)


class Scheduler(threading.Thread):
    """One thread owns every training process (it started them: PR_SET_PDEATHSIG follows the thread that forks).
    HTTP handlers only write requests into the store (stop_request); this thread acts on them."""

    def __init__(self, cfg, store: Store):
        super().__init__(name="scheduler", daemon=True)
        self.cfg, self.store = cfg, store
        self.out = Path(cfg.output_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping = threading.Event()
        self.stopped = threading.Event()
        self.export_proc: tuple[str, subprocess.Popen] | None = None
        self.recover()

    def recover(self) -> None:
        for job in self.store.query("SELECT * FROM jobs WHERE status = 'running'"):
            self.recover_job(job)
        # an export the last service was writing has no process here: it is made again from the start (its
        # output was only ever a .partial directory)
        self.store.execute("UPDATE exports SET status = 'queued', pid = NULL WHERE status = 'running'")

    def recover_job(self, job: dict) -> None:
        """After a restart (however the last service ended), a job marked running has no process here: it goes
        back to the queue and resumes from its checkpoint; a stop asked for before the restart is honoured."""
        stop = job["stop_request"]
        status = {"cancel": "cancelled", "pause": "paused"}.get(stop, "queued")
        self.store.update_job(job["id"], status=status, pid=None, stop_request=None,
                              finished_at=now() if status == "cancelled" else None,
                              said="The service restarted: the job resumes from its last checkpoint"
                              if status == "queued" else f"The service restarted: job {status}")

    def run(self) -> None:
        while not self.stopping.wait(self.cfg.poll_seconds):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the store's own trouble (a job's is its own: one_job); next poll
                traceback.print_exc()
        self.stop_all()
        self.stopped.set()

    def tick(self) -> None:
        """One poll: new jobs validated, trainings followed, queued jobs started; each job's part on its own
        (`one_job`), so one job's surprise fails that job and the others go on."""
        for job in self.store.query("SELECT * FROM jobs WHERE status = 'validating_files' ORDER BY seq"):
            with self.one_job(job["id"], "validating its files"):
                self.validate(job)
        self.follow_running()
        for job in self.store.query("SELECT * FROM jobs WHERE status = 'queued' ORDER BY seq"):
            if self.active() >= self.cfg.max_jobs:
                break
            with self.one_job(job["id"], "starting its training"):
                if not self.launch(job):
                    break  # first come, first trained: a job waiting on its lock keeps its place
        self.follow_exports()

    # -- exports (POST /v1/fine_tuning/jobs/{id}/exports): one at a time, each `entrypoint.py export` in a child
    # process here, whatever the runner (the service's own venv has llama.cpp: make llama-cpp) --------------------
    def export_dir(self, e: dict) -> Path:
        return self.store.jobs_dir / e["job_id"] / "exports" / e["id"]

    def follow_exports(self) -> None:
        if self.export_proc is not None:
            export_id, proc = self.export_proc
            if proc.poll() is None:
                return
            self.export_proc = None
            try:
                self.reap_export(self.store.export(export_id), proc.returncode)
            except Exception as e:  # noqa: BLE001 - one export must not stop the service
                traceback.print_exc()
                self.store.update_export(export_id, status="failed", finished_at=now(), pid=None, error={
                    "code": "service_error", "message": surprise_message(e, "reading the export")})
        queued = self.store.query("SELECT * FROM exports WHERE status = 'queued' ORDER BY seq LIMIT 1")
        if queued:
            self.start_export(queued[0])

    def start_export(self, e: dict) -> None:
        where = self.export_dir(e)
        where.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, str(ROOT / "entrypoint.py"), "export", str(runs.Run(self.out, e["job_id"]).final),
                   "--format", e["format"], "--output_dir", str(where)]
        command += (["--quant", e["quant"]] if e["format"] == "gguf" else []) + (["--force"] if e["force"] else [])
        with open(where / "export.log", "ab") as log:
            log.write(f"\n[serve] {' '.join(command)}\n".encode())
            log.flush()
            proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_training_child)
        self.export_proc = (e["id"], proc)
        self.store.update_export(e["id"], status="running", pid=proc.pid)
        self.store.event(e["job_id"], f"Export {e['id']} started ({export_label(e)})", data={"export_id": e["id"]})

    def reap_export(self, e: dict, rc: int) -> None:
        """The export's process ended: its tarball becomes a file the client downloads (GET /v1/files/{id}/content),
        its report goes on the export; or it failed (refused by its check, or an error) with the reason it gave."""
        where = self.export_dir(e)
        tarballs = sorted(where.glob("*.tar.gz"))
        if rc == 0 and tarballs:
            tarball = tarballs[0]
            report = runs.read_json(where / tarball.name.removesuffix(".tar.gz") / "export_report.json")
            f = self.store.add_file(f"{e['job_id']}-{tarball.name}", "fine-tune-results", tarball,
                                    tarball.stat().st_size)
            self.store.update_export(e["id"], status="succeeded", finished_at=now(), pid=None, file_id=f["id"],
                                     report=report)
            self.store.event(e["job_id"], f"Export {e['id']} ({export_label(e)}) is ready: file {f['id']}"
                             + (" (kept with force although its check failed)" if report.get("forced") else ""),
                             data={"export_id": e["id"], "file_id": f["id"]})
            return
        lines = [x for x in (where / "export.log").read_text(errors="replace").splitlines() if x.strip()]
        said = [x for x in lines if "export refused" in x or x.startswith(("error", "Error")) or ": error" in x]
        message = (said or lines or [f"the export exited with status {rc}"])[-1].strip().removeprefix("error: ")[-1500:]
        code = "export_refused" if "export refused" in message else "export_failed"
        self.store.update_export(e["id"], status="failed", finished_at=now(), pid=None,
                                 error={"code": code, "message": message})
        self.store.event(e["job_id"], f"Export {e['id']} failed: {message}", level="error",
                         data={"export_id": e["id"]})

    def stop_export(self) -> None:
        """The service is stopping: the export in progress is stopped and queued again (made anew at the next
        start)."""
        if self.export_proc is None:
            return
        export_id, proc = self.export_proc
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=self.cfg.shutdown_seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self.export_proc = None
        self.store.update_export(export_id, status="queued", pid=None)

    @contextlib.contextmanager
    def one_job(self, job_id: str, doing: str):
        """One job's part of a tick. Any exception in it (a file no check foresaw, a runner's odd answer, a bug)
        fails that job with the reason, its training stopped, and the tick goes on with the other jobs; the
        traceback goes to the service's log. The store failing is the service's trouble, not the job's: it ends
        the tick, and the next poll tries again."""
        try:
            yield
        except sqlite3.Error:
            raise
        except Exception as e:  # noqa: BLE001 - one job must not stop the service
            traceback.print_exc()
            self.abandon(job_id)
            reason = surprise_message(e, doing)
            self.store.move(job_id, ("validating_files", "queued", "running", "paused"), status="failed",
                            finished_at=now(), pid=None, error={"code": "service_error", "message": reason,
                                                                "param": None}, said=f"Job failed: {reason}",
                            level="error")

    # The runner seam: how a training starts, is followed, stopped and found again. Here each is a child process
    # (train_dpo.py, scaleout.py or launcher.py); slurm.SlurmScheduler overrides these for SLURM jobs.
    def active(self) -> int:
        """Trainings started and not yet reaped."""
        return len(self.procs)

    def follow_running(self) -> None:
        for job_id, proc in list(self.procs.items()):
            with self.one_job(job_id, "following its training"):
                job = self.store.job(job_id)
                self.follow_metrics(job)
                if proc.poll() is not None:
                    self.reap(job, proc.returncode)
                elif job["stop_request"] and not getattr(proc, "signalled", False):
                    proc.send_signal(signal.SIGTERM)  # train_dpo.py saves a checkpoint at the end of the step
                    proc.signalled = True

    def abandon(self, job_id: str) -> None:
        """A job the service gives up on (`one_job`): its training, if one started, is stopped (SIGTERM: it saves
        a checkpoint) and no longer followed."""
        proc = self.procs.pop(job_id, None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)

    # -- validation: the whole file checked before the job is queued ------------------------------------
    def validate(self, job: dict) -> None:
        try:
            data = self.prepare_data(job)
        except UserError as e:
            param = getattr(e, "param", "training_file")
            self.fail(job, "invalid_file", user_error_message(e, getattr(e, "filename", "training_file")), param)
            return
        self.store.move(job["id"], ("validating_files",), status="queued", data=data,
                        said="Files validated; the job is queued")

    def prepare_data(self, job: dict) -> str:
        """The training file validated in full (pairs), turned into pairs by the retraining rules (run logs) or
        into SFT pairs (method supervised); the validation file checked too. Returns the pairs file to train on."""
        work = self.store.jobs_dir / job["id"]
        work.mkdir(parents=True, exist_ok=True)
        for param in ("training_file", "validation_file"):
            if not job[param]:
                continue
            f = self.store.file(job[param])
            if f is None:
                raise _with(UserError("the file was deleted before the job started"), param, job[param])
            try:
                if param == "validation_file":
                    if job["method"]["type"] == "reinforcement":
                        self.prompts_file(job, f, work / "valid.prompts.jsonl")
                    else:
                        read_as_training(job["method"]["type"], f["path"])
                    self.store.event(job["id"], "validation_file checked; the kit evaluates on a held-out share "
                                     "of the training pairs (--eval_fraction), not on this file", level="warn")
                    continue
                data = self.training_pairs(job, f, work)
            except UserError as e:
                raise _with(e, param, f["filename"]) from None
        return data

    def training_pairs(self, job: dict, f: dict, work: Path) -> str:
        kind = input_kind(f["path"])
        if job["method"]["type"] == "reinforcement":
            return self.training_prompts(job, f, work, kind)
        if job["method"]["type"] == "supervised":
            return self.sft_pairs(job, f, work)
        if kind == "run_log":
            return self.pairs_from_runs(job, f, work)
        _, stats = formats.load_pairs(f["path"])
        if stats["format"] == formats.UNPAIRED:
            self.check_kto(job, f)
            self.store.event(job["id"], f"{stats['pairs']} unpaired examples in {f['filename']} (format kto): "
                             "the job trains KTO on them", data={"examples": stats["pairs"], "format": "kto"})
            return f["path"]
        self.store.event(job["id"], f"{stats['pairs']} pairs in {f['filename']} (format {stats['format']})",
                         data={"pairs": stats["pairs"], "format": stats["format"]})
        return f["path"]

    def sft_pairs(self, job: dict, f: dict, work: Path) -> str:
        """A supervised job's file (OpenAI's supervised rows, supervised.py) as SFT pairs, one per assistant
        message of weight 1; what was trained and what stayed context as an event."""
        data = supervised.read(f["path"])
        records = from_logs.sft_pairs(data.examples, 0)
        out = work / "train.pairs.jsonl"
        kit.atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        self.store.event(job["id"], data.summary(f["filename"]),
                         data={"examples": len(records), "rows": data.rows, "context_only": data.context_only,
                               "with_tools": sum(not ex.text_only() for ex in data.examples)})
        return str(out)

    def training_prompts(self, job: dict, f: dict, work: Path, kind: str) -> str:
        """A reinforcement job's prompts (GRPO): run logs' code-asking prompts, or OpenAI's reinforcement rows
        ({"messages": [...], ...the item's fields}), or the kit's prompts file; written as the kit's prompts file,
        each row's other fields kept as the item its grader reads ({{item.FIELD}}). Checked as the training will
        read them (every prompt, with its line; enough training prompts for a step)."""
        out, rows = self.prompts_file(job, f, work / "train.prompts.jsonl")
        self.store.event(job["id"], f"{len(rows)} prompts in {f['filename']}: the job samples answers to each and "
                         f"its grader ({job['method']['grader'].get('name') or job['method']['grader']['type']}) "
                         "scores them (GRPO)", data={"prompts": len(rows)})
        return str(out)

    def prompts_file(self, job: dict, f: dict, out: Path) -> tuple[Path, list[dict]]:
        """f's prompts (run logs' code-asking prompts, OpenAI's reinforcement rows, the kit's prompts file) written
        to out as the kit's prompts file, checked as the training reads them; (out, the rows)."""
        kind = input_kind(f["path"])
        rows, lines = (runlogs.prompts_from_logs(f["path"]), []) if kind == "run_log" else rft_rows(f["path"])
        kit.atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        cfg = self.train_config(job, str(out)) or config.TrainConfig(data=str(out), method="grpo")
        try:
            methods.grpo_data(cfg, formats.TrainingData(path=str(out), sha256="", format="", pairs=0, skipped={}))
        except UserError as e:
            raise UserError(e.message, f["path"], lines[e.line - 1] if e.line and lines else None) from None
        return out, rows

    def train_config(self, job: dict, data: str):
        """The TrainConfig the job's training command will parse (None when its flags are not the kit's own:
        train_dpo.py reports them in the job's log)."""
        argv = kit.normalise_argv(config.TrainConfig, job_flags(self.cfg, job | {"data": data}))
        try:
            values = vars(kit.build_parser(config.TrainConfig, "").parse_args(argv))
        except SystemExit:
            return None
        values.pop("config", None)
        return config.TrainConfig(**values)

    def check_kto(self, job: dict, f: dict) -> None:
        """A file of labelled examples trains KTO (train_dpo.py --method auto): what its training command would
        refuse (a fine-tuned model to continue, batch size 1, DPO-only hyperparameters) fails the validation."""
        cfg = self.train_config(job, f["path"])
        if cfg is None:
            return
        dpo = dataclasses.replace(cfg, method="dpo").problems()  # the rest train_dpo.py reports itself
        problems = [p for p in dataclasses.replace(cfg, method="kto").problems() if p not in dpo]
        if job["init_adapter"]:
            problems = [p for p in problems if "--init_adapter" not in p] + [
                f"{job['model']} is a fine-tuned model, and KTO does not continue an adapter: start from its base, "
                f"{job['base']}"]
        if problems:
            raise UserError("the file holds unpaired examples (KTO), and " + "; ".join(problems))

    def pairs_from_runs(self, job: dict, f: dict, work: Path) -> str:
        """An agent's raw run logs -> pairs by the retraining rules (build_pairs.py), with what was kept and
        dropped as an event."""
        import io

        out, report = work / "train.pairs.jsonl", work / "pairs.report.json"
        log = io.StringIO()
        with contextlib.redirect_stderr(log), contextlib.redirect_stdout(log):
            status = from_logs.main([f["path"], "-o", str(out), "--report", str(report), "--workers", "1"])
        if status != 0:
            raise UserError("no usable run in the file (nothing succeeded, or nothing to pair)")
        s = json.loads(report.read_text())
        self.store.event(job["id"], f"{s['runs_read']} runs read from {f['filename']}: {s['pairs_written']} pairs "
                         f"({', '.join(f'{k} {v}' for k, v in s['pairs_by_rule'].items())}); dropped: "
                         f"{', '.join(f'{k} {v}' for k, v in s['runs_dropped'].items())}, "
                         f"{s['duplicates_removed']} duplicate pairs",
                         data={k: s[k] for k in ("runs_read", "runs_by_outcome", "runs_dropped", "pairs_written",
                                                 "pairs_by_rule", "duplicates_removed")})
        return str(out)

    # -- processes --------------------------------------------------------------------------------
    def run_locked(self, job: dict) -> bool:
        """Whether a process (the last service's training, still saving) holds the run's lock; said once."""
        holder = runs.lock_holder(self.out, job["id"])
        if holder is not None and job["waiting_on"] != holder:
            self.store.update_job(job["id"], waiting_on=holder)
            self.store.event(job["id"], f"Waiting for pid {holder}, which holds the run's lock")
        return holder is not None

    def launch(self, job: dict) -> bool:
        """Start the job's training; False when a process (the last service's training, still saving) holds the
        run's lock."""
        if self.run_locked(job):
            return False
        if not self.store.move(job["id"], ("queued",), status="running", waiting_on=None):
            return True  # cancelled or paused a moment ago
        last = runs.last_checkpoint(runs.Run(self.out, job["id"]).checkpoints)
        command = train_command(self.cfg, job_flags(self.cfg, job))
        log = open(self.store.jobs_dir / job["id"] / "train.log", "ab")
        log.write(f"\n[serve] {' '.join(command)}\n".encode())
        log.flush()
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_training_child)
        log.close()
        self.procs[job["id"]] = proc
        self.store.update_job(job["id"], pid=proc.pid)
        self.store.event(job["id"], f"Resuming from {last.name}" if last else "Fine-tuning job started",
                         data={"pid": proc.pid})
        return True

    def follow_metrics(self, job: dict) -> None:
        """New metrics.jsonl rows (steps not yet reported) as metrics events."""
        run = runs.Run(self.out, job["id"])
        rows = runs.read_metrics(run.partial if run.partial.exists() else run.final)
        seen, left, events = job["metrics_step"] or 0, None, []
        for row in rows:
            if row["step"] > seen and "train_runtime" not in row and "loss" in row:
                events.append(metrics_event(row))
                seen, left = row["step"], row.get("seconds_left")
        if seen != job["metrics_step"]:
            # OpenAI's estimated_finish: the training's own estimate of the time its remaining steps take (the
            # held-out evaluation and the handoff after them are not in it)
            self.store.metrics_events(job["id"], events, seen,
                                      now() + int(left) if isinstance(left, (int, float)) else None)

    def reap(self, job: dict, rc: int) -> None:
        """The process ended: succeeded (the run is complete), or stopped as asked (cancel, pause, the service
        stopping), or failed with the run's own error."""
        self.procs.pop(job["id"], None)
        run = runs.Run(self.out, job["id"])
        status = runs.read_json((run.final if run.final.exists() else run.partial) / "status.json")
        stop = job["stop_request"]
        if rc == 0 and run.final.exists():
            return self.succeed(job, run)
        step = status.get("step")
        # the stop asked for is cleared with the status it leads to, in one write: a service killed in between
        # finds it still asked for (recover_job honours it), never a cancelled job back in the queue
        ended = {"pid": None, "stop_request": None}
        if stop == "cancel":
            self.store.update_job(job["id"], status="cancelled", finished_at=now(), **ended,
                                  said=f"Job cancelled; its checkpoint (step {step}) is kept")
        elif stop == "pause":
            self.store.update_job(job["id"], status="paused", **ended,
                                  said=f"Job paused at step {step}; resume continues from its checkpoint")
        elif stop == "shutdown":
            self.store.update_job(job["id"], status="queued", **ended,
                                  said=f"The service is stopping: checkpoint at step {step}; the job resumes "
                                  "when the service starts again")
        elif rc == kit.EXIT_USAGE and "is in use by pid" in str(status.get("error", "")) + self.log_tail(job):
            self.store.update_job(job["id"], status="queued", **ended)  # another process holds the run: try again
        else:
            message = status.get("error") or self.log_tail(job) or f"training exited with status {rc}"
            self.fail(job, "training_failed" if rc != kit.EXIT_USAGE else "invalid_training_options", message)

    def succeed(self, job: dict, run: runs.Run) -> None:
        metrics = runs.read_metrics(run.final)
        tokens = max((int(r["num_tokens"]) for r in metrics if isinstance(r.get("num_tokens"), (int, float))),
                     default=None)
        step_metrics = self.store.jobs_dir / job["id"] / "step_metrics.csv"
        step_metrics.parent.mkdir(parents=True, exist_ok=True)
        kit.atomic_write_text(step_metrics, results_csv(metrics))
        results = [self.store.add_file(f"{job['id']}-{name}", "fine-tune-results", path, path.stat().st_size)["id"]
                   for name, path in (("step_metrics.csv", step_metrics), ("adapter.tar.gz", run.tarball),
                                      ("metrics.jsonl", run.final / "metrics.jsonl")) if path.exists()]
        self.store.update_job(job["id"], status="succeeded", finished_at=now(), trained_tokens=tokens,
                              fine_tuned_model=job["fine_tuned_model"], result_files=results, pid=None,
                              stop_request=None, said=f"The job has successfully completed: {job['fine_tuned_model']}")

    def fail(self, job: dict, code: str, message: str, param: str | None = None) -> None:
        self.store.update_job(job["id"], status="failed", finished_at=now(), pid=None, stop_request=None,
                              error={"code": code, "message": message, "param": param},
                              said=f"Job failed: {message}", level="error")

    def log_tail(self, job: dict, lines: int = 3) -> str:
        path = self.store.jobs_dir / job["id"] / "train.log"
        text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
        return "\n".join(text[-lines:])

    def stop_all(self) -> None:
        """The service is stopping: every training saves a checkpoint and stops; its job goes back to the queue."""
        self.stop_export()
        for job_id, proc in self.procs.items():
            self.store.update_job(job_id, stop_request="shutdown")
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.time() + self.cfg.shutdown_seconds
        for job_id, proc in list(self.procs.items()):
            try:
                proc.wait(timeout=max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            job = self.store.job(job_id)
            self.follow_metrics(job)
            self.reap(job, proc.returncode)


def export_label(e: dict) -> str:
    return f"GGUF {e['quant']}" if e["format"] == "gguf" else "merged model"


def _with(e: UserError, param: str, filename: str) -> UserError:
    e.param, e.filename = param, filename
    return e
