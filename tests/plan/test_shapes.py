"""plan/shapes.py's recompute arithmetic (the units and their FLOPs are config/sizes.py's, tested in
tests/model/test_sizes.py)."""

from seekforge.config import preset
from seekforge.plan.shapes import model_units, recompute_flops, unit_flops


def test_recompute_flops_by_mode():
    cfg = preset("small")
    for unit in model_units(cfg):
        if unit.kind not in ("dense", "moe"):
            continue
        forward, _ = unit_flops(cfg, unit, 512, 256)
        assert recompute_flops(cfg, unit, 512, 256, "none") == 0
        assert recompute_flops(cfg, unit, 512, 256, "full") == forward
        assert 0 < recompute_flops(cfg, unit, 512, 256, "selective") < forward
