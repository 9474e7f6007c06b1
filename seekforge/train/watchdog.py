"""Naming the rank that hung or died, when a collective fails.

A collective that times out (the process group's timeout, TrainConfig.dist_timeout_s) or loses a
peer tells each surviving rank only that *something* went wrong. After such a failure every
surviving rank checks in under a key in the job's key-value store (torchrun's TCPStore, which
outlives the ranks) and waits a short grace period for the others; the ranks that never check in are
the ones that hung or died. The error then names them, and the process exits so that torchrun
(--max-restarts) restarts the job from the last checkpoint.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist


def missing_ranks(incident: str, grace_s: float = 10.0) -> list[int] | None:
    """Check in for `incident` (the same string on every rank, e.g. the step) and return the ranks that
    did not within grace_s; None when the store itself is gone (nothing can be said)."""
    try:
        store = dist.distributed_c10d._get_default_store()  # the store the process group rendezvoused on
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        keys = [f"seekforge/alive/{attempt}/{incident}/{r}" for r in range(dist.get_world_size())]
        store.set(keys[dist.get_rank()], "1")
        deadline = time.monotonic() + grace_s
        while True:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 — a diagnosis must never hide the failure it diagnoses
        return None


def collective_failure(error: BaseException, step: int, timeout_s: float | None) -> RuntimeError:
    """The error to raise instead of `error`, a failed collective during optimizer step `step`."""
    missing = missing_ranks(f"step{step}", grace_s=min(10.0, timeout_s or 10.0))
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if missing:
        who = ", ".join(map(str, missing))
        return RuntimeError(f"rank {dist.get_rank()}: a collective of step {step} failed ({first}); rank(s) {who} "
                            f"did not respond: hung or dead. Under torchrun --max-restarts the job restarts from "
                            f"the last checkpoint")
    return RuntimeError(f"rank {dist.get_rank()}: a collective of step {step} failed ({first}); every rank is "
                        "still alive, so this is not a lost rank")
