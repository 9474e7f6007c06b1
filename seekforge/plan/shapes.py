"""Per-layer parameter counts and training FLOPs from a ModelConfig alone: the arithmetic that the
memory estimate, the stage balancer and the strategy search share.

A model is a list of `Unit`s in forward order: the embedding, the main layers (dense or MoE), the
final norm with the head, then each MTP module (its block, projections, norms, and a second call of
the shared head). Sums over units equal `ModelConfig.num_params()` (tests/plan/test_shapes.py).

FLOPs follow the PaLM appendix B convention (as train/flops.py): a matmul of an (n, k) by a (k, m)
costs 2nkm forward and twice that backward (input gradient + weight gradient, equal halves); the
attention core QKᵀ and PV is counted over the full T×T square (causality not discounted).
"""

from __future__ import annotations

from dataclasses import dataclass

from seekforge.config import ModelConfig


@dataclass(frozen=True)
class Unit:
    """One piece of the model a pipeline stage can hold, with its parameter groups (elements)."""

    kind: str  # "embed", "dense", "moe", "head", "mtp"
    layer_id: int  # main layer id; MTP: num_hidden_layers + depth; embed: -1; head: num_hidden_layers
    attn_params: int = 0
    dense_params: int = 0  # every other non-expert parameter (dense MLP, shared experts, router, norms, head)
    expert_params: int = 0  # routed experts (sharded by EP)

    @property
    def params(self) -> int:
        return self.attn_params + self.dense_params + self.expert_params


def attention_params(cfg: ModelConfig) -> int:
    """MLA projections and its two inner norms, plus the block's two RMSNorms."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q = h * nh * cfg.qk_head_dim
    else:
        q = h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * nh * cfg.qk_head_dim
    kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    kv += cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + nh * cfg.v_head_dim * h + 2 * h


def block_unit(cfg: ModelConfig, layer_id: int, kind: str | None = None) -> Unit:
    h = cfg.hidden_size
    moe = cfg.n_routed_experts > 0 and (layer_id >= cfg.num_hidden_layers or cfg.is_moe_layer(layer_id))
    if not moe:
        return Unit(kind or "dense", layer_id, attention_params(cfg), 3 * h * cfg.intermediate_size)
    expert = 3 * h * cfg.moe_intermediate_size
    router = cfg.n_routed_experts * h  # the bias is a buffer in seekforge (num_params counts it: + E)
    shared = cfg.n_shared_experts * expert
    return Unit(kind or "moe", layer_id, attention_params(cfg), router + cfg.n_routed_experts + shared,
                cfg.n_routed_experts * expert)


def model_units(cfg: ModelConfig) -> list[Unit]:
    """embed, layers 0..L-1, head (final norm + lm_head), MTP modules (block + eh_proj + 3 norms)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    units = [Unit("embed", -1, dense_params=v * h)]
    units += [block_unit(cfg, i) for i in range(cfg.num_hidden_layers)]
    units.append(Unit("head", cfg.num_hidden_layers, dense_params=h + (0 if cfg.tie_word_embeddings else v * h)))
    for k in range(cfg.num_nextn_predict_layers):
        block = block_unit(cfg, cfg.num_hidden_layers + k, "mtp")
        units.append(Unit("mtp", block.layer_id, block.attn_params, block.dense_params + 2 * h * h + 3 * h,
                          block.expert_params))
    return units


def unit_flops(cfg: ModelConfig, unit: Unit, tokens: int, seq_len: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of one unit over `tokens` tokens in sequences of `seq_len`."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    if unit.kind == "embed":
        return 0.0, 0.0
    if unit.kind == "head":
        fwd = 2.0 * tokens * cfg.vocab_size * h
        return fwd, 2 * fwd
    matmul = unit.attn_params + unit.dense_params  # every non-expert weight is a matmul's, to first order
    if unit.expert_params:
        active = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
        matmul += active - cfg.n_routed_experts  # the routed experts a token visits; minus the bias buffer
    fwd = 2.0 * tokens * matmul + 2.0 * tokens * seq_len * nh * (cfg.qk_head_dim + cfg.v_head_dim)
    if unit.kind == "mtp":
        fwd += 2.0 * tokens * cfg.vocab_size * h  # its call of the shared head
    return fwd, 2 * fwd


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token, MTP included."""
    return sum(sum(unit_flops(cfg, u, 1, seq_len)) for u in model_units(cfg))


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
    experts = 2.0 * tokens * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return 2.0 * tokens * unit.attn_params + core + (experts if unit.expert_params else 0.0)
