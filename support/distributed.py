"""The ranks of a torchrun job: start them, end them, agree on a number. One process without
torchrun is rank 0 of 1 and none of this communicates.
"""

import gc
import os

import torch
import torch.distributed as dist


def rank_device() -> torch.device:
    """This rank's GPU (torchrun's LOCAL_RANK, else 0), or the CPU: every script's device."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")


def start_ranks(timeout, backend=None) -> tuple:
    """-> (device, rank, world, distributed); under torchrun the process group starts here, its
    collectives' timeout a timedelta; backend None: nccl on a GPU, gloo on the CPU."""
    distributed = "RANK" in os.environ
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # first: nccl (and anything on "cuda") uses this rank's GPU
    if distributed:
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        bound = device if backend == "nccl" else None  # nccl binds the group to this rank's GPU
        dist.init_process_group(backend, device_id=bound, timeout=timeout)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    return device, rank, world, distributed


def end_ranks():
    # A gloo run that exits without this dies at exit now and then (SIGABRT in the teardown race).
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def agreed(n: int, device, distributed) -> int:
    """Rank 0's n on every rank."""
    if not distributed:
        return n
    t = torch.tensor([n], device=device)
    dist.broadcast(t, src=0)
    return int(t.item())
