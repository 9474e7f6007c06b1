"""Activation recompute, applied from outside to a built model's blocks.

Modes per block: "none"; "full" — keep only the block input, recompute the whole block in backward;
"selective" — recompute the memory-heavy, compute-light parts (attention core with its expanded
per-head K/V, and the routed experts' SwiGLU activations) and keep the rest.
PyTorch's checkpoint_wrapper (non-reentrant) composes with FSDP2, DTensor and torch.compile, and its
state-dict hooks strip the wrapper prefix, so checkpoints keep the plain parameter names.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from seekforge.model.model import block_slots

MODES = ("none", "full", "selective")


def apply_recompute(model: nn.Module, mode: str | list[str]) -> nn.Module:
    """mode: one of MODES for every block, or one mode per block (main layers, then MTP blocks)."""
    slots = block_slots(model)
    modes = [mode] * len(slots) if isinstance(mode, str) else list(mode)
    if len(modes) != len(slots):
        raise ValueError(f"recompute got {len(modes)} modes for {len(slots)} blocks; give one per block")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"recompute mode {m!r} is not one of {MODES}")
    for (container, name), m in zip(slots, modes, strict=True):
        block = getattr(container, name)
        if m == "full":
            setattr(container, name, checkpoint_wrapper(block))
        elif m == "selective":
            block.self_attn = checkpoint_wrapper(block.self_attn)
            if hasattr(block.mlp, "experts"):
                block.mlp.experts = checkpoint_wrapper(block.mlp.experts)
    return model
