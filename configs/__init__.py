"""Typed settings (pydantic-settings) and the default YAML."""

from configs.settings import (
    BlendSettings,
    DecodeCache,
    DeviationKind,
    GenerationSettings,
    ModelSettings,
    PrefillMode,
    HeadReduce,
    ScoreCombine,
    SelectionKind,
    Settings,
    SinkMode,
    WeightFormat,
    load_settings,
)

__all__ = [
    "BlendSettings",
    "DecodeCache",
    "DeviationKind",
    "GenerationSettings",
    "ModelSettings",
    "PrefillMode",
    "HeadReduce",
    "ScoreCombine",
    "SelectionKind",
    "Settings",
    "SinkMode",
    "WeightFormat",
    "load_settings",
]
