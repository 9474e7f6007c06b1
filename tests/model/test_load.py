"""model/load.py: what `--model` names, resolved the same way with and without reading the weights."""

import json

import pytest

from seekforge.config import preset
from seekforge.errors import UserError
from seekforge.model.hf import save_hf
from seekforge.model.load import checkpoint_config, load_model
from seekforge.model.model import build_model


def test_checkpoint_config_is_the_config_load_model_builds(tmp_path):
    """transformers drops MTP layers when it saves: a config.json that still counts one is served without it,
    whether the weights are read whole (load_model) or rank by rank (serve/distributed, checkpoint_config)."""
    save_hf(build_model(preset("tiny", num_nextn_predict_layers=0), seed=0), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.warns(UserWarning, match="num_nextn_predict_layers=0"):
        cfg = checkpoint_config(str(tmp_path))
    with pytest.warns(UserWarning):
        model, _ = load_model(str(tmp_path))
    assert cfg == model.cfg and cfg.num_nextn_predict_layers == 0
    assert checkpoint_config("tiny") == preset("tiny")


def test_checkpoint_config_says_what_a_run_directory_is(tmp_path):
    save_hf(build_model(preset("tiny"), seed=0), tmp_path / "hf")
    with pytest.raises(UserError, match="training run directory; its HF export is"):
        checkpoint_config(str(tmp_path))
    with pytest.raises(ValueError, match="neither a preset"):
        checkpoint_config(str(tmp_path / "nowhere"))
