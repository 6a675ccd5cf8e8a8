"""Export a finished run for where agents run without the training stack: a GGUF file (llama.cpp, Ollama,
LM Studio) or a merged model directory (transformers, vLLM), checked before it is kept.

    make export RUN=<run> FORMAT=gguf|merged [QUANT=f16|q8_0|q4_k_m] [ARGS=--force]
    .venv/bin/python entrypoint.py export RUN_DIR|RUN.tar.gz [--format gguf] [--quant q8_0] [--force]

The adapter is merged into the base it trained against (the 4-bit base's dequantised weights, in float32; checked
against base + adapter: evaluate.merge). A GGUF is that model converted by llama.cpp's own converter and
quantised by llama.cpp's own quantiser; a merged export is it saved in bfloat16. Then the export is checked, not
trusted:
  - it answers the run's held-out prompts with the report's seeded sampling, in its own runtime (llama.cpp for a
    GGUF), and the checker scores the answers; the adapter's figures are the run's report's;
  - its top-1 token is compared with the merged float32 model's at every token of the merged model's greedy
    answers to the probes.
An export whose pass rate falls more than --pass_tolerance below the adapter's (0.05; 0.10 for q4_k_m), or whose
top-1 agreement is below --min_agreement (0.95; 0.90 for q4_k_m), is refused with a sentence saying which; --force
keeps it, marked. What is kept: artifacts/<run>-gguf-<quant>/ or <run>-merged/ (the model, export_report.json,
README.md with the figures, a Modelfile for Ollama beside a GGUF, manifest.json with every file's sha256) and its
tarball with a .sha256; `make verify TARBALL=` checks it as it checks an adapter's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dpokit.core import kit, runs
from dpokit.model import models
from dpokit.scoring import checker
from dpokit.train import evaluate
from dpokit.core.kit import UserError, field

FORMATS = ("gguf", "merged")
QUANTS = ("f16", "q8_0", "q4_k_m")
# What an export may lose against the adapter: held-out pass rate, and greedy probe tokens whose top-1 moves. q4_k_m
# (about 4.5 bits a weight) moves about 1 greedy token in 10 on the bundled 135M model (measured: 90.4% agreement,
# pass rate 0.297 -> 0.219 on the default make train run); the others keep both (q8_0: 100%, 0.297 -> 0.297).
PASS_TOLERANCE = {"f16": 0.05, "q8_0": 0.05, "q4_k_m": 0.10, "merged": 0.05}
MIN_AGREEMENT = {"f16": 0.95, "q8_0": 0.95, "q4_k_m": 0.90, "merged": 0.95}
LLAMA_CPP_ENV = "DPO_KIT_LLAMA_CPP"  # a llama.cpp source tree (its convert_hf_to_gguf.py and gguf-py)


@dataclasses.dataclass
class ExportConfig:
    run: str = field("", "the finished run: its directory or its tarball")
    format: str = field("gguf", "gguf (llama.cpp, Ollama, LM Studio) or merged (transformers, vLLM)", choices=FORMATS)
    quant: str = field("q8_0", "a GGUF's weights: f16, q8_0 or q4_k_m", choices=QUANTS)
    force: bool = field(False, "keep an export that fails its check (marked so in its card and report)")
    pass_tolerance: float = field(-1.0, "how far the export's held-out pass rate may fall below the adapter's "
                                        "(-1: 0.05; 0.10 for q4_k_m)")
    min_agreement: float = field(-1.0, "the least share of greedy probe tokens whose top-1 must match the merged "
                                       "float32 model's (-1: 0.95; 0.90 for q4_k_m)")
    output_dir: str = field("", "where <run>-<format>/ and its tarball go ('': the run's output directory)")

    def problems(self) -> list[str]:
        out = [] if self.run else ["give the run: entrypoint.py export RUN_DIR|RUN.tar.gz"]
        if not (self.pass_tolerance == -1.0 or 0 <= self.pass_tolerance <= 1):
            out.append("--pass_tolerance must be between 0 and 1 (or -1)")
        if not (self.min_agreement == -1.0 or 0 <= self.min_agreement <= 1):
            out.append("--min_agreement must be between 0 and 1 (or -1)")
        return out

    def kind(self) -> str:
        return self.quant if self.format == "gguf" else "merged"

    def tolerance(self) -> float:
        return PASS_TOLERANCE[self.kind()] if self.pass_tolerance == -1.0 else self.pass_tolerance

    def agreement(self) -> float:
        return MIN_AGREEMENT[self.kind()] if self.min_agreement == -1.0 else self.min_agreement


def verdict(adapter: dict | None, export: dict | None, agreement: float, tolerance: float,
            min_agreement: float) -> str | None:
    """Why the export must not be kept (one sentence), or None. adapter/export: {"pass_rate", ...} on the same
    held-out prompts (None: the run has none, so only the agreement is checked)."""
    reasons = []
    if adapter and export and export["pass_rate"] is not None and adapter["pass_rate"] is not None \
            and export["pass_rate"] < adapter["pass_rate"] - tolerance - 1e-9:
        reasons.append(f"its held-out pass rate {export['pass_rate']:.3f} is more than {tolerance:.2f} below the "
                       f"adapter's {adapter['pass_rate']:.3f}")
    if agreement < min_agreement:
        reasons.append(f"its top-1 token matches the merged model's on {agreement:.1%} of the greedy probe tokens "
                       f"(at least {min_agreement:.0%} required)")
    return "; and ".join(reasons) or None


def modelfile(gguf_name: str, chat_template: str, ends: list[str]) -> str:
    """An Ollama Modelfile beside the GGUF: the file, and the end tokens as stops. Ollama reads the chat template
    from the GGUF's own metadata (tokenizer.chat_template), the one the run trained with; a ChatML template is
    also given in Ollama's syntax, for Ollama versions that do not translate it."""
    lines = [f"FROM ./{gguf_name}"]
    if "<|im_start|>" in chat_template:
        lines.append('TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n'
                     '{{ end }}<|im_start|>assistant\n"""')
    lines += [f'PARAMETER stop "{end}"' for end in ends]
    return "\n".join(lines) + "\n"


