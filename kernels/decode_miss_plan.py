"""The decode miss plan (Triton), kernel 1 of ``decode_miss.py``: one program that maps every routed pair to a pool
row and lists the step's distinct missing experts; also the plan phase of the larger launches
(``decode_miss.plan_misses``' plan + alignment, ``decode_route.py``'s top-k + plan).

Legend as in ``decode_miss.py``: T tokens, K top-k, M = T*K routed pairs, E experts of the layer, EB the register
plan's per-expert vector length (a power of two >= E), MC pairs of one register-plan chunk.

Two bodies that the tests check agree: ``_plan_ws`` marks the missing experts in an [E] workspace in global memory
(phases separated by ``tl.debug_barrier()``) and also serves the lookahead's dense plan; ``_plan_regs`` keeps the
marks in registers (``[MC, EB]`` match matrices), where ``register_plan_fits``. The launches and their host-side
arguments (``plan_outputs``, ``plan_workspace``, ``plan_chunk``) are here; ``decode_miss.plan_misses`` picks one.
No host sync anywhere: grids depend on host-known shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.kernels.pdl import pdl_enter
from moe_offload.kernels.decode_moe import _align_sorted

_PLAN_BLOCK = 1024  # elements per step of the plan program's loops (elementwise; not tuned)


@triton.jit
def _pairs(ids_ptr, slot_ptr, pf_ptr, m0, M, E, CHUNK: tl.constexpr, PF: tl.constexpr, IDS_VOLATILE: tl.constexpr):
    """Pairs ``m0 .. m0 + CHUNK - 1``: ``(offs_m, ids, valid, slot, pf)``; ids int64 (-1 past M), valid = inside M
    and the layer, slot int32 (0 where not valid), pf int32 the lookahead row of a missing expert (PF), else -1.
    IDS_VOLATILE: the ids were written by other programs of this launch (read past the SM's L1)."""
    offs_m = m0 + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs_m, mask=offs_m < M, other=-1, volatile=IDS_VOLATILE).to(tl.int64)
    valid = (offs_m < M) & (ids >= 0) & (ids < E)
    slot = tl.load(slot_ptr + ids, mask=valid, other=0).to(tl.int32)
    if PF:
        pf = tl.load(pf_ptr + ids, mask=valid & (slot < 0), other=-1).to(tl.int32)
    else:
        pf = tl.full((CHUNK,), -1, tl.int32)
    return offs_m, ids, valid, slot, pf


@triton.jit
def _add_counts(stats_ptr, n_pairs, n_missed, n_copied, n_routed, n_pf, STATS: tl.constexpr):
    """Adds the step's counts to the first STATS (3 to 5) int64 counters at ``stats_ptr``."""
    if STATS > 0:
        tl.store(stats_ptr, tl.load(stats_ptr) + n_pairs)
        tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + n_missed)
        tl.store(stats_ptr + 2, tl.load(stats_ptr + 2) + n_copied)
    if STATS >= 4:
        tl.store(stats_ptr + 3, tl.load(stats_ptr + 3) + n_routed)
    if STATS >= 5:
        tl.store(stats_ptr + 4, tl.load(stats_ptr + 4) + n_pf)


@triton.jit
def _plan_kernel(slot_ptr, ids_ptr, need_ptr, scratch_of_ptr, miss_ptr, count_ptr, rows_ptr,
                 stats_ptr, record_ptr, pf_ptr, M, E, scratch_base, BLOCK: tl.constexpr, STATS: tl.constexpr,
                 PF: tl.constexpr, DENSE: tl.constexpr, USE_PDL: tl.constexpr = False):
    """The workspace plan, one program (``_plan_ws``)."""
    pdl_enter(USE_PDL)
    _plan_ws(slot_ptr, ids_ptr, need_ptr, scratch_of_ptr, miss_ptr, count_ptr, rows_ptr, stats_ptr, record_ptr,
             pf_ptr, M, E, scratch_base, BLOCK, STATS, PF, DENSE, False)


