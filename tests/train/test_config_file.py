import pytest
import yaml

from seekforge.config import TrainConfig
from seekforge.train.config_file import config_to_dict, load_train_config, parse_overrides


def _write_toml(cfg_dict: dict, path):
    lines, tables = [], []
    for key, value in cfg_dict.items():
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    for name, table in tables:
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")


def _toml_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


@pytest.fixture
def custom():
    return TrainConfig(preset="tiny", model={"num_hidden_layers": 2}, steps=7, lr=1e-3, min_lr=1e-5,
                       schedule="wsd", betas=(0.9, 0.99), compile=True, out_dir="runs/x")


def test_yaml_round_trip(tmp_path, custom):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(custom)))
    assert load_train_config(path) == custom


def test_toml_round_trip(tmp_path, custom):
    path = tmp_path / "c.toml"
    _write_toml(config_to_dict(custom), path)
    assert load_train_config(path) == custom


def test_overrides_win_over_the_file(tmp_path, custom):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(custom)))
    cfg = load_train_config(path, ["steps=9", "model.hidden_size=32", "betas=[0.8, 0.9]", "compile=false"])
    assert cfg.steps == 9 and cfg.betas == (0.8, 0.9) and cfg.compile is False
    assert cfg.model == {"num_hidden_layers": 2, "hidden_size": 32}  # merged, not replaced
    assert parse_overrides(["lr=1e-3"]) == {"lr": "1e-3"}  # YAML 1.1 leaves it a string...
    assert load_train_config(None, ["lr=1e-3"]).lr == 1e-3  # ...the float field accepts it


def test_unknown_key_names_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stpes: 10\n")
    with pytest.raises(ValueError, match="stpes"):
        load_train_config(path)
    with pytest.raises(ValueError, match="learning_rate"):
        load_train_config(None, ["learning_rate=1"])
    with pytest.raises(ValueError, match="hidden_sise"):
        load_train_config(None, ["model.hidden_sise=8"])


@pytest.mark.parametrize("override, match", [
    ("steps=ten", "TrainConfig.steps='ten': expected an integer"),
    ("steps=0", "steps=0: must be a positive integer"),
    ("lr=fast", "expected a number"),
    ("schedule=linear", "use 'cosine' or 'wsd'"),
    ("dtype=fp16", "use 'auto'"),
    ("compile=1", "expected true or false"),
    ("betas=[0.9, 1.5]", "two numbers in"),
    ("min_lr=1.0", "min_lr <= lr"),
    ("preset=huge", "choose one of"),
    ("model.num_experts_per_tok=99", "num_experts_per_tok"),
    ("oops", "not key=value"),
])
def test_bad_values_are_clear_value_errors(override, match):
    with pytest.raises(ValueError, match=match.replace("[", r"\[").replace("(", r"\(")):
        load_train_config(None, [override])


def test_unparsable_file_and_wrong_extension(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text("steps = = 3\n")
    with pytest.raises(ValueError, match="does not parse"):
        load_train_config(bad)
    json_file = tmp_path / "c.json"
    json_file.write_text("{}")
    with pytest.raises(ValueError, match=".yaml, .yml or .toml"):
        load_train_config(json_file)


def test_parallel_table_and_flag(tmp_path):
    from seekforge.config import parse_parallel

    path = tmp_path / "c.yaml"
    path.write_text("preset: tiny\nrecompute: full\nparallel:\n  dp_shard: 2\n  tp: 2\n")
    cfg = load_train_config(path, ["parallel.ep=2"])
    pc = cfg.parallel_config()
    assert (pc.dp_shard, pc.tp, pc.ep, pc.recompute) == (2, 2, 2, "full")  # recompute defaults to the run's
    assert parse_parallel("dp_shard=2,pp_split_points=[2,4],pp_schedule=1F1B") == dict(
        dp_shard=2, pp_split_points=[2, 4], pp_schedule="1F1B")
    with pytest.raises(ValueError, match=r"parallel has unknown key\(s\) \['tpp'\]"):
        load_train_config(None, ["parallel.tpp=2"])
