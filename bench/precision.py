"""Does bfloat16 learn what float32 learns? The same DPO runs in both, over several seeds, side by side.

    make precision                      # six demo-sized runs, each evaluated again: bench/precision.{md,json,png}
    .venv/bin/python bench/precision.py [--seeds 1,2,3] [--dtypes float32,bfloat16] [--eval_fraction 0.4]
                                        [--data PAIRS.jsonl] [--out bench/precision] [-- TRAIN_FLAGS...]

Each (seed, dtype) is one `train_dpo.py` run on the same pairs (default: the demo logs' pairs built by
build_pairs.py plus data/general.jsonl, about 90 pairs, with 40% held out: dozens of held-out pairs, where
the demo's 10% gives four) with the demo's settings otherwise, `--compute_dtype` the only difference
between the two arms of a seed. Every trained adapter is then evaluated again in float32, so the held-out
preference accuracy and margin compare what was learned, not the precision of the evaluation. Writes the
table (per run, and mean and spread per dtype), the loss curves side by side and the verdict: bfloat16
"learns the same" when its mean held-out accuracy and margin are within the float32 runs' seed-to-seed
spread (two standard deviations, and at least one held-out pair for the accuracy).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dpokit.core import kit  # noqa: E402
from dpokit.core import runs  # noqa: E402


@dataclasses.dataclass
class PrecisionConfig:
    seeds: str = kit.field("1,2,3", "training seeds (LoRA init and data order)")
    dtypes: str = kit.field("float32,bfloat16", "--compute_dtype of each arm")
    eval_fraction: float = kit.field(0.4, "share of pairs held out (by a hash of each pair, the same for every run)")
    data: str = kit.field("", "pairs file (default: build_pairs.py on data/runs.jsonl, plus data/general.jsonl)")
    out: str = kit.field("bench/precision", "writes OUT.md, OUT.json and OUT.png")
    work: str = kit.field("", "where the runs go, kept (default: a temporary directory, removed after); run again "
                                  "with the same --work to keep the runs that finished")


def verdict(rows: list[dict], base: str, other: str, held: int) -> dict:
    """Whether `other` learns the same as `base`: its mean held-out accuracy and margin within two standard
    deviations of base's seed-to-seed spread (the accuracy's allowance at least one held-out pair)."""
    out = {}
    for key in ("accuracy", "margin"):
        a = [r["tuned"][key] for r in rows if r["dtype"] == base]
        b = [r["tuned"][key] for r in rows if r["dtype"] == other]
        spread = statistics.stdev(a) if len(a) > 1 else 0.0
        allowance = max(2 * spread, 1.0 / held if key == "accuracy" and held else 0.0)
        diff = statistics.mean(b) - statistics.mean(a)
        out[key] = {"mean_" + base: statistics.mean(a), "mean_" + other: statistics.mean(b), "difference": diff,
                    "spread_" + base: spread, "allowance": allowance, "same": abs(diff) <= allowance}
    out["same"] = all(v["same"] for v in out.values())
    return out


def default_pairs(work: Path) -> Path:
    built = work / "runs.pairs.jsonl"
    subprocess.run([sys.executable, str(ROOT / "build_pairs.py"), str(ROOT / "data/runs.jsonl"), "-o", str(built)],
                   check=True, stdout=subprocess.DEVNULL)
    combined = work / "pairs.jsonl"
    combined.write_text(built.read_text(encoding="utf-8") + (ROOT / "data/general.jsonl").read_text(encoding="utf-8"),
                        encoding="utf-8")
    return combined


def evaluate_in_float32(run_dir: Path) -> dict:
    """The run's adapter on its held-out pairs, base and tuned, with every matmul in float32."""
    from dpokit.train import evaluate
    from dpokit.data import formats
    from dpokit.model import models

    cfg = json.loads((run_dir / "config.json").read_text())
    pairs, _ = formats.load_pairs(cfg["data"], cfg["skip_invalid"])
    held = [r for r in pairs if formats.held_out(r, cfg["eval_fraction"])]
    model, tokenizer = models.load_run(run_dir, cfg | {"compute_dtype": "float32"})
    return evaluate.held_out_accuracy(model, tokenizer, held, cfg["max_length"])


