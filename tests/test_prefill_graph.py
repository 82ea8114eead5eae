"""A fresh batch's prefill padded to a length bucket (moe_offload/prefill_graph.py), on the CPU: the padded
forwards the CUDA graphs capture, run eagerly, against the unpadded prefill and plain decoding."""

import pytest
import torch
from hypothesis import given, strategies as st

from moe_offload.config import load_config
from moe_offload.decode_graph import StaticDecoder
from moe_offload.engine import Engine
from moe_offload.prefill_graph import PrefillNotCapturable, bucket, in_place_rows


def _engine(path, *extra):
    cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "logging.level=WARNING", *extra])
    return Engine.from_config(cfg, progress=False)


@given(st.integers(1, 5000), st.integers(1, 5000))
def test_a_bucket_holds_the_prompt_pads_at_most_a_quarter_above_64_tokens_and_respects_the_limit(T, limit):
    b = bucket(T, limit)
    if T > limit:
        assert b is None
        return
    assert T <= b <= limit
    if T <= 64:
        assert b % 16 == 0 or b == limit
    else:
        assert b - T <= T // 4
    assert bucket(b, limit) == b  # a bucket is its own bucket: one graph per bucket


def _greedy(dec, prompts, n):
    logits = dec.prefill(torch.tensor(prompts))
    first = logits.clone()
    out = [[] for _ in prompts]
    for _ in range(n):
        tok = logits.argmax(-1)
        for b, t in enumerate(tok.tolist()):
            out[b].append(t)
        logits = dec.step(tok)
    return first, out


@pytest.mark.parametrize("budget, mode", [("0.3", "routed"), ("1.0", "routed"), ("1.0", "in_place"),
                                          ("0.3", "piecewise")])
@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "bf16"])
def test_a_padded_prefill_gives_the_unpadded_logits_and_the_same_decode(tiny_ckpt, budget, mode, fmt):
    """Pad tokens after the prompt change nothing a real position sees (causal attention; per-row MoE and
    norms): the last real logits match the unpadded static prefill and the greedy continuation is the same.
    ``routed``: the prompt takes the routed path (at 0.3 with misses copied from host memory); ``in_place``:
    longer than the routed threshold, staged, every expert read in place; ``piecewise``: staged with misses
    (the forward a piecewise capture splits at each experts call)."""
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", fmt), f"cache.budget={budget}", "prefill.routed_max_tokens=24")
    T = 11 if mode == "routed" else 37  # buckets 16 (routed, <= 24) and 48 (above the threshold)
    prompts = [list(range(7, 7 + T)), list(range(90, 90 + T))]
    padded = StaticDecoder(eng, 2, 96, graphs=False, padded_prefill=True)
    plain = StaticDecoder(eng, 2, 96, graphs=False)
    # 2 sequences x 12 tokens fill the 24 routed tokens; 37 tokens pad to 48, read in place
    assert padded.prefill_graphs.plan(2, T) == ((12, "routed") if mode == "routed" else (48, mode))
    a_first, a_out = _greedy(padded, prompts, 6)
    b_first, b_out = _greedy(plain, prompts, 6)
    torch.testing.assert_close(a_first, b_first, atol=2e-4, rtol=2e-4)
    assert a_out == b_out
    assert eng.cache.counters.compute["prefill_graph_eager"] == 1  # the padded forward ran (once: `plain` is not padded)


def test_pad_rows_route_as_the_last_real_row_so_padding_copies_no_expert_the_prompt_did_not_route(tiny_ckpt):
    """At residency 0.3 the routed prefill copies each missing routed expert from host memory: the padded
    forward misses and routes exactly the distinct experts of the unpadded one, layer by layer (only the
    pair counts grow by the pad rows)."""
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-ct"), "cache.budget=0.3", "prefill.routed_max_tokens=24",
                  "cache.admit_per_step=0")
    cache = eng.cache
    E = cache.E
    resident = {layer: list(range(0, E, 3))[: cache.num_slots // len(cache.layers)] for layer in cache.layers}
    prompts = torch.tensor([list(range(7, 18)), list(range(90, 101))])  # 2 x 11 tokens, bucket 12
    counts = []
    for padded in (True, False):
        cache.set_residency(resident)
        cache.decode.reset_counts()
        dec = StaticDecoder(eng, 2, 64, graphs=False, padded_prefill=padded)
        dec.prefill(prompts)
        counts.append(cache.decode.counts())
    for layer in cache.layers:
        (p_pairs, _, p_missed, p_routed, *_), (u_pairs, _, u_missed, u_routed, *_) = counts[0][layer], counts[1][layer]
        assert (p_missed, p_routed) == (u_missed, u_routed), layer
        assert (p_pairs, u_pairs) == (2 * 12 * cache.store.geometry.top_k, 2 * 11 * cache.store.geometry.top_k)
    assert any(c[2] > 0 for c in counts[1].values())  # the case has misses at all


@pytest.mark.parametrize("piecewise", [True, False])
def test_a_staged_layer_is_refused_under_capture_and_a_prefill_with_misses_is_piecewise_or_declined(tiny_ckpt,
                                                                                                     piecewise):
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "bf16"), "cache.budget=0.3", "prefill.routed_max_tokens=16",
                  f"prefill.piecewise_graphs={str(piecewise).lower()}")
    first = eng.cache.layers[0]
    with pytest.raises(PrefillNotCapturable, match=f"layer {first} is staged"):
        in_place_rows(eng.cache, first)
    dec = StaticDecoder(eng, 1, 96, graphs=False, padded_prefill=True)
    # above the routed threshold, and experts are missing: split at each experts call, or eager when that is off
    assert dec.prefill_graphs.plan(1, 40) == ((48, "piecewise") if piecewise else None)
    assert eng.cache.counters.declined["prefill_graph:staged_layers"] == (0 if piecewise else 1)
    assert dec.prefill_graphs.plan(1, 9) == (16, "routed")


