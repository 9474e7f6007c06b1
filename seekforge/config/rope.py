"""YaRN's scalar math (arXiv:2309.00071): the context-extension factor and the attention-entropy mscale."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from seekforge.config.model import ModelConfig


def rope_type(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(cfg: ModelConfig) -> float:
    rope = cfg.rope_scaling or {}
    factor = rope.get("factor")
    if factor is None:  # DeepSeek convention: ratio of the extended to the original context
        factor = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
    return float(factor)
