"""decode.lookahead (moe_offload/lookahead.py): the next MoE layer's predicted misses are copied a layer ahead.

CPU: the kernels (interpreted) equal their torch references; a decode with the lookahead gives the bits of the
same decode without it, at a tiny cache and a full one; its counters agree with an independent count from
the routing the model really took; a mispredicting router changes bytes, never results.
tests/gpu/test_lookahead_gpu.py runs it on CUDA (side stream, captured step)."""

import pytest
import torch

from test_decode_static import _engine

from moe_offload.decode_graph import StaticDecoder
from moe_offload.kernels.decode_miss import (count_step_reference, prefetch_misses, prefetch_misses_reference,
                                             serve_misses, serve_misses_reference)


def _decode(eng, prompts, n):
    """Greedy static-cache decode (the graph path's eager twin): every step's logits."""
    dec = StaticDecoder(eng, len(prompts), 64, graphs=False)
    logits = dec.prefill(torch.tensor(prompts))
    out = [logits]
    for _ in range(n):
        logits = dec.step(logits.argmax(-1))
        out.append(logits)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_prefetch_and_the_served_rows_equal_their_references(seed):
    g = torch.Generator().manual_seed(seed)
    E, R, S, T, K = 24, 44, 6, 3, 4
    X = min(T * K, E)
    host = torch.randint(0, 256, (E, R), dtype=torch.uint8, generator=g)
    slot = torch.full((E,), -1, dtype=torch.int32)
    resident = torch.randperm(E, generator=g)[:S]
    slot[resident] = torch.arange(S, dtype=torch.int32)
    pools = [torch.zeros((S + 3 * X, R), dtype=torch.uint8) for _ in range(2)]
    for p in pools:
        p[:S] = host[resident]
    predicted = torch.randint(0, E, (T, K), generator=g)
    maps = [torch.empty(E, dtype=torch.int32) for _ in range(2)]
    copied = torch.zeros(1, dtype=torch.int64)
    prefetch_misses(slot, predicted, host, pools[0], S + X, maps[0], copied)
    n = prefetch_misses_reference(slot, predicted, host, pools[1], S + X, maps[1])
    assert torch.equal(maps[0], maps[1]) and torch.equal(pools[0], pools[1]) and int(copied) == n
    want_copied = {e for e in predicted.flatten().tolist() if slot[e] < 0}
    assert n == len(want_copied) and {e for e in range(E) if maps[0][e] >= 0} == want_copied

    routed = torch.randint(0, E, (T, K), generator=g)
    routed[0, 0] = E + 3  # out of range: row -1, nothing copied
    counts = torch.zeros(5, dtype=torch.int64)  # pairs, missed, copied here, routed, from a lookahead row
    record = torch.zeros((T, K), dtype=torch.int32)
    rows = serve_misses(slot, routed, host, pools[0], S, stats=(counts, record), pf_row_E=maps[0])
    ref = serve_misses_reference(slot, routed, host, pools[1], S, maps[1])
    assert torch.equal(rows, ref) and torch.equal(pools[0], pools[1])
    assert torch.equal(record, routed.to(torch.int32))
    for (t, k), e in zip(torch.cartesian_prod(torch.arange(T), torch.arange(K)).tolist(), routed.flatten().tolist()):
        if e >= E:
            assert rows[t, k] == -1
        else:  # every routed pair reads its own expert's bytes, wherever they came from
            assert torch.equal(pools[0][rows[t, k]], host[e])
    valid = [e for e in routed.flatten().tolist() if e < E]
    missed = [e for e in valid if slot[e] < 0]
    from_pf = {e for e in missed if e in want_copied}
    assert counts.tolist() == [len(valid), len(missed), len(set(missed) - from_pf), len(set(valid)), len(from_pf)]
    ref_counts, ref_record = torch.zeros(6, dtype=torch.int64), torch.zeros((T, K), dtype=torch.int32)
    count_step_reference(routed, slot, maps[1], ref_counts, ref_record)
    assert ref_counts[:5].tolist() == counts.tolist() and ref_counts[5] == 0 and torch.equal(ref_record, record)


@pytest.mark.parametrize("n", [3, 4, 6])
def test_the_plan_kernel_counts_like_its_reference_without_the_lookahead(n):
    g = torch.Generator().manual_seed(n)
    E, R, S, T, K = 32, 16, 8, 5, 4
    host = torch.randint(0, 256, (E, R), dtype=torch.uint8, generator=g)
    slot = torch.full((E,), -1, dtype=torch.int32)
    slot[torch.randperm(E, generator=g)[:S]] = torch.arange(S, dtype=torch.int32)
    pool = torch.zeros((S + T * K, R), dtype=torch.uint8)
    ids = torch.randint(0, E, (T, K), generator=g)
    got, want = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    rec, ref_rec = torch.zeros((T, K), dtype=torch.int32), torch.zeros((T, K), dtype=torch.int32)
    serve_misses(slot, ids, host, pool, S, stats=(got, rec))
    count_step_reference(ids, slot, None, want, ref_rec)
    assert got.tolist() == want.tolist() and torch.equal(rec, ref_rec)
    if n >= 4:
        assert got[3] == len(set(ids.flatten().tolist()))  # distinct routed experts: the HBM floor's count


