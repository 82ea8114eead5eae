"""The router's top-k and the decode miss plan (``decode_miss.py``) in one launch (Triton), for decode steps of up to
``ROUTE_PLAN_MAX_PAIRS`` routed pairs (``compute.fused_moe_launches``; ``moe_offload/experts.py`` ``route``).

Legend: T tokens, E experts, K top-k, M = T*K routed pairs, N rows of the slot pool.

One program per token runs ``router.topk_row`` (the router kernel's row, same warps, so the same fp32 sums); the
program that finishes last (a barrier, then an acq_rel counter) runs the plan and, when asked, the tile
kernels' sorted alignment over every token's ids, read past L1. Same outputs, bit for bit, as ``router.router_topk``
followed by ``decode_miss.serve_misses_plan``; then the same copy of the missing experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.kernels import pdl
from moe_offload.kernels.pdl import pdl_enter
from moe_offload.kernels.decode_miss import MissCopyConfig, MissPlan, _check, _check_stats, copy_misses
from moe_offload.kernels.decode_miss_plan import (
    _PLAN_BLOCK,
    _plan_phase,
    experts_block,
    plan_chunk,
    plan_outputs,
    plan_workspace,
    register_plan_fits,
)
from moe_offload.kernels.decode_moe import _align_sorted, alignment_buffers, sorted_align_launch
from moe_offload.kernels.moe_align import MoeAlignment
from moe_offload.kernels.nvfp4 import device_guard
from moe_offload.kernels.router import router_outputs, topk_launch, topk_row


@triton.jit
def _route_plan_kernel(logits_ptr, stride_t, w_ptr, ids_ptr, done_ptr, K,
                       slot_ptr, work_ptr, E_work, miss_ptr, count_ptr, rows_ptr, stats_ptr, record_ptr,
                       key_ptr, sorted_ids_ptr, block_row_ptr, num_padded_ptr,
                       M, E, scratch_base, N, last_key,
                       RENORM: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr, EB: tl.constexpr, MC: tl.constexpr,
                       STATS: tl.constexpr, REGS: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                       BLOCK_M: tl.constexpr, MP: tl.constexpr, USE_PDL: tl.constexpr = False):
    """The router's top-k and the miss plan (+ with ALIGN the tile kernels' alignment) of a decode step in one
    launch, one program per token. Each program runs ``router.topk_row`` for its token; the last one to finish
    (a counter at ``done_ptr``, int32, 0 between launches: that program sets it back) then runs
    ``_plan_align_kernel``'s phases over every token's ids. The order: all threads' stores, a barrier, then
    the counter's acq_rel atomic (release: the stores before it are visible to whoever acquires it), and the
    last program reads the ids past L1 (volatile). REGS: the register plan (``register_plan_fits``), else
    the workspace plan over ``work_ptr``."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    topk_row(logits_ptr, stride_t, w_ptr, ids_ptr, t.to(tl.int64), E, K, RENORM, EP, KP)
    tl.debug_barrier()
    done = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch (a graph replay)
        _plan_phase(slot_ptr, ids_ptr, work_ptr, E_work, miss_ptr, count_ptr, rows_ptr, stats_ptr, record_ptr, M, E,
                    scratch_base, EB, MC, STATS, REGS, BLOCK, True)
        if ALIGN:
            tl.debug_barrier()
            _align_sorted(rows_ptr, key_ptr, sorted_ids_ptr, block_row_ptr, num_padded_ptr, M, N, last_key, BLOCK_M,
                          MP, True)


#: most routed pairs a step may have for ``route_and_serve``'s one launch (its plan runs in the router's launch
#: shape, one warp per token up to 256 experts: the register plan where the pairs fit one smaller chunk
#: (``decode_miss_plan.register_plan_fits``), else the workspace plan)
ROUTE_PLAN_MAX_PAIRS = 128


