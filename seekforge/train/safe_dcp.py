"""Reading DCP checkpoints without running code from them.

torch.distributed.checkpoint unpickles twice on load: the `.metadata` file with plain
`pickle.load`, and every non-tensor value (step counters, scheduler and loader state, optimizer
param-group entries) with `torch.load(weights_only=False)`. A checkpoint directory from someone else
could therefore run code. SafeReader reads `.metadata` with an unpickler that can build only DCP's
own metadata classes (the Python docs' "restricting globals"), and SafePlanner reads non-tensor
values with torch's weights-only unpickler. Tensors were already read weights-only by DCP.
"""

from __future__ import annotations

import pickle  # noqa: TID251 — only the restricted unpickler below, which builds DCP's metadata classes alone

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import StorageMeta

from seekforge.errors import CorruptFileError

# Every global a DCP `.metadata` file refers to (collected from checkpoints of plain, FSDP, TP, EP and
# pipeline runs), plus torch dtypes.
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch.strided etc. by name
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
}


class _MetadataUnpickler(pickle.Unpickler):  # noqa: S301 — find_class allows DCP's metadata classes only
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not something a DCP .metadata file holds")


class SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
            raise CorruptFileError(path, f"not a DCP metadata file ({e})",
                                   "it may have been crafted to run code; load only checkpoints you made") from e
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(dcp.DefaultLoadPlanner):
    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)  # noqa: TID251 — weights-only: plain data, no code
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
