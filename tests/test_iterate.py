"""Rounds: stage chaining in train_dpo.py (--init_adapter) and the plan runner iterate.py."""
import json

import pytest

import kit
import train_dpo
from test_train_dpo import MODEL, needs_model, pairs_in, small_run


def logps(model, tokenizer, records, side):
    toks = [train_dpo.tokenize_pair(tokenizer, r, 96) for r in records]
    k = {"chosen": 1, "rejected": 2}[side]
    return [lp for lp, _ in train_dpo.completion_logps(model, [t[0] for t in toks], [t[k] for t in toks],
                                                       tokenizer.pad_token_id)]


@needs_model
@pytest.mark.integration
def test_stage_two_reference_is_stage_one_tuned_model_not_the_base(tmp_path):
    # Stage 1: a few strong steps, so base and stage-1 model give clearly different log-probs.
    stage1, _ = small_run(tmp_path, "trl_conversational", "s1", "--learning_rate", "5e-3", "--max_steps", "3")
    # Stage 2: one step over all four pairs, starting from stage 1's adapter.
    stage2, out = small_run(tmp_path, "trl_conversational", "s2", "--init_adapter", str(stage1),
                            "--max_steps", "1", "--per_device_train_batch_size", "4")
    assert "starting from the adapter of s1" in out
    first = [json.loads(x) for x in (stage2 / "metrics.jsonl").read_text().splitlines()][0]
    # TRL logs the policy's mean summed log-prob and beta * (policy - reference); the policy starts
    # exactly at the reference, so the rewards are 0 and the reference log-prob is the logged one.
    assert first["rewards/chosen"] == pytest.approx(0, abs=1e-4)
    assert first["rewards/rejected"] == pytest.approx(0, abs=1e-4)
    ref_chosen = first["logps/chosen"] - first["rewards/chosen"] / 0.1

    model, tok = train_dpo.load_for_chat(stage1, train_dpo.TrainConfig(data="x", model_name_or_path=str(MODEL)))
    records = pairs_in("trl_conversational")
    tuned = sum(logps(model, tok, records, "chosen")) / 4
    with model.disable_adapter():
        base = sum(logps(model, tok, records, "chosen")) / 4
    assert abs(tuned - base) > 1.0  # stage 1 moved the model: the check below can tell them apart
    assert ref_chosen == pytest.approx(tuned, abs=0.05)

    manifest = json.loads((stage2 / "manifest.json").read_text())
    assert manifest["init_adapter"]["run_name"] == "s1"
    assert manifest["init_adapter"]["adapter_sha256"] == kit.sha256_file(stage1 / "adapter_model.safetensors")
    assert not (stage2 / "ref").exists()  # only the trained adapter is handed off, not TRL's frozen copy
    assert "base with the adapter of" in (stage2 / "README.md").read_text()