def route_plan_applies(T: int, K: int, lookahead: bool) -> bool:
    """Whether ``route_and_serve`` runs the router's top-k and the plan in one launch for a step of T tokens at top-K
    (else: ``router_topk``, then ``serve_misses_plan``); any number of experts the router takes."""
    return 0 < T * K <= ROUTE_PLAN_MAX_PAIRS and not lookahead


def route_and_serve(logits_TE: torch.Tensor, top_k: int, renorm: bool, w_dtype: torch.dtype, slot_of_E: torch.Tensor,
                    host_rows_ER: torch.Tensor, pool_rows_NR: torch.Tensor, scratch_base: int, done_1: torch.Tensor,
                    stats=None, align_block_m: int | None = None, config: MissCopyConfig | None = None):
    """``(w_TK, ids_TK, plan)``: ``router.router_topk(logits_TE, top_k, renorm, w_dtype)`` and
    :func:`serve_misses_plan` of its ids, with the top-k, the plan and (``align_block_m``) the alignment in one launch
    (``_route_plan_kernel``), then the copy. Same results, bit for bit, as the two calls. Needs
    ``route_plan_applies`` (no lookahead row map). ``done_1``: an int32 ``[1]`` counter on the device, 0 before the
    first call; each launch leaves it at 0 (one counter per call site that may be in flight at once, e.g. per
    layer)."""
    logits_TE, w_TK, ids_TK = router_outputs(logits_TE, top_k, w_dtype)
    T, E = logits_TE.shape
    _check(slot_of_E, ids_TK, host_rows_ER, pool_rows_NR, scratch_base)
    dev = pool_rows_NR.device
    if not route_plan_applies(T, top_k, False) or host_rows_ER.shape[0] != E:
        raise ValueError(f"route_and_serve: T*K={T * top_k} pairs over E={E} experts (host rows for "
                         f"{host_rows_ER.shape[0]}): the one-launch form takes 1..{ROUTE_PLAN_MAX_PAIRS} pairs and the "
                         "layer's own experts; use router_topk and serve_misses_plan")
    if done_1.dtype != torch.int32 or done_1.numel() != 1 or done_1.device != dev:
        raise ValueError(f"done_1 must be an int32 [1] counter on {dev}, got {done_1.dtype} {tuple(done_1.shape)} on "
                         f"{done_1.device}")
    if stats is not None:
        _check_stats(stats, T, top_k, dev)
    M = T * top_k
    rows_TK, miss_experts_X, num_missing_1, counts_3, record_MK, n_stats = plan_outputs(T, top_k, E, dev, stats)
    N = pool_rows_NR.shape[0]
    launch = topk_launch(E, top_k)
    EB = experts_block(E)
    MC = max(1, min(triton.next_power_of_2(M), plan_chunk(EB, launch["num_warps"])))
    regs = register_plan_fits(M, E)
    work, E_work = plan_workspace(E, regs, dev)
    alignment = None if align_block_m is None else alignment_buffers(M, N, align_block_m, dev)
    key_MP, MP, _ = sorted_align_launch(M, dev)
    a = alignment or MoeAlignment(rows_TK, rows_TK, rows_TK, 1)  # unused without ALIGN
    with device_guard(dev):
        _route_plan_kernel[(T,)](logits_TE, logits_TE.stride(0), w_TK, ids_TK, done_1, top_k,
                                 slot_of_E, work, E_work, miss_experts_X, num_missing_1, rows_TK, counts_3, record_MK,
                                 key_MP, a.sorted_ids_P, a.block_row_B, a.num_padded_1,
                                 M, E, scratch_base, N, N * MP, RENORM=renorm, EB=EB, MC=MC, STATS=n_stats,
                                 REGS=regs, BLOCK=_PLAN_BLOCK, ALIGN=alignment is not None,
                                 BLOCK_M=align_block_m or 1, MP=MP, **launch, **pdl.launch_kwargs())
    plan = MissPlan(rows_TK, miss_experts_X, num_missing_1, alignment)
    copy_misses(plan, host_rows_ER, pool_rows_NR, scratch_base, config)
    return w_TK, ids_TK, plan