def llama_cpp_tree() -> Path:
    """Where llama.cpp's converter is: $DPO_KIT_LLAMA_CPP, else the tree `make llama-cpp` unpacked into the venv."""
    tree = Path(os.environ.get(LLAMA_CPP_ENV) or Path(sys.prefix) / "share" / "llama.cpp")
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise UserError(f"llama.cpp's converter is not at {tree}: `make llama-cpp` installs it (and llama.cpp's "
                        f"runtime) into the venv, or set {LLAMA_CPP_ENV} to a llama.cpp source tree")
    return tree


def to_gguf(merged: Path, dest: Path, quant: str) -> None:
    """The merged model as a GGUF: f16 and q8_0 written by llama.cpp's converter, q4_k_m quantised from its f16 by
    llama.cpp's quantiser (llama_model_quantize)."""
    tree = llama_cpp_tree()
    outtype = "f16" if quant == "q4_k_m" else quant
    first = dest.with_suffix(".f16.gguf") if quant == "q4_k_m" else dest
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(tree / "gguf-py"),
                                                                     os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(merged), "--outtype", outtype,
                           "--outfile", str(first)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"llama.cpp's converter failed on the merged model: {done.stderr.strip()[-600:]}")
    if quant == "q4_k_m":
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        if llama_cpp.llama_model_quantize(str(first).encode(), str(dest).encode(), params) != 0:
            raise UserError("llama.cpp's quantiser failed to write q4_k_m")
        first.unlink()


