"""Layout: where every parameter's elements live, over ranks — the one description resharding needs.

A tensor's placement is MindSpore's device matrix + tensor map, or DTensor's mesh + placements, in
one form that also covers FSDP's strided composition with TP/EP and pipeline stage ownership:

    Placement(mesh_shape, mesh_dim_names, ranks, shards)
      ranks   the global ranks of the device matrix, row-major over mesh_shape
      shards  ((mesh_dim, tensor_dim), ...) in the order they were applied: each step splits the box
              that the earlier steps left along tensor_dim into mesh_shape[mesh_dim] chunks with
              DTensor's chunk rule (size ⌈n/k⌉, the last ones short or empty). Mesh dims in no step
              replicate. TP then FSDP on the same dim is ((tp, 0), (dp_shard, 0)): FSDP splits the TP
              shard, which DTensor writes as _StridedShard on the dp dim.

A TensorLayout is a list of placements, each one complete copy of the tensor: a plain parameter
held by several ranks, or a pipeline's second copy of the embedding (MTP on the last stage) on
other ranks. Pipeline stage ownership is simply which ranks a placement's device matrix holds.

Two ways to get a Layout:
  layout_of_model(modules)          from a parallelized model on every rank (one all_gather_object)
  describe_layout(cfg, pc)          from a ModelConfig + ParallelConfig, nothing built beyond the meta
                                    device: the planner runs for v3-671b on 2048 ranks in one process.
tests/dist/test_reshard.py checks the two agree on real parallelized models.

Boxes are tuples of (start, stop) per tensor dim: pure integer geometry (parallel/reshard.py).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

Box = tuple[tuple[int, int], ...]



def _dtype(name: str) -> torch.dtype:
    """"bfloat16" → torch.bfloat16 (names as str(dtype) writes them, without "torch.")."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype; the layout file is damaged")
    return dtype


def chunk(start: int, stop: int, parts: int, index: int) -> tuple[int, int]:
    """DTensor's (and FSDP2's) chunk rule: chunk `index` of [start, stop) cut into `parts` chunks of
    ⌈n/parts⌉ elements, the last ones short or empty (empty chunks sit at `stop`)."""
    n = stop - start
    size = math.ceil(n / parts) if n else 0
    lo = min(index * size, n)
    return start + lo, start + min(lo + size, n)


def box_volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


@dataclass(frozen=True)
class Placement:
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    ranks: tuple[int, ...]  # row-major over mesh_shape
    shards: tuple[tuple[int, int], ...] = ()  # (mesh_dim, tensor_dim), in application order

    def __post_init__(self):
        assert len(self.ranks) == math.prod(self.mesh_shape), (self.ranks, self.mesh_shape)
        assert len(self.mesh_dim_names) == len(self.mesh_shape)

    def boxes(self, shape: tuple[int, ...]) -> list[tuple[int, Box]]:
        """(rank, box) for every rank of the device matrix, row-major."""
        out = []
        for rank, coord in zip(self.ranks, itertools.product(*map(range, self.mesh_shape)), strict=True):
            box = [(0, n) for n in shape]
            for mesh_dim, tensor_dim in self.shards:
                box[tensor_dim] = chunk(*box[tensor_dim], self.mesh_shape[mesh_dim], coord[mesh_dim])
            out.append((rank, tuple(box)))
        return out

    def describe(self) -> str:
        """e.g. "S0(tp,dp_shard) R(dp_replicate) on 8 ranks [0..7]"."""
        by_dim: dict[int, list[str]] = {}
        for mesh_dim, tensor_dim in self.shards:
            by_dim.setdefault(tensor_dim, []).append(self.mesh_dim_names[mesh_dim])
        used = {m for m, _ in self.shards}
        parts = [f"S{d}({','.join(names)})" for d, names in sorted(by_dim.items())]
        replicated = [n for i, n in enumerate(self.mesh_dim_names) if i not in used and self.mesh_shape[i] > 1]
        if replicated:
            parts.append(f"R({','.join(replicated)})")
        ranks = sorted(self.ranks)
        contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
        where = f"[{ranks[0]}..{ranks[-1]}]" if contiguous and len(ranks) > 2 else str(ranks)
        return f"{' '.join(parts) or 'full'} on {len(ranks)} rank(s) {where}"


