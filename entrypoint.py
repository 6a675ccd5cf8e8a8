"""The kit's front door (the container's ENTRYPOINT, and usable locally): dispatch to the scripts.

    python entrypoint.py model [DEST]          # convert the bundled SmolLM2-135M-Instruct GGUF to safetensors
    python entrypoint.py pairs RUNS.jsonl -o pairs.jsonl [build_pairs options]
    python entrypoint.py train --data pairs.jsonl [train_dpo options]
    python entrypoint.py launch --nproc 4 [--nnodes 2 --node_rank 1 --master_addr IP] [--dist zero2] -- --data pairs.jsonl ...
    python entrypoint.py check [--require_gpu] [--allow_cpu] [--nproc N] [--output_dir DIR]  # the pre-flight
    python entrypoint.py verify RUN.tar.gz      # checksums, safe paths, serving rules; what the adapter is
    python entrypoint.py chat RUN_DIR|RUN.tar.gz [--compare] [PROMPT ...]   # no PROMPT: read the terminal
    python entrypoint.py merge RUN_DIR|RUN.tar.gz [OUT_DIR]                  # standalone 16-bit model
    python entrypoint.py export RUN_DIR|RUN.tar.gz [--format gguf|merged] [--quant q8_0] [--force]  # checked export
    python entrypoint.py eval RUN_DIR|RUN.tar.gz [PAIRS.jsonl]   # held-out accuracy, probes -> <run>-eval/report.md
    python entrypoint.py runs [ARTIFACTS_DIR]   # every run: status, data, steps, held-out accuracy, size
    python entrypoint.py iterate [PLAN.yaml] [--output_dir DIR]   # rounds: SPIN / self-reward / DPO / SFT stages
    python entrypoint.py serve [--host 0.0.0.0 --port 8000] [serve options]   # the fine-tuning jobs service (HTTP)

No logic of its own: each subcommand hands its arguments to one script's `main`.
"""

from __future__ import annotations

import sys

from dpokit.core import kit

USAGE = __doc__.split("\n\n")[1]


def check(argv) -> int:
    """The pre-flight (preflight.py): GPU, driver, compute capability, MIG, /dev/shm, writable caches, Triton;
    exit 1 with one sentence per problem. `train` runs the same checks first."""
    from dpokit.model import preflight

    return preflight.main(argv)


def model(argv) -> int:
    from dpokit.model import convert

    convert.export_bundled_model(*(argv[:1] or [convert.BUNDLED_MODEL_DIR]))
    return 0


def verify(argv) -> int:
    if len(argv) != 1:
        raise kit.UserError("usage: entrypoint.py verify RUN.tar.gz")
    from dpokit.core import runs

    manifest = runs.verify_tarball(argv[0])
    if manifest.get("kind") == "export":
        print(f"{argv[0]}: OK\n{manifest['run_name']}: {manifest['format']} export"
              f"{' (' + manifest['quant'] + ')' if manifest.get('quant') else ''} of run {manifest['exported_from']}, "
              f"{len(manifest['files'])} files; see its README.md and export_report.json")
        return 0
    print(f"{argv[0]}: OK\n" + runs.describe_run(manifest))
    for warning in manifest["serving_warnings"]:
        print(f"warning: {warning}")
    return 0


def chat(argv) -> int:
    from dpokit.train import evaluate

    compare = "--compare" in argv
    rest = [a for a in argv if a != "--compare"]
    if not rest:
        raise kit.UserError("usage: entrypoint.py chat RUN_DIR|RUN.tar.gz [--compare] [PROMPT ...]")
    return evaluate.chat(rest[0], rest[1:], compare=compare)


def merge(argv) -> int:
    from dpokit.train import evaluate

    if len(argv) not in (1, 2):
        raise kit.UserError("usage: entrypoint.py merge RUN_DIR|RUN.tar.gz [OUT_DIR]")
    evaluate.merge(*argv)
    return 0


def export_run(argv) -> int:
    from dpokit.train import export

    return export.main(argv)


def eval_run(argv) -> int:
    from dpokit.train import evaluate

    if len(argv) not in (1, 2):
        raise kit.UserError("usage: entrypoint.py eval RUN_DIR|RUN.tar.gz [PAIRS.jsonl]")
    evaluate.evaluate_run(*argv)
    return 0


def launch(argv) -> int:
    from dpokit.apps import scaleout  # accelerate launch over several processes / machines, then the failing rank in status.json

    return scaleout.main(argv)


def list_runs(argv) -> int:
    from dpokit.core import runs

    print(runs.runs_table(argv[0] if argv else "artifacts"))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from dpokit.train import training

        return training.main(rest)
    if command == "pairs":
        from dpokit.pairs import from_logs

        return from_logs.main(rest)
    if command == "iterate":
        from dpokit.apps import iterate

        return iterate.main(rest)
    if command == "serve":
        from dpokit.service import serve

        return serve.main(rest)
    commands = {"model": model, "check": check, "verify": verify, "chat": chat, "merge": merge, "export": export_run,
                "eval": eval_run, "runs": list_runs, "launch": launch}
    if command in commands:
        if rest[:1] in (["-h"], ["--help"]) and command != "export":  # its own usage lines above (export: its own)
            print("\n".join(line for line in USAGE.splitlines() if f"entrypoint.py {command} " in line + " "))
            return 0
        return commands[command](rest)
    raise kit.UserError(f"unknown command {command!r}; expected one of: train, pairs, iterate, serve, {', '.join(commands)}")


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
