"""The server's settings: each package's frozen config, composed as a section, and resolved at the edge.

Sources, later ones winning: each config class's own defaults (the one place they live), an optional
user YAML (`--config FILE`), `RAGBLEND_*` env vars, CLI flags. Nested fields are reached from the
environment with a double underscore, e.g. `RAGBLEND_BLEND__RECOMPUTE_RATIO=0.3` or `RAGBLEND_SERVER__PORT=9000`.

| section | config class (its package owns it) |
| --- | --- |
| model, blend, generation | `blend_engine.config`: ModelConfig, BlendConfig, GenerationConfig |
| store | `kv_store.config.StoreConfig` |
| retrieval, database | `retrieval.config`: RetrievalConfig, DatabaseConfig |
| scheduler | `runtime.config.SchedulerConfig` |
| server, limits | `app.config`: ServerConfig, LimitsConfig |

Only the edge (the app's component builder, the CLI, the benchmarks, the tests) imports this module; the
packages take their own config and never the whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from app.config import LimitsConfig, ServerConfig
from blend_engine.config import BlendConfig, GenerationConfig, ModelConfig
from kv_store.config import StoreConfig
from retrieval.config import DatabaseConfig, RetrievalConfig
from runtime.config import SchedulerConfig


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="RAGBLEND_",
        env_nested_delimiter="__",
        yaml_file=[],
        yaml_file_encoding="utf-8",
        extra="forbid",
    )

    data_dir: Annotated[Path, Field(description="Root of the server's persistent state.")] = Path("./data")
    model: ModelConfig = ModelConfig()
    blend: BlendConfig = BlendConfig()
    generation: GenerationConfig = GenerationConfig()
    store: StoreConfig = StoreConfig()
    retrieval: RetrievalConfig = RetrievalConfig()
    database: DatabaseConfig = DatabaseConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    server: ServerConfig = ServerConfig()
    limits: LimitsConfig = LimitsConfig()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Earlier sources win: CLI flags (init) > environment > the YAML file.
        return (init_settings, env_settings, YamlConfigSettingsSource(settings_cls, deep_merge=True))


def load_settings(config_file: Path | str | None = None, **overrides: Any) -> Settings:
    """Settings from the config classes' defaults, then `config_file`, env vars and `overrides` (nested dicts)."""
    if config_file is None:
        return Settings(**overrides)
    path = Path(config_file)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")

    class _FileSettings(Settings):
        model_config = SettingsConfigDict(**{**Settings.model_config, "yaml_file": [path]})

    return Settings.model_validate(_FileSettings(**overrides).model_dump())
