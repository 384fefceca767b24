"""The training runtime: DeepSpeed config, engine setup, save/load with client state, launch.

This package imports torch and DeepSpeed; the reader/consolidator side of dsckpt never does.
"""
from .config import PRESETS, build_config, resolve_config

__all__ = ["PRESETS", "build_config", "resolve_config"]