@dataclass
class TensorLayout:
    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: list[Placement] = field(default_factory=list)

    def pieces(self) -> dict[Box, list[int]]:
        """Every distinct non-empty box → the ranks holding it (sorted, no duplicates)."""
        held: dict[Box, set[int]] = {}
        for placement in self.placements:
            for rank, box in placement.boxes(self.shape):
                if box_volume(box):
                    held.setdefault(box, set()).add(rank)
        return {box: sorted(ranks) for box, ranks in held.items()}

    def rank_boxes(self) -> dict[int, list[Box]]:
        """rank → the distinct non-empty boxes it holds."""
        out: dict[int, list[Box]] = {}
        for box, ranks in self.pieces().items():
            for r in ranks:
                out.setdefault(r, []).append(box)
        return out

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Layout:
    """name (full-model state-dict key) → TensorLayout, over `world_size` ranks."""

    world_size: int
    tensors: dict[str, TensorLayout]

    def rank_bytes(self) -> list[int]:
        """Parameter bytes each rank holds."""
        out = [0] * self.world_size
        for t in self.tensors.values():
            for box, ranks in t.pieces().items():
                for r in ranks:
                    out[r] += box_volume(box) * t.element_size
        return out

    def table(self, limit: int | None = None) -> str:
        """One row per tensor: name, global shape, dtype, placements."""
        rows = [(name, "×".join(map(str, t.shape)), str(t.dtype).removeprefix("torch."),
                 " + ".join(p.describe() for p in t.placements)) for name, t in self.tensors.items()]
        shown = rows if limit is None else rows[:limit]
        widths = [max(len(r[i]) for r in [("tensor", "shape", "dtype", "placement"), *shown]) for i in range(3)]
        lines = [f"{'tensor':<{widths[0]}}  {'shape':<{widths[1]}}  {'dtype':<{widths[2]}}  placement"]
        lines += [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in shown]
        if len(shown) < len(rows):
            lines.append(f"... {len(rows) - len(shown)} more tensors")
        return "\n".join(lines)

    # ---------------------------------------------------------------- JSON
    def to_json(self) -> dict:
        """Device matrices are stored once and referenced by index (2048-rank layouts stay small)."""
        meshes: dict[tuple, int] = {}
        tensors = {}
        for name, t in self.tensors.items():
            entries = []
            for p in t.placements:
                key = (p.mesh_shape, p.mesh_dim_names, p.ranks)
                index = meshes.setdefault(key, len(meshes))
                entries.append({"mesh": index, "shards": [list(s) for s in p.shards]})
            tensors[name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                             "placements": entries}
        mesh_list = [{"shape": list(s), "dim_names": list(n), "ranks": list(r)} for (s, n, r) in meshes]
        return {"format": "seekforge-layout-1", "world_size": self.world_size, "meshes": mesh_list,
                "tensors": tensors}

    @classmethod
    def from_json(cls, data: dict) -> Layout:
        if data.get("format") != "seekforge-layout-1":
            raise ValueError(f"not a seekforge layout file (format={data.get('format')!r}); write one with "
                             "Layout.save")
        meshes = [(tuple(m["shape"]), tuple(m["dim_names"]), tuple(m["ranks"])) for m in data["meshes"]]
        tensors = {}
        for name, t in data["tensors"].items():
            placements = [Placement(*meshes[p["mesh"]], tuple(tuple(s) for s in p["shards"])) for p in t["placements"]]
            tensors[name] = TensorLayout(tuple(t["shape"]), _dtype(t["dtype"]), placements)
        return cls(data["world_size"], tensors)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> Layout:
        return cls.from_json(json.loads(Path(path).read_text()))


# ---------------------------------------------------------------------------------- from a model
def tensor_placement(tensor: torch.Tensor, rank: int) -> Placement:
    """The placement of this rank's copy of `tensor`: a DTensor's mesh and placements, or this rank
    alone holding the whole of a plain tensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(tensor, DTensor):
        return Placement((1,), ("rank",), (rank,))
    mesh = tensor.device_mesh
    names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    plain, strided = [], []
    for mesh_dim, p in enumerate(tensor.placements):
        if isinstance(p, _StridedShard):
            # FSDP over a TP/EP shard: the dp split applies to what the later mesh dims left.
            strided.append((mesh_dim, p.dim))
        elif isinstance(p, Shard):
            plain.append((mesh_dim, p.dim))
        elif not isinstance(p, Replicate):
            raise ValueError(f"placement {p} (mesh dim {names[mesh_dim]}) has no layout: only Shard and Replicate "
                             "parameters can be resharded; reduce Partial tensors first")
    return Placement(tuple(mesh.mesh.shape), names, ranks, tuple(plain + strided))


def named_tensors(modules) -> dict[str, list[torch.Tensor]]:
    """Full-model name → this rank's parameters and persistent buffers of that name (a list: a pipeline
    rank of a V schedule holds the embedding twice). Names carry no wrapper prefixes."""
    out: dict[str, list[torch.Tensor]] = {}
    for module in modules if isinstance(modules, list | tuple) else [modules]:
        for name, t in module.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor):  # a module's extra state
                continue
            out.setdefault(name, [])
            if not any(t is seen for seen in out[name]):
                out[name].append(t)
    return out


def layout_of_model(modules) -> Layout:
    """The Layout of a parallelized model (a module, or this rank's pipeline stages) across the
    process group (without one: a single-process model). Every rank calls it; every rank gets the
    same Layout."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    mine = {name: [(tuple(t.shape), str(t.dtype).removeprefix("torch."), tensor_placement(t, rank)) for t in ts]
            for name, ts in named_tensors(modules).items()}
    if not distributed:  # one process: every tensor whole on rank 0
        return _merge([mine], 1)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return _merge(everyone, dist.get_world_size())


