"""One-line layouts over a built model:

    model  = AutoParallel(model).hsdp(replicate=2).tp(2).recompute("selective").build()
    runner = AutoParallel(model).fsdp().pipeline("DualPipeV", microbatches=8)

Each call fills one part of a ParallelConfig; the data-parallel shard size not given takes whatever
ranks are left. `build()` returns the parallelized model; `pipeline(...)` returns a PipelineRunner
(parallel/pp.py). `config` and `mesh` stay available for the data loader and checkpoints.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from seekforge.config import ParallelConfig
from seekforge.parallel.mesh import ParallelMesh, build_mesh
from seekforge.parallel.parallelize import parallelize


class AutoParallel:
    def __init__(self, model: nn.Module, world_size: int | None = None):
        """world_size defaults to the initialized process group's."""
        self.model = model
        self.world_size = world_size if world_size is not None else dist.get_world_size()
        self.settings: dict = {}
        self.config: ParallelConfig | None = None
        self.mesh: ParallelMesh | None = None

    def hsdp(self, replicate: int = 1, shard: int | None = None) -> AutoParallel:
        """HSDP: `replicate` copies, each FSDP-sharded over `shard` ranks (default: the rest)."""
        self.settings["dp_replicate"] = replicate
        if shard is not None:
            self.settings["dp_shard"] = shard
        return self

    def fsdp(self, shard: int | None = None) -> AutoParallel:
        return self.hsdp(1, shard)

    def tp(self, size: int) -> AutoParallel:
        self.settings["tp"] = size
        return self

    def ep(self, size: int) -> AutoParallel:
        self.settings["ep"] = size
        return self

    def recompute(self, mode: str | list[str]) -> AutoParallel:
        self.settings["recompute"] = mode
        return self

    def compile(self) -> AutoParallel:
        self.settings["compile"] = True
        return self

    def mixed_precision(self, name: str = "bf16") -> AutoParallel:
        self.settings["mixed_precision"] = name
        return self

    def build(self) -> nn.Module:
        """The parallelized model (no pipeline)."""
        self._resolve()
        return parallelize(self.model, self.config, self.mesh)

    def pipeline(self, schedule: str = "1F1B", microbatches: int | None = None, pp: int = 2,
                 split_points: list[int] | None = None):
        """A PipelineRunner over `pp` ranks; microbatches default to 2 per stage."""
        from seekforge.parallel.pp import PipelineRunner  # pipelining imports are heavy; only when used

        self.settings.update(pp=pp, pp_schedule=schedule, pp_split_points=split_points)
        self._resolve(microbatches)
        return PipelineRunner(self.model, self.config, self.mesh)

    def _resolve(self, microbatches: int | None = None) -> None:
        settings = dict(self.settings)
        if "dp_shard" not in settings:
            others = settings.get("dp_replicate", 1) * settings.get("tp", 1) * settings.get("pp", 1)
            if self.world_size % others:
                raise ValueError(f"dp_replicate*tp*pp = {others} does not divide the world size "
                                 f"{self.world_size}; change one of them")
            settings["dp_shard"] = self.world_size // others
        if "pp" in settings:
            stages = ParallelConfig(pp_schedule=settings["pp_schedule"]).stages_per_rank * settings["pp"]
            settings["microbatches"] = microbatches if microbatches is not None else 2 * stages
        self.config = ParallelConfig(**settings)
        self.config.validate(self.world_size, self.model.cfg)
        self.mesh = build_mesh(self.config, self.model.cfg)
