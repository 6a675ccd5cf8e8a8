#!/usr/bin/env bash
# One command for a lent GPU machine: install the wheels carried in .whl/, print the versions, then
# run the kit's CUDA checks and benchmarks in order, each step's output in $OUT/<step>.log.
#
#   bench/gpu.sh [STEP ...]       STEP: tests e2e recipe bench-1b bench-8b bench-8b-4k, or all (the default: each in turn)
#   GPU_BUDGET_S=570 bench/gpu.sh bench-8b     # start no work after 570 s (a device call ends at 600)
#   GPU_BENCH_ARGS="--prompt_fractions 0.75 --grpo_steps 0" bench/gpu.sh bench-8b   # more bench.py flags (they win)
#
#   tests        pytest -m gpu: the gpu-marked tests (random weights bit-identical on CUDA, 4-bit DPO steps on
#                random:smollm2-135m with and without the fast path, TRL with Liger)                 ~2 min
#   e2e          make's path on CUDA in 4-bit: pairs from the demo logs, 8 steps on random:smollm2-135m with the
#                default and with --no_fused_ops, their losses side by side, then chat, merge and verify   ~4 min
#   bench-1b     bench.py --device cuda at random:llama-3.2-1b: 1,024 and 4,096 tokens, prompt 3/4 and 1/4,
#                default vs trl_separate_ref vs trl_best -> $OUT/results-gpu-1b.{md,json}           ~6 min
#   bench-8b     the same at random:llama-3-8b, 1,024 tokens (the GPU speed goals) -> $OUT/results-gpu.{md,json}
#   bench-8b-4k  random:llama-3-8b at 4,096 tokens -> $OUT/results-gpu-8b-4k.{md,json}
#
# Here first: `make gpu-wheels` (the lock's transformers, peft, bitsandbytes, trl, datasets, dill, multiprocess,
# liger-kernel for Python 3.12, and the bundled tokenizer, ~58 MB in .whl/). Through the device tool, one call per ten minutes, e.g.
#   run(command="bench/gpu.sh tests e2e", carry=[".whl"]), then bench-1b, then bench-8b, then bench-8b-4k.
# At most 8 files come back from $OUT: each step writes one log, a bench step its .md and .json too. Copy the
# results into bench/ to commit them (bench/README.md). Without a device tool, OUT defaults to ./gpu-out.
# Checking this script on a CPU: GPU_SH_CPU=1 GPU_E2E_ARGS="--max_steps 2 --max_length 128 --probes=" bench/gpu.sh e2e
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

STARTED=$(date +%s)
BUDGET=${GPU_BUDGET_S:-570}
OUT=${OUT:-$PWD/gpu-out}
PY=${PYTHON:-python3}
SITE=${GPU_SITE:-/tmp/site}
WORK=${GPU_WORK:-/tmp/dpo-kit-gpu}
export DPO_KIT_CACHE=${DPO_KIT_CACHE:-/tmp/dpo-kit-cache}  # random shapes are built here once (8B: 16 GB)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1  # no network there
export TQDM_DISABLE=1  # logs, not terminals: no progress bars of carriage returns

left() { local s=$((BUDGET - ($(date +%s) - STARTED))); echo $((s > 1 ? s : 1)); }  # seconds, at least 1

# Logs come back only under 16 MB: keep a long one's head and tail.
trim() {
  local f=$1
  if [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt 15000000 ]; then
    { head -c 5000000 "$f"; printf '\n[... trimmed by bench/gpu.sh ...]\n'; tail -c 9000000 "$f"; } >"$f.tmp" && mv "$f.tmp" "$f"
  fi
}

