"""A training run on disk: its directory, status, lock, manifest and tarball, and the receiving end's checks.

Not run on its own: train_dpo.py makes runs through `Run`; entrypoint.py (verify, runs), scaleout.py and
iterate.py read them. Standard library only, so the launcher and `--help` never pay for torch.

    artifacts/.<run>.lock      held by the one process that trains <run> (a second gets exit 2); says its pid and host
    artifacts/<run>.partial/   while training: config.json, status.json, metrics.jsonl, checkpoints/, ...
    artifacts/<run>/           renamed into place when complete; manifest.json lists every file's sha256
    artifacts/<run>.tar.gz     the handoff, with <run>.tar.gz.sha256 beside it (`sha256sum -c` reads it)

status.json has one writer, `write_status`: the training process through `Run.set_status` (rank 0), and
scaleout.py when a rank of a multi-process run fails.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import hashlib
import importlib.util
import io
import json
import os
import shutil
import socket
import tarfile
import tempfile
from pathlib import Path

from dpokit.core import ranks
from dpokit.core.kit import UserError, atomic_write_bytes, atomic_write_json, atomic_write_text, num, sha256_file

# May differ on resume: the step budget and logging, and how the same values are computed (so a run
# stopped before --fused_ops / --share_prompts existed, whose config lacks them, resumes with them on).
# What chat / eval / merge / --init_adapter read from a finished run's config.json (TrainConfig's names).
RUN_CONFIG_KEYS = ("model_name_or_path", "load_in_4bit", "bnb_4bit_quant_type", "data", "skip_invalid",
                   "eval_fraction", "probes", "max_length", "seed", "output_dir")
RESUMABLE_CHANGES = {"max_steps", "num_train_epochs", "save_steps", "logging_steps", "fused_ops", "share_prompts",
                     "use_liger_kernel", "report_to"}


# ---------------------------------------------------------------------------------------------
# Pure helpers.
# ---------------------------------------------------------------------------------------------


def default_run_name(data_sha256: str, now: dt.datetime) -> str:
    return f"{now:%Y%m%d-%H%M%S}-{data_sha256[:8]}"


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def config_conflicts(old: dict, new: dict) -> list[str]:
    """Options that differ between a stored run and this invocation and make a resume unsafe."""
    return sorted(k for k in set(old) | set(new) if k not in RESUMABLE_CHANGES and old.get(k) != new.get(k))


def last_checkpoint(folder: Path) -> Path | None:
    """The checkpoint-N directory with the highest N (what a resume starts from), or None."""
    steps = [(int(p.name.split("-")[1]), p) for p in folder.glob("checkpoint-*")
             if p.is_dir() and p.name.split("-")[1].isdigit()] if folder.is_dir() else []
    return max(steps)[1] if steps else None


# ---------------------------------------------------------------------------------------------
# The run directory: written as <run>.partial, renamed to <run> only when complete.
# ---------------------------------------------------------------------------------------------


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def read_metrics(directory: Path) -> list[dict]:
    """A run's metrics.jsonl rows (none when it has not logged yet); complete lines only: the service reads the
    file while the training appends to it, and a row is whole once its newline is written."""
    path = Path(directory) / "metrics.jsonl"
    return [json.loads(r) for r in path.read_text().split("\n")[:-1] if r.strip()] if path.exists() else []


def write_status(directory: Path, run_name: str, state: str, **fields) -> None:
    """status.json: the state, the fields that go with it (error, step, rank...), and every state so far
    with its time (a state is not repeated back to back)."""
    path = Path(directory) / "status.json"
    history = read_json(path).get("history", [])
    if not history or history[-1]["state"] != state:
        history = history + [{"state": state, "at": now_iso()}]
    atomic_write_json(path, {"run_name": run_name, "state": state, "history": history, **fields})


class RunLock:
    """An exclusive lock on a run name (flock on <output_dir>/.<run>.lock, holding the owner's pid and host), so
    two trainings never write into one <run>.partial. Released when the process ends, however it ends. Across
    machines (SLURM, several nodes) it holds where the shared filesystem takes flock from every client (NFS, which
    Linux maps onto byte-range locks; CephFS; Lustre mounted -o flock): docs/slurm.md."""

    def __init__(self, output_dir: Path, name: str):
        self.name, self.path, self.fd = name, Path(output_dir) / f".{name}.lock", None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                holder = holder_words(os.pread(fd, 300, 0).decode(errors="replace"))
                os.close(fd)
                raise UserError(f"run {self.name} is in use by {holder}; wait for it, or choose another "
                                "--run_name (RUN=)") from None
            try:  # the holder before us may have removed the file after we opened it: lock the file that is there
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)  # while still held: a waiting process sees the file gone and retries
        os.close(self.fd)
        self.fd = None


def holder_words(text: str) -> str:
    """A lock file's "<pid> <host>" as the messages say it: pid 12 on node3 (pid ? before the holder wrote it)."""
    pid, _, host = text.strip().partition(" ")
    return f"pid {pid or '?'}{f' on {host}' if host else ''}"


def lock_text(output_dir: str | os.PathLike, name: str) -> str | None:
    """What <run>'s lock file says while a process holds its RunLock ("<pid> <host>", "" before the holder has
    written it), or None when no process does. Looks without keeping the lock."""
    try:
        fd = os.open(Path(output_dir) / f".{name}.lock", os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        text = os.pread(fd, 300, 0).decode(errors="replace")
        os.close(fd)
        return text
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    return None


def lock_holder(output_dir: str | os.PathLike, name: str) -> int | None:
    """The pid of the process that holds <run>'s RunLock (-1 when it has not written its pid yet), or None when
    no process does (serve.py asks before it starts a training)."""
    text = lock_text(output_dir, name)
    if text is None:
        return None
    words = text.split()
    return int(words[0]) if words and words[0].isdigit() else -1


class Run:
    """Where a run lives: <output_dir>/<name>.partial while training, <name> when complete, <name>.tar.gz."""

    def __init__(self, output_dir: str | os.PathLike, name: str):
        self.root = Path(output_dir)
        self.name = name
        self.final = self.root / name
        self.partial = self.root / f"{name}.partial"
        self.tarball = self.root / f"{name}.tar.gz"
        self.checkpoints = self.partial / "checkpoints"
        self.state = "pending"
        self.stopped_by = None  # the signal that cancelled it

    def lock(self) -> RunLock:
        return RunLock(self.root, self.name)

    def set_status(self, state: str, **fields) -> None:
        self.state = state
        if ranks.is_main_process():  # one status per run: rank 0's
            write_status(self.partial, self.name, state, **fields)

    def prepare(self, resolved: dict, data_sha: str) -> str | None:
        """Create or reopen <run>.partial. Returns the checkpoint to resume from ('' = fresh start), or
        None when <run> is already complete with the same config; a different config is a UserError."""
        from_disk = self.final if self.final.exists() else self.partial if self.partial.exists() else None
        if from_disk is not None:
            old = read_json(from_disk / "config.json")
            old_data = read_json(from_disk / "data.json").get("sha256")
            conflicts = config_conflicts(old, resolved)
            if old_data == data_sha:  # the same bytes at another path (a moved clone, a container's mount): the same run
                conflicts = [k for k in conflicts if k != "data"]
            elif old_data is not None:
                conflicts.append("data (sha256)")
            if conflicts:
                raise UserError(f"run {self.name!r} exists in {from_disk} with different {', '.join(conflicts)}; "
                                "choose another --run_name (RUN=)")
            if from_disk == self.final:
                print(f"[run] {self.final} is already complete; nothing to do (tarball: {self.tarball})")
                self.state = "succeeded"
                return None
        self.partial.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.partial / ranks.FAILURES_DIR, ignore_errors=True)  # an earlier attempt's
        atomic_write_json(self.partial / "config.json", resolved)
        last = last_checkpoint(self.checkpoints)
        if last:
            trim_metrics(self.partial / "metrics.jsonl", int(last.name.split("-")[1]))
            print(f"[run] resuming {self.name} from {last}", flush=True)
        else:
            (self.partial / "metrics.jsonl").unlink(missing_ok=True)
        self.set_status("pending")
        return str(last or "")

    def metrics(self) -> list[dict]:
        return read_metrics(self.partial if self.partial.exists() else self.final)

    def finish(self, manifest: dict) -> str:
        """Checkpoints gone, manifest.json (every file's sha256) written, <run>.partial renamed to <run>, the
        tarball packed. Returns the tarball's sha256."""
        shutil.rmtree(self.checkpoints, ignore_errors=True)
        self.set_status("succeeded", **({"step": manifest["steps"]} if "steps" in manifest else {}))
        atomic_write_json(self.partial / "manifest.json", {**manifest, "files": file_hashes(self.partial)})
        os.replace(self.partial, self.final)
        return make_tarball(self.final, self.tarball)


def trim_metrics(path: Path, last_step: int) -> None:
    """On resume, drop log rows after the checkpoint we restart from (they will be logged again), and the
    interrupted attempt's end-of-training summary (the resumed run writes its own)."""
    if path.exists():
        rows = [r for r in path.read_text().splitlines()
                if r.strip() and json.loads(r)["step"] <= last_step and "train_runtime" not in json.loads(r)]
        atomic_write_text(path, "".join(r + "\n" for r in rows))


# ---------------------------------------------------------------------------------------------
# While it trains: metrics.jsonl, a signal turned into save-and-stop, and what the user watches.
# ---------------------------------------------------------------------------------------------


def progress_line(step: int, max_steps: int, logs: dict, seconds_per_step: float | None) -> str:
    """One logged step in a few words: 'step 3/10  loss 0.6931  margin 0.012  acc 0.50  2.1 s/step  0:00:15 left'
    (held-out numbers as 'eval loss ...' when the row is an evaluation; GRPO: 'reward 0.120 ± 0.210  pass 0.12
    ran 0.50', the reward's mean and spread over the step's answers and the checker's pass and ran rates)."""
    def num(key, fmt):
        return f"{logs[key]:{fmt}}" if isinstance(logs.get(key), (int, float)) else None

    if "train_runtime" in logs:  # the Trainer's summary at the end
        return (f"step {step}/{max_steps}  done in {logs['train_runtime']:.0f}s"
                + (f"  mean loss {logs['train_loss']:.4f}" if isinstance(logs.get("train_loss"), float) else ""))
    parts = [f"step {step}/{max_steps}"]
    for prefix, label in (("", ""), ("eval_", "eval ")):
        for key, name, fmt in (("loss", "loss", ".4f"), ("rewards/margins", "margin", ".3f"),
                               ("rewards/accuracies", "acc", ".2f")):
            value = num(prefix + key, fmt)
            if value is not None:
                parts.append(f"{label}{name} {value}")
    if num("reward", ".3f") is not None:  # GRPO: the group's rewards, and what the checker saw
        parts.append(f"reward {num('reward', '.3f')} ± {num('reward_std', '.3f') or '?'}")
        parts += [f"{name} {num(key, '.2f')}" for key, name in (("pass_rate", "pass"), ("ran_rate", "ran"))
                  if num(key, ".2f") is not None]
    if seconds_per_step is not None:
        left = int(seconds_per_step * max(max_steps - step, 0))
        parts.append(f"{seconds_per_step:.1f} s/step  {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d} left")
    return "  ".join(parts)


def training_callbacks(run: Run, stop_requested, terminal: bool) -> list:
    """Trainer callbacks: every log row appended to metrics.jsonl (rank 0); a save-and-stop at the end of
    the step after stop_requested() turns true in any process; and progress: a bar with steps, loss,
    margin and time left on a terminal, one line per logged step in a log."""
    import sys
    import time

    from transformers import TrainerCallback

    class Record(TrainerCallback):
        start, first_step = 0.0, 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.start, self.first_step = time.time(), state.global_step

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero:  # logs are already averaged over processes
                return
            row = {"step": state.global_step, "epoch": round(state.epoch or 0, 4), "max_steps": state.max_steps}
            done = state.global_step - self.first_step
            if done > 0 and "train_runtime" not in (logs or {}):  # at this process's pace so far (a resume too)
                row["seconds_left"] = round((time.time() - self.start) / done * max(state.max_steps - state.global_step, 0))
            row |= logs or {}
            with open(run.partial / "metrics.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

        def on_step_end(self, args, state, control, **kwargs):
            if ranks.any_process(stop_requested()):  # every rank stops at the same step
                control.should_save = True
                control.should_training_stop = True

    class Progress(TrainerCallback):
        bar, start, first_step = None, 0.0, 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.start, self.first_step = time.time(), state.global_step
            if terminal and state.is_world_process_zero:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="[train]", unit="step",
                                dynamic_ncols=True, file=sys.stdout)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            done = state.global_step - self.first_step
            per_step = (time.time() - self.start) / done if done else None
            if self.bar is not None and "train_runtime" not in logs:
                self.bar.set_postfix_str(progress_line(state.global_step, state.max_steps, logs, None)
                                         .split("  ", 1)[-1], refresh=True)
                return
            if self.bar is not None:  # the end: the bar gives way to the summary line
                self.bar.close()
                self.bar = None
            print(f"[train] {progress_line(state.global_step, state.max_steps, logs, per_step)}", flush=True)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    return [Record(), Progress()]


# ---------------------------------------------------------------------------------------------
# Handoff: a reproducible tarball, and checking one before trusting anything in it.
# ---------------------------------------------------------------------------------------------


def file_hashes(root: str | os.PathLike, skip: tuple[str, ...] = ("manifest.json",)) -> dict[str, str]:
    """sha256 of every regular file below root, keyed by its POSIX path relative to root, sorted."""
    root = Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in skip:
            out[rel] = sha256_file(p)
    return out


def write_export_manifest(directory: Path, name: str, report: dict) -> None:
    """manifest.json of an export (export.py): what it is and every file's sha256, as a run's manifest lists its
    files, so verify_tarball checks an export's tarball as it checks an adapter's."""
    atomic_write_json(Path(directory) / "manifest.json", {
        "kind": "export", "run_name": name, "format": report["format"], "quant": report["quant"],
        "exported_from": report["run"], "files": file_hashes(directory)})


def export_problems(run_dir: Path, manifest: dict) -> list[str]:
    """What is wrong with an unpacked export beyond its checksums: a GGUF that llama.cpp's gguf reader cannot read
    (or that holds no tensors; where the gguf package is installed), a merged model without its config or
    weights."""
    if manifest.get("format") == "merged":
        model = run_dir / "model"
        missing = [f for f in ("config.json",) if not (model / f).exists()]
        if not list(model.glob("*.safetensors")):
            missing.append("*.safetensors")
        return [f"model/{f} is missing" for f in missing]
    problems = []
    ggufs = sorted(run_dir.glob("*.gguf"))
    if len(ggufs) != 1:
        return [f"an export holds one .gguf file (found {len(ggufs)})"]
    try:
        from gguf import GGUFReader  # the checksums above need nothing; reading the GGUF needs this package
    except ImportError:
        return problems
    try:
        if not GGUFReader(str(ggufs[0])).tensors:
            problems.append(f"{ggufs[0].name} holds no tensors")
    except Exception as e:  # noqa: BLE001 - the reader's ValueError, struct and numpy errors on a bad file
        problems.append(f"{ggufs[0].name} is not a readable GGUF ({type(e).__name__}: {str(e)[:160]})")
    return problems


def make_tarball(src_dir: str | os.PathLike, dest: str | os.PathLike) -> str:
    """Pack src_dir as `<name>/...` into dest (.tar.gz) reproducibly; returns the tarball's sha256.

    Entries are sorted, owned by 0:0 with mode 0644/0755 and a fixed mtime, and gzip carries no
    timestamp, so the same files always give the same bytes. A `<dest>.sha256` file is written
    beside it in the format `sha256sum -c` reads.
    """
    import gzip

    src_dir, dest = Path(src_dir), Path(dest)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for p in [src_dir, *sorted(src_dir.rglob("*"))]:
            if p.is_symlink() or not (p.is_file() or p.is_dir()):
                continue
            info = tar.gettarinfo(str(p), arcname=str(Path(src_dir.name) / p.relative_to(src_dir)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            info.mode = 0o755 if p.is_dir() else 0o644
            if p.is_file():
                with open(p, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    data = buf.getvalue()
    atomic_write_bytes(dest, data)
    digest = hashlib.sha256(data).hexdigest()
    atomic_write_text(f"{dest}.sha256", f"{digest}  {dest.name}\n")
    return digest


def unsafe_member(member: tarfile.TarInfo, top: str | None) -> str | None:
    """Why a tar member must not be extracted (absolute path, `..`, link, device, outside the run
    directory), or None when it is a plain file or directory inside it."""
    name = member.name
    parts = Path(name).parts
    if name.startswith(("/", "\\")) or (parts and ":" in parts[0]):
        return f"absolute path {name!r}"
    if ".." in parts:
        return f"path with '..' {name!r}"
    if "\0" in name:  # no file system takes it (open() raises ValueError)
        return f"NUL byte in the name {name!r}"
    if member.issym() or member.islnk():
        return f"link {name!r} -> {member.linkname!r}"
    if not (member.isfile() or member.isdir()):
        return f"special file {name!r}"
    if not parts and member.isdir():  # '.' or './': the archive's own top, as `tar -czf x.tar.gz .` writes it
        return None
    if top is not None and (not parts or parts[0] != top):
        return f"{name!r} is outside the run directory {top!r}"
    return None


def serving_problems(adapter_config: dict) -> list[str]:
    """What stops an adapter loading in vLLM or plain PEFT: extra saved modules, LoRA on the
    embeddings or the output head."""
    problems = []
    if adapter_config.get("modules_to_save"):
        problems.append(f"modules_to_save is set ({adapter_config['modules_to_save']}); vLLM rejects it")
    targets = adapter_config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    for t in targets:
        if any(w in str(t) for w in ("embed", "lm_head", "wte", "output")):
            problems.append(f"LoRA on {t!r} (embeddings or output head); vLLM does not serve that")
    if adapter_config.get("peft_type") != "LORA":
        problems.append(f"peft_type is {adapter_config.get('peft_type')!r}, not LORA")
    return problems


def verify_tarball(path: str | os.PathLike, extract_to: str | os.PathLike | None = None) -> dict:
    """Check a run tarball: safe members only, every file matches manifest.json's sha256, nothing
    unlisted, the adapter obeys the serving rules (an export's tarball: its GGUF reads, or its merged model is
    whole). Returns the manifest; raises UserError.

    Extraction goes to a temporary directory (removed afterwards) unless extract_to is given; the run's
    directory must not exist there yet.
    """
    import gzip
    import zlib

    path = Path(path)
    sidecar = Path(f"{path}.sha256")
    try:
        if sidecar.exists() and sidecar.read_bytes().split()[:1] != [sha256_file(path).encode()]:
            raise UserError(f"tarball sha256 differs from {sidecar.name}", path)
    except OSError as e:
        raise UserError(f"cannot read the tarball or {sidecar.name}: {e.strerror or e}", path) from None
    try:
        with gzip.open(path) as gz:  # to the end: tarfile stops at the tar's last block, so it never
            while gz.read(1 << 20):  # reaches gzip's CRC and length, and a cut-off copy would pass
                pass
        tar = tarfile.open(path, "r:gz")
        members = tar.getmembers()
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise UserError(f"not a readable .tar.gz: {e}", path) from None
    with tar, tempfile.TemporaryDirectory(prefix="verify-") as tmp:
        parts = [Path(m.name).parts for m in members]  # './a' -> ('a',); '.' and './' -> ()
        flat = ("manifest.json",) in parts  # packed from inside the run directory: `tar -czf x.tar.gz .`
        top = flat_run_name(tar, members, parts, path) if flat else next((p[0] for p in parts if p), None)
        if top is None:
            raise UserError("refused: the archive does not start with the run's directory", path)
        for m in members:
            if why := unsafe_member(m, None if flat else top):
                raise UserError(f"refused: {why}", path)
        dest = Path(extract_to) if extract_to else Path(tmp)
        if os.path.lexists(dest / top):  # its files would stand in for missing ones; a link would lead out
            raise UserError(f"{dest / top} already exists; extract into a new directory", path)
        run_dir = dest / top
        run_dir.mkdir(parents=True)
        for m, p in zip(members, parts):  # every member was checked above; extract plain files by hand
            target = (run_dir if flat else dest).joinpath(*p)
            try:
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(m) as src, open(target, "wb") as out:
                    out.write(src.read())
            except (FileExistsError, IsADirectoryError, NotADirectoryError):  # a file over a directory, or back
                raise UserError(f"refused: {m.name!r} clashes with an earlier member", path) from None
            except (tarfile.TarError, EOFError) as e:
                raise UserError(f"not a readable .tar.gz: {e}", path) from None
            except (OSError, ValueError) as e:  # a name too long for this file system, a full disk
                raise UserError(f"cannot extract {m.name!r}: {getattr(e, 'strerror', None) or e}", path) from None
        manifest = read_json_object(run_dir / "manifest.json", "no readable manifest.json in the run directory", path)
        listed, found = manifest.get("files", {}), file_hashes(run_dir)
        if not isinstance(listed, dict):
            raise UserError("refused: manifest.json's files is not a mapping of name to sha256", path)
        problems = [f"{name}: sha256 differs from manifest.json" for name in sorted(listed)
                    if name in found and found[name] != listed[name]]
        problems += [f"{name}: listed in manifest.json but missing" for name in sorted(set(listed) - set(found))]
        problems += [f"{name}: present but not in manifest.json" for name in sorted(set(found) - set(listed))]
        exported = manifest.get("kind") == "export"
        if exported and not problems:
            problems += export_problems(run_dir, manifest)
        elif not exported and not (run_dir / "adapter_config.json").exists():
            problems.append("adapter_config.json is missing")
        if manifest.get("run_name") != top:  # open_run finds the unpacked run by this name
            problems.append(f"manifest.json names run {manifest.get('run_name')!r}, but the archive holds {top!r}")
        if problems:
            raise UserError("refused:\n  - " + "\n  - ".join(problems), path)
        if exported:
            return manifest
        manifest["adapter_config"] = read_json_object(run_dir / "adapter_config.json", "adapter_config.json is "
                                                      "not readable", path)
        serving = serving_problems(manifest["adapter_config"])
        if serving and manifest.get("lora_target_modules_requested", "auto") == "auto":
            raise UserError("refused (serving rules):\n  - " + "\n  - ".join(serving), path)
        manifest["serving_warnings"] = serving  # the trainer asked for these modules explicitly
        return manifest


def read_json_object(file: Path, what: str, archive) -> dict:
    """A JSON object from an unpacked archive; anything else is the archive's fault (UserError naming it)."""
    try:
        obj = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"{what} ({type(e).__name__}: {str(e)[:200]})", archive) from None
    if not isinstance(obj, dict):
        raise UserError(f"{what} (not a JSON object)", archive)
    return obj


def flat_run_name(tar: tarfile.TarFile, members: list, parts: list, path) -> str:
    """The run's name for an archive packed from inside its directory (manifest.json at the top, as a receiver
    who unpacked and packed again makes it): manifest.json's run_name, which must be a plain name."""
    m = [m for m, p in zip(members, parts) if p == ("manifest.json",)][-1]  # tar extracts the last one
    name = None
    if m.isfile():
        try:
            with tar.extractfile(m) as f:
                manifest = json.loads(f.read().decode("utf-8"))
            name = manifest.get("run_name") if isinstance(manifest, dict) else None
        except (tarfile.TarError, EOFError, OSError, ValueError, RecursionError):
            pass
    if not isinstance(name, str) or not name or name.startswith(".") or any(c in name for c in "/\\:\0"):
        raise UserError("refused: packed from inside the run directory, and manifest.json names no run "
                        "(a plain run_name) to unpack it as", path)
    return name


def describe_run(manifest: dict) -> str:
    """A few lines on what an adapter is, for the person receiving it."""
    cfg = manifest.get("adapter_config", {})
    base = manifest.get("base_model", {})
    origin = base.get("origin", {}).get("upstream")
    data = manifest.get("data", {})
    lines = [
        f"run:            {manifest.get('run_name')} ({manifest.get('steps')} steps, seed {manifest.get('seed')}, "
        f"finished {manifest.get('finished_at')})",
        f"base model:     {base.get('name_or_path')}" + (f" = {origin}" if origin else ""),
        f"adapter:        LoRA r={cfg.get('r')} alpha={cfg.get('lora_alpha')} on {', '.join(cfg.get('target_modules') or [])}",
        f"data:           {data.get('pairs_trained', data.get('pairs'))} "
        f"{ {'kto': 'KTO examples', 'grpo': 'GRPO prompts'}.get(manifest.get('method'), 'pairs')}, {data.get('format')}, "
        f"sha256 {data.get('sha256')}",
    ]
    if manifest.get("eval"):
        lines.append(f"held-out:       preference accuracy {manifest['eval']['base']:.3f} (base) -> "
                     f"{manifest['eval']['tuned']:.3f} (tuned); see report.md")
    if manifest.get("execution"):
        e = manifest["execution"]
        lines.append(f"checker:        held-out answers' pass rate {num(e['base']['pass_rate'], '.3f')} (base) -> "
                     f"{num(e['tuned']['pass_rate'], '.3f')} (tuned), mean score "
                     f"{num(e['base']['mean_score'], '+.4f')} -> {num(e['tuned']['mean_score'], '+.4f')}"
                     + (f" (sandbox: {e['base']['isolation']} mode, Landlock {e['base'].get('landlock') or 'off'})"
                        if e['base'].get('isolation') else "")
                     + "".join(f"; {e[k]['unscorable']} of {k}'s {e[k]['answers']} answers could not be scored in "
                               f"{e[k]['isolation']} mode" for k in ("base", "tuned") if e[k].get("unscorable")))
    versions = ", ".join(f"{k} {v}" for k, v in manifest.get("versions", {}).items() if v)
    lines.append(f"versions:       python {manifest.get('python')}, {versions}")
    lines.append(f"files:          {len(manifest.get('files', {}))} checked against manifest.json")
    return "\n".join(lines)


def runs_table(root: str | os.PathLike) -> str:
    """One line per run under root (finished, partial, failed): status, data, method, steps, held-out accuracy, the
    checker's mean score of held-out answers (base -> tuned), size."""
    rows = [("run", "status", "data", "method", "pairs", "steps", "held-out acc", "checker score", "size")]
    for d in sorted(p for p in Path(root).glob("*") if (p / "status.json").exists()):
        status, data, manifest = (read_json(d / name) for name in ("status.json", "data.json", "manifest.json"))
        acc, run = manifest.get("eval") or {}, manifest.get("execution") or {}
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        rows.append((d.name, status.get("state", "?"), Path(data.get("path", "?")).name, data.get("method", "-"),
                     str(data.get("pairs_trained", data.get("pairs", "?"))), str(status.get("step", "-")),
                     f"{acc['base']:.2f} -> {acc['tuned']:.2f}" if acc else "-",
                     " -> ".join("n/a" if run[k]["mean_score"] is None else f"{run[k]['mean_score']:+.3f}"
                                 for k in ("base", "tuned")) + (" (limits)" if run["base"].get("isolation") == "limits"
                                                                else "") if run else "-",
                     f"{size / 1e6:.1f} MB"))
    if len(rows) == 1:
        return f"no runs in {root}"
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def open_run(path: str | os.PathLike, workdir: str | os.PathLike) -> tuple[Path, dict]:
    """A finished run's directory (a tarball is verified and unpacked into workdir first), and the config
    it was trained with (its config.json: train_dpo.TrainConfig's names). A plan's name (iterate.py: the folder
    <output_dir>/<name> beside <name>.lineage.json, as `make train RUN=<name>` leaves) is its last stage's run."""
    p = Path(path)
    lineage = p.parent / f"{p.name}.lineage.json"
    if p.is_dir() and not (p / "adapter_config.json").exists() and lineage.is_file():
        final = read_json(lineage).get("final_run")
        p = p.parent / final if isinstance(final, str) and final else p
    if p.is_file():
        manifest = verify_tarball(p, extract_to=workdir)
        p = Path(workdir) / manifest["run_name"]
    if not (p / "adapter_config.json").exists() or not (p / "config.json").exists():
        raise UserError(f"{path} is not a finished run (no adapter_config.json and config.json)")
    config = read_json(p / "config.json")
    if missing := [k for k in RUN_CONFIG_KEYS if k not in config]:
        raise UserError(f"config.json is not a train_dpo.py run's (no {', '.join(missing)})", p / "config.json")
    return p, config


# ---------------------------------------------------------------------------------------------
# Experiment trackers (--report_to): checked before a run, and where TensorBoard writes.
# ---------------------------------------------------------------------------------------------

# --report_to: transformers' experiment trackers (integrations.INTEGRATION_TO_CALLBACK) -> the modules each needs
TRACKERS = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",),
            "trackio": ("trackio",), "comet_ml": ("comet_ml",), "clearml": ("clearml",), "swanlab": ("swanlab",),
            "dvclive": ("dvclive",), "neptune": ("neptune",), "azure_ml": ("azureml",), "dagshub": ("dagshub",),
            "codecarbon": ("codecarbon",), "flyte": ("flytekit",), "kubeflow": ("kubeflow",)}


def tracker_problems(report_to: str) -> list[str]:
    """Unknown tracker names, and trackers whose package is not installed (transformers would fail at start)."""
    p = []
    for name in (t.strip() for t in report_to.split(",") if t.strip() not in ("", "none")):
        if name not in TRACKERS:
            p.append(f"--report_to: unknown tracker {name!r} (choose from none, {', '.join(TRACKERS)})")
        elif not any(importlib.util.find_spec(module) for module in TRACKERS[name]):
            p.append(f"--report_to {name}: needs the {TRACKERS[name][-1]} package (pip install {TRACKERS[name][-1]})")
    return p


@contextlib.contextmanager
def tensorboard_dir(path: Path):
    """TensorBoard's event files in the run directory (they travel with it into the tarball), not under the
    checkpoints that finishing deletes; a TENSORBOARD_LOGGING_DIR the user set wins."""
    if os.environ.get("TENSORBOARD_LOGGING_DIR"):
        yield
        return
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(path)
    try:
        yield
    finally:
        del os.environ["TENSORBOARD_LOGGING_DIR"]
