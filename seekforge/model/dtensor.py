"""The model code runs on plain tensors; parallel/ swaps some weights and activations for DTensors.
These two views are all the layers above need of a tensor that may be either."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (e.g. its experts of an EP-sharded weight); a plain tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (e.g. a loss under TP's loss_parallel, replicated); a plain tensor as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t
