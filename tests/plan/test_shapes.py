"""plan/shapes.py's per-unit arithmetic against the config's own parameter count and train/flops.py."""

import pytest

from seekforge.config import PRESETS, preset
from seekforge.plan.shapes import flops_per_token, model_units
from seekforge.train.flops import flops_per_token as train_flops_per_token


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_units_add_up_to_num_params(name):
    cfg = preset(name)
    units = model_units(cfg)
    counts = cfg.num_params()
    assert sum(u.params for u in units if u.kind != "mtp") == counts["total"]
    assert sum(u.params for u in units if u.kind == "mtp") == counts["mtp"]
    assert [u.kind for u in units].count("moe") == cfg.num_moe_layers


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_flops_match_the_mfu_convention(name):
    """The same PaLM convention as train/flops.py; they differ only by norm weights (elementwise,
    not matmuls) that the per-unit count includes: < 1e-4 relative."""
    cfg = preset(name)
    assert flops_per_token(cfg, 4096) == pytest.approx(train_flops_per_token(cfg, 4096), rel=1e-4)


def test_recompute_flops_by_mode():
    from seekforge.plan.shapes import recompute_flops, unit_flops

    cfg = preset("small")
    for unit in model_units(cfg):
        if unit.kind not in ("dense", "moe"):
            continue
        forward, _ = unit_flops(cfg, unit, 512, 256)
        assert recompute_flops(cfg, unit, 512, 256, "none") == 0
        assert recompute_flops(cfg, unit, 512, 256, "full") == forward
        assert 0 < recompute_flops(cfg, unit, 512, 256, "selective") < forward
