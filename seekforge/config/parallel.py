"""`ParallelConfig`: how a model is laid out over ranks, the pipeline schedules, and `--parallel`'s parser."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from seekforge.config.model import ModelConfig


PIPELINE_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                      "ZBVZeroBubble", "DualPipeV")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def parse_parallel(spec: str) -> dict[str, Any]:
    """"dp_shard=2,tp=2,pp_split_points=[2,4]" → {"dp_shard": 2, "tp": 2, "pp_split_points": [2, 4]}
    (ParallelConfig keys; YAML values; commas inside [...] belong to the value)."""
    out: dict[str, Any] = {}
    for item in re.split(r",(?![^\[]*\])", spec):
        key, eq, text = item.strip().partition("=")
        if not eq or not key or not text:
            raise ValueError(f"--parallel {spec!r}: {item!r} is not key=value; write e.g. "
                             "--parallel dp_shard=2,tp=2 (keys of ParallelConfig in seekforge/config/parallel.py)")
        out[key] = yaml.safe_load(text)
    return out


@dataclass
class ParallelConfig:
    """How a model is laid out over ranks. world size = pp · dp_replicate · dp_shard · cp · tp.

    dp_replicate × dp_shard is HSDP (FSDP within a shard group, replicas across); dp_shard alone is
    FSDP. Expert parallelism borrows ranks from dp_shard (as in torchtitan): `ep` must divide it, and
    each expert's weights are FSDP-sharded over the remaining dp_shard / ep ranks.

    ep_nodes > 1 groups the ep ranks into that many nodes of consecutive ranks, and the expert
    all-to-all becomes hierarchical (parallel/ep.py's HierarchicalDispatcher): a token crosses to
    another node once per destination node, then an intra-node all-to-all reaches the experts.

    etp > 1 is expert tensor parallelism (Megatron's expert_tensor_parallel_size): etp ranks, also
    borrowed from dp_shard, hold the same experts and split each one's intermediate dimension (gate
    and up by columns, down by rows), each storing only its 1/etp; the all-to-all runs over the ep
    ranks only (parallel/ep.py's EtpDispatcher). dp_shard must be a multiple of ep · etp.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    ep_nodes: int = 1  # nodes the ep ranks are grouped into (hierarchical all-to-all when > 1)
    etp: int = 1  # expert tensor parallelism: ranks splitting each expert's intermediate dim (needs ep > 1)
    pp: int = 1
    cp: int = 1  # context parallelism: ranks a sequence is split over (parallel/cp.py)
    sequence_parallel: bool = False  # with tp > 1: norms run on T/tp tokens (parallel/tp.py)
    pp_schedule: str = "1F1B"
    microbatches: int = 1  # pipeline micro-batches per step
    pp_split_points: list[int] | None = None  # first layer of stages 1..n-1; None: even split
    recompute: str | list[str] = "none"  # see parallel/recompute.py
    compile: bool = False
    mixed_precision: str = "fp32"  # "bf16": bf16 params/compute with fp32 gradient reduction

    def __post_init__(self):
        for key in ("dp_replicate", "dp_shard", "tp", "ep", "ep_nodes", "etp", "pp", "cp", "microbatches"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{key}={value!r}: must be a positive integer")
        if self.pp_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"ParallelConfig.pp_schedule={self.pp_schedule!r}: choose one of {PIPELINE_SCHEDULES}")
        if self.mixed_precision not in ("fp32", "bf16"):
            raise ValueError(f"ParallelConfig.mixed_precision={self.mixed_precision!r}: use 'fp32' or 'bf16'")
        if self.sequence_parallel and self.pp > 1:
            raise ValueError("sequence_parallel=True with pp > 1 is not supported (pipeline stages would see "
                             "T/tp positions); set sequence_parallel=False or pp=1")
        if self.dp_shard * self.cp % self.ep:  # with cp, ep may also borrow cp ranks (as torchtitan)
            name = "dp_shard" if self.cp == 1 else "dp_shard*cp"
            raise ValueError(f"ep={self.ep} does not divide {name}={self.dp_shard * self.cp}: experts are split over "
                             f"data-parallel ranks; pick ep in {_divisors(self.dp_shard * self.cp)} or raise dp_shard")
        if self.ep % self.ep_nodes:
            raise ValueError(f"ep_nodes={self.ep_nodes} does not divide ep={self.ep}: every node holds the same "
                             f"number of expert-parallel ranks; pick ep_nodes in {_divisors(self.ep)}")
        self._check_cp()
        if self.etp > 1:
            self._check_etp()
        # Checked here, not in validate: they need no model, so `plan schedule` applies them too.
        if self.pp > 1:
            if self.microbatches < self.pp:
                raise ValueError(f"microbatches={self.microbatches} < pp={self.pp} leaves stages idle; "
                                 f"use microbatches >= {self.pp}")
            if self.pp_schedule == "DualPipeV" and self.microbatches < self.num_stages:
                raise ValueError(f"DualPipeV needs microbatches >= num_stages={self.num_stages} (two stages per "
                                 f"pp rank); got {self.microbatches}: use microbatches >= {self.num_stages}")

    def _check_cp(self) -> None:
        """Context parallelism composes with FSDP/HSDP, TP, PP and EP, in fp32 or bf16; not yet with ep_nodes or etp."""
        if self.cp == 1:
            return
        if self.ep_nodes > 1 or self.etp > 1:
            raise ValueError(f"cp={self.cp} with ep_nodes={self.ep_nodes}, etp={self.etp} is not supported yet (their "
                             "meshes split dp_shard alone); use ep_nodes=1 and etp=1 with cp")

    def _check_etp(self) -> None:
        """Expert-TP splits each expert-parallel rank's experts over etp more data-parallel ranks."""
        if self.ep == 1:
            raise ValueError(f"etp={self.etp} needs ep > 1: expert-TP splits the experts of each expert-parallel "
                             "rank; set ep (e.g. ep=2) or drop etp")
        if self.ep_nodes > 1:
            raise ValueError(f"etp={self.etp} with ep_nodes={self.ep_nodes} is not supported (the hierarchical "
                             "all-to-all has no expert-TP path); use ep_nodes=1 or etp=1")
        if self.dp_shard % (self.ep * self.etp):
            raise ValueError(f"ep*etp = {self.ep}*{self.etp} = {self.ep * self.etp} does not divide dp_shard="
                             f"{self.dp_shard}: both borrow data-parallel ranks; raise dp_shard to a multiple of "
                             f"{self.ep * self.etp} or pick etp in {_divisors(self.dp_shard // self.ep)}")

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> ParallelConfig:
        """A `parallel` table (--parallel, a config file's `parallel:`) as a ParallelConfig; an unknown key
        is a ValueError listing the valid ones, not a TypeError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - names)
        if unknown:
            raise ValueError(f"parallel has unknown key(s) {unknown}; valid ParallelConfig keys: {sorted(names)}")
        return cls(**table)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def fsdp(self) -> bool:
        """Whether parallel/parallelize.py shards with FSDP (then FSDP also reduces the cp ranks' gradients,
        parallel/cp.py): data parallelism, expert parallelism (its ranks are data-parallel, also under cp:
        ep | dp_shard · cp) or bf16 mixed precision (FSDP's policy casts). plan/ models the same rule."""
        return self.dp_replicate * self.dp_shard > 1 or self.ep > 1 or self.mixed_precision != "fp32"

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.pp_schedule in MULTI_STAGE_SCHEDULES else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    def validate(self, world_size: int, model: ModelConfig) -> None:
        """Everything that can be checked before a process group exists; one ValueError naming the fix."""
        if world_size != self.world_size:
            rest = self.world_size // self.dp_shard
            hint = f"dp_shard={world_size // rest}" if world_size % rest == 0 else "a layout whose product matches"
            raise ValueError(f"pp*dp_replicate*dp_shard*cp*tp = {self.pp}*{self.dp_replicate}*{self.dp_shard}*"
                             f"{self.cp}*{self.tp} = {self.world_size}, but the world size is {world_size}; "
                             f"use {hint}")
        if model.num_attention_heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide num_attention_heads={model.num_attention_heads}; "
                             f"pick tp in {_divisors(model.num_attention_heads)}")
        for key in ("vocab_size", "intermediate_size", "moe_intermediate_size"):
            if getattr(model, key) % self.tp:
                raise ValueError(f"tp={self.tp} does not divide {key}={getattr(model, key)}; "
                                 f"pick tp in {_divisors(getattr(model, key))}")
        if self.ep > 1 and not (model.n_routed_experts and model.num_moe_layers):
            raise ValueError(f"ep={self.ep} splits routed experts, but this model has none (n_routed_experts="
                             f"{model.n_routed_experts}, {model.num_moe_layers} MoE layers); drop ep")
        if self.ep > 1 and model.n_routed_experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide n_routed_experts={model.n_routed_experts}; "
                             f"pick ep in {_divisors(model.n_routed_experts)}")
        if self.etp > 1 and model.moe_intermediate_size % self.etp:
            raise ValueError(f"etp={self.etp} does not divide moe_intermediate_size={model.moe_intermediate_size}; "
                             f"pick etp in {_divisors(model.moe_intermediate_size)}")
        if self.pp > 1:
            if self.num_stages > model.num_hidden_layers:
                raise ValueError(f"pp={self.pp} with {self.pp_schedule} needs {self.num_stages} stages but the "
                                 f"model has num_hidden_layers={model.num_hidden_layers}; every stage needs a "
                                 f"layer: lower pp or use a single-stage schedule such as 1F1B")
            points = self.pp_split_points
            if points is not None and (len(points) != self.num_stages - 1 or list(points) != sorted(set(points))
                                       or points[0] < 1 or points[-1] >= model.num_hidden_layers):
                raise ValueError(f"pp_split_points={points}: need {self.num_stages - 1} increasing layer ids in "
                                 f"[1, {model.num_hidden_layers - 1}] (the first layer of each later stage)")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
