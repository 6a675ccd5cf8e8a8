"""Sampling speed: the kit's decode loop (sampler.py) against transformers' `generate` on the same model, prompts
and settings, as the held-out checker scores sample (the demo's held-out prompts x 4 answers, up to 256 tokens).

    python bench/sampling.py [--repeats 3] [--max_new_tokens 256]      # make bench runs it too
    -> bench/results-sampling.{md,json}   (make bench QUICK=1: results-sampling-quick.*, shorter answers)

The model is loaded as a run's evaluation loads it (4-bit NF4, dequantised on a CPU) with a LoRA adapter on every
linear layer (B moved off zero, so the adapter changes the answers as a trained one does). Each path samples the
same rows with the same seeds; generated tokens/s counts the answers' own tokens (up to the end-of-turn token),
not padding. Both paths run `repeats` times, alternating, after a short warm-up each; the median of each is
reported, and the speed-up is the median of the adjacent runs' ratios (drift between runs cancels in a pair).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dpokit.core import kit  # noqa: E402
from dpokit.data import runlogs
from dpokit.core.kit import field  # noqa: E402


@dataclasses.dataclass
class SamplingBenchConfig:
    model_name_or_path: str = field("models/SmolLM2-135M-Instruct", "the model sampled")
    prompts: str = field("data/runs.jsonl", "run logs: their held-out runs' code prompts are sampled")
    samples: int = field(4, "answers per prompt (the held-out checker score's --eval_samples)")
    max_new_tokens: int = field(256, "longest answer (the checker score's --eval_max_new_tokens)")
    repeats: int = field(3, "timed runs of each path, alternating, after a warm-up (the median is reported)")
    lora_r: int = field(16, "the adapter's rank (train_dpo.py's default)")
    seed: int = field(0, "sampling seed")
    out_dir: str = field("bench", "where the results go")
    stem: str = field("results-sampling", "their file names: <stem>.md and <stem>.json (make bench QUICK=1: "
                      "results-sampling-quick, not committed)")


def held_out_prompts(logs: str) -> list[list[dict]]:
    from dpokit.data import formats

    rows = runlogs.prompts_from_logs(logs)
    return [r["prompt"] for r in rows if formats.held_out_prompt(r, 0.2)]


def timed(fn, tokenizer, stop: set[int]) -> tuple[float, int, list[str]]:
    start = time.perf_counter()
    answers = fn()
    seconds = time.perf_counter() - start
    tokens = sum(len(tokenizer(a, add_special_tokens=False)["input_ids"]) + 1 for a in answers)  # + the stop token
    return seconds, tokens, answers


def paired_speedups(before: list[tuple[float, int]], after: list[tuple[float, int]]) -> list[float]:
    """Each (seconds, tokens) run of `after` in tokens/s over the `before` run just ahead of it: the machine's
    speed, which drifts on a shared one, is about the same within a pair and cancels in its ratio."""
    return [(t / s) / (t0 / s0) for (s0, t0), (s, t) in zip(before, after)]


def markdown(r: dict) -> str:
    rows = [f"| {name} | {v['tokens_per_s']:.0f} | {v['seconds']:.1f} | {v['tokens']} |"
            for name, v in r["paths"].items()]
    return "\n".join([
        "# Sampling speed: sampler.py against transformers' generate", "",
        f"{r['rows']} answers ({r['prompts']} held-out prompts x {r['samples']}), up to {r['max_new_tokens']} tokens, "
        f"temperature {r['sampling']['temperature']}, top-p {r['sampling']['top_p']}; {r['model']} "
        f"(4-bit NF4 dequantised, LoRA r={r['lora_r']} on {r['lora_layers']} layers), {r['device']}, "
        f"{r['threads']} threads. Median of {r['repeats']} runs; `python bench/sampling.py` wrote this.", "",
        "| path | generated tokens/s | seconds | tokens |", "| --- | --- | --- | --- |", *rows, "",
        f"**{r['speedup']:.2f}x** the generated tokens/s of transformers' `generate`: the median of the runs' "
        f"ratios, each sampler.py run against the `generate` run just before it "
        f"({', '.join(f'{x:.2f}' for x in r['paired_speedups'])}; a shared machine's speed drifts between runs, "
        f"and an adjacent pair shares it). The ratio of the medians above: {r['speedup_of_medians']:.2f}x.", ""])


def main(argv=None) -> int:
    cfg = kit.parse_config(SamplingBenchConfig, argv, __doc__)
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    from dpokit.train import evaluate
    from dpokit.model import models
    from dpokit.model import sampler

    on_gpu, bf16_ok = models.device()
    path = models.resolve_model_path(cfg.model_name_or_path)
    model = models.load_model(path, models.LoadOptions(), on_gpu, bf16_ok)
    targets = models.detect_lora_targets(model)
    torch.manual_seed(cfg.seed)  # LoRA's A and B: the same adapter, so the same answers, in every run
    model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=2 * cfg.lora_r, target_modules=targets))
    if not on_gpu:
        models.dequantize_4bit_(model)
    torch.manual_seed(cfg.seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=1e-3)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = held_out_prompts(cfg.prompts)
    sampling = evaluate.CODE_SAMPLING
    paths = {
        "transformers generate": lambda tokens=cfg.max_new_tokens: models.hf_generate(
            model, tokenizer, prompts, tokens, sampling, cfg.seed, n=cfg.samples),
        "sampler.py": lambda tokens=cfg.max_new_tokens: models.generate(
            model, tokenizer, prompts, tokens, sampling, cfg.seed, n=cfg.samples, label="sample")}
    runs = {name: [] for name in paths}
    for name, fn in paths.items():
        fn(8)  # warm-up: the first calls' one-time costs
    for i in range(cfg.repeats):
        for name, fn in paths.items():
            seconds, tokens, _ = timed(fn, tokenizer, set())
            runs[name].append((seconds, tokens))
            print(f"[bench] sampling {name}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.0f} tokens/s",
                  flush=True)
    result = {"model": cfg.model_name_or_path, "device": "cuda" if on_gpu else "cpu",
              "threads": torch.get_num_threads(), "prompts": len(prompts), "samples": cfg.samples,
              "rows": len(prompts) * cfg.samples, "max_new_tokens": cfg.max_new_tokens, "sampling": sampling,
              "lora_r": cfg.lora_r, "lora_layers": len(sampler.lora_layers(model)), "repeats": cfg.repeats,
              "paths": {}}
    for name, rs in runs.items():
        rates = [t / s for s, t in rs]
        i = rates.index(statistics.median_low(rates))
        result["paths"][name] = {"tokens_per_s": rates[i], "seconds": rs[i][0], "tokens": rs[i][1], "all": rs}
    result["speedup_of_medians"] = result["paths"]["sampler.py"]["tokens_per_s"] / \
        result["paths"]["transformers generate"]["tokens_per_s"]
    result["paired_speedups"] = paired_speedups(runs["transformers generate"], runs["sampler.py"])
    result["speedup"] = statistics.median(result["paired_speedups"])
    out = ROOT / cfg.out_dir
    kit.atomic_write_json(out / f"{cfg.stem}.json", result)
    kit.atomic_write_text(out / f"{cfg.stem}.md", markdown(result))
    print(f"[bench] sampling: {result['speedup']:.2f}x transformers' generate; {out / (cfg.stem + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
