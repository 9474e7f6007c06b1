"""Spawn N gloo ranks on this CPU and collect what each returns.

    results = launch(fn, world_size, *args)   # fn(*args) runs on every rank, inside a process group

`fn` must be importable (a module-level function of a test module). Rendezvous is a file in a
fresh temporary directory, so concurrent test runs never collide on a port. Each rank uses one
thread (the test machine is shared), and a 120 s collective timeout turns a hang into a failure.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = str(Path(__file__).resolve().parents[2])


def launch(fn, world_size: int, *args):
    """Run fn(*args) on `world_size` ranks; returns the list of per-rank return values."""
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world_size, tmp, fn, args), nprocs=world_size, join=True)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _entry(rank: int, world_size: int, tmp: str, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(*args)
        torch.save(result, Path(tmp) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