@triton.jit
def _plan_ws(slot_ptr, ids_ptr, need_ptr, scratch_of_ptr, miss_ptr, count_ptr, rows_ptr,
             stats_ptr, record_ptr, pf_ptr, M, E, scratch_base, BLOCK: tl.constexpr, STATS: tl.constexpr,
             PF: tl.constexpr, DENSE: tl.constexpr, IDS_VOLATILE: tl.constexpr):
    """The body of ``_plan_kernel`` (and the plan phase of ``_plan_align_kernel`` and
    ``decode_route._route_plan_kernel`` where ``register_plan_fits`` says no). One program.
    need[E] and scratch_of[E] are workspaces (any initial contents). STATS > 0 (the number of
    counters at ``stats_ptr``, int64) also counts the step and stores its ids into ``record_ptr[0:M]`` (int32):
    adds routed pairs, missed pairs, distinct missed experts copied here to ``stats_ptr[0:3]``; with STATS >= 4
    the distinct routed experts to ``stats_ptr[3]``; with PF and STATS >= 5 the distinct missing experts read
    from a lookahead row to ``stats_ptr[4]``.

    PF (a lookahead copy, ``lookahead.py``): ``pf_ptr[E]`` int32 is the row a missing expert was already
    copied into (-1: none); such an expert is read there (not copied again). DENSE (the lookahead's own plan):
    no rows and no record; ``scratch_of_ptr`` becomes ``[E]`` rows for every expert: ``scratch_base + j`` for
    the j-th distinct missing one, -1 for the rest; with STATS ``stats_ptr[0]`` gets the distinct missing
    count. IDS_VOLATILE: the ids were written by other programs of this launch (read past the SM's L1)."""
    tl.static_assert(DENSE or STATS == 0 or STATS >= 3, "STATS is the number of counters: 0, or 3 to 5")
    for e0 in range(0, E, BLOCK):
        offs_e = e0 + tl.arange(0, BLOCK)
        tl.store(need_ptr + offs_e, tl.zeros((BLOCK,), tl.int32), mask=offs_e < E)
    tl.debug_barrier()
    for m0 in range(0, M, BLOCK):  # mark missing experts (several pairs may store the same value)
        offs_m = m0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs_m, mask=offs_m < M, other=-1, volatile=IDS_VOLATILE).to(tl.int64)
        valid = (offs_m < M) & (ids >= 0) & (ids < E)
        slot = tl.load(slot_ptr + ids, mask=valid, other=0)
        mark = tl.where(slot >= 0, 3, 1)  # 3: resident (counted as routed), 1: missing, to copy
        if PF:  # 2: missing but already copied by the lookahead (read there, not copied)
            pf = tl.load(pf_ptr + ids, mask=valid & (slot < 0), other=-1)
            mark = tl.where((slot < 0) & (pf >= 0), 2, mark)
        tl.store(need_ptr + ids, mark, mask=valid)
    tl.debug_barrier()
    total = tl.full((), 0, tl.int32)
    n_pf = tl.full((), 0, tl.int64)
    n_routed = tl.full((), 0, tl.int64)
    for e0 in range(0, E, BLOCK):  # exclusive scan: scratch index of each missing expert, by ascending id
        offs_e = e0 + tl.arange(0, BLOCK)
        marked = tl.load(need_ptr + offs_e, mask=offs_e < E, other=0, volatile=True)
        need = (marked == 1).to(tl.int32)
        idx = total + tl.cumsum(need, 0) - need
        missing = (offs_e < E) & (need > 0)
        if DENSE:
            tl.store(scratch_of_ptr + offs_e, tl.where(missing, scratch_base + idx, -1), mask=offs_e < E)
        else:
            tl.store(scratch_of_ptr + offs_e, idx, mask=missing)
        tl.store(miss_ptr + idx, offs_e.to(tl.int32), mask=missing)
        total += tl.sum(need, 0)
        n_pf += tl.sum((marked == 2).to(tl.int64), 0)
        n_routed += tl.sum((marked > 0).to(tl.int64), 0)
    tl.store(count_ptr, total)
    if DENSE:
        if STATS > 0:
            tl.store(stats_ptr, tl.load(stats_ptr) + total.to(tl.int64))
    else:
        tl.debug_barrier()
        n_pairs = tl.full((), 0, tl.int64)
        n_missed = tl.full((), 0, tl.int64)
        for m0 in range(0, M, BLOCK):
            offs_m, ids, valid, slot, pf = _pairs(ids_ptr, slot_ptr, pf_ptr, m0, M, E, BLOCK, PF, IDS_VOLATILE)
            scratch = tl.load(scratch_of_ptr + ids, mask=valid & (slot < 0) & (pf < 0), other=0, volatile=True)
            row = tl.where(slot >= 0, slot, tl.where(pf >= 0, pf, scratch_base + scratch))
            tl.store(rows_ptr + offs_m, tl.where(valid, row, -1), mask=offs_m < M)
            if STATS > 0:
                n_pairs += tl.sum(valid.to(tl.int64), 0)
                n_missed += tl.sum((valid & (slot < 0)).to(tl.int64), 0)
                tl.store(record_ptr + offs_m, ids.to(tl.int32), mask=offs_m < M)
        _add_counts(stats_ptr, n_pairs, n_missed, total.to(tl.int64), n_routed, n_pf, STATS)