setup() {
  mkdir -p "$OUT" "$WORK"
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || { echo "gpu.sh: installing .whl/*.whl failed" >&2; exit 2; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # Every random shape uses the bundled SmolLM2 tokenizer; its 540 MB of weights stay behind, its tokenizer travels.
  local bundled=models/SmolLM2-135M-Instruct
  if [ ! -f "$bundled/tokenizer.json" ] && [ -f .whl/tokenizer/tokenizer.json.gz ]; then
    mkdir -p "$bundled" && cp .whl/tokenizer/* "$bundled/" && gunzip -f "$bundled/tokenizer.json.gz"
  fi
  "$PY" - <<'EOF' 2>&1 | tee "$OUT/versions.log"
import importlib.metadata as md, platform, torch
names = ("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate", "datasets", "liger-kernel", "triton")
def version(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return "missing"
print("python", platform.python_version(), "|", " ".join(f"{n} {version(n)}" for n in names))
print("cuda", torch.version.cuda, "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE")
EOF
  [ -n "${GPU_SH_CPU:-}" ] || "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "gpu.sh: torch sees no CUDA device; this script is for a GPU machine (GPU_SH_CPU=1 to check it on a CPU)" >&2; exit 2; }
}

step_tests() {  # only the files that hold gpu tests: the others need nothing from a GPU
  local files
  mapfile -t files < <(grep -l "pytest.mark.gpu" tests/test_*.py)
  timeout "$(left)" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${files[@]}"
}

step_e2e() {
  local art=$WORK/art pairs=$WORK/pairs.jsonl rc=0 extra=()
  read -ra extra <<<"${GPU_E2E_ARGS:-}"  # more train_dpo flags, last (they win)
  rm -rf "$art"
  "$PY" build_pairs.py data/runs.jsonl -o "$pairs" --report "$WORK/pairs.report.json" || return 1
  for variant in fused no_fused old_path; do
    local flags=()
    [ "$variant" = no_fused ] && flags=(--no_fused_ops)
    # the path before issue 59: the reference in every step, bitsandbytes' kernels, the run's own batch
    [ "$variant" = old_path ] && flags=(--no_precompute_ref_log_probs --no_dequantize_on_gpu --no_auto_micro_batch)
    echo "== train gpu-$variant"
    timeout "$(left)" "$PY" train_dpo.py --data "$pairs" --model_name_or_path random:smollm2-135m --output_dir "$art" \
      --run_name "gpu-$variant" --max_steps 8 --max_length 512 --per_device_train_batch_size 4 --eval_steps 4 \
      ${flags[@]+"${flags[@]}"} ${extra[@]+"${extra[@]}"} || rc=1
  done
  echo "== the same run with and without the fast path"
  "$PY" - "$art" <<'EOF' || rc=1
import json, sys
from pathlib import Path
art = Path(sys.argv[1])
def rows(run):
    return [json.loads(x) for x in (art / run / "metrics.jsonl").read_text().splitlines() if x.strip()]
a, b, c = rows("gpu-fused"), rows("gpu-no_fused"), rows("gpu-old_path")
print("step  loss (default)  loss (--no_fused_ops)  difference  loss (the old path)  difference")
worst = 0.0
for x, y, z in zip(*([r for r in rows_ if "loss" in r] for rows_ in (a, b, c))):
    print(f"{x['step']:>4}  {x['loss']:>14.5f}  {y['loss']:>21.5f}  {x['loss'] - y['loss']:>+10.5f}  "
          f"{z['loss']:>19.5f}  {x['loss'] - z['loss']:>+10.5f}")
    worst = max(worst, abs(x['loss'] - z['loss']))
print(f"the default against the old path: at most {worst:.5f} apart at a step (bfloat16 noise: under 0.02)")
if worst >= 0.02:
    sys.exit(1)
for run in ("gpu-fused", "gpu-no_fused", "gpu-old_path"):
    ev = json.loads((art / run / "evaluation.json").read_text()).get("held_out", {})
    data = json.loads((art / run / "data.json").read_text())
    print(run, "held-out accuracy", {k: v.get("accuracy") for k, v in ev.items()}, "|", data["compute"], "|", data["logps"], "|", data.get("reference"), "|", data.get("micro_batch"))
EOF
  echo "== chat"
  timeout "$(left)" "$PY" entrypoint.py chat "$art/gpu-fused.tar.gz" --compare "How do I free disk space?" || rc=1
  echo "== merge"
  timeout "$(left)" "$PY" entrypoint.py merge "$art/gpu-fused" "$WORK/merged" && cat "$WORK/merged/merge_report.json" || rc=1
  echo "== verify"
  "$PY" entrypoint.py verify "$art/gpu-fused.tar.gz" || rc=1
  return $rc
}

step_recipe() {  # the first stage of make train's round (make -n train ROUNDS=0), the model swapped for its random shape
  local art=$WORK/recipe stem=$WORK/recipe-pairs t0 extra=()
  read -ra extra <<<"${GPU_RECIPE_ARGS:-}"  # more train_dpo flags, last (they win)
  rm -rf "$art"
  "$PY" build_pairs.py data/runs.jsonl --extra_runs data/attempts.jsonl,data/attempts-round2.jsonl -o "$stem.pairs.jsonl" \
    --report "$stem.report.json" --prompts "$stem.prompts.jsonl" || return 1
  t0=$(date +%s)
  timeout "$(left)" "$PY" train_dpo.py --data "$stem.pairs.jsonl" --output_dir "$art" --eval_prompts "$stem.prompts.jsonl" \
    --config configs/demo.yaml --model_name_or_path random:smollm2-135m --run_name gpu-recipe \
    ${extra[@]+"${extra[@]}"} || return 1
  echo "== train_dpo.py took $(($(date +%s) - t0)) s"
  ls -la "$art/gpu-recipe"
  "$PY" -c 'import json, sys; e = json.load(open(sys.argv[1])); print(json.dumps(e, indent=1, default=str)[:8000])' \
    "$art/gpu-recipe/evaluation.json"
  cp "$art/gpu-recipe/report.md" "$OUT/recipe-report.md" 2>/dev/null || true
}

bench() {  # bench MODEL STEM [bench.py flags]
  local model=$1 stem=$2
  shift 2
  "$PY" bench/bench.py --device cuda --model "$model" --out_dir "$OUT" --out_stem "$stem" \
    --budget_s "$(($(left) > 40 ? $(left) - 20 : 20))" "$@" ${GPU_BENCH_ARGS:-}
}

step_bench-1b() { bench random:llama-3.2-1b results-gpu-1b --max_tokens 16384; }
step_bench-8b() { bench random:llama-3-8b results-gpu --lengths 1024 --max_tokens 8192; }
step_bench-8b-4k() { bench random:llama-3-8b results-gpu-8b-4k --lengths 4096 --max_tokens 8192; }

STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] || [ "${STEPS[*]}" = all ] && STEPS=(tests e2e recipe bench-1b bench-8b bench-8b-4k)
for s in "${STEPS[@]}"; do
  declare -F "step_$s" >/dev/null || { echo "gpu.sh: unknown step $s (tests e2e recipe bench-1b bench-8b bench-8b-4k all)" >&2; exit 2; }
done

setup
failed=()
for s in "${STEPS[@]}"; do
  if [ "$(left)" -lt 60 ]; then
    echo "[gpu.sh] $s: skipped, $(left) s of the ${BUDGET} s budget left" | tee -a "$OUT/versions.log"
    failed+=("$s(skipped)")
    continue
  fi
  t0=$(date +%s)
  echo "[gpu.sh] $s: starting, $(left) s left; log $OUT/$s.log"
  "step_$s" >"$OUT/$s.log" 2>&1
  rc=$?
  trim "$OUT/$s.log"
  echo "[gpu.sh] $s: exit $rc after $(($(date +%s) - t0)) s" | tee -a "$OUT/versions.log"
  tail -n 25 "$OUT/$s.log"
  [ $rc -eq 0 ] || failed+=("$s")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "[gpu.sh] not done: ${failed[*]}"
  exit 1
fi
echo "[gpu.sh] all done"
