"""DeepSpeed's shape for zerokern: `initialize`, `init_distributed`, the config and schedules."""

from .config import EngineConfig, parse_config
from .config_values import ConfigError
from .engine import NoOptimizerError, NoSyncError, ZeroEngine, init_distributed
from .entry import initialize
from .pipeline_engine import PipelineEngine, PipelineModeError
from .schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["initialize", "init_distributed", "ZeroEngine", "EngineConfig", "parse_config",
           "ConfigError", "NoOptimizerError", "NoSyncError", "WarmupLR", "WarmupDecayLR",
           "WarmupCosineLR", "OneCycle", "LRRangeTest", "PipelineEngine", "PipelineModeError"]
