"""Shared plumbing for the kit's scripts: config parsing, user errors, atomic writes, manifests, tarballs.

Not run on its own; train_dpo.py, build_pairs.py and entrypoint.py import it. Everything here is
standard library only, so `--help` and the unit tests never pay for torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile
import typing
from pathlib import Path

EXIT_USAGE = 2  # a user's mistake: bad flag, bad file, bad combination


class UserError(Exception):
    """A mistake in what the user gave us: printed as `FILE:LINE: message`, exit status 2."""

    def __init__(self, message: str, path: str | os.PathLike | None = None, line: int | None = None):
        super().__init__(message)
        self.message, self.path, self.line = message, path, line

    def __str__(self) -> str:
        where = "" if self.path is None else f"{self.path}:" if self.line is None else f"{self.path}:{self.line}:"
        return f"{where} {self.message}" if where else self.message


# ---------------------------------------------------------------------------------------------
# Config: one dataclass per script is the only place defaults live.
# ---------------------------------------------------------------------------------------------

def field(default, help: str, **meta):
    """A dataclass field with help text (and optional `choices`) for the generated CLI."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


def parse_bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in {"1", "true", "yes", "y", "on"}:
        return True
    if lowered in {"0", "false", "no", "n", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _base_type(tp):
    """int for `int`, `int | None` and `Optional[int]`; the type argparse converts with."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def build_parser(cfg_cls, description: str, positional: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one `--name` flag per dataclass field, named exactly as the field."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     argument_default=argparse.SUPPRESS, allow_abbrev=False)
    parser.add_argument("--config", metavar="FILE.yaml", help="read options from a YAML (or JSON) file; flags override it")
    hints = typing.get_type_hints(cfg_cls)
    for f in dataclasses.fields(cfg_cls):
        tp = _base_type(hints[f.name])
        helptext = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name == positional:
            parser.add_argument(f.name, nargs="?", help=f"{helptext} (default: {default})")
            continue
        kwargs = {"help": f"{helptext} (default: {default})", "dest": f.name}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        names = [f.metadata["short"], f"--{f.name}"] if "short" in f.metadata else [f"--{f.name}"]
        if tp is bool:
            parser.add_argument(*names, type=parse_bool, nargs="?", const=True, metavar="BOOL", **kwargs)
            parser.add_argument(f"--no_{f.name}", action="store_const", const=False, dest=f.name, help=argparse.SUPPRESS)
        else:
            parser.add_argument(*names, type=tp, metavar=tp.__name__.upper(), **kwargs)
    return parser


def _read_config_file(path: str) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot read config file: {e.strerror}", path) from None
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml  # a dependency of transformers; only needed when --config is used

            data = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        raise UserError(f"not valid YAML/JSON: {e}", path, None if line is None else line + 1) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError("a config file must hold a mapping of option: value", path, 1)
    return data


def coerce(cfg_cls, values: dict, source: str) -> dict:
    """Check the names and convert the values of a config mapping (from YAML) against the dataclass."""
    hints = typing.get_type_hints(cfg_cls)
    names = {f.name: f for f in dataclasses.fields(cfg_cls)}
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise UserError(f"unknown option(s): {', '.join(unknown)}", source)
    out = {}
    for key, value in values.items():
        tp = _base_type(hints[key])
        if value is None:
            out[key] = None
        elif tp is bool:
            out[key] = value if isinstance(value, bool) else parse_bool(value)
        else:
            try:
                out[key] = tp(value)
            except (TypeError, ValueError):
                raise UserError(f"option {key}: expected {tp.__name__}, got {value!r}", source) from None
        choices = names[key].metadata.get("choices")
        if choices and out[key] not in choices:
            raise UserError(f"option {key}: {out[key]!r} is not one of {', '.join(map(str, choices))}", source)
    return out


BOOL_WORDS = {"1", "0", "true", "false", "yes", "no", "y", "n", "on", "off"}


def normalise_argv(cfg_cls, argv: list[str]) -> list[str]:
    """`--a-b` -> `--a_b` (both spellings work, as with HfArgumentParser), and `--flag=true` for a
    bare boolean flag followed by something that is not a boolean (such as a file name), which
    `--flag [BOOL]` would otherwise swallow as its value."""
    hints = typing.get_type_hints(cfg_cls)
    bools = {f"--{f.name}" for f in dataclasses.fields(cfg_cls) if _base_type(hints[f.name]) is bool}
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = "--" + name[2:].replace("-", "_") + eq + value
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if arg in bools and nxt and (nxt == "-" or not nxt.startswith("-")) and nxt.lower() not in BOOL_WORDS:
            arg += "=true"
        out.append(arg)
    return out


def parse_config(cfg_cls, argv: list[str] | None, description: str, positional: str | None = None):
    """Defaults from the dataclass, then `--config FILE`, then flags; then every problem at once.

    A config class may define `problems(self) -> list[str]`; all of them are reported together.
    """
    parser = build_parser(cfg_cls, description, positional)
    argv = normalise_argv(cfg_cls, list(sys.argv[1:] if argv is None else argv))
    args = vars(parser.parse_args(argv))  # unknown flags: argparse prints usage and exits 2
    values = {}
    config_path = args.pop("config", None)
    if config_path:
        values.update(coerce(cfg_cls, _read_config_file(config_path), config_path))
    values.update({k: v for k, v in args.items()})
    cfg = cfg_cls(**values)
    problems = cfg.problems() if hasattr(cfg, "problems") else []
    if problems:
        raise UserError("bad options:\n  - " + "\n  - ".join(problems))
    return cfg


def run_cli(main, argv=None) -> int:
    """Run `main(argv)`, turning a UserError into `FILE:LINE: message` on stderr and exit 2."""
    try:
        return main(argv) or 0
    except UserError as e:
        print(f"error: {e}" if e.path is None else str(e), file=sys.stderr)
        return EXIT_USAGE


# ---------------------------------------------------------------------------------------------
# Files: nothing half-written is ever left where a finished file belongs.
# ---------------------------------------------------------------------------------------------

def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the mode open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_hashes(root: str | os.PathLike, skip: tuple[str, ...] = ("manifest.json",)) -> dict[str, str]:
    """sha256 of every regular file below root, keyed by its POSIX path relative to root, sorted."""
    root = Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in skip:
            out[rel] = sha256_file(p)
    return out


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


def package_versions(names=("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate",
                            "datasets", "safetensors", "gguf")) -> dict[str, str | None]:
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit(cwd: str | os.PathLike | None = None) -> str | None:
    """The kit's own commit (with `-dirty` when the tree has changes), or None outside git."""
    import subprocess

    cwd = cwd or Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------------------------------------
# Handoff: check a run tarball before trusting anything in it.
# ---------------------------------------------------------------------------------------------

def unsafe_member(member: tarfile.TarInfo, top: str | None) -> str | None:
    """Why a tar member must not be extracted (absolute path, `..`, link, device, outside the run
    directory), or None when it is a plain file or directory inside it."""
    name = member.name
    parts = Path(name).parts
    if name.startswith(("/", "\\")) or (parts and ":" in parts[0]):
        return f"absolute path {name!r}"
    if ".." in parts:
        return f"path with '..' {name!r}"
    if member.issym() or member.islnk():
        return f"link {name!r} -> {member.linkname!r}"
    if not (member.isfile() or member.isdir()):
        return f"special file {name!r}"
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
        if any(w in t for w in ("embed", "lm_head", "wte", "output")):
            problems.append(f"LoRA on {t!r} (embeddings or output head); vLLM does not serve that")
    if adapter_config.get("peft_type") != "LORA":
        problems.append(f"peft_type is {adapter_config.get('peft_type')!r}, not LORA")
    return problems


def verify_tarball(path: str | os.PathLike, extract_to: str | os.PathLike | None = None) -> dict:
    """Check a run tarball: safe members only, every file matches manifest.json's sha256, nothing
    unlisted, the adapter obeys the serving rules. Returns the manifest; raises UserError.

    Extraction goes to a temporary directory (removed afterwards) unless extract_to is given.
    """
    path = Path(path)
    sidecar = Path(f"{path}.sha256")
    if sidecar.exists() and sidecar.read_text().split()[:1] != [sha256_file(path)]:
        raise UserError(f"tarball sha256 differs from {sidecar.name}", path)
    try:
        tar = tarfile.open(path, "r:gz")
        members = tar.getmembers()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UserError(f"not a readable .tar.gz: {e}", path) from None
    with tar, tempfile.TemporaryDirectory(prefix="verify-") as tmp:
        top = Path(members[0].name).parts[0] if members else None
        for m in members:
            if why := unsafe_member(m, top):
                raise UserError(f"refused: {why}", path)
        dest = Path(extract_to) if extract_to else Path(tmp)
        for m in members:  # every member was checked above; extract plain files by hand
            target = dest / m.name
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(m) as src, open(target, "wb") as out:
                out.write(src.read())
        run_dir = dest / top
        try:
            manifest = json.loads((run_dir / "manifest.json").read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"no readable manifest.json in the run directory ({e})", path) from None
        listed, found = manifest.get("files", {}), file_hashes(run_dir)
        problems = [f"{name}: sha256 differs from manifest.json" for name in sorted(listed)
                    if name in found and found[name] != listed[name]]
        problems += [f"{name}: listed in manifest.json but missing" for name in sorted(set(listed) - set(found))]
        problems += [f"{name}: present but not in manifest.json" for name in sorted(set(found) - set(listed))]
        if not (run_dir / "adapter_config.json").exists():
            problems.append("adapter_config.json is missing")
        if problems:
            raise UserError("refused:\n  - " + "\n  - ".join(problems), path)
        manifest["adapter_config"] = json.loads((run_dir / "adapter_config.json").read_text())
        serving = serving_problems(manifest["adapter_config"])
        if serving and manifest.get("lora_target_modules_requested", "auto") == "auto":
            raise UserError("refused (serving rules):\n  - " + "\n  - ".join(serving), path)
        manifest["serving_warnings"] = serving  # the trainer asked for these modules explicitly
        return manifest


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
        f"data:           {data.get('pairs_trained', data.get('pairs'))} pairs, {data.get('format')}, "
        f"sha256 {data.get('sha256')}",
    ]
    if manifest.get("eval"):
        lines.append(f"held-out:       preference accuracy {manifest['eval']['base']:.3f} (base) -> "
                     f"{manifest['eval']['tuned']:.3f} (tuned); see report.md")
    versions = ", ".join(f"{k} {v}" for k, v in manifest.get("versions", {}).items() if v)
    lines.append(f"versions:       python {manifest.get('python')}, {versions}")
    lines.append(f"files:          {len(manifest.get('files', {}))} checked against manifest.json")
    return "\n".join(lines)


def runs_table(root: str | os.PathLike) -> str:
    """One line per run under root (finished, partial, failed): status, data, steps, held-out accuracy, size."""
    rows = [("run", "status", "data", "pairs", "steps", "held-out acc", "size")]
    for d in sorted(p for p in Path(root).glob("*") if (p / "status.json").exists()):
        def read(name):
            try:
                return json.loads((d / name).read_text())
            except (OSError, ValueError):
                return {}
        status, data, manifest = read("status.json"), read("data.json"), read("manifest.json")
        acc = manifest.get("eval") or {}
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        rows.append((d.name, status.get("state", "?"), Path(data.get("path", "?")).name,
                     str(data.get("pairs_trained", data.get("pairs", "?"))), str(status.get("step", "-")),
                     f"{acc['base']:.2f} -> {acc['tuned']:.2f}" if acc else "-", f"{size / 1e6:.1f} MB"))
    if len(rows) == 1:
        return f"no runs in {root}"
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
