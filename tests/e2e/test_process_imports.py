"""What a server process imports: serving a hand-written architecture loads no mlx-lm."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def test_serving_a_hand_written_model_never_imports_mlx_lm():
    """mlx-lm's import pulls in transformers and, where installed, torch (seconds of start-up,
    a heavier process, and on a GPU host torch's libraries beside MLX's): a server of the
    default model (a hand-written architecture) builds its engine without any of them. In a
    fresh interpreter, with mlx-lm made unimportable (any import of it fails loudly)."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["mlx_lm"] = None  # an import of mlx-lm now raises
        import service.api.app, service.cli
        from prometheus_client import CollectorRegistry
        from service.config import load_settings
        from service.metrics import Metrics
        from service.process.build import build_engine
        from service.process.startup import check_memory, load_models
        config = load_settings()
        models = load_models(config)
        config = check_memory(config, models)
        served = config.served_models()[0]
        metrics = Metrics(CollectorRegistry(), version="t", device="cpu")
        engine = build_engine(config, served, models[served.name], metrics)
        print(sorted(m for m in ("mlx_lm", "transformers", "torch") if sys.modules.get(m) is not None))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
