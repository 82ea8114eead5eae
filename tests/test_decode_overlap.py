"""``decode.overlap_misses_from`` on a CPU (no streams to overlap on): declined with one event and a count, decoding
gives the tokens it gives without. tests/test_decode_moe.py checks the split compute's bits (the Triton interpreter);
tests/gpu/test_decode_overlap_gpu.py runs the overlap itself."""

from moe_offload.decode_path import _overlap

from test_decode_static import _engine, _static_greedy


def test_the_overlap_on_a_cpu_is_declined_once_counted_and_decodes_the_same_tokens(tiny_ckpt, events):
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    prompt = list(range(10, 26))
    want = _static_greedy(_engine(path, "cache.budget=0.3"), prompt, 6)
    eng = _engine(path, "cache.budget=0.3", "decode.overlap_misses_from=1")
    got = _static_greedy(eng, prompt, 6)
    declined = [e for e in events() if e["event"] == "decode_miss_overlap_declined"]
    assert len(declined) == 1 and declined[0]["reason"] == "not_cuda"
    assert declined[0]["change_with"] == "decode.overlap_misses_from=0"
    assert eng.cache.stats()["declined"]["decode_miss_overlap:not_cuda"] == 1
    eng.cache.reset()  # the count survives a reset of the counters, as every declined setting's does
    assert eng.cache.stats()["declined"]["decode_miss_overlap:not_cuda"] == 1
    assert not eng.cache.decode_splits(16)
    assert got == want


def test_the_overlap_applies_only_where_its_copy_is_the_split_s_own():
    import torch

    cuda = torch.device("cuda", 0)
    assert _overlap(0, cuda, False, False) == (0, None)  # off: nothing to decline
    assert _overlap(16, cuda, False, False) == (16, None)
    assert _overlap(16, cuda, True, False) == (0, "lookahead")
    assert _overlap(16, cuda, False, True) == (0, "copy_engine_misses")
    assert _overlap(16, torch.device("cpu"), False, False) == (0, "not_cuda")


def test_the_split_plan_gives_the_plans_rows_copies_the_misses_and_counts_alike(tiny_ckpt):
    """``DecodeResidency.plan_split`` (the Triton plan and copy kernels, in the interpreter here): the rows ``plan``
    gives, every missed pair's scratch row holding its expert's host bytes once joined, and the same counts."""
    import torch

    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), "cache.budget=0.3")
    dp = eng.cache.decode
    layer = eng.cache.layers[1]
    lp = dp.pool.layer_pos[layer]
    ids = torch.tensor([[0, 5, 9, 63], [5, 1, 2, 40], [7, 8, 9, 10]], dtype=torch.int32)[:, :dp.store.geometry.top_k]
    before = dp.counts_LC[lp].clone()
    want = dp.plan(layer, ids)[0]
    counts = dp.counts_LC[lp].clone()
    rows, base, join = dp.plan_split(layer, ids)
    join()
    join()  # again: harmless
    assert base == dp.scratch_base and torch.equal(rows.long(), want.long())
    host = dp.host_rows(layer)
    missed = rows >= base
    assert missed.any() and (~missed).any()
    for r, e in zip(rows[missed].tolist(), ids[missed].tolist()):
        assert torch.equal(dp.pool.rows_NR[r], host[e])
    assert torch.equal(dp.counts_LC[lp] - counts, counts - before)


def _fused_on_the_interpreter(eng, overlap: bool):
    """The engine's decode compute with the NVFP4 tile kernels on (the Triton interpreter: the CPU has no fused
    path of its own), and the cache's split threshold at one token when ``overlap``."""
    from moe_offload.experts import offloaded_experts
    from moe_offload.kernels.decode_gemv import decode_gemv_nvfp4
    from moe_offload.kernels.decode_moe import decode_moe_nvfp4

    dc = offloaded_experts(eng.model)[0].decode_compute
    dc.fused, dc.kernel, dc.overlap = True, "tiles", overlap
    dc._gemv, dc._tiles = decode_gemv_nvfp4, decode_moe_nvfp4
    eng.cache.decode.overlap_from = 1 if overlap else 0
    return eng


def test_a_split_decode_step_gives_the_one_pass_logits_bit_for_bit(tiny_ckpt):
    """The whole routed path with the split (``OffloadedExperts._decode``: plan_split, DecodeCompute.split, join) on
    the tile kernels against the same kernels in one pass: the same logits at every step, bit for bit."""
    import torch

    from moe_offload.decode_graph import StaticDecoder

    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    runs = []
    for overlap in (True, False):
        eng = _fused_on_the_interpreter(_engine(path, "cache.budget=0.3"), overlap)
        calls = []
        real = eng.cache.decode_plan_split
        eng.cache.decode_plan_split = lambda *a, **k: calls.append(1) or real(*a, **k)
        dec = StaticDecoder(eng, 2, 48, graphs=False)
        logits = dec.prefill(torch.tensor([list(range(10, 18)), list(range(20, 28))]))
        seen = [logits.clone()]
        for _ in range(3):
            logits = dec.step(logits.argmax(-1))
            seen.append(logits.clone())
        runs.append(seen)
        assert bool(calls) == overlap
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), f"step {i} differs"


def test_a_padded_prompt_splits_with_its_pad_rows_routed_as_their_source_rows_and_the_one_pass_bits(tiny_ckpt):
    """A padded prefill (``cache.pad_src_N``, as prefill_graph.py sets it for a prompt padded to its graph bucket):
    the split plans the ids with each pad row routed as its source row, as the one-pass plan does, so padding copies
    no expert the prompt did not route, and the logits equal the one-pass run's bit for bit."""
    import torch

    from moe_offload.decode_graph import StaticDecoder

    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    src = torch.tensor([0, 1, 2, 3, 4, 5, 5, 5, 8, 9, 10, 11, 12, 13, 13, 13])  # rows 6-7 and 14-15 are pads
    runs = []
    for overlap in (True, False):
        eng = _fused_on_the_interpreter(_engine(path, "cache.budget=0.3"), overlap)
        planned = []
        real = eng.cache.decode_plan_split
        eng.cache.decode_plan_split = lambda layer, ids, *a, **k: planned.append(ids.clone()) or real(layer, ids, *a,
                                                                                                       **k)
        dec = StaticDecoder(eng, 2, 48, graphs=False)
        eng.cache.pad_src_N = src
        try:
            logits = dec.prefill(torch.tensor([list(range(10, 18)), list(range(20, 28))]))
        finally:
            eng.cache.pad_src_N = None
        runs.append(logits.clone())
        assert bool(planned) == overlap
        for ids_TK in planned:  # every layer's plan saw the pad rows as their source rows
            assert torch.equal(ids_TK, ids_TK.index_select(0, src))
    assert torch.equal(runs[0], runs[1])