class GgufRuntime:
    """The exported GGUF in llama.cpp's runtime (llama-cpp-python): chat answers with the GGUF's own chat template,
    and each position's top-1 token for a given token sequence."""

    def __init__(self, path: Path, n_ctx: int = 2048):
        import llama_cpp

        self.path = path
        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, logits_all=True, verbose=False,
                                   n_threads=max(1, len(os.sched_getaffinity(0))))

    def answers(self, prompts: list[list[dict]], n: int, sampling: dict, seed: int, max_tokens: int
                ) -> tuple[list[str], float]:
        """(n answers per prompt, in prompt order, each seeded from `seed`; generated tokens per second)."""
        out, tokens, began = [], 0, time.perf_counter()
        for i, messages in enumerate(prompts):
            for k in range(n):
                reply = self.llm.create_chat_completion(messages=messages, max_tokens=max_tokens, seed=seed + i * n + k,
                                                        temperature=sampling.get("temperature", 1.0),
                                                        top_p=sampling.get("top_p", 1.0))
                out.append(reply["choices"][0]["message"]["content"] or "")
                tokens += reply["usage"]["completion_tokens"]
        return out, tokens / max(time.perf_counter() - began, 1e-9)

    def top1(self, ids: list[int]) -> list[int]:
        """The runtime's most likely next token after each prefix of ids."""
        import numpy as np

        self.llm.reset()
        self.llm.eval(ids)
        return np.asarray(self.llm.scores[:len(ids)]).argmax(-1).tolist()


def hf_top1(model, ids: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids], device=model.device)).logits[0].argmax(-1).tolist()


def agreement(reference: list[list[int]], other: list[list[int]], starts: list[int]) -> float:
    """The share of answer positions (from each sequence's start) where two runtimes' top-1 tokens match."""
    same = total = 0
    for ref, oth, start in zip(reference, other, starts):
        pairs = list(zip(ref[start - 1:-1], oth[start - 1:-1]))  # predictions of the answer's tokens
        same += sum(a == b for a, b in pairs)
        total += len(pairs)
    return same / total if total else 1.0


def probe_sequences(model, tokenizer, probes: list[dict]) -> tuple[list[list[int]], list[int]]:
    """The merged float32 model's greedy answers to the probes, as token ids (prompt, then answer), and where
    each answer starts."""
    prompts = [[{"role": "user", "content": p["prompt"]}] for p in probes]
    answers = models.generate(model, tokenizer, prompts, 48, None)
    sequences, starts = [], []
    for messages, answer in zip(prompts, answers):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        sequences.append(prompt_ids + tokenizer.encode(answer, add_special_tokens=False))
        starts.append(len(prompt_ids))
    return sequences, starts