def _merge(per_rank: list[dict], world_size: int) -> Layout:
    tensors: dict[str, TensorLayout] = {}
    plain_holders: dict[str, list[int]] = {}
    for rank, mine in enumerate(per_rank):
        for name, entries in mine.items():
            for shape, dtype, placement in entries:
                t = tensors.setdefault(name, TensorLayout(shape, _dtype(dtype)))
                if t.shape != shape:
                    raise ValueError(f"{name} has shape {t.shape} on one rank and {shape} on rank {rank}")
                if placement.mesh_dim_names == ("rank",):
                    plain_holders.setdefault(name, []).append(rank)
                elif placement not in t.placements:
                    t.placements.append(placement)
    for name, holders in plain_holders.items():  # plain copies: one placement, replicated over its holders
        tensors[name].placements.append(Placement((len(holders),), ("replica",), tuple(holders)))
    return Layout(world_size, tensors)


# ---------------------------------------------------------------------------------- described
def mesh_ranks(pc, experts: bool = False) -> tuple[tuple[int, ...], tuple[str, ...], list[int]]:
    """parallel/mesh.py's views as (shape, dim names, row-major global ranks): the dense view
    (pp, dp_replicate, dp_shard, tp) or the experts view (pp, dp_replicate, dp_shard_mod_ep, ep, tp).
    All unflatten the same 1-D world mesh, so rank = row-major index. With expert-TP the experts view
    is the etp one, (pp, dp_replicate, dp_shard_mod_etp, etp, ep, tp). With context parallelism the dense
    view is (pp, dp_replicate, dp_shard_cp, tp): the weights are FSDP-sharded over dp_shard × cp, or
    replicated over the cp ranks without FSDP."""
    if experts and pc.etp > 1:
        return ((pc.pp, pc.dp_replicate, pc.dp_shard // (pc.ep * pc.etp), pc.etp, pc.ep, pc.tp),
                ("pp", "dp_replicate", "dp_shard_mod_etp", "etp", "ep", "tp"), list(range(pc.world_size)))
    if experts:
        return ((pc.pp, pc.dp_replicate, pc.dp_shard * pc.cp // pc.ep, pc.ep, pc.tp),
                ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp"), list(range(pc.world_size)))
    if pc.cp > 1:
        return (pc.pp, pc.dp_replicate, pc.dp_shard * pc.cp, pc.tp), ("pp", "dp_replicate", "dp_shard_cp", "tp"), \
            list(range(pc.world_size))
    return (pc.pp, pc.dp_replicate, pc.dp_shard, pc.tp), ("pp", "dp_replicate", "dp_shard", "tp"), \
        list(range(pc.world_size))


# Expert-TP (parallel/ep.py apply_ep): the stacked experts' intermediate dim, fused gate_up rows and down columns.
_ETP_DIM = (("experts.gate_up_proj", 1), ("experts.down_proj", 2))

# TP rules of parallel/tp.py as (name suffix, tensor dim): colwise Linear weights split rows (dim 0),
# rowwise split columns (dim 1); the embedding is rowwise (vocab rows), the head colwise (vocab rows).
_TP_DIM = (("embed_tokens.weight", 0), ("lm_head.weight", 0), ("self_attn.q_b_proj.weight", 0),
           ("self_attn.q_proj.weight", 0), ("self_attn.kv_b_proj.weight", 0), ("self_attn.o_proj.weight", 1),
           ("gate_proj.weight", 0), ("up_proj.weight", 0), ("down_proj.weight", 1))


def tp_dim(name: str) -> int | None:
    """The tensor dim TP splits for parameter `name`, None when TP leaves it whole. Routed experts
    (stacked `experts.*`) and the router are not TP-split."""
    if ".experts." in name or ".gate.weight" in name:
        return None
    return next((d for suffix, d in _TP_DIM if name.endswith(suffix)), None)


def describe_layout(cfg, pc, dtype: torch.dtype = torch.float32) -> Layout:
    """The Layout `parallelize` (and the pipeline split) would give a model of `cfg` under `pc`, from
    the meta-device model's names and shapes: TP → EP → FSDP/HSDP, one copy per pipeline stage."""
    from seekforge.model.model import build_model
    from seekforge.parallel.pp import stage_ids_of_rank, stage_layer_ranges

    meta = build_model(cfg, device="meta")
    shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items()}
    buffers = {name for name, _ in meta.named_buffers() if name in shapes}  # persistent: whole on every rank
    del meta
    dense_shape, dense_names, world = mesh_ranks(pc)
    expert_shape, expert_names, _ = mesh_ranks(pc, experts=True)
    fsdp = pc.dp_replicate * pc.dp_shard > 1 or pc.ep > 1  # parallelize's rule (a size-1 FSDP splits nothing)
    ranges = stage_layer_ranges(cfg.num_hidden_layers, pc.num_stages, pc.pp_split_points)
    pp_of_stage = {s: p for p in range(pc.pp) for s in stage_ids_of_rank(p, pc)}
    last = pc.num_stages - 1

    def stages_of(name: str) -> list[int]:
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            return [next(s for s, (a, b) in enumerate(ranges) if a <= layer < b)]
        if name.startswith("embed_tokens."):
            return [0, last] if cfg.num_nextn_predict_layers and last != 0 else [0]
        return [last]  # norm, lm_head, mtp

    tensors = {}
    for name, shape in shapes.items():
        experts = ".experts." in name and pc.ep > 1
        mesh_shape, names = (expert_shape, expert_names) if experts else (dense_shape, dense_names)
        steps: list[tuple[int, int]] = []
        if name in buffers:
            pass
        elif pc.tp > 1 and (d := tp_dim(name)) is not None:
            steps.append((names.index("tp"), d))
        if experts and pc.etp > 1:
            steps += [(names.index("etp"), d) for suffix, d in _ETP_DIM if name.endswith(suffix)]
        if experts:
            steps.append((names.index("ep"), 0))
        if fsdp and name not in buffers:
            expert_dp = "dp_shard_mod_etp" if pc.etp > 1 else "dp_shard_mod_ep"
            steps.append((names.index(expert_dp if experts else names[2]), 0))  # names[2]: dp_shard or dp_shard_cp
        placements = []
        for pp_rank in sorted({pp_of_stage[s] for s in stages_of(name)}):
            per_pp = len(world) // pc.pp
            ranks = tuple(world[pp_rank * per_pp:(pp_rank + 1) * per_pp])
            placement = Placement(mesh_shape[1:], names[1:], ranks, tuple((m - 1, d) for m, d in steps))
            if placement not in placements:
                placements.append(placement)
        tensors[name] = TensorLayout(shape, dtype, placements)
    return Layout(pc.world_size, tensors)


def describe_engine_layout(cfg, tp: int = 1, dp_attention: int = 1, ep: int = 1,
                           dtype: torch.dtype = torch.float32) -> Layout:
    """A serving layout over dp_attention · tp ranks: attention, dense MLPs, shared experts, embedding
    and head split by TP (parallel/tp.py's rules) within each of the dp_attention replicas; routed
    experts split over `ep` ranks (dividing the world) and replicated over the rest."""
    from seekforge.model.model import build_model

    world = tp * dp_attention
    if world % ep:
        raise ValueError(f"ep={ep} does not divide the engine's dp_attention*tp={world} ranks; pick ep among "
                         f"the divisors of {world}")
    meta = build_model(cfg, device="meta")
    shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items()}
    buffers = {name for name, _ in meta.named_buffers() if name in shapes}
    ranks = tuple(range(world))
    dense = ((dp_attention, tp), ("dp_attention", "tp"))
    experts = ((world // ep, ep), ("expert_replica", "ep"))
    tensors = {}
    for name, shape in shapes.items():
        if ".experts." in name:
            placement = Placement(*experts, ranks, ((1, 0),) if ep > 1 else ())
        else:
            d = None if name in buffers or tp == 1 else tp_dim(name)
            placement = Placement(*dense, ranks, ((1, d),) if d is not None else ())
        tensors[name] = TensorLayout(shape, dtype, [placement])
    return Layout(world, tensors)