def one_run(cfg: PrecisionConfig, data: Path, work: Path, seed: int, dtype: str, extra: list[str]) -> dict:
    name = f"{dtype}-seed{seed}"
    t0 = time.time()
    cmd = [sys.executable, str(ROOT / "train_dpo.py"), "--data", str(data), "--output_dir", str(work),
           "--run_name", name, "--seed", str(seed), "--compute_dtype", dtype, "--eval_fraction", str(cfg.eval_fraction),
           "--probes=", *extra]
    log, run_dir, timing = work / f"{name}.log", work / name, work / f"{name}.seconds"
    if runs.read_json(run_dir / "status.json").get("state") == "succeeded" and timing.exists():
        seconds = float(timing.read_text())  # finished by an earlier, interrupted `--work DIR` invocation
    else:
        with open(log, "w") as f:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        if code:
            raise SystemExit(f"{log}: train_dpo.py exited {code}")
        seconds = time.time() - t0
        kit.atomic_write_text(timing, f"{seconds:.1f}\n")
    losses = [m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if "loss" in m]
    held = evaluate_in_float32(run_dir)
    row = {"seed": seed, "dtype": dtype, "steps": len(losses), "seconds": round(seconds, 1), "losses": losses,
           "final_loss": statistics.mean(losses[-5:]), "held_out_pairs": held["base"]["pairs"],
           "base": {"accuracy": held["base"]["accuracy"], "margin": held["base"]["mean_margin"]},
           "tuned": {"accuracy": held["tuned"]["accuracy"], "margin": held["tuned"]["mean_margin"]}}
    print(f"[precision] {name}: {row['steps']} steps in {seconds:.0f}s, last-5 loss {row['final_loss']:.4f}, held-out "
          f"accuracy {row['base']['accuracy']:.3f} -> {row['tuned']['accuracy']:.3f}, margin "
          f"{row['base']['margin']:.2f} -> {row['tuned']['margin']:.2f} ({row['held_out_pairs']} pairs)", flush=True)
    return row


def machine() -> str:
    import os
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores"


def markdown(result: dict) -> str:
    rows, dtypes = result["runs"], result["dtypes"]
    lines = [f"# bfloat16 against float32: {len(result['seeds'])} seeds, {rows[0]['held_out_pairs']} held-out pairs",
             "", f"Machine: {result['machine']}. Data: {result['data']}. Evaluated in float32.", "",
             "| seed | dtype | steps | s | last-5 loss | held-out accuracy | margin (nats) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['dtype']} | {r['steps']} | {r['seconds']:.0f} | {r['final_loss']:.4f} | "
                     f"{r['base']['accuracy']:.3f} -> {r['tuned']['accuracy']:.3f} | "
                     f"{r['base']['margin']:.2f} -> {r['tuned']['margin']:.2f} |")
    lines += ["", "| dtype | mean accuracy | sd | mean margin | sd | mean s per run |", "| --- | --- | --- | --- | --- | --- |"]
    for d in dtypes:
        acc = [r["tuned"]["accuracy"] for r in rows if r["dtype"] == d]
        mar = [r["tuned"]["margin"] for r in rows if r["dtype"] == d]
        sec = [r["seconds"] for r in rows if r["dtype"] == d]
        sd = (lambda v: statistics.stdev(v) if len(v) > 1 else 0.0)
        lines.append(f"| {d} | {statistics.mean(acc):.3f} | {sd(acc):.3f} | {statistics.mean(mar):.2f} | {sd(mar):.2f} | "
                     f"{statistics.mean(sec):.0f} |")
    for other, v in result["verdicts"].items():
        lines += ["", f"Verdict, {other} against {dtypes[0]}: **{'learns the same' if v['same'] else 'differs'}** "
                      f"(accuracy {v['accuracy']['difference']:+.3f}, allowance {v['accuracy']['allowance']:.3f}; "
                      f"margin {v['margin']['difference']:+.2f}, allowance {v['margin']['allowance']:.2f})."]
    return "\n".join(lines) + "\n"


def plot(result: dict, dest: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["seeds"]), figsize=(4 * len(result["seeds"]), 3), sharey=True, squeeze=False)
    for ax, seed in zip(axes[0], result["seeds"]):
        for r in result["runs"]:
            if r["seed"] == seed:
                ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["dtype"])
        ax.set_title(f"seed {seed}")
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("DPO loss")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(dest, dpi=100)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    cfg = kit.parse_config(PrecisionConfig, argv, __doc__)
    seeds = [int(s) for s in cfg.seeds.split(",")]
    dtypes = cfg.dtypes.split(",")
    with tempfile.TemporaryDirectory(prefix="precision-") as tmp:
        work = Path(cfg.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = Path(cfg.data) if cfg.data else default_pairs(work)
        # every float32 run first: the fast arm's spread is known early (bfloat16 is slow on a CPU without it)
        rows = [one_run(cfg, data, work, seed, dtype, extra) for dtype in dtypes for seed in seeds]
    held = rows[0]["held_out_pairs"]
    result = {"machine": machine(), "data": cfg.data or "data/runs.jsonl pairs + data/general.jsonl",
              "seeds": seeds, "dtypes": dtypes, "eval_fraction": cfg.eval_fraction, "train_flags": extra, "runs": rows,
              "verdicts": {d: verdict(rows, dtypes[0], d, held) for d in dtypes[1:]}}
    out = ROOT / cfg.out if not Path(cfg.out).is_absolute() else Path(cfg.out)
    kit.atomic_write_json(out.with_suffix(".json"), result)
    kit.atomic_write_text(out.with_suffix(".md"), markdown(result))
    plot(result, out.with_suffix(".png"))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
