"""Pipeline parallelism against one process: two ranks started by the real ``mlx.launch`` (ring
backend over 127.0.0.1, CPU) each load only their stage and run the scenario of
tests/pipeline_ranks.py (prefill, decode steps with per-row positions across a capacity move,
a chunked prefill); rank 0's logits and greedy tokens must equal those of the whole model run
in this process, and each rank's MLX memory must hold its stage, not the model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from models.default import default_model_path
from models.loader import load_model
from service.bench.servers import free_ports
from tests.pipeline_ranks import Steps, scenario
from tests.support import ROOT, write_dir

LAUNCH = str(Path(sys.executable).parent / "mlx.launch")


def launch(model: Path, out: Path, timeout: float = 240) -> None:
    """Two ranks on loopback; fails with their output if they fail or do not finish in time
    (then the launcher and both ranks, its process group, are killed)."""
    port = free_ports(2)  # the ring backend listens on port and port + 1
    command = [LAUNCH, "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1", "--starting-port", str(port)]
    command += ["--", sys.executable, "-m", "tests.pipeline_ranks", str(model), str(out)]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the ranks did not finish in {timeout} s:\n{output}")
    assert proc.returncode == 0 and (out / "logits.safetensors").is_file(), output


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A random Llama of 5 layers (an odd split) with an untied head."""
    directory = tmp_path_factory.mktemp("tiny") / "tiny5"
    write_dir(directory, model_keys={"num_hidden_layers": 5, "tie_word_embeddings": False})
    return directory


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_two_ranks_give_one_process_logits_and_hold_their_stage(which, tiny, tmp_path):
    model = tiny if which == "tiny" else default_model_path()
    launch(model, tmp_path)
    whole = load_model(model, which, mx.float32, "dequantized")
    expected = scenario(Steps(whole.args, whole.params, None))
    got = mx.load(str(tmp_path / "logits.safetensors"))
    assert isinstance(got, dict) and len(got) == len(expected) == 10  # 1 prefill, 6 + 2 decodes, 1 chunked
    for i, want in enumerate(expected):
        have = got[f"{i:03d}"]
        assert have.shape == want.shape and mx.allclose(have, want, atol=1e-4).item(), (i, mx.abs(have - want).max())
        assert mx.array_equal(mx.argmax(have, -1), mx.argmax(want, -1)).item(), i  # the same greedy tokens

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[1]["stage"][0] == 0 and ranks[1]["stage"][1] == ranks[0]["stage"][0]  # rank 1 runs the first layers
    assert ranks[0]["stage"][1] == whole.args.num_hidden_layers
    for rank in ranks:
        assert rank["whole_bytes"] == whole.nbytes
        # Only the stage is in MLX memory (a few KB of step inputs aside): never the whole file.
        assert rank["stage_bytes"] <= rank["active_bytes"] < rank["stage_bytes"] + (1 << 20), rank
        assert rank["active_bytes"] < 0.7 * whole.nbytes, rank
