"""`seekforge info`: a model's size from its config alone (nothing is allocated)."""

from __future__ import annotations

from seekforge.config import CONFIG_HELP, PRESETS, ModelConfig, model_config_of, preset


def add_arguments(p):
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), help="a built-in config")
    src.add_argument("--config", help=CONFIG_HELP)


def describe(cfg: ModelConfig) -> str:
    n = cfg.num_params()
    bytes_bf16 = 2 * (n["total"] + n["mtp"])

    def b(x):
        return f"{x / 1e9:.1f}B" if x >= 1e8 else f"{x / 1e6:.2f}M"

    lines = [
        f"total {b(n['total'])} parameters (main model, MTP excluded)",
        f"activated {b(n['active'])} per token ({cfg.num_experts_per_tok} of {cfg.n_routed_experts} "
        f"routed experts + {cfg.n_shared_experts} shared)",
        f"mtp {b(n['mtp'])} in {cfg.num_nextn_predict_layers} MTP module(s) (embedding and head shared)",
        f"layers {cfg.num_hidden_layers} ({cfg.first_k_dense_replace} dense, {cfg.num_moe_layers} MoE), "
        f"hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}, vocab {cfg.vocab_size}",
        f"latent KV cache {cfg.kv_lora_rank + cfg.qk_rope_head_dim} values/token/layer "
        f"(vs {cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)} for MHA)",
        f"weights in bf16 {bytes_bf16 / 2**30:.1f} GiB",
    ]
    return "\n".join(lines)


def run(args):
    if args.config:
        cfg = model_config_of(args.config)
    else:
        cfg = preset(args.preset or "tiny")
    print(describe(cfg))
