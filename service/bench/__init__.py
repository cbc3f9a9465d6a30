"""Benchmarks and load tools: they measure a server from the outside or the steps in-process.
No serving module imports this package. Measurements and how to run each: docs/BENCHMARKS.md.

``stepserve bench …`` and ``stepserve soak …`` reach :func:`main` and
:func:`service.bench.soak.main` through the CLI, whose ``main()`` loads OpenBLAS before
anything imports MLX; each tool is imported only when it runs.
"""

from __future__ import annotations

import argparse
import importlib

#: ``stepserve bench FORM …``: the module under :mod:`service.bench` whose ``main`` runs it.
FORMS = {
    "steps": "steps",
    "ab": "ab",
    "settings-ab": "settings_ab",
    "profile": "profile",
    "pipeline": "pipeline",
    "group": "group",
    "gguf-storage": "gguf_storage",
    "hit-profile": "hit_profile",
    "prefix-ttft": "prefix_ttft",
    "moe": "moe",
    "random-model": "random_model",
    "kv-bits": "kv_bits",
    "routes": "routes",
    "embeddings": "embeddings",
}


def main(argv: list[str]) -> int:
    """``stepserve bench ARGV``: dispatch on the form and return the tool's exit code.

    * ``steps …``: one prefill and decode step per dtype, weight format and compile mode
      (:mod:`service.bench.steps`);
    * ``profile …``: where a decode step's time goes (:mod:`service.bench.profile`);
    * ``ab …``: two running servers, the same requests alternating (:mod:`service.bench.ab`);
    * ``settings-ab …``: two serve configurations (or source trees) of one model, fresh servers
      started in alternating order (``--together``: both up, paired rounds), the same load on
      each, B / A (:mod:`service.bench.settings_ab`);
    * ``pipeline …``: one process against pipeline ranks per decode step (:mod:`service.bench.pipeline`);
    * ``group …``: one ``stepserve serve`` against a ``stepserve launch`` group, through HTTP
      (:mod:`service.bench.group`);
    * ``hit-profile …``: a prefix-cache hit's prefill iteration, part by part, against a
      decode step (:mod:`service.bench.hit_profile`);
    * ``prefix-ttft …``: a prefix-sharing request's TTFT through the paged pool's blocks, the
      static prefix cache and no reuse, in-process (:mod:`service.bench.prefix_ttft`);
    * ``moe …``: a random Qwen3-MoE's decode step against mlx-lm's (:mod:`service.bench.moe`);
    * ``gguf-storage …``: a K-quant GGUF kept dense or re-quantized (:mod:`service.bench.gguf_storage`);
    * ``random-model …``: a model directory of mlx-lm's class at a named shape with random weights
      (:mod:`service.bench.random_model`);
    * ``kv-bits …``: quantized KV (``kv_bits``) against full precision, greedy agreement free-running
      and teacher-forced, and the pool's bytes per token (:mod:`service.bench.kv_bits`);
    * ``routes …``: tokens/s of streams spread over ``/v1/chat/completions``, ``/v1/messages``
      (with tools) and ``/v1/responses`` against all on chat completions, one server
      (:mod:`service.bench.routes`);
    * ``embeddings …``: the embedding engine's texts/s per batch size against
      sentence-transformers, in-process (:mod:`service.bench.embeddings`);
    * ``… --micro …``: plain against compiled, in-process (:mod:`service.bench.micro`);
    * ``… --side-by-side …``: stepserve against its peers (:mod:`service.bench.compare`);
    * ``… --workload long-arrival …``: stalls while a long prompt prefills
      (:mod:`service.bench.long_arrival`);
    * ``… --workload first-burst …``: a just-ready server's first burst against its second
      (:mod:`service.bench.first_burst`);
    * anything else: the HTTP load generator (:mod:`service.bench.load`).
    """
    if argv[:1] and argv[0] in FORMS:
        module = importlib.import_module(f"service.bench.{FORMS[argv[0]]}")
        return module.main(argv[1:])
    if "--micro" in argv:
        from service.bench.micro import main as micro

        return micro(argv)
    if "--side-by-side" in argv:
        from service.bench.compare import main as side_by_side

        return side_by_side(argv)
    workload = _workload(argv)
    if workload == "long-arrival":
        from service.bench.long_arrival import main as long_arrival

        return long_arrival(argv)
    if workload == "first-burst":
        from service.bench.first_burst import main as first_burst

        return first_burst(argv)
    from service.bench.load import main as load

    return load(argv)


def _workload(argv: list[str]) -> str | None:
    """The value of ``--workload`` in ``argv`` (spelled as argparse would accept it), or None."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--workload")
    return parser.parse_known_args(argv)[0].workload
