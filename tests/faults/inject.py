"""`python tests/faults/inject.py VERB ARGS...`: run `seekforge VERB ARGS...` with faults injected
from the environment, so the product code carries no test hooks. Under torchrun every fault fires
only on the first attempt (TORCHELASTIC_RESTART_COUNT=0): the restarted job runs clean.

    FAULT=kill:STEP          SIGKILL this process just before optimizer step STEP
    FAULT=hang:STEP          sleep forever just before step STEP (a hung rank)
    FAULT=save:STEP:PHASE    SIGKILL during the save of step STEP; PHASE = manifest (the DCP shards and
                             RNG files are written, the manifest is not) | latest (the directory is
                             renamed into place, `latest` not yet updated)
    FAULT_RANK=R             only on rank R (default: every rank)
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(fault: str) -> None:
    from seekforge.train import checkpoint, integrity
    from seekforge.train.trainer import Trainer

    kind, step, *rest = fault.split(":")
    step = int(step)
    if kind in ("kill", "hang"):
        train_step = Trainer.train_step

        def faulty_step(self):
            if self.step + 1 == step:
                print(f"inject: {kind} rank {os.environ.get('RANK', '0')} before step {step} at {time.time():.3f}",
                      file=sys.stderr, flush=True)
                if kind == "kill":
                    _die()
                time.sleep(10**6)
            return train_step(self)

        Trainer.train_step = faulty_step
    elif kind == "save":
        module, name = {"manifest": (integrity, "write_manifest"), "latest": (checkpoint, "_write_latest")}[rest[0]]
        original = getattr(module, name)

        def faulty(path, *args, **kwargs):
            if f"step_{step:06d}" in str(path) or (args and f"step_{step:06d}" in str(args[0])):
                _die()
            return original(path, *args, **kwargs)

        setattr(module, name, faulty)
    else:
        raise SystemExit(f"inject: unknown FAULT {fault!r}")


if __name__ == "__main__":
    fault = os.environ.get("FAULT", "")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    on_rank = os.environ.get("FAULT_RANK") in (None, os.environ.get("RANK", "0"))
    if fault and first_attempt and on_rank:
        install(fault)
    from seekforge.cli import main

    main(sys.argv[1:])