def save_bfloat16(model, dest: Path) -> None:
    """A float32 model saved in bfloat16 without a second copy of it loaded: the tensors cast as they are written,
    and config.json's dtype made to say so (save_pretrained writes the parameters' dtype, float32)."""
    import torch

    model.save_pretrained(dest, state_dict={k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    config = json.loads((dest / "config.json").read_text())
    config["dtype"] = "bfloat16"
    kit.atomic_write_json(dest / "config.json", config)


def hf_answers(model, tokenizer, messages: list[list[dict]], samples: int, seed: int, max_tokens: int
               ) -> tuple[list[str], float]:
    """The report's seeded sampling through transformers (models.generate); (answers, generated tokens/s)."""
    began = time.perf_counter()
    answers = models.generate(model, tokenizer, messages, max_tokens, evaluate.CODE_SAMPLING, seed, n=samples,
                              label="export answers")
    return answers, sum(len(tokenizer.encode(a)) for a in answers) / (time.perf_counter() - began)


def prompt_text(messages) -> str:
    """A held-out prompt's task as the report's rows name it (evaluate.py: the last message's content)."""
    return messages if isinstance(messages, str) else messages[-1]["content"]


def adapter_figures(run_dir: Path, prompts: list[dict], samples: int) -> dict | None:
    """The adapter's held-out pass rate and mean score as the run's report gives them (evaluation.json), when the
    report scored these very prompts (the same tasks, as many samples); else None."""
    path = run_dir / "evaluation.json"
    if not path.exists():
        return None
    execution = json.loads(path.read_text()).get("execution") or {}
    if execution.get("prompts") != len(prompts) or "tuned" not in execution or execution.get("samples") != samples:
        return None
    scored_tasks = {r.get("prompt") for r in execution.get("rows", []) if r.get("model") == "tuned"}
    if scored_tasks != {prompt_text(p["prompt"]) for p in prompts}:
        return None
    return {k: execution["tuned"].get(k) for k in ("pass_rate", "mean_score", "answers")} | {"source": "the run's report"}


def scored(answers: list[str], prompts: list[dict], samples: int) -> dict:
    hosts = [p["host"] for p in prompts for _ in range(samples)]
    checks = checker.check_many([(checker.code_of(a), h) for a, h in zip(answers, hosts)], label="check export")
    tally = checker.tally(checks)
    return {k: tally.get(k) for k in ("pass_rate", "mean_score", "answers")} | {"isolation": checks[0].isolation}


def export(cfg: ExportConfig) -> Path:
    """Merge, export and check the run (checked_export), then rename the export into place and pack its tarball."""
    with tempfile.TemporaryDirectory(prefix="export-") as tmp:
        run_dir, rcfg = runs.open_run(cfg.run, tmp)
        out_root = Path(cfg.output_dir or rcfg["output_dir"])
        name = f"{run_dir.name}-{cfg.format}" + (f"-{cfg.quant}" if cfg.format == "gguf" else "")
        dest, partial = out_root / name, out_root / f"{name}.partial"
        merged32 = evaluate.merge(str(run_dir), str(Path(tmp) / "merged32"), dtype="float32")  # not unpacked again
        merge_error = json.loads((merged32 / "merge_report.json").read_text())["float32_merge_max_abs_diff"]
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            size, why = checked_export(cfg, run_dir, rcfg, merged32, merge_error, partial, name)
        except BaseException:  # a converter failure, a refusal, ^C: no half-written export is left behind
            shutil.rmtree(partial, ignore_errors=True)
            raise
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(partial, dest)
    digest = runs.make_tarball(dest, out_root / f"{name}.tar.gz")
    print(f"[export] {dest} ({size / 2**20:,.0f} MiB){' FORCED: ' + why if why else ''}; "
          f"{out_root / (name + '.tar.gz')} sha256 {digest[:16]}", flush=True)
    return dest


def checked_export(cfg: ExportConfig, run_dir: Path, rcfg: dict, merged32: Path, merge_error: float,
                   partial: Path, name: str) -> tuple[int, str | None]:
    """Write the export into `partial`, check it (held-out answers scored, probe tokens compared) and write its
    report, card, Modelfile and manifest there; a UserError when it is refused. Returns (model bytes, why it
    failed its check when --force kept it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(merged32)
    reference = AutoModelForCausalLM.from_pretrained(merged32, dtype=torch.float32).eval()
    runtime = mine = None
    if cfg.format == "gguf":
        model_file = partial / f"{run_dir.name}-{cfg.quant}.gguf"
        to_gguf(merged32, model_file, cfg.quant)
        runtime = GgufRuntime(model_file)
    else:  # bfloat16 from the float32 model already loaded, then read back from disk: the check is of the files
        model_file = partial / "model"
        save_bfloat16(reference, model_file)
        tokenizer.save_pretrained(model_file)
        mine = AutoModelForCausalLM.from_pretrained(model_file, dtype=torch.float32).eval()
    probes = evaluate.load_probes(rcfg.get("probes") or "")
    sequences, starts = probe_sequences(reference, tokenizer, probes) if probes else ([], [])
    tops = [runtime.top1(s) if mine is None else hf_top1(mine, s) for s in sequences]
    agree = agreement([hf_top1(reference, s) for s in sequences], tops, starts)
    _, prompts = evaluate.held_out_data(rcfg["data"], rcfg, every=False) if Path(rcfg["data"]).exists() \
        else ([], [])
    samples, max_tokens, seed = rcfg.get("eval_samples", 4), rcfg.get("eval_max_new_tokens", 256), rcfg["seed"]
    adapter = mine_figures = None
    speed = None
    if prompts:
        messages = [p["prompt"] for p in prompts]
        adapter = adapter_figures(run_dir, prompts, samples)
        if adapter is None:  # the report scored other prompts (or none): the adapter's side is measured here
            print(f"[export] the run's report did not score these {len(prompts)} held-out prompts: the adapter's "
                  "answers are sampled now, from the merged float32 model (base + adapter)", flush=True)
            answers, _ = hf_answers(reference, tokenizer, messages, samples, seed, max_tokens)
            adapter = scored(answers, prompts, samples) | {"source": "measured by the export (merged float32 model)"}
        if mine is None:
            answers, speed = runtime.answers(messages, samples, evaluate.CODE_SAMPLING, seed, max_tokens)
        else:
            answers, speed = hf_answers(mine, tokenizer, messages, samples, seed, max_tokens)
        mine_figures = scored(answers, prompts, samples)
    why = verdict(adapter, mine_figures, agree, cfg.tolerance(), cfg.agreement())
    if not prompts:
        print("[export] the run has no held-out prompts here (--eval_prompts, its data file): only the probe "
              "tokens are checked, not the pass rate", flush=True)
    if why and not cfg.force:
        raise UserError(f"export refused: {why} (nothing kept; --force keeps it, marked)")
    size = sum(f.stat().st_size for f in ([model_file] if model_file.is_file() else model_file.rglob("*"))
               if f.is_file())
    report = {"run": run_dir.name, "format": cfg.format, "quant": cfg.quant if cfg.format == "gguf" else None,
              "adapter": adapter, "export": mine_figures, "held_out_prompts": len(prompts), "samples": samples,
              "probe_top1_agreement": agree, "probe_tokens": sum(len(s) - st for s, st in zip(sequences, starts)),
              "pass_tolerance": cfg.tolerance(), "min_agreement": cfg.agreement(), "bytes": size,
              "tokens_per_s": speed, "merge_max_abs_diff": merge_error, "forced": bool(why),
              "refused_because": why}
    kit.atomic_write_json(partial / "export_report.json", report)
    if cfg.format == "gguf":
        template = tokenizer.chat_template or ""
        ends = {tokenizer.eos_token} | ({"<|im_end|>"} if "<|im_end|>" in template else set())
        kit.atomic_write_text(partial / "Modelfile", modelfile(model_file.name, template, sorted(ends - {None})))
    kit.atomic_write_text(partial / "README.md", card(report, rcfg, model_file.name))
    runs.write_export_manifest(partial, name, report)
    return size, why


def card(report: dict, rcfg: dict, model_name: str) -> str:
    """README.md of the export: what it is, how it was checked, the figures side by side."""
    def figure(side: dict | None, key: str, fmt: str) -> str:
        return format(side[key], fmt) if side and side.get(key) is not None else "n/a"

    what = f"GGUF ({report['quant']})" if report["format"] == "gguf" else "merged model (bfloat16)"
    lines = [f"# {report['run']}: {what}", ""]
    if report["forced"]:
        lines += [f"**Kept with --force although its check failed**: {report['refused_because']}.", ""]
    lines += [f"{rcfg['model_name_or_path']} with run {report['run']}'s LoRA adapter merged into the weights it "
              f"trained against (the 4-bit base's dequantised values, float32; largest logit change "
              f"{report['merge_max_abs_diff']:.1e}), exported "
              f"as `{model_name}`, {report['bytes'] / 2**20:,.1f} MiB.", "",
              f"| | adapter ({(report['adapter'] or {}).get('source', 'no held-out prompts')}) | this export |",
              "| --- | --- | --- |",
              f"| held-out pass rate ({report['held_out_prompts']} prompts x {report['samples']}) | "
              f"{figure(report['adapter'], 'pass_rate', '.3f')} | {figure(report['export'], 'pass_rate', '.3f')} |",
              f"| mean score | {figure(report['adapter'], 'mean_score', '+.4f')} | "
              f"{figure(report['export'], 'mean_score', '+.4f')} |", "",
              f"Top-1 agreement with the merged float32 model on {report['probe_tokens']} greedy probe tokens: "
              f"{report['probe_top1_agreement']:.1%} (at least {report['min_agreement']:.0%} required). Generated "
              f"tokens/s while answering: {report['tokens_per_s'] or 0:,.1f}. Pass rate tolerance: "
              f"{report['pass_tolerance']:.2f}.", ""]
    if report["format"] == "gguf":
        lines += ["Run it: `llama-server -m " + model_name + "` (llama.cpp), or `ollama create " +
                  report["run"] + " -f Modelfile` then `ollama run " + report["run"] + "`.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    cfg = kit.parse_config(ExportConfig, argv, __doc__, positional="run")
    export(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(kit.run_cli(main))
