"""Parameter counts and training FLOPs from a ModelConfig alone (no tensors): the one computation behind
`ModelConfig.num_params`, the MFU of a training run, and `seekforge plan`'s memory estimate, stage
balancer and strategy search.

A model is a list of `Unit`s in forward order: the embedding, the main layers (dense or MoE), the
final norm with the head, then each MTP module (its block, projections, norms, and a second call of
the shared head). tests/model/test_sizes.py checks every unit against a built model's parameters.

FLOPs follow the PaLM appendix B convention (as torchtitan): a matmul of an (n, k) by a (k, m) costs
2nkm forward and twice that backward (input gradient + weight gradient, equal halves); the attention
core QKᵀ and PV is counted over the full T×T square (causality not discounted), and recompute is not
counted: MFU measures useful model work, not the hardware's total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from seekforge.config.model import ModelConfig


@dataclass(frozen=True)
class Unit:
    """One piece of the model a pipeline stage can hold, with its parameter groups (elements)."""

    kind: str  # "embed", "dense", "moe", "head", "mtp"
    layer_id: int  # main layer id; MTP: num_hidden_layers + depth; embed: -1; head: num_hidden_layers
    attn_params: int = 0
    dense_params: int = 0  # every other non-expert parameter (dense MLP, shared experts, router, norms, head)
    expert_params: int = 0  # routed experts (sharded by EP)
    active_expert_params: int = 0  # the routed experts one token visits: num_experts_per_tok of them

    @property
    def params(self) -> int:
        return self.attn_params + self.dense_params + self.expert_params

    @property
    def active_params(self) -> int:
        return self.attn_params + self.dense_params + self.active_expert_params


def attention_params(cfg: ModelConfig) -> int:
    """MLA projections and its two inner norms, plus the block's two RMSNorms."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q = h * nh * cfg.qk_head_dim  # q_proj
    else:  # q_a_proj, q_a_layernorm, q_b_proj
        q = h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * nh * cfg.qk_head_dim
    # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
    kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    kv += cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + nh * cfg.v_head_dim * h + 2 * h  # + o_proj, input and post-attention norms


def block_unit(cfg: ModelConfig, layer_id: int, kind: str | None = None) -> Unit:
    h = cfg.hidden_size
    if not cfg.is_moe_layer(layer_id):  # an MTP block too, by its layer id (as in the model and HF's)
        return Unit(kind or "dense", layer_id, attention_params(cfg), 3 * h * cfg.intermediate_size)
    expert = 3 * h * cfg.moe_intermediate_size
    # The router's weight and its bias: a buffer in seekforge, but a tensor of the HF checkpoint
    # (e_score_correction_bias), so it counts as a parameter here.
    router = cfg.n_routed_experts * h + cfg.n_routed_experts
    shared = cfg.n_shared_experts * expert
    return Unit(kind or "moe", layer_id, attention_params(cfg), router + shared,
                cfg.n_routed_experts * expert, cfg.num_experts_per_tok * expert)


def model_units(cfg: ModelConfig) -> list[Unit]:
    """embed, layers 0..L-1, head (final norm + lm_head), MTP modules (block + eh_proj + 3 norms)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    units = [Unit("embed", -1, dense_params=v * h)]
    units += [block_unit(cfg, i) for i in range(cfg.num_hidden_layers)]
    units.append(Unit("head", cfg.num_hidden_layers, dense_params=h + (0 if cfg.tie_word_embeddings else v * h)))
    # An MTP module: enorm + hnorm + eh_proj + one (MoE) block + its final norm; the embedding and the
    # head are shared with the main model.
    for k in range(cfg.num_nextn_predict_layers):
        block = block_unit(cfg, cfg.num_hidden_layers + k, "mtp")
        units.append(Unit("mtp", block.layer_id, block.attn_params, block.dense_params + 2 * h * h + 3 * h,
                          block.expert_params, block.active_expert_params))
    return units


def num_params(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts: "total" and "active" (routed experts counted K of E) of the main model,
    and "mtp", the MTP modules' own."""
    units = model_units(cfg)
    main = [u for u in units if u.kind != "mtp"]
    return {"total": sum(u.params for u in main), "active": sum(u.active_params for u in main),
            "mtp": sum(u.params for u in units if u.kind == "mtp")}


def unit_flops(cfg: ModelConfig, unit: Unit, tokens: int, seq_len: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of one unit over `tokens` tokens in sequences of `seq_len`."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    if unit.kind == "embed":
        return 0.0, 0.0  # a lookup
    if unit.kind == "head":
        fwd = 2.0 * tokens * cfg.vocab_size * h
        return fwd, 2 * fwd
    # Every non-expert weight is a matmul's, to first order (norms are elementwise); the router's bias is not.
    matmul = unit.active_params - (cfg.n_routed_experts if unit.expert_params else 0)
    fwd = 2.0 * tokens * matmul + 2.0 * tokens * seq_len * nh * (cfg.qk_head_dim + cfg.v_head_dim)
    if unit.kind == "mtp":
        fwd += 2.0 * tokens * cfg.vocab_size * h  # its call of the shared head
    return fwd, 2 * fwd


def flops_per_token(cfg: ModelConfig, seq_len: int, with_mtp: bool = True) -> float:
    """Training (forward + backward) FLOPs per token; `with_mtp`: the MTP modules' too (a run whose
    mtp_loss_scale is 0 skips them)."""
    return sum(sum(unit_flops(cfg, u, 1, seq_len)) for u in model_units(cfg) if with_mtp or u.kind != "mtp")
