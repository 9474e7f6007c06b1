"""Configuration dataclasses, one module per concern; every name is importable from `seekforge.config`.

- model.py: `ModelConfig` (the keys of a DeepSeek-V3 `config.json`), `PRESETS`, `preset`
- sizes.py: parameter counts and training FLOPs per unit of the model
- parallel.py: `ParallelConfig`, the pipeline schedules, `parse_parallel`
- train.py: `TrainConfig`, `OptimizerConfig`, `parse_split`
- engine.py: `EngineConfig`, `parse_bytes`
- files.py: `read_config_file`, `model_config_of`

This package imports nothing from seekforge but `seekforge.errors`: every other layer builds on it.
"""

from seekforge.config.engine import EngineConfig, parse_bytes
from seekforge.config.files import CONFIG_HELP, model_config_of, read_config_file
from seekforge.config.model import PRESETS, ModelConfig, preset, rope_type
from seekforge.config.parallel import MULTI_STAGE_SCHEDULES, PIPELINE_SCHEDULES, ParallelConfig, parse_parallel
from seekforge.config.train import OptimizerConfig, TrainConfig, parse_split

__all__ = [
    "CONFIG_HELP", "MULTI_STAGE_SCHEDULES", "PIPELINE_SCHEDULES", "PRESETS", "EngineConfig", "ModelConfig",
    "OptimizerConfig", "ParallelConfig", "TrainConfig", "model_config_of", "parse_bytes", "parse_parallel",
    "parse_split", "preset", "read_config_file", "rope_type",
]
