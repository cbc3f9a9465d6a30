"""``stepserve bench moe``: its interleaved rounds and their summary."""

import json

import pytest

from service.bench import moe


def test_summary_is_the_ratio_of_medians_with_the_per_round_spread():
    rounds = [
        {"stepserve": {"pipelined_step_s": s}, "mlx_lm": {"pipelined_step_s": m}}
        for s, m in [(1.0, 2.0), (2.0, 2.0), (4.0, 2.0)]
    ]
    summary = moe.summarize(rounds)
    assert summary["stepserve"] == {"pipelined_step_s": 2.0}
    assert summary["mlx_lm"] == {"pipelined_step_s": 2.0}
    assert summary["mlx_lm_over_stepserve"] == 1.0
    assert (summary["ratio_min"], summary["ratio_max"]) == (0.5, 2.0)
    assert [r["mlx_lm_over_stepserve"] for r in summary["rounds"]] == [2.0, 1.0, 0.5]


def test_tiny_run_writes_every_round(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(moe, "machine_info", lambda in_process: {})  # platform.processor() runs uname
    out = tmp_path / "moe.json"
    argv = "--layers 1 --experts 4 --top-k 2 --hidden 64 --expert-width 64 --vocab 64 --batch 1 --capacity 32"
    argv += f" --steps 2 --repeats 1 --rounds 2 --dtype float32 --out {out}"
    assert moe.main(argv.split()) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert result["rounds"] == 2 and len(row["rounds"]) == 2
    assert row["ratio_min"] <= row["mlx_lm_over_stepserve"] <= row["ratio_max"]
    assert set(row["stepserve"]) >= {"pipelined_step_s", "sync_step_s", "dispatch_s", "eval_s"}
    printed = capsys.readouterr()
    assert json.loads(printed.out) == row
    assert "batch 1 round 2/2: stepserve" in printed.err


def test_rounds_below_one_are_refused():
    with pytest.raises(SystemExit):
        moe.main(["--rounds", "0"])


TINY = "--layers 1 --experts 4 --top-k 2 --hidden 64 --expert-width 64 --vocab 64".split()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(mlx-lm's tiny random Qwen3-MoE, stepserve's load of the same directory), float32."""
    import mlx.core as mx

    from models.loader import load_model

    directory = tmp_path_factory.mktemp("moe") / "model"
    peer = moe.build(moe.moe_config(moe._parser().parse_args(TINY)), 4, directory)
    return peer, load_model(directory, "moe", mx.float32, "quantized")


def test_stepserve_steps_each_take_the_previous_steps_cache(tiny, monkeypatch):
    """As the runner does: the timer keeps only the latest cache, so the step's cache write
    can be in place (a cache held for every step makes each layer's scatter copy it first)."""
    from service.bench import profile
    from service.engine.executor import Executor

    calls = []
    step_fn = Executor.step_fn

    def spy(self, phase, *args):
        fn = step_fn(self, phase, *args)
        if phase != "decode":
            return fn

        def decode(params, tokens, positions, kv):
            logits, new_kv = fn(params, tokens, positions, kv)
            calls.append((kv, new_kv))
            return logits, new_kv

        return decode

    monkeypatch.setattr(Executor, "step_fn", spy)
    figures = profile.stepserve_timer(tiny[1], 2, 32, 3, 2)()
    assert figures["pipelined_step_s"] > 0 and len(calls) > 5
    for (_, before), (after, _) in zip(calls, calls[1:], strict=False):
        assert after is before


@pytest.mark.parametrize("kind", ["kv", "batch"])
def test_peer_rounds_restart_at_half_the_capacity(tiny, kind):
    """Every round of mlx-lm's loop starts at offset capacity/2, with either cache."""
    from service.bench import profile

    peer, offsets = tiny[0], []

    class Recorder:
        layers = peer.layers

        def __call__(self, tokens, cache):
            offsets.append(cache[0]._idx if kind == "batch" else cache[0].offset)
            return peer(tokens, cache=cache)

    timer = profile.peer_timer(Recorder(), 2, 32, 3, kind)
    assert offsets == [0, 16]  # the prefill, the warm-up step
    for _ in range(2):
        offsets.clear()
        assert timer()["pipelined_step_s"] > 0
        assert offsets == [16, 17, 18, 19]


@pytest.mark.parametrize("kv", ["paged", "paged-copying"])
def test_paged_timer_steps_over_the_pool(tiny, monkeypatch, kv):
    """``--kv paged``: every step runs over the executor's paged pool, queued after the device's
    work in flight (``mx.synchronize``); ``paged-copying`` is queued without that wait. The
    round's peak memory counts the pool."""
    import mlx.core as mx

    from service.bench import profile
    from service.engine.executor import Executor

    pools, waits, wait = [], [], Executor.wait_for_pool

    def spy(self):
        pools.append(self.pool)
        wait(self)

    monkeypatch.setattr(Executor, "wait_for_pool", spy)
    monkeypatch.setattr(mx, "synchronize", lambda *a: waits.append(a))
    figures = profile.stepserve_timer(tiny[1], 2, 32, 3, 2, kv=kv, pool_tokens=256)()
    assert figures["pipelined_step_s"] > 0 and len(pools) > 5
    assert pools[-1].num_blocks == 256 // profile.BLOCK_TOKENS
    assert figures["peak_memory_bytes"] >= pools[-1].nbytes
    assert (len(waits) >= len(pools)) if kv == "paged" else not waits


@pytest.mark.parametrize("kv", ["static", "paged"])
def test_profile_rows_sit_at_the_positions_asked_a_long_row_among_short_ones(tiny, kv, monkeypatch):
    """``--long-row`` and ``--row-position``: every decode step the timer builds puts row 0 at
    the long position and the others at theirs, on the static cache and on the pool; a
    position outside the capacity is refused."""
    from service.bench import profile
    from service.engine.executor import Executor

    seen: list[list[int]] = []
    decode = Executor.decode

    def spy(self, kv_cache, tokens, positions):
        seen.append(list(positions))
        return decode(self, kv_cache, tokens, positions)

    monkeypatch.setattr(Executor, "decode", spy)
    positions = profile.row_positions(3, 32, 4, 29)
    assert positions == [29, 4, 4] and profile.row_positions(2, 32, None, None) == [16, 16]
    profile.stepserve_timer(tiny[1], 3, 32, 2, 1, kv, 64, positions)()
    assert len(seen) > 4 and all(p == [29, 4, 4] for p in seen)
    with pytest.raises(ValueError, match="each in"):
        profile.stepserve_timer(tiny[1], 3, 32, 2, 1, kv, 64, [32, 4, 4])
