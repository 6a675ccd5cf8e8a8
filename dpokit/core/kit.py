"""Shared plumbing for the kit's scripts: config parsing, user errors, atomic writes, file hashes, versions.

Not run on its own; every script imports it (the run directory and its tarball are runs.py). Everything here is
standard library only, so `--help` and the unit tests never pay for torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import sys
import tempfile
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the kit's checkout (or the image's /opt/kit): scripts, data/, templates/
EXIT_USAGE = 2  # a user's mistake: bad flag, bad file, bad combination
# The column that marks a pair whose rejected answer deleted what must be kept: formats.trainable writes it,
# the kit's DPO trainer (fastpath.py) hands it to --broke_weight's term.
BROKE_COLUMN = "kit_broke"

# bitsandbytes (0.50, the pinned one), on a CPU with AVX-512 bf16, tries at import to fetch an optional 4-bit GEMM
# kernel from the Hugging Face hub (the `kernels` package, not a dependency of the kit) and warns on stderr when it
# cannot; it then uses its own kernel. The kit's CPU path dequantises the 4-bit weights once by default
# (models.dequantize_4bit_), so the warning said nothing a user could act on, and it broke the one-sentence errors
# of `entrypoint.py check` on such CPUs. bitsandbytes' other warnings still print.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


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


def fields(cfg_cls) -> list:
    """The config's fields, its own first and then those it inherits (train_dpo.TrainConfig's method options live
    in methods.py), each in the order written: the order of --help and of a run's printed config."""
    own = cfg_cls.__dict__.get("__annotations__", {})
    every = dataclasses.fields(cfg_cls)
    return [f for f in every if f.name in own] + [f for f in every if f.name not in own]


def build_parser(cfg_cls, description: str, positional: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one `--name` flag per dataclass field, named exactly as the field."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     argument_default=argparse.SUPPRESS, allow_abbrev=False)
    parser.add_argument("--config", metavar="FILE.yaml", help="read options from a YAML (or JSON) file; flags override it")
    hints = typing.get_type_hints(cfg_cls)
    for f in fields(cfg_cls):
        tp = _base_type(hints[f.name])
        helptext = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
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
    from_file = {k: config_path for k in values if k not in args}
    values.update({k: v for k, v in args.items()})
    cfg = cfg_cls(**values)
    cfg.__dict__[FROM_FILE] = from_file  # not a field: what a recipe set, which the data may show does not apply
    return checked(cfg)


FROM_FILE = "_from_config_file"  # on a parsed config: {option: the --config file that set it (no flag did)}


def from_config_file(cfg) -> dict:
    """{option: file} for the options a --config file set and no flag overrode ({} for a config made otherwise)."""
    return getattr(cfg, FROM_FILE, {})


def checked(cfg, source: str | None = None):
    """cfg when its `problems()` (if the class has one) finds none; else every problem in one UserError."""
    problems = cfg.problems() if hasattr(cfg, "problems") else []
    if problems:
        raise UserError("bad options:\n  - " + "\n  - ".join(problems), source)
    return cfg


def config_from(cfg_cls, values: dict, source: str):
    """A config for an in-process caller (iterate.py's plan): names and types checked as a --config file's
    are, then problems(). source names where the values came from in errors."""
    return checked(cfg_cls(**coerce(cfg_cls, values, source)), source)


def num(value, spec: str) -> str:
    """A number as `format(value, spec)`, or "n/a" for None (a rate over no answers, a figure not measured)."""
    return "n/a" if value is None else format(value, spec)


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

    cwd = cwd or ROOT
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