@triton.jit
def _plan_regs(slot_ptr, ids_ptr, miss_ptr, count_ptr, rows_ptr, stats_ptr, record_ptr, pf_ptr,
               M, E, scratch_base, EB: tl.constexpr, MC: tl.constexpr, STATS: tl.constexpr, PF: tl.constexpr,
               IDS_VOLATILE: tl.constexpr):
    """The body of ``_plan_regs_kernel`` (and the plan phase of ``_plan_align_kernel`` and
    ``decode_route._route_plan_kernel`` where ``register_plan_fits``)."""
    offs_e = tl.arange(0, EB)
    routed_e = tl.zeros((EB,), tl.int32)  # experts a valid pair routes to
    copy_e = tl.zeros((EB,), tl.int32)  # missing experts copied by this step (ascending id -> scratch index)
    pf_e = tl.zeros((EB,), tl.int32)  # missing experts read from a lookahead row
    n_pairs = tl.full((), 0, tl.int64)
    n_missed = tl.full((), 0, tl.int64)
    for m0 in range(0, M, MC):
        offs_m, ids, valid, slot, pf = _pairs(ids_ptr, slot_ptr, pf_ptr, m0, M, E, MC, PF, IDS_VOLATILE)
        missed = valid & (slot < 0)
        from_pf = missed & (pf >= 0)
        match = (ids[:, None] == offs_e[None, :]) & valid[:, None]
        routed_e = tl.maximum(routed_e, tl.max(match.to(tl.int32), axis=0))
        copy_e = tl.maximum(copy_e, tl.max((match & (missed & ~from_pf)[:, None]).to(tl.int32), axis=0))
        pf_e = tl.maximum(pf_e, tl.max((match & from_pf[:, None]).to(tl.int32), axis=0))
        if STATS > 0:
            n_pairs += tl.sum(valid.to(tl.int64), 0)
            n_missed += tl.sum(missed.to(tl.int64), 0)
            tl.store(record_ptr + offs_m, ids.to(tl.int32), mask=offs_m < M)
    scratch_e = tl.cumsum(copy_e, 0) - copy_e  # exclusive scan: rank among the copied experts by ascending id
    total = tl.sum(copy_e, 0)
    tl.store(miss_ptr + scratch_e, offs_e.to(tl.int32), mask=copy_e > 0)
    tl.store(count_ptr, total)
    for m0 in range(0, M, MC):
        offs_m, ids, valid, slot, pf = _pairs(ids_ptr, slot_ptr, pf_ptr, m0, M, E, MC, PF, IDS_VOLATILE)
        match = (ids[:, None] == offs_e[None, :]) & valid[:, None]
        scratch = tl.sum(tl.where(match, scratch_e[None, :], 0), axis=1)
        row = tl.where(slot >= 0, slot, tl.where(pf >= 0, pf, scratch_base + scratch))
        tl.store(rows_ptr + offs_m, tl.where(valid, row, -1), mask=offs_m < M)
    _add_counts(stats_ptr, n_pairs, n_missed, total.to(tl.int64), tl.sum(routed_e.to(tl.int64), 0),
                tl.sum(pf_e.to(tl.int64), 0), STATS)


@triton.jit
def _plan_regs_kernel(slot_ptr, ids_ptr, miss_ptr, count_ptr, rows_ptr, stats_ptr, record_ptr, pf_ptr,
                      M, E, scratch_base, EB: tl.constexpr, MC: tl.constexpr, STATS: tl.constexpr,
                      PF: tl.constexpr, USE_PDL: tl.constexpr = False):
    """``_plan_kernel``'s non-DENSE result, bit for bit, with the per-expert marks kept in registers (``[EB]``
    vectors, EB >= E) instead of an [E] workspace in global memory: no barriers and no store -> load round trips,
    one gather of the slot table (and of the lookahead map with PF). Pairs are taken MC at a time as an
    ``[MC, EB]`` match matrix (``ids[m] == e``): a max over pairs marks the experts, a sum picks each pair's
    scratch index. Same arguments and STATS/PF meaning as ``_plan_kernel``."""
    pdl_enter(USE_PDL)
    _plan_regs(slot_ptr, ids_ptr, miss_ptr, count_ptr, rows_ptr, stats_ptr, record_ptr, pf_ptr, M, E, scratch_base,
               EB, MC, STATS, PF, False)


@triton.jit
def _plan_phase(slot_ptr, ids_ptr, work_ptr, E_work, miss_ptr, count_ptr, rows_ptr, stats_ptr, record_ptr,
                M, E, scratch_base, EB: tl.constexpr, MC: tl.constexpr, STATS: tl.constexpr, REGS: tl.constexpr,
                BLOCK: tl.constexpr, IDS_VOLATILE: tl.constexpr):
    """The plan (no lookahead row map) inside a larger launch: the register plan (REGS: ``register_plan_fits``),
    else the workspace plan over ``work_ptr`` (``[2, E_work]`` int32: need, scratch_of)."""
    if REGS:
        _plan_regs(slot_ptr, ids_ptr, miss_ptr, count_ptr, rows_ptr, stats_ptr, record_ptr, slot_ptr, M, E,
                   scratch_base, EB, MC, STATS, False, IDS_VOLATILE)
    else:
        _plan_ws(slot_ptr, ids_ptr, work_ptr, work_ptr + E_work, miss_ptr, count_ptr, rows_ptr, stats_ptr, record_ptr,
                 slot_ptr, M, E, scratch_base, BLOCK, STATS, False, False, IDS_VOLATILE)


