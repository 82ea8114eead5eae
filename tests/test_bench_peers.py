"""TTFT peers measured on fewer layers than the engine: two depths and their per-layer slope, never a
ratio that multiplies the fixed costs (moe_offload/bench/peers.py)."""

import pytest

from moe_offload.bench import report
from moe_offload.bench.peers import layer_repeat, peer_depths, scale_to_depth

QWEN3_NEXT_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def _runs(ttft_by_depth: dict[int, float]) -> dict[int, dict]:
    return {d: {"1024": {"median": t, "min": t, "max": t, "reps": [t]}} for d, t in ttft_by_depth.items()}


def test_the_slope_of_two_depths_counts_the_fixed_cost_once():
    fixed, per_layer = 0.030, 0.001  # 30 ms of embedding, LM head and launch; 1 ms a layer
    runs = _runs({d: fixed + d * per_layer for d in (2, 4)})
    got = scale_to_depth(runs, 48)["1024"]
    assert got["at_engine_layers_s"] == pytest.approx(fixed + 48 * per_layer)  # 78 ms
    assert got["per_layer_s"] == pytest.approx(per_layer) and got["fixed_s"] == pytest.approx(fixed)
    ratio = (fixed + 4 * per_layer) * 48 / 4  # what scaling t(4) by 48/4 would have said: 408 ms
    assert got["at_engine_layers_s"] < ratio / 5


def test_a_peer_run_at_the_engines_depth_is_reported_as_measured():
    got = scale_to_depth(_runs({48: 0.077}), 48)["1024"]
    assert got["at_engine_layers_s"] == 0.077 and got["extrapolated"] is False


@pytest.mark.parametrize("requested, engine, repeat, want", [
    (None, 48, 1, (48,)),
    ((48,), 48, 1, (48,)),
    ((60,), 48, 1, (48,)),
    ((8,), 48, 1, (4, 8)),
    ((2,), 48, 1, (1, 2)),
    ((1,), 48, 1, (1, 2)),
    ((4, 12), 48, 1, (4, 12)),
    ((8,), 48, 4, (4, 8)),       # qwen3_next: whole repeats of 3 linear + 1 full attention
    ((4,), 48, 4, (4, 8)),       # one repeat only: the second depth is one repeat deeper
    ((16,), 48, 4, (8, 16)),
])
def test_peer_depths(requested, engine, repeat, want):
    assert peer_depths(requested, engine, repeat) == want


@pytest.mark.parametrize("requested, engine, repeat", [((4, 6), 48, 4), ((2, 4), 48, 4), ((8, 60), 48, 1),
                                                       ((4,), 6, 4)])
def test_depths_that_cannot_give_a_slope_are_an_error_naming_the_option(requested, engine, repeat):
    with pytest.raises(ValueError, match="--peer-layers"):
        peer_depths(requested, engine, repeat)


def test_the_layer_repeat_of_a_hybrid_model_and_of_a_plain_one():
    assert layer_repeat({"layer_types": QWEN3_NEXT_TYPES * 12}) == 4
    assert layer_repeat({"layer_types": ["full_attention"] * 48}) == 1
    assert layer_repeat({}) == 1


def test_the_report_states_how_a_peer_was_scaled():
    peer = {"status": "ok", "layers": 8, "engine_layers": 48, "depths": [4, 8],
            "ttft_s": scale_to_depth(_runs({4: 0.034, 8: 0.038}), 48)}
    text = "\n".join(report._peer_table({"settings": {"prompt_lens": [1024]}, "peers": {"full_gpu": peer}}))
    assert "per-layer slope" in text and "t(8) + (48 - 8) x (t(8) - t(4)) / (8 - 4)" in text
    assert "| full_gpu | ok | 8 | 78.0\\* |" in text  # 38 ms + 40 x 1 ms