def test_a_prompt_above_the_largest_bucket_is_prefilled_unpadded(tiny_ckpt):
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "bf16"), "cache.budget=1.0", "prefill.chunk_tokens=32")
    dec = StaticDecoder(eng, 1, 96, graphs=False, padded_prefill=True)
    assert dec.prefill_graphs.plan(1, 33) is None
    assert eng.cache.counters.declined["prefill_graph:longer_than_bucket"] == 1
    logits = dec.prefill(torch.tensor([list(range(3, 36))]))
    assert dec.length == 33 and logits.shape[0] == 1
    assert eng.cache.counters.compute["prefill_graph_eager"] == 0


def test_a_prompt_the_observed_routing_routes_is_padded_on_the_routed_path(tiny_ckpt):
    """Above the fixed threshold, a single prompt whose length the cache has seen route few experts takes
    the routed path (prefill.routed_adaptive_max_tokens); its padded forward does too (forced: a capture
    would otherwise fall back to the fixed threshold), with the unpadded logits."""
    from test_observed_routing import make_adaptive_engine

    eng = make_adaptive_engine(tiny_ckpt)  # its cost model routes skewed prompts
    cache = eng.cache
    prompt = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(1))
    dec = StaticDecoder(eng, 1, 96, graphs=False, padded_prefill=True)
    plain = StaticDecoder(eng, 1, 96, graphs=False)
    for _ in range(2):  # two observed (eager, unpadded, staged) forwards teach the spread of this length
        dec.reset()
        assert dec.prefill_graphs.plan(1, 30) is None
        eng.prefill(prompt)
    assert dec.prefill_graphs.plan(1, 30) == (32, "routed")
    cache.reset()
    dec.reset()
    got = dec.prefill(prompt)
    st = cache.stats()
    assert st["compute"]["prefill_graph_eager"] == 1 and st["decode_steps"] == 1 and st["prefills"] == 0
    # one forward, one decision (the plan's query does not count; the padded forward counts once)
    assert st["routed_adaptive"]["routed_forwards"] == 1 and st["routed_adaptive"]["staged_forwards"] == 0
    torch.testing.assert_close(got, plain.prefill(prompt), atol=2e-4, rtol=2e-4)


def test_a_model_with_linear_attention_layers_is_never_padded(tiny_ckpt):
    """Pad tokens would run through qwen3_next's linear-attention layers and leave their state past the
    prompt: such a decoder prefills unpadded (declined once, counted) and decodes the plain decoder's tokens."""
    eng = _engine(tiny_ckpt("tiny-qwen3-next", "bf16"), "cache.budget=1.0")
    padded = StaticDecoder(eng, 1, 64, graphs=False, padded_prefill=True)
    assert padded.prefill_graphs is None and not padded.hands_off
    assert eng.cache.counters.declined["prefill_graph:non_full_attention_layers"] == 1
    prompt = [list(range(5, 16))]
    assert _greedy(padded, prompt, 6)[1] == _greedy(StaticDecoder(eng, 1, 64, graphs=False), prompt, 6)[1]


def test_a_bucket_never_runs_past_the_static_cache(tiny_ckpt):
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "bf16"), "prefill.routed_max_tokens=24")
    dec = StaticDecoder(eng, 1, 20, graphs=False, padded_prefill=True)
    assert dec.prefill_graphs.plan(1, 17) == (19, "routed")  # not 32: 20 positions, one kept for the first step