@triton.jit
def _plan_align_kernel(slot_ptr, ids_ptr, work_ptr, E_work, miss_ptr, count_ptr, rows_ptr, stats_ptr, record_ptr,
                       key_ptr, sorted_ids_ptr, block_row_ptr, num_padded_ptr,
                       M, E, scratch_base, N, last_key, EB: tl.constexpr, MC: tl.constexpr, STATS: tl.constexpr,
                       REGS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, MP: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    """One program, two phases: the plan (``_plan_phase``), then, after a barrier (one CTA sees its own global
    writes after it), ``decode_moe._align_sorted_kernel`` over the rows it just wrote: the plan and the tile
    kernels' alignment of a decode step in one launch instead of two, with the same outputs."""
    pdl_enter(USE_PDL)
    _plan_phase(slot_ptr, ids_ptr, work_ptr, E_work, miss_ptr, count_ptr, rows_ptr, stats_ptr, record_ptr, M, E,
                scratch_base, EB, MC, STATS, REGS, BLOCK, False)
    tl.debug_barrier()
    _align_sorted(rows_ptr, key_ptr, sorted_ids_ptr, block_row_ptr, num_padded_ptr, M, N, last_key, BLOCK_M, MP, True)


#: the register plan's match matrix holds at most this many elements ([MC pairs, EB experts]); experts past it
#: (EB > this: more than 4,096 experts) take the workspace plan
PLAN_REGS_ELEMENTS = 4096


def experts_block(E: int) -> int:
    """EB: the register plan's per-expert vectors for a layer of E experts (a power of two >= 16)."""
    return max(16, triton.next_power_of_2(E))


def plan_outputs(T: int, K: int, E: int, dev, stats):
    """``(rows_TK, miss_experts_X, num_missing_1, counts, record, n_stats)``: the unwritten outputs of a plan of T x K
    pairs over E experts, and the STATS arguments (``stats`` checked by the caller; without it the counts and record
    arguments are placeholders the kernels never touch, and ``n_stats`` is 0)."""
    rows_TK = torch.empty((T, K), dtype=torch.int32, device=dev)
    miss_experts_X = torch.empty(max(min(T * K, E), 1), dtype=torch.int32, device=dev)
    num_missing_1 = torch.empty(1, dtype=torch.int32, device=dev)
    counts, record = stats if stats is not None else (num_missing_1, rows_TK)
    return rows_TK, miss_experts_X, num_missing_1, counts, record, min(counts.shape[0], 5) if stats is not None else 0


def plan_workspace(E: int, registers: bool, dev) -> tuple[torch.Tensor, int]:
    """``(work, E_work)``: the workspace plan's ``[2 * E_work]`` int32 (need, scratch_of; any contents), or a
    one-element placeholder the register plan never touches."""
    if registers:
        return torch.empty(1, dtype=torch.int32, device=dev), 0
    return torch.empty(2 * max(E, 1), dtype=torch.int32, device=dev), max(E, 1)


def plan_chunk(EB: int, num_warps: int = 4) -> int:
    """MC: the pairs of one ``[MC, EB]`` match chunk of the register plan in a program of ``num_warps`` warps
    (``PLAN_REGS_ELEMENTS`` elements at 4 warps)."""
    return max(1, PLAN_REGS_ELEMENTS // 4 * num_warps // EB)


def register_plan_fits(M: int, E: int) -> bool:
    """Whether the register plan serves a step of M pairs over E experts: where they fit one chunk of a one-warp
    program (8 pairs at E = 128). Each chunk is a chain of dependent global loads (ids, then the slot table) and
    cross-thread reductions, twice over, in one program. Timed alone on an H100 at 8bcd799
    (``benchmarks/decode_plan.py``, benchmarks/results/HISTORY.md): 6.80 vs 7.16 us with the workspace plan at 8 pairs,
    but 8.93 vs 7.15 at 32 (one chunk at 4 warps), 18.4 vs 7.3 at 128 and 54.4 vs 7.3 at 512. Above that the workspace
    plan (``_plan_ws``: a fixed number of barriers, 1,024 pairs a step) runs instead."""
    EB = experts_block(E)
    return EB <= PLAN_REGS_ELEMENTS and M <= plan_chunk(EB, num_warps=1)
