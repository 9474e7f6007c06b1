"""What recompute costs in FLOPs, per unit of the model (the units, parameter counts and FLOPs
themselves are config/sizes.py's, re-exported here for plan/): the arithmetic that the memory
estimate, the stage balancer and the strategy search share."""

from __future__ import annotations

from seekforge.config import ModelConfig
from seekforge.config.sizes import Unit, model_units, unit_flops

__all__ = ["Unit", "model_units", "recompute_flops", "unit_flops"]


def recompute_flops(cfg: ModelConfig, unit: Unit, tokens: int, seq_len: int, mode: str) -> float:
    """Forward FLOPs a recompute mode runs again in backward (parallel/recompute.py): "full" the
    whole block, "selective" the attention module (projections and core) and the routed experts."""
    if mode == "none" or unit.kind in ("embed", "head"):
        return 0.0
    forward, _ = unit_flops(cfg, unit, tokens, seq_len)
    if unit.kind == "mtp":
        forward -= 2.0 * tokens * cfg.vocab_size * cfg.hidden_size  # its head call is outside the block
    if mode == "full":
        return forward
    core = 2.0 * tokens * seq_len * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    return 2.0 * tokens * (unit.attn_params + unit.active_expert_params) + core
