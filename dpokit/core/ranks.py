"""Which process this is in a multi-process run, and what the processes share: rank 0 alone writes the run.

Not run on its own: imported by train_dpo.py, runs.py and scaleout.py in every training process. Standard
library at import time; torch and accelerate only when there is more than one process. The launcher side
(starting the processes, naming the rank that failed) is scaleout.py.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

from dpokit.core.kit import atomic_write_json

FAILURES_DIR = "failures"  # <run>.partial/failures/rank-N.json: what each failing rank recorded


def effective_batch_size(per_device: int, processes: int, gradient_accumulation_steps: int) -> int:
    """Pairs per optimiser step: 2 per device x 4 processes x 2 accumulation = 16. A 1-GPU run with
    per_device 8 x accumulation 2 takes the same steps on the same batches as that 4-GPU run."""
    return per_device * processes * gradient_accumulation_steps


def world_from_env(env) -> dict:
    """rank / local_rank / world_size / nodes from the variables torchrun (accelerate launch) sets; one
    process when they are absent."""
    world = int(env.get("WORLD_SIZE", 1))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    return {"rank": int(env.get("RANK", 0)), "local_rank": int(env.get("LOCAL_RANK", 0)), "world_size": world,
            "nodes": max(world // max(local_world, 1), 1)}


def world() -> dict:
    return world_from_env(os.environ)


def is_main_process() -> bool:
    return world()["rank"] == 0


def device_map(on_gpu: bool):
    """Where each process puts its model: its own GPU (local rank: several processes share a machine), or the
    CPU. Under ZeRO-3 / FSDP the engine places the shards itself, so no device_map at all."""
    if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3" or os.environ.get("ACCELERATE_USE_FSDP") == "true":
        return None
    return {"": world()["local_rank"] if on_gpu else "cpu"}


def share_from_rank0(obj):
    """Rank 0's value of obj in every process (the run name, the checkpoint to resume from)."""
    if world()["world_size"] == 1:
        return obj
    import torch
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    PartialState(cpu=not torch.cuda.is_available())  # the same process group the Trainer uses later
    box = [obj]
    broadcast_object_list(box, from_process=0)
    return box[0]


def any_process(flag: bool) -> bool:
    """True in every process when it is true in any: all ranks stop at the same step after a signal
    (a rank stopping alone would leave the others waiting in the next all-reduce)."""
    if world()["world_size"] == 1:
        return flag
    import torch
    from accelerate import PartialState

    t = torch.tensor([1.0 if flag else 0.0], device=PartialState().device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def record_failure(partial: Path, error: str, user_error: bool = False) -> None:
    """A failing process writes what went wrong to <run>.partial/failures/rank-N.json (any rank, any machine
    sharing the output directory), for the wrapper to name in status.json."""
    if world()["world_size"] == 1 or not partial.is_dir():  # one process: status.json says it all
        return

    rank = world()["rank"]
    atomic_write_json(partial / FAILURES_DIR / f"rank-{rank}.json",
                          {"rank": rank, "error": error, "user_error": user_error, "at": time.time(),
                           "host": os.uname().nodename, "traceback": traceback.format_exc(limit=8)})
