"""serve_misses (kernels/decode_miss.py) against the plain-torch reference, on awkward shapes.

Legend: T tokens, K top-k, E experts, B bytes per row, S resident slots, R pool rows (S + scratch).

Without CUDA the kernels run in the Triton interpreter on CPU tensors (host rows are plain CPU
tensors there); with CUDA the host rows are plain device tensors here (the mapped-memory case is in
tests/gpu/test_decode_kernels_gpu.py).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from moe_offload.kernels.decode_miss import (  # noqa: E402
    MissCopyConfig,
    plan_misses,
    serve_misses,
    serve_misses_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = 0xA5
SMALL_CHUNKS = MissCopyConfig(chunk_bytes=64, ctas_per_sm=3)  # many chunks per row, several per program


def setup(T, K, E, B, resident, seed=0, ids=None, S=None):
    """Random host rows, a pool of S slots + min(T*K, E) scratch rows filled with POISON, a table where
    the experts in ``resident`` sit in shuffled slots, and routed ids (random distinct per token)."""
    gen = torch.Generator().manual_seed(seed)
    host_ER = torch.randint(0, 256, (E, B), dtype=torch.uint8, generator=gen)
    S = max(len(resident), 1) if S is None else S
    X = min(T * K, E)
    pool_NR = torch.full((S + X, B), POISON, dtype=torch.uint8)
    slot_of_E = torch.full((E,), -1, dtype=torch.int32)
    slots = torch.randperm(S, generator=gen)[: len(resident)]
    for e, s in zip(resident, slots.tolist()):
        slot_of_E[e] = s
        pool_NR[s] = host_ER[e]
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return (slot_of_E.to(DEVICE), ids.to(DEVICE), host_ER.to(DEVICE), pool_NR.to(DEVICE), S)


def check_against_reference(slot_of_E, ids, host_ER, pool_NR, S, config=None):
    ref_pool = pool_NR.clone()
    want = serve_misses_reference(slot_of_E, ids, host_ER, ref_pool, S)
    got = serve_misses(slot_of_E, ids, host_ER, pool_NR, S, config)
    assert got.dtype == torch.int32 and got.shape == ids.shape
    assert torch.equal(got, want)
    assert torch.equal(pool_NR, ref_pool)  # scratch rows hold exactly the host rows; nothing else written
    return got


CASES = {  # T, K, E, B, resident experts
    "one-token": (1, 1, 3, 40, [1]),
    "one-token-top4-half-missing": (1, 4, 8, 100, [0, 2, 4, 6]),
    "odd-row-bytes": (3, 2, 7, 1001, [3]),  # B % 4 != 0: byte copies, masked tail
    "row-bytes-4-not-16": (5, 3, 9, 4 * 37, [0, 1, 8]),  # int32 words, 4-byte alignment only
    "row-bytes-16": (4, 2, 6, 16 * 9, [5]),  # 16-byte aligned rows
}


@pytest.mark.parametrize("config", [None, SMALL_CHUNKS], ids=["default", "small-chunks"])
@pytest.mark.parametrize("case", CASES.keys())
def test_serve_misses_matches_the_reference(case, config):
    T, K, E, B, resident = CASES[case]
    check_against_reference(*setup(T, K, E, B, resident), config=config)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("case", CASES.keys())
def test_the_plan_kernel_counts_and_records_as_its_reference(case, n):
    """``serve_misses(..., stats=)`` (the decode path's counting, no launch of its own) adds what
    ``count_step_reference`` adds to earlier steps' sums and leaves the same routing record; an id outside the
    layer counts as no pair and no routed expert."""
    from moe_offload.kernels.decode_miss import count_step_reference

    slot_of_E, ids, host_ER, pool_NR, S = setup(*CASES[case], seed=2)
    T, K = ids.shape
    ids[0, 0] = 99  # outside [0, E): row -1, recorded as routed, counted as no pair
    counts = torch.tensor([5, 2, 1, 4][:n], dtype=torch.int64, device=DEVICE)  # earlier steps' sums
    record = torch.full((T + 2, K), -7, dtype=torch.int32, device=DEVICE)
    want_counts, want_record = counts.clone(), record.clone()
    rows = serve_misses(slot_of_E, ids, host_ER, pool_NR.clone(), S)
    count_step_reference(ids, slot_of_E, None, want_counts, want_record)
    got = serve_misses(slot_of_E, ids, host_ER, pool_NR, S, stats=(counts, record))
    assert torch.equal(got, rows)
    assert torch.equal(counts, want_counts) and torch.equal(record, want_record)
    missed = {e for e in ids.flatten().tolist() if 0 <= e < slot_of_E.shape[0] and slot_of_E[e] < 0}
    assert int(counts[2] - 1) == len(missed)  # distinct missed experts, independently
    with pytest.raises(ValueError, match="stats record"):
        serve_misses(slot_of_E, ids, host_ER, pool_NR, S, stats=(counts, record.long()))


def test_all_pairs_to_one_missing_expert_copy_it_once_into_the_first_scratch_row():
    T, K, E, B = 6, 3, 5, 72
    ids = torch.full((T, K), 3)
    slot_of_E, ids, host_ER, pool_NR, S = setup(T, K, E, B, [0, 1], ids=ids)
    got = check_against_reference(slot_of_E, ids, host_ER, pool_NR, S, SMALL_CHUNKS)
    assert (got == S).all()
    assert (pool_NR[S + 1:] == POISON).all()  # the other scratch rows are untouched


def test_all_misses_take_one_scratch_row_per_distinct_expert_in_ascending_id():
    T, K, E, B = 3, 2, 6, 24
    ids = torch.tensor([[5, 1], [1, 4], [0, 5]])
    slot_of_E, ids, host_ER, pool_NR, S = setup(T, K, E, B, [], ids=ids)
    got = check_against_reference(slot_of_E, ids, host_ER, pool_NR, S)
    # distinct missing experts 0, 1, 4, 5 -> scratch rows S+0 .. S+3
    assert got.cpu().tolist() == [[S + 3, S + 1], [S + 1, S + 2], [S + 0, S + 3]]


def test_all_hits_never_touch_scratch():
    T, K, E, B = 4, 2, 8, 40
    slot_of_E, ids, host_ER, pool_NR, S = setup(T, K, E, B, list(range(E)))
    before = pool_NR.clone()
    got = serve_misses(slot_of_E, ids, host_ER, pool_NR, S, SMALL_CHUNKS)
    assert torch.equal(got, slot_of_E[ids.long()].to(torch.int32))
    assert torch.equal(pool_NR, before)
    assert (pool_NR[S:] == POISON).all()


def test_duplicates_across_tokens_share_one_scratch_row():
    T, K, E, B = 5, 2, 6, 32
    ids = torch.tensor([[2, 4], [4, 2], [2, 0], [4, 5], [0, 2]])
    slot_of_E, ids, host_ER, pool_NR, S = setup(T, K, E, B, [5], ids=ids)
    got = check_against_reference(slot_of_E, ids, host_ER, pool_NR, S)
    plan = plan_misses(slot_of_E, ids, host_ER, pool_NR, S)
    assert int(plan.num_missing_1) == 3  # experts 0, 2, 4
    assert plan.miss_experts_X[:3].cpu().tolist() == [0, 2, 4]
    assert ((got >= S) == (ids != 5)).all()  # the miss mask


def test_qwen3_routing_shape_t64_k8_e128():
    T, K, E, B = 64, 8, 128, 36  # real routing shape, short rows to keep the interpreter fast
    gen = torch.Generator().manual_seed(7)
    resident = torch.randperm(E, generator=gen)[:47].tolist()
    check_against_reference(*setup(T, K, E, B, resident, seed=7, S=60), config=MissCopyConfig(chunk_bytes=16))


def test_ids_outside_the_layer_get_row_minus_one_and_copy_nothing():
    T, K, E, B = 2, 2, 4, 16
    ids = torch.tensor([[0, 7], [-1, 2]])
    slot_of_E, ids, host_ER, pool_NR, S = setup(T, K, E, B, [0], ids=ids)
    got = check_against_reference(slot_of_E, ids, host_ER, pool_NR, S)
    assert got.cpu().tolist()[0][1] == -1 and got.cpu().tolist()[1][0] == -1


def test_a_table_change_is_read_at_the_next_call():
    T, K, E, B = 2, 2, 4, 16
    slot_of_E, ids, host_ER, pool_NR, S = setup(T, K, E, B, [], ids=torch.tensor([[0, 1], [1, 2]]))
    assert (serve_misses(slot_of_E, ids, host_ER, pool_NR, S) >= S).all()
    slot_of_E[1] = 0
    got = serve_misses(slot_of_E, ids, host_ER, pool_NR, S)
    assert got.cpu().tolist() == [[S, 0], [0, S + 1]]


def test_no_tokens_return_an_empty_row_table():
    slot_of_E, _, host_ER, pool_NR, S = setup(1, 1, 3, 8, [0])
    ids = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    assert serve_misses(slot_of_E, ids, host_ER, pool_NR, S).shape == (0, 2)


def test_serve_misses_names_the_bad_input():
    slot_of_E, ids, host_ER, pool_NR, S = setup(2, 2, 4, 16, [0])
    with pytest.raises(ValueError, match="slot_of_E"):
        serve_misses(slot_of_E[:3], ids, host_ER, pool_NR, S)
    with pytest.raises(ValueError, match="topk_ids_TK"):
        serve_misses(slot_of_E, ids.float(), host_ER, pool_NR, S)
    with pytest.raises(ValueError, match="row bytes differ"):
        serve_misses(slot_of_E, ids, host_ER[:, :8], pool_NR, S)
    with pytest.raises(ValueError, match="host_rows_ER"):
        serve_misses(slot_of_E, ids, host_ER.view(torch.int8), pool_NR, S)
    with pytest.raises(ValueError, match="scratch_base"):
        serve_misses(slot_of_E, ids, host_ER, pool_NR, S + 1)  # 4 pairs need 4 scratch rows past S
    with pytest.raises(ValueError, match="chunk_bytes"):
        MissCopyConfig(chunk_bytes=100)


@pytest.mark.parametrize("B, word, vec", [(16 * 9, 4, 4), (4 * 37, 4, 1), (8 * 5, 4, 2), (1001, 1, 1), (2 * 51, 1, 2)])
def test_copy_words_follow_the_alignment_of_every_row_start(B, word, vec):
    from moe_offload.kernels.decode_miss import _word_layout

    host = torch.zeros(3, B, dtype=torch.uint8)
    pool = torch.zeros(4, B, dtype=torch.uint8)
    dtype, got_word, got_vec = _word_layout(host, pool)
    # 16-byte rows give 4 int32 per vector (one 16-byte load), 4-byte rows single words, odd rows bytes
    assert (got_word, got_vec) == (word, vec) and dtype == (torch.int32 if word == 4 else torch.uint8)


def _fresh_stats(n_stats: int, T: int, K: int):
    """``(counters, record)`` for a plan's STATS (None for 0 counters), with contents a kernel must add to / overwrite."""
    if not n_stats:
        return None
    return (torch.arange(n_stats, dtype=torch.int64, device=DEVICE) * 10,
            torch.full((T + 1, K), -7, dtype=torch.int32, device=DEVICE))


def _plan_both(slot_of_E, ids, E, scratch_base, n_stats, pf_row_E):
    """The plan of the register kernel and of the workspace kernel, each from the same counters and record."""
    from moe_offload.kernels.decode_miss import plan_misses

    T, K = ids.shape
    host = torch.zeros((E, 4), dtype=torch.uint8, device=DEVICE)
    pool = torch.zeros((scratch_base + min(T * K, E), 4), dtype=torch.uint8, device=DEVICE)
    out = []
    for registers in (True, False):
        stats = _fresh_stats(n_stats, T, K)
        plan = plan_misses(slot_of_E, ids, host, pool, scratch_base, stats, pf_row_E, registers=registers)
        count = int(plan.num_missing_1)
        out.append((plan.rows_TK, plan.miss_experts_X[:count], count, stats))
    return out


@settings(max_examples=60, deadline=None)
@given(T=st.integers(1, 70), K=st.integers(1, 10), E=st.integers(1, 300), seed=st.integers(0, 2**16),
       resident=st.floats(0, 1), n_stats=st.sampled_from([0, 3, 4, 5]), lookahead=st.booleans(),
       outside=st.booleans())
def test_the_register_plan_gives_the_workspace_plans_rows_copies_and_counts(T, K, E, seed, resident, n_stats,
                                                                            lookahead, outside):
    """``_plan_regs_kernel`` (the default where a step's pairs fit one chunk, ``register_plan_fits``; forced here)
    against ``_plan_kernel`` on any decode-sized routing:
    duplicates, ids outside the layer, any residency, with and without the lookahead's row map and counters
    (pairs > the register tile's chunk, so its loops run several times)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T, K), generator=gen)
    if outside:
        ids[0, 0] = E + 3
        ids[-1, -1] = -1
    slot_of_E = torch.where(torch.rand(E, generator=gen) < resident, torch.randperm(E, generator=gen), -1).int()
    pf_row_E = None
    if lookahead and n_stats in (0, 5):  # the row map needs 5 counters when counting
        pf_row_E = torch.where((slot_of_E < 0) & (torch.rand(E, generator=gen) < 0.5), 1000 + torch.arange(E), -1).int()
        pf_row_E = pf_row_E.to(DEVICE)
    regs, work = _plan_both(slot_of_E.to(DEVICE), ids.to(DEVICE), E, E + 5, n_stats, pf_row_E)
    assert torch.equal(regs[0], work[0]) and regs[2] == work[2] and torch.equal(regs[1], work[1])
    if n_stats:
        assert torch.equal(regs[3][0], work[3][0]) and torch.equal(regs[3][1], work[3][1])


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 64), K=st.integers(1, 8), E=st.integers(1, 300), seed=st.integers(0, 2**16),
       resident=st.floats(0, 1), n_stats=st.sampled_from([0, 3, 4]), block_m=st.sampled_from([1, 4, 16]),
       outside=st.booleans(), registers=st.sampled_from([None, True, False]))
def test_the_plan_with_the_alignment_in_its_launch_gives_the_plan_and_decode_align_of_two(T, K, E, seed, resident,
                                                                                          n_stats, block_m, outside,
                                                                                          registers):
    """``_plan_align_kernel`` (``align_block_m``, the decode tile path: up to 512 pairs, no lookahead) writes the
    plan's rows, copies, counts and record (register or workspace plan: ``registers``), and the alignment
    ``decode_align`` makes of those rows over the whole pool, bit for bit (the same blocks, the same pair order
    inside each: both sort by (row, pair id))."""
    from moe_offload.kernels.decode_moe import decode_align

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T, K), generator=gen)
    if outside:
        ids[0, 0] = E + 3
        ids[-1, -1] = -1
    slot_of_E = torch.where(torch.rand(E, generator=gen) < resident, torch.randperm(E, generator=gen) + 2, -1).int()
    scratch_base = E + 2
    host = torch.zeros((E, 4), dtype=torch.uint8, device=DEVICE)
    pool = torch.zeros((scratch_base + min(T * K, E) + 3, 4), dtype=torch.uint8, device=DEVICE)
    out = []
    for fused in (True, False):
        stats = _fresh_stats(n_stats, T, K)
        plan = plan_misses(slot_of_E.to(DEVICE), ids.to(DEVICE), host, pool, scratch_base, stats,
                           registers=registers, align_block_m=block_m if fused else None)
        assert (plan.alignment is not None) == fused
        a = plan.alignment if fused else decode_align(plan.rows_TK, pool.shape[0], block_m)
        n = int(a.num_padded_1)
        count = int(plan.num_missing_1)
        out.append((plan.rows_TK, plan.miss_experts_X[:count], stats, n, a.sorted_ids_P[:n],
                    a.block_row_B[:n // block_m]))
    (rows, miss, stats, n, ids_P, block_rows), want = out
    assert torch.equal(rows, want[0]) and torch.equal(miss, want[1]) and n == want[3]
    assert torch.equal(ids_P, want[4]) and torch.equal(block_rows, want[5])
    if n_stats:
        assert torch.equal(stats[0], want[2][0]) and torch.equal(stats[1], want[2][1])


def test_serve_misses_plan_copies_the_misses_and_aligns_like_serve_misses():
    """The whole call (plan with its alignment, then the copy) leaves the pool as ``serve_misses_reference`` does."""
    from moe_offload.kernels.decode_miss import serve_misses_plan

    slot_of_E, ids, host_ER, pool_NR, S = setup(6, 4, 16, 100, [1, 3, 5, 9], seed=4)
    ref_pool = pool_NR.clone()
    want = serve_misses_reference(slot_of_E, ids, host_ER, ref_pool, S)
    plan = serve_misses_plan(slot_of_E, ids, host_ER, pool_NR, S, SMALL_CHUNKS, align_block_m=16)
    assert torch.equal(plan.rows_TK, want) and torch.equal(pool_NR, ref_pool)
    assert plan.alignment is not None and plan.alignment.block_m == 16


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 16), K=st.integers(1, 8), E=st.integers(8, 300), seed=st.integers(0, 2**16),
       resident=st.floats(0, 1), n_stats=st.sampled_from([0, 3, 4]), block_m=st.sampled_from([None, 1, 16]),
       renorm=st.booleans(), ties=st.booleans())
def test_the_router_top_k_and_the_plan_in_one_launch_give_the_two_calls_results(T, K, E, seed, resident, n_stats,
                                                                                block_m, renorm, ties):
    """``route_and_serve`` (decode steps of up to 128 pairs: the top-k, the plan and the alignment in one launch, the
    last program to finish planning) against ``router_topk`` then ``serve_misses_plan``: the same weights, ids,
    rows, copies, pool, counts, record and alignment, bit for bit; its counter is back at 0 after each launch."""
    from moe_offload.kernels.decode_miss import serve_misses_plan
    from moe_offload.kernels.decode_route import ROUTE_PLAN_MAX_PAIRS, route_and_serve
    from moe_offload.kernels.router import router_topk

    if T * K > ROUTE_PLAN_MAX_PAIRS or K > E:
        return
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen).to(torch.bfloat16)
    if ties:  # equal logits: the lowest index wins, in both
        logits[:, : E // 2] = logits[:, :1]
    slot_of_E = torch.where(torch.rand(E, generator=gen) < resident, torch.randperm(E, generator=gen), -1).int()
    host = torch.randint(0, 256, (E, 12), dtype=torch.uint8, generator=gen).to(DEVICE)
    out = []
    for fused in (True, False):
        pool = torch.full((E + min(T * K, E), 12), POISON, dtype=torch.uint8, device=DEVICE)
        stats = _fresh_stats(n_stats, T, K)
        args = (slot_of_E.to(DEVICE), host, pool, E)
        if fused:
            done = torch.zeros(1, dtype=torch.int32, device=DEVICE)
            w, ids, plan = route_and_serve(logits.to(DEVICE), K, renorm, torch.bfloat16, *args[:3], E, done, stats,
                                           block_m)
            assert int(done) == 0
        else:
            w, ids = router_topk(logits.to(DEVICE), K, renorm, torch.bfloat16)
            plan = serve_misses_plan(args[0], ids, *args[1:], stats=stats, align_block_m=block_m)
        a = plan.alignment
        n = int(a.num_padded_1) if a is not None else 0
        out.append((w, ids, plan.rows_TK, pool, stats, n, a and a.sorted_ids_P[:n], a and a.block_row_B[:n // block_m]))
    for got, want in zip(*out):
        if isinstance(got, tuple):
            assert all(torch.equal(g, x) for g, x in zip(got, want))
        elif isinstance(got, torch.Tensor):
            assert torch.equal(got, want)
        else:
            assert got == want


def test_route_and_serve_names_what_it_does_not_take():
    from moe_offload.kernels.decode_route import route_and_serve

    slot_of_E, ids, host_ER, pool_NR, S = setup(17, 8, 16, 40, [1, 3])
    done = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="136 pairs.*1..128 pairs.*router_topk and serve_misses_plan"):
        route_and_serve(torch.randn(17, 16, device=DEVICE), 8, True, torch.float32, slot_of_E, host_ER, pool_NR, S, done)
    with pytest.raises(ValueError, match="done_1 must be an int32"):
        route_and_serve(torch.randn(2, 16, device=DEVICE), 8, True, torch.float32, slot_of_E, host_ER, pool_NR, S,
                        done.long())


@pytest.mark.parametrize("T,K,E,align", [(1, 8, 128, None), (4, 4, 16, 16), (16, 8, 128, 16)])
def test_route_and_serve_small_steps_match_the_two_calls(T, K, E, align):
    """Decode-shaped steps (batch 1, a tiny model's, batch 16 of 128 experts at top-8) of ``route_and_serve`` against
    ``router_topk`` + ``serve_misses_plan``, half the experts resident: rows, weights, ids, pool and alignment equal.
    Fixed cases (no search): what ``benchmarks/gpu_run.sh sanitize`` runs under compute-sanitizer on a GPU."""
    from moe_offload.kernels.decode_miss import serve_misses_plan
    from moe_offload.kernels.decode_route import route_and_serve
    from moe_offload.kernels.router import router_topk

    gen = torch.Generator().manual_seed(T * E)
    logits = torch.randn(T, E, generator=gen).to(DEVICE, torch.bfloat16)
    slot_of_E = torch.where(torch.arange(E) % 2 == 0, torch.arange(E) // 2, -1).int().to(DEVICE)
    host = torch.randint(0, 256, (E, 24), dtype=torch.uint8, generator=gen).to(DEVICE)
    pools = [torch.full((E // 2 + min(T * K, E), 24), POISON, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    done = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    w, ids, plan = route_and_serve(logits, K, True, torch.bfloat16, slot_of_E, host, pools[0], E // 2, done,
                                   align_block_m=align)
    w2, ids2 = router_topk(logits, K, True, torch.bfloat16)
    plan2 = serve_misses_plan(slot_of_E, ids2, host, pools[1], E // 2, align_block_m=align)
    assert torch.equal(w, w2) and torch.equal(ids, ids2) and torch.equal(plan.rows_TK, plan2.rows_TK)
    assert torch.equal(pools[0], pools[1]) and int(done) == 0
    if align is not None:
        n = int(plan.alignment.num_padded_1)
        assert n == int(plan2.alignment.num_padded_1)
        assert torch.equal(plan.alignment.sorted_ids_P[:n], plan2.alignment.sorted_ids_P[:n])


def test_the_register_plan_runs_only_where_the_pairs_fit_one_chunk(monkeypatch):
    """The default plan: the register kernel up to one one-warp chunk of pairs (E = 128: 8 pairs, batch 1), the
    workspace kernel above (timed alone on an H100 at 8bcd799, ``benchmarks/decode_plan.py``: the register plan
    lost from 32 pairs up, benchmarks/results/HISTORY.md), also in the plan + alignment launch; ``registers``
    True/False still force either."""
    from moe_offload.kernels import decode_miss as dm

    assert dm.register_plan_fits(8, 128) and not dm.register_plan_fits(9, 128)
    assert not dm.register_plan_fits(1, 5000)
    seen = []
    for name in ("_plan_regs_kernel", "_plan_kernel", "_plan_align_kernel"):
        kernel = getattr(dm, name)
        monkeypatch.setattr(dm, name, _Spy(kernel, name, seen))
    E = 128
    host = torch.zeros((E, 4), dtype=torch.uint8, device=DEVICE)
    pool = torch.zeros((E + 64, 4), dtype=torch.uint8, device=DEVICE)
    slot_of_E = torch.arange(E, dtype=torch.int32, device=DEVICE)
    for T, registers, align, want in ((1, None, None, ("_plan_regs_kernel", None)), (2, None, None, ("_plan_kernel", None)),
                                      (4, True, None, ("_plan_regs_kernel", None)),
                                      (1, None, 16, ("_plan_align_kernel", True)),
                                      (4, None, 16, ("_plan_align_kernel", False))):
        seen.clear()
        ids = torch.randint(0, E, (T, 8), device=DEVICE)
        dm.plan_misses(slot_of_E, ids, host, pool, E, registers=registers, align_block_m=align)
        assert seen == [want], (T, registers, align, seen)


class _Spy:
    """A launcher that records which plan kernel ran (and its REGS) before launching it."""

    def __init__(self, kernel, name, seen):
        self.kernel, self.name, self.seen = kernel, name, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append((self.name, kwargs.get("REGS")))
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_the_routing_launch_bench_runs_every_form_on_the_cpu(tmp_path):
    """``benchmarks/decode_plan.py --smoke``: every form (separate, plan + alignment, route) runs and gives the same
    rows (the script exits otherwise), and the report is written."""
    import json
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_plan.py"
    main = runpy.run_path(str(script))["main"]
    assert main(["--smoke", "--out", str(tmp_path), "--tokens", "1", "8", "--experts", "40"]) == 0
    report = json.loads(next(tmp_path.glob("decode_plan-*.json")).read_text())
    variants = {(r["tokens"], r["variant"]) for r in report["rows"]}
    assert (8, "topk+plan+align (route), copy") in variants and (1, "topk, plan (default), copy") in variants
