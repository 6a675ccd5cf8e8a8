"""What a GPU run decides from its free memory, without a GPU (dpokit/model/models.py): the activations a pair
keeps, the pairs per forward that hold the asked pairs per step, and whether the NF4 base's dense copy fits.
The decisions on a real GPU are tests/test_shapes.py's gpu tests (bench/gpu.sh runs them first).

    .venv/bin/python -m pytest -q tests/test_gpu_memory.py
"""
import pytest

from dpokit.model import models

LLAMA_3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8}
GB = 1e9


def test_activations_per_token_at_the_8b_shape_by_hand():
    # (6 x 4,096 + 2 x 1,024 + 4 x 14,336) elements x 2 bytes x 32 layers
    assert models.activation_bytes_per_token(LLAMA_3_8B) == (24576 + 2048 + 57344) * 2 * 32 == 5_373_952
    assert models.activation_bytes_per_token(LLAMA_3_8B, dtype_bytes=4) == 2 * 5_373_952
    # a pair of 1,024 tokens, the prompt three quarters and run once (768 + 2 x 256 tokens): 6.9 GB, under the
    # 8.3 GB the H200 run measured a pair; with the safety factor, over it
    pair = 1280 * models.activation_bytes_per_token(LLAMA_3_8B)
    assert 6.8 * GB < pair < 8.3 * GB < pair * models.ACTIVATION_SAFETY


@pytest.mark.parametrize("per_device, accumulation, fit_pairs, expected", [
    (4, 1, 10, (4, 1)),  # asked 4, room for 10: 4 (the pairs per step stay 4)
    (1, 8, 10, (8, 1)),  # 8 accumulated one by one: all 8 in one forward
    (1, 8, 5, (4, 2)),  # room for 5: the largest divisor of 8 under it
    (8, 1, 3, (2, 4)),  # asked 8 in one forward, room for 3: 2 x 4 instead of running out of memory
    (6, 1, 4, (3, 2)),
    (7, 1, 3, (1, 7)),  # a prime: one at a time
    (4, 1, 0, (1, 4)),  # not even one fits: one, and the run finds out
])
def test_pairs_per_forward_hold_the_pairs_per_step(per_device, accumulation, fit_pairs, expected):
    pair = 1 * GB
    free = (fit_pairs + 0.5) * pair * models.ACTIVATION_SAFETY / models.MICRO_BATCH_HEADROOM
    micro, acc = models.plan_micro_batch(per_device, accumulation, pair, free)
    assert (micro, acc) == expected and micro * acc == per_device * accumulation


def test_the_dense_copy_is_made_only_where_it_and_a_step_fit():
    params = 8 * 10 ** 9  # 16 GB in bfloat16, 4 GB of it already there in 4 bits
    step = 4 * 8.3 * GB
    assert models.dequantize_on_gpu_fits(params, "bfloat16", 140 * GB, step)  # an H200
    assert not models.dequantize_on_gpu_fits(params, "bfloat16", 40 * GB, step)  # a 40 GB card: keep 4-bit
    assert models.dequantize_on_gpu_fits(params, "bfloat16", 80 * GB, step)  # 12 + 49.8 <= 64
    assert not models.dequantize_on_gpu_fits(params, "float32", 80 * GB, step)  # 28 + 49.8 > 64
