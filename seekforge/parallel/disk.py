"""The from-disk resharding executor: each rank reads only the slices of a checkpoint its own boxes
need, straight into its local tensors (parallel/transfer.py's `Shards`: {name: [(box, tensor)]}).

  read_hf_shards(path, shards)    HF safetensors (one file or an index of shards): safetensors'
                                  `get_slice` reads just the rows/columns of each stored tensor that
                                  meet a box; per-expert tensors land in their slice of the stacked
                                  expert weights (model/hf.py's name mapping); FP8 weights bring
                                  only the block scales covering the slice.
  read_dcp_shards(path, shards)   a DCP checkpoint (train/checkpoint.py): a DCP LoadPlanner asks for
                                  exactly these boxes; DCP's own resharding picks the stored chunks
                                  that overlap them and reads only those.
Both return the bytes this rank read, which tests compare with the bytes its boxes hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from seekforge.config import ModelConfig
from seekforge.model.hf import FP8_BLOCK, hf_layout, open_shard, shard_files, tensor_files
from seekforge.model.model import build_model
from seekforge.parallel.layout import Box
from seekforge.parallel.reshard import intersect
from seekforge.parallel.transfer import Shards, _region


# ---------------------------------------------------------------------------------- safetensors
def _slot_box(index: tuple, shape: tuple[int, ...]) -> tuple[Box, list[int]]:
    """Where an HF tensor sits in its seekforge tensor: model/hf.py's Slot index (e.g. (expert,
    slice(0, I))) → the box, and the seekforge dims the HF tensor keeps (integer indices drop one)."""
    box, kept = [], []
    for d, n in enumerate(shape):
        i = index[d] if d < len(index) else slice(None)
        if isinstance(i, int):
            box.append((i, i + 1))
        else:
            start, stop, _ = i.indices(n)
            box.append((start, stop))
            kept.append(d)
    return tuple(box), kept


@torch.no_grad()
def read_hf_shards(path: str | Path, shards: Shards) -> int:
    """Fill `shards` from the HF checkpoint at `path`, reading only the needed slices (bf16, fp32, or
    official FP8: the slice plus the 128×128-block scales that cover it, dequantized on read)."""
    path = Path(path)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    model = build_model(cfg, device="meta")  # names and shapes only
    layout = hf_layout(model)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    files, _ = shard_files(path)
    where = tensor_files(files)
    wanted = {hf: slot for hf, slot in layout.items() if slot.target in shards and not slot.copy_of_shared}
    missing = sorted({slot.target for hf, slot in wanted.items() if hf not in where})
    if missing:
        raise ValueError(f"{path} lacks tensors for {missing[:3]}; it holds a different model than this one")
    read = 0
    by_file: dict[Path, list[str]] = {}
    for hf in wanted:
        by_file.setdefault(where[hf], []).append(hf)
    for file, names in by_file.items():
        with open_shard(file) as f:
            for hf in names:
                slot = wanted[hf]
                source_box, kept = _slot_box(slot.index, shapes[slot.target])
                stored = f.get_slice(hf)
                fp8 = stored.get_dtype() == "F8_E4M3"
                for box, target in shards[slot.target]:
                    region = intersect(box, source_box)
                    if region is None:
                        continue
                    index = tuple(slice(region[d][0] - source_box[d][0], region[d][1] - source_box[d][0])
                                  for d in kept)  # into the stored tensor's own dims
                    value = stored[index]
                    read += value.numel() * value.element_size()
                    if fp8:
                        scale = _scale_blocks(hf, file, where, index)
                        read += scale.numel() * scale.element_size()
                        value = _dequantize_slice(value, scale, index)
                    _region(target, region, box).copy_(value.reshape([b - a for a, b in region]))
    return read


def _scale_blocks(hf: str, file: Path, where: dict[str, Path], index: tuple[slice, ...]) -> torch.Tensor:
    """The 128×128-block scales (`<name>_scale_inv`) covering rows/cols `index` of an FP8 weight."""
    name = f"{hf}_scale_inv"
    if name not in where:
        raise ValueError(f"FP8 tensor {hf!r} in {file} has no {name!r}; an official FP8 checkpoint stores one "
                         "per weight: re-download the shard that holds it")
    blocks = tuple(slice(i.start // FP8_BLOCK, -(-i.stop // FP8_BLOCK)) for i in index)
    with open_shard(where[name]) as f:
        return f.get_slice(name)[blocks]


def _dequantize_slice(value: torch.Tensor, scale: torch.Tensor, index: tuple[slice, ...]) -> torch.Tensor:
    """value (rows, cols) fp8 at offsets index[*].start of the weight; scale: the blocks covering it →
    fp32, w = fp8 · scale_inv of its block (model/hf.dequantize_fp8_block on a slice)."""
    (r, c) = (i.start % FP8_BLOCK for i in index)  # the slice's offset inside its first block
    full = scale.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return value.float() * full[r:r + value.shape[0], c:c + value.shape[1]]


# ---------------------------------------------------------------------------------- DCP
class BoxLoadPlanner(DefaultLoadPlanner):
    """Loads the boxes of `shards` ({name: [(box, tensor)]}) from the keys `prefix + name`: DCP
    computes the reads of the stored chunks overlapping each box (`create_read_items_for_chunk_list`)."""

    def __init__(self, shards: Shards, prefix: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.targets = {prefix + name: pieces for name, pieces in shards.items()}
        self.bytes_read = 0

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        missing = [k for k in self.targets if k not in stored]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}; it holds a "
                             "different model (or weights under another prefix)")
        items = []
        for key, pieces in self.targets.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size([a for a, _ in box]),
                                           sizes=torch.Size([b - a for a, b in box])) for box, _ in pieces]
            items += create_read_items_for_chunk_list(key, stored[key], chunks)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.targets[index.fqn][index.index][1]  # index.index: the chunk's position in our list

    def transform_tensor(self, read_item, tensor: torch.Tensor):
        self.bytes_read += tensor.element_size() * int(torch.Size(read_item.lengths).numel())
        return super().transform_tensor(read_item, tensor)


@torch.no_grad()
def read_dcp_shards(path: str | Path, shards: Shards, prefix: str = "model.") -> int:
    """Fill `shards` from a DCP checkpoint directory (train/checkpoint.py stores weights under
    "model."); every rank of the process group calls it. Returns this rank's bytes read."""
    planner = BoxLoadPlanner(shards, prefix)
    dcp.load({}, checkpoint_id=str(path), planner=planner)
    return planner.bytes_read