def test_a_row_map_of_the_wrong_shape_is_refused_with_its_name():
    E, R = 8, 16
    host, pool = torch.zeros((E, R), dtype=torch.uint8), torch.zeros((20, R), dtype=torch.uint8)
    slot, ids = torch.full((E,), -1, dtype=torch.int32), torch.zeros((1, 2), dtype=torch.int64)
    with pytest.raises(ValueError, match="lookahead row map"):
        serve_misses(slot, ids, host, pool, 4, pf_row_E=torch.full((E + 1,), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="lookahead row map"):
        prefetch_misses(slot, ids, host, pool, 8, torch.full((E,), -1, dtype=torch.int64))


@pytest.mark.parametrize("budget", ["0.25", "1.0"])
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_decoding_with_the_lookahead_gives_the_bits_of_decoding_without_it(tiny_ckpt, preset, budget):
    path = tiny_ckpt(preset, "nvfp4-modelopt")
    prompts = [list(range(10, 26)), list(range(40, 56))]
    off = _engine(path, f"cache.budget={budget}")
    want = _decode(off, prompts, 6)
    on = _engine(path, f"cache.budget={budget}", "decode.lookahead=true")
    assert on.cache.decode.lookahead is not None and on.cache.decode.lookahead.ready
    got = _decode(on, prompts, 6)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    la = on.cache.stats()["lookahead"]
    if budget == "1.0":  # nothing is missing: nothing to predict or copy
        assert la["copied"] == la["used"] == la["missed_experts"] == 0
    else:
        assert la["copied"] > 0 and la["missed_experts"] > 0 and la["used"] > 0  # lookahead rows were read
        assert 0 <= la["used"] <= min(la["copied"], la["missed_experts"])
        assert la["recall"] == la["used"] / la["missed_experts"]


def test_its_counts_match_an_independent_count_of_the_routing(tiny_ckpt, monkeypatch):
    """Record each MoE layer's real routing and input during one decode step, predict with the next layer's
    router by hand, and count what the lookahead must have copied and used."""
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "bf16"), "cache.budget=0.3", "decode.lookahead=true",
                  "cache.admit_per_step=0")
    cache = eng.cache
    dec = StaticDecoder(eng, 1, 64, graphs=False)
    logits = dec.prefill(torch.tensor([list(range(5, 25))]))
    seen = {}
    original = cache.decode.plan

    def spy(layer, ids_TK, hidden_TH=None, align_block_m=None):
        seen[layer] = (ids_TK.clone(), hidden_TH.clone())
        return original(layer, ids_TK, hidden_TH, align_block_m)

    monkeypatch.setattr(cache.decode, "plan", spy)
    cache.reset()
    dec.step(logits.argmax(-1))
    la = cache.stats()["lookahead"]
    decoder_layers = eng.model.model.layers  # the routers straight from the model, not the lookahead's mapping
    layers = cache.store.layers
    copied = used = missed_experts = 0
    for lp, layer in enumerate(layers):
        table = cache.pool.table_LE[lp]
        ids = seen[layer][0].flatten().tolist()
        missing = {e for e in ids if table[e] < 0}
        if lp == 0:  # never predicted: outside recall's denominator
            continue
        missed_experts += len(missing)
        with torch.no_grad():
            predicted = decoder_layers[layer].mlp.gate(seen[layers[lp - 1]][1])[2].flatten().tolist()
        prefetched = {e for e in predicted if table[e] < 0}
        copied += len(prefetched)
        used += len(missing & prefetched)
    assert (la["copied"], la["used"], la["missed_experts"]) == (copied, used, missed_experts)
    assert copied > 0


def test_a_router_that_always_mispredicts_costs_bytes_not_results(tiny_ckpt):
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    prompts = [list(range(10, 26))]
    want = _decode(_engine(path, "cache.budget=0.25"), prompts, 5)
    eng = _engine(path, "cache.budget=0.25", "decode.lookahead=true")
    E = eng.cache.E

    class Wrong(torch.nn.Module):  # predicts the two highest ids for every token, whatever the routing
        def forward(self, hidden):
            T = hidden.reshape(-1, hidden.shape[-1]).shape[0]
            ids = torch.arange(E - 2, E).expand(T, 2)
            return None, None, ids

    la = eng.cache.decode.lookahead
    la.set_routers({layer: Wrong() for layer in eng.cache.store.layers})
    got = _decode(eng, prompts, 5)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    la = eng.cache.stats()["lookahead"]
    assert la["copied"] > 0 and la["used"] < la["missed_experts"]


def test_the_lookahead_rows_come_out_of_the_budget(tiny_ckpt):
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    off = _engine(path, "cache.budget=64MiB")
    on = _engine(path, "cache.budget=64MiB", "decode.lookahead=true")
    K, E, T = on.store.geometry.top_k, on.cache.E, on.cfg.decode.max_tokens
    extra = 2 * min(T * K, E)
    assert on.cache.plan.scratch_rows == off.cache.plan.scratch_rows + extra
    assert on.cache.plan.total_bytes <= 64 * 2**20 and on.cache.num_slots <= off.cache.num_slots
    assert on.cache.pool.rows_NR.shape[0] == on.cache.num_slots + on.cache.plan.scratch_rows


_COMPILE_SM90 = r'''
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from moe_offload.kernels import decode_miss as dm

fn = dm._plan_kernel
names = fn.arg_names
ok = []
for stats, pf, dense in ((3, False, False), (5, True, False), (5, False, False), (1, False, True), (0, False, True)):
    sig = {n: "*i32" for n in names}
    sig.update({"stats_ptr": "*i64", "M": "i32", "E": "i32", "scratch_base": "i32"})
    consts = {"BLOCK": 1024, "STATS": stats, "PF": pf, "DENSE": dense}
    for c in consts:
        sig[c] = "constexpr"
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    ok.append("st.global" in ptx)
print(all(ok))
'''


def test_the_plan_kernel_compiles_for_sm90_in_every_mode(compiled_without_interpreter):
    """The interpreter accepts code the compiler refuses: the miss server's plan (with and without lookahead
    rows) and the lookahead's dense plan compile for an H200 (sm_90), no GPU needed."""
    assert compiled_without_interpreter(_COMPILE_SM90) == "True"
