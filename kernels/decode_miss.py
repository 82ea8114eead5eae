"""Decode miss server (Triton): routed pair -> pool row, copying missing experts from mapped host memory.

Legend: T tokens, K top-k, M = T*K routed pairs, E experts of the layer, R bytes of one expert row,
N rows of the slot pool (S slots + scratch rows), X = min(M, E) scratch rows a step may need,
W row words (R / word bytes), C chunks of a row.

For every routed pair (t, k) with expert ``e = topk_ids_TK[t, k]``:
- resident (``slot_of_E[e] >= 0``): ``rows_TK[t, k] = slot_of_E[e]``; nothing is copied;
- missing: each distinct missing expert gets one scratch row ``scratch_base + j``, j its rank among the
  step's distinct missing experts in ascending expert id (deterministic), and SMs copy its host row
  ``host_rows_ER[e]`` there; ``rows_TK[t, k] = scratch_base + j``. So ``rows_TK >= scratch_base``
  marks exactly the missed pairs (free miss info for stats, no extra output);
- an id outside [0, E) gets row -1 (the fused MoE kernels leave such pairs out) and copies nothing.

Two launches, no host sync, grids sized from host-known shapes only (CUDA-graph capturable; the table
and the ids are read at replay time):
1. The plan (``decode_miss_plan.py``), one program, in one of two kernels that the tests check agree.
   ``_plan_kernel`` marks the missing experts in an [E] workspace in global memory, phases separated by ``tl.debug_barrier()`` (one CTA: global
   writes before the barrier are visible after it), and scans them into scratch indices, a list of missing
   experts (+ their count) and ``rows_TK``; it also serves the lookahead's dense plan. ``_plan_regs_kernel`` does
   the same in registers (a max over an ``[pairs, E]`` match matrix, pairs taken a chunk at a time; each pair's
   scratch index a sum over its match row), with no store -> barrier -> load round trips, but each chunk is a
   chain of dependent loads: it runs only where ``register_plan_fits`` (one one-warp chunk, batch 1 at E = 128;
   timed alone on an H100 at 8bcd799, ``benchmarks/decode_plan.py``).
2. ``_copy_kernel``, persistent: (missing expert, chunk of its row) work items, ``count * C`` of them,
   spread over a fixed grid (``ctas_per_sm`` x SMs), so one miss still uses many SMs. Rows are copied
   as int32 words where the rows allow it, with the alignment of the row starts passed as a constexpr so
   Triton emits 16-byte vector loads when rows start on 16-byte boundaries (R % 16 == 0). The NVFP4
   rows of Qwen3-30B-A3B (B = 2,654,220) and Flash-Next are only 4-byte aligned: padding the row
   stride of the host store and the pool to a multiple of 16 would give 16-byte vectors
   (``benchmarks/decode_kernels.py`` measures both).

The plan also runs in larger launches (``compute.fused_moe_launches``), with the same outputs as the separate ones:
``_plan_align_kernel`` (the plan, then the tile kernels' sorted alignment of its rows, one program), and with the
router's top-k in ``decode_route.py``.

On CUDA, ``host_rows_ER`` must be a device tensor aliasing pinned, mapped host memory
(``ExpertStore.device_rows(layer, device)``); the copy then reads it over PCIe (UVA). Under
``TRITON_INTERPRET=1`` every tensor is a CPU tensor and the same kernels run in the interpreter (CI).
Their plain-torch oracles, which are also the CPU path's miss server, are in ``decode_miss_reference.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_offload.kernels import pdl
from moe_offload.kernels.pdl import pdl_enter
from moe_offload.kernels.decode_moe import (
    SORTED_ALIGN_MAX_PAIRS,
    alignment_buffers,
    decode_align,
    sorted_align_launch,
)
from moe_offload.kernels.moe_align import MoeAlignment
from moe_offload.kernels.decode_miss_reference import (count_step_reference, prefetch_misses_reference,
                                                      serve_misses_reference)
from moe_offload.kernels.decode_miss_plan import (
    _PLAN_BLOCK,
    PLAN_REGS_ELEMENTS,
    _plan_align_kernel,
    _plan_kernel,
    _plan_regs_kernel,
    experts_block,
    plan_chunk,
    plan_outputs,
    plan_workspace,
    register_plan_fits,
)
from moe_offload.kernels.nvfp4 import device_guard

# the oracles (decode_miss_reference.py), imported from here by the CPU path and patched here by the tests
__all__ = ["MissCopyConfig", "MissPlan", "plan_misses", "prefetch_misses", "copy_misses", "serve_misses",
           "serve_misses_plan", "count_step_reference", "prefetch_misses_reference", "serve_misses_reference"]

_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class MissCopyConfig:
    """Shape of the copy launch: ``chunk_bytes`` per work item (a power of two >= 16), ``ctas_per_sm``
    programs per SM (CPU: programs in all), ``num_warps`` per program.

    The defaults are a starting point, not a tuned result: 16 KiB per item keeps 8 vectors of 16 B in
    flight per thread at 4 warps, and 4 CTAs per SM give ~2 MB of reads in flight over the GPU, far
    above what PCIe latency x bandwidth needs (~100 KB). ``benchmarks/decode_kernels.py`` sweeps them."""

    chunk_bytes: int = 16384
    ctas_per_sm: int = 4
    num_warps: int = 4

    def __post_init__(self):
        if self.chunk_bytes < 16 or self.chunk_bytes & (self.chunk_bytes - 1):
            raise ValueError(f"chunk_bytes={self.chunk_bytes}: must be a power of two >= 16")
        if self.ctas_per_sm < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"invalid {self}: ctas_per_sm >= 1, num_warps a power of two <= 16")


@dataclass
class MissPlan:
    """What the plan kernel wrote (device tensors, no host sync).

    ``rows_TK`` int32 pool row of every pair (``>= scratch_base`` where the pair missed, -1 for an id
    outside [0, E)); ``miss_experts_X`` int32 the distinct missing experts in ascending id (entries
    past the count are undefined); ``num_missing_1`` int32 their count (copy it to pinned host memory
    non-blockingly for stats); ``alignment``: the rows grouped for the tile kernels when asked for
    (``align_block_m``; ``decode_moe.decode_align``'s result), else None."""

    rows_TK: torch.Tensor
    miss_experts_X: torch.Tensor
    num_missing_1: torch.Tensor
    alignment: MoeAlignment | None = None


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, miss_ptr, count_ptr, row_words, src_stride_v, dst_stride_v, scratch_base,
                 chunks, BLOCK: tl.constexpr, VEC: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Work item w = (x, c): words [c*BLOCK, (c+1)*BLOCK) of host row miss[x] -> pool row scratch_base + x.
    Strides are in units of VEC words, so every row start is known to be VEC-word aligned."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = tl.load(count_ptr) * chunks
    for w in range(pid, total, nprog):
        x = w // chunks
        c = w - x * chunks
        e = tl.load(miss_ptr + x).to(tl.int64)
        src = src_ptr + tl.multiple_of(e * src_stride_v * VEC, VEC)
        dst = dst_ptr + tl.multiple_of((scratch_base + x).to(tl.int64) * dst_stride_v * VEC, VEC)
        offs = tl.max_contiguous(tl.multiple_of(c * BLOCK + tl.arange(0, BLOCK), BLOCK), BLOCK)
        if c * BLOCK + BLOCK <= row_words:
            tl.store(dst + offs, tl.load(src + offs))
        else:
            inside = offs < row_words
            tl.store(dst + offs, tl.load(src + offs, mask=inside), mask=inside)


def _check(slot_of_E, topk_ids_TK, host_rows_ER, pool_rows_NR, scratch_base) -> None:
    dev = pool_rows_NR.device if isinstance(pool_rows_NR, torch.Tensor) else None
    for name, t in (("host_rows_ER", host_rows_ER), ("pool_rows_NR", pool_rows_NR)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D uint8 tensor [rows, R], got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} rows must be contiguous (stride(1) == 1), got strides {tuple(t.stride())}")
    if host_rows_ER.shape[1] != pool_rows_NR.shape[1]:
        raise ValueError(f"row bytes differ: host_rows_ER {tuple(host_rows_ER.shape)} vs pool_rows_NR "
                         f"{tuple(pool_rows_NR.shape)}")
    if host_rows_ER.device != dev:
        raise ValueError(f"host_rows_ER is on {host_rows_ER.device} but pool_rows_NR on {dev}; on CUDA pass the "
                         "mapped device view of the host rows (ExpertStore.device_rows(layer, device))")
    E = host_rows_ER.shape[0]
    if not isinstance(slot_of_E, torch.Tensor) or slot_of_E.dtype not in _INDEX_DTYPES or tuple(slot_of_E.shape) != (E,):
        raise ValueError(f"slot_of_E must be int32/int64 [E={E}], got {getattr(slot_of_E, 'dtype', None)} "
                         f"{tuple(getattr(slot_of_E, 'shape', ()))}")
    if not isinstance(topk_ids_TK, torch.Tensor) or topk_ids_TK.dtype not in _INDEX_DTYPES or topk_ids_TK.dim() != 2:
        raise ValueError(f"topk_ids_TK must be an int32/int64 [T, K] tensor, got {getattr(topk_ids_TK, 'dtype', None)} "
                         f"{tuple(getattr(topk_ids_TK, 'shape', ()))}")
    for name, t in (("slot_of_E", slot_of_E), ("topk_ids_TK", topk_ids_TK)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but pool_rows_NR on {dev}")
    X = min(topk_ids_TK.numel(), E)
    if not isinstance(scratch_base, int) or scratch_base < 0 or scratch_base + X > pool_rows_NR.shape[0]:
        raise ValueError(f"scratch_base={scratch_base!r}: rows scratch_base .. scratch_base + min(T*K, E) - 1 = "
                         f"{scratch_base} .. {scratch_base + X - 1} must lie in pool_rows_NR's {pool_rows_NR.shape[0]} "
                         "rows (size the pool as S slots + min(T*K, E) scratch rows for the largest T)")


def _check_row_map(pf_row_E, E: int, dev) -> None:
    if (not isinstance(pf_row_E, torch.Tensor) or pf_row_E.dtype != torch.int32 or tuple(pf_row_E.shape) != (E,)
            or pf_row_E.device != dev or pf_row_E.stride(0) != 1):
        raise ValueError(f"the lookahead row map must be a contiguous int32 [E={E}] tensor on {dev}, got "
                         f"{getattr(pf_row_E, 'dtype', type(pf_row_E).__name__)} {tuple(getattr(pf_row_E, 'shape', ()))}")


def _check_counts(counts_C: torch.Tensor, need: int, dev) -> None:
    if (counts_C.dim() != 1 or counts_C.shape[0] < need or counts_C.dtype != torch.int64 or counts_C.device != dev
            or counts_C.stride(0) != 1):
        raise ValueError(f"stats counts must be a contiguous int64 [>= {need}] on {dev}, got {counts_C.dtype} "
                         f"{tuple(counts_C.shape)} on {counts_C.device}")


def _check_stats(stats, T: int, K: int, dev, need: int = 3) -> None:
    counts_3, record_MK = stats
    _check_counts(counts_3, need, dev)
    if (record_MK.dtype != torch.int32 or record_MK.dim() != 2 or record_MK.shape[0] < T or record_MK.shape[1] != K
            or not record_MK.is_contiguous() or record_MK.device != dev):
        raise ValueError(f"stats record must be a contiguous int32 [>= {T}, {K}] tensor on {dev}, got "
                         f"{record_MK.dtype} {tuple(record_MK.shape)} on {record_MK.device}")


def plan_misses(slot_of_E: torch.Tensor, topk_ids_TK: torch.Tensor, host_rows_ER: torch.Tensor,
                pool_rows_NR: torch.Tensor, scratch_base: int, stats=None, pf_row_E: torch.Tensor | None = None,
                registers: bool | None = None, align_block_m: int | None = None) -> MissPlan:
    """Kernel 1 only (enqueue): the rows of every pair and the list of distinct missing experts.
    Arguments as for :func:`serve_misses`; ``registers``: None picks the register plan (``_plan_regs_kernel``)
    where ``register_plan_fits``, else the workspace plan (``_plan_kernel``); True forces the register plan (up to
    ``PLAN_REGS_ELEMENTS`` experts, in as many chunks as it takes), False the workspace plan (the tests compare
    them). ``align_block_m``: also group the rows into blocks of that many pairs for the tile kernels
    (``MissPlan.alignment``, over the pool's rows): in the plan's own launch (``_plan_align_kernel``) where the
    sorted alignment applies and there is no lookahead row map, else by ``decode_moe.decode_align`` after it."""
    _check(slot_of_E, topk_ids_TK, host_rows_ER, pool_rows_NR, scratch_base)
    dev = pool_rows_NR.device
    if pf_row_E is not None:
        _check_row_map(pf_row_E, host_rows_ER.shape[0], dev)
    if stats is not None:
        _check_stats(stats, *topk_ids_TK.shape, dev, 5 if pf_row_E is not None else 3)
    T, K = topk_ids_TK.shape
    E = host_rows_ER.shape[0]
    M = T * K
    rows_TK, miss_experts_X, num_missing_1, counts_3, record_MK, n_stats = plan_outputs(T, K, E, dev, stats)
    ids_M = topk_ids_TK.reshape(-1)
    if not ids_M.is_contiguous():
        ids_M = ids_M.contiguous()
    pf_arg = slot_of_E if pf_row_E is None else pf_row_E
    EB = experts_block(E)
    regs = register_plan_fits(M, E) if registers is None else registers and EB <= PLAN_REGS_ELEMENTS
    MC = min(triton.next_power_of_2(max(M, 1)), plan_chunk(EB))
    N = pool_rows_NR.shape[0]
    if align_block_m is not None and pf_row_E is None and 0 < M <= SORTED_ALIGN_MAX_PAIRS:
        alignment = alignment_buffers(M, N, align_block_m, dev)
        key_MP, MP, warps = sorted_align_launch(M, dev)
        work, E_work = plan_workspace(E, regs, dev)
        with device_guard(dev):
            _plan_align_kernel[(1,)](slot_of_E, ids_M, work, E_work, miss_experts_X, num_missing_1, rows_TK, counts_3,
                                     record_MK, key_MP, alignment.sorted_ids_P, alignment.block_row_B,
                                     alignment.num_padded_1, M, E, scratch_base, N, N * MP, EB=EB, MC=MC,
                                     STATS=n_stats, REGS=regs, BLOCK=_PLAN_BLOCK, BLOCK_M=align_block_m, MP=MP,
                                     num_warps=warps, **pdl.launch_kwargs())
        return MissPlan(rows_TK, miss_experts_X, num_missing_1, alignment)
    with device_guard(dev):
        if regs:
            _plan_regs_kernel[(1,)](slot_of_E, ids_M, miss_experts_X, num_missing_1, rows_TK, counts_3, record_MK,
                                    pf_arg, M, E, scratch_base, EB=EB, MC=MC, STATS=n_stats,
                                    PF=pf_row_E is not None, num_warps=4, **pdl.launch_kwargs())
        else:
            work, E_work = plan_workspace(E, False, dev)
            _plan_kernel[(1,)](slot_of_E, ids_M, work, work[E_work:], miss_experts_X, num_missing_1, rows_TK,
                               counts_3, record_MK, pf_arg, M, E, scratch_base, BLOCK=_PLAN_BLOCK, STATS=n_stats,
                               PF=pf_row_E is not None, DENSE=False, num_warps=4, **pdl.launch_kwargs())
    alignment = None if align_block_m is None or M == 0 else decode_align(rows_TK, N, align_block_m)
    return MissPlan(rows_TK, miss_experts_X, num_missing_1, alignment)


def prefetch_misses(slot_of_E: torch.Tensor, predicted_ids_TK: torch.Tensor, host_rows_ER: torch.Tensor,
                    pool_rows_NR: torch.Tensor, base: int, row_of_E: torch.Tensor, counts_1: torch.Tensor | None = None,
                    config: MissCopyConfig | None = None) -> None:
    """The lookahead's copy (enqueue, no host sync): every distinct expert of ``predicted_ids_TK`` that is not
    resident is copied from host memory into rows ``base + j`` (j its rank by ascending id), and ``row_of_E``
    (int32 ``[E]``, overwritten whole) gets that row for those experts and -1 for every other; pass it as
    ``pf_row_E`` to :func:`serve_misses` of the layer it was predicted for. ``counts_1``: optional int64
    ``[>= 1]`` that the number of copied experts is added to. Two launches, as :func:`serve_misses`."""
    _check(slot_of_E, predicted_ids_TK, host_rows_ER, pool_rows_NR, base)
    dev = pool_rows_NR.device
    E = host_rows_ER.shape[0]
    _check_row_map(row_of_E, E, dev)
    if counts_1 is not None:
        _check_counts(counts_1, 1, dev)
    M = predicted_ids_TK.numel()
    miss_experts_X = torch.empty(max(min(M, E), 1), dtype=torch.int32, device=dev)
    num_missing_1 = torch.empty(1, dtype=torch.int32, device=dev)
    need_E = torch.empty(max(E, 1), dtype=torch.int32, device=dev)
    ids_M = predicted_ids_TK.reshape(-1)
    if not ids_M.is_contiguous():
        ids_M = ids_M.contiguous()
    with device_guard(dev):
        _plan_kernel[(1,)](slot_of_E, ids_M, need_E, row_of_E, miss_experts_X, num_missing_1, num_missing_1,
                           num_missing_1 if counts_1 is None else counts_1, num_missing_1, row_of_E, M, E, base,
                           BLOCK=_PLAN_BLOCK, STATS=int(counts_1 is not None), PF=False, DENSE=True, num_warps=4,
                           **pdl.launch_kwargs())
    copy_misses(MissPlan(predicted_ids_TK, miss_experts_X, num_missing_1), host_rows_ER, pool_rows_NR, base, config)


def _word_layout(host_rows_ER: torch.Tensor, pool_rows_NR: torch.Tensor) -> tuple[torch.dtype, int, int]:
    """(word dtype, word bytes, VEC words of alignment shared by every row start of both tensors)."""
    R = host_rows_ER.shape[1]
    ptrs = [t.data_ptr() for t in (host_rows_ER, pool_rows_NR)]
    strides = [t.stride(0) for t in (host_rows_ER, pool_rows_NR)]

    def aligned(n: int) -> bool:
        return R % n == 0 and all(p % n == 0 for p in ptrs) and all(s % n == 0 for s in strides)

    word, dtype = (4, torch.int32) if aligned(4) else (1, torch.uint8)
    vec = next(v for v in (16 // word, 8 // word, 4 // word, 2 // word, 1) if v >= 1 and aligned(v * word))
    return dtype, word, vec


def copy_misses(plan: MissPlan, host_rows_ER: torch.Tensor, pool_rows_NR: torch.Tensor, scratch_base: int,
                config: MissCopyConfig | None = None) -> None:
    """Kernel 2 only (enqueue): copy the planned missing experts' host rows into their scratch rows."""
    config = config or MissCopyConfig()
    R = host_rows_ER.shape[1]
    X = min(plan.rows_TK.numel(), host_rows_ER.shape[0])
    if X == 0 or R == 0:
        return
    dtype, word, vec = _word_layout(host_rows_ER, pool_rows_NR)
    src, dst = host_rows_ER.view(dtype), pool_rows_NR.view(dtype)
    row_words = R // word
    block = min(config.chunk_bytes // word, triton.next_power_of_2(row_words))
    chunks = triton.cdiv(row_words, block)
    dev = pool_rows_NR.device
    if dev.type == "cuda":
        sms = torch.cuda.get_device_properties(dev).multi_processor_count  # host-side property, no sync
    else:
        sms = 1
    grid = (min(X * chunks, config.ctas_per_sm * sms),)
    with device_guard(dev):
        _copy_kernel[grid](src, dst, plan.miss_experts_X, plan.num_missing_1, row_words,
                           src.stride(0) // vec, dst.stride(0) // vec, scratch_base, chunks,
                           BLOCK=block, VEC=vec, num_warps=config.num_warps, **pdl.launch_kwargs())


def serve_misses(slot_of_E: torch.Tensor, topk_ids_TK: torch.Tensor, host_rows_ER: torch.Tensor,
                 pool_rows_NR: torch.Tensor, scratch_base: int, config: MissCopyConfig | None = None,
                 stats=None, pf_row_E: torch.Tensor | None = None) -> torch.Tensor:
    """Pool row of every routed pair, with missing experts copied into scratch rows (no host sync).

    Args:
        slot_of_E: ``[E]`` int32/int64 slot of each expert of the layer, -1 = not resident.
        topk_ids_TK: ``[T, K]`` int32/int64 routed expert ids.
        host_rows_ER: ``[E, R]`` uint8 host rows of the layer; on CUDA their mapped device view
            (``ExpertStore.device_rows``), on CPU the rows themselves.
        pool_rows_NR: ``[N, R]`` uint8 device pool; rows ``scratch_base .. scratch_base + min(T*K, E) - 1``
            are scratch (overwritten); resident slots are only read through ``rows_TK``.
        scratch_base: first scratch row.
        config: copy launch shape (default :class:`MissCopyConfig`).
        stats: optional ``(counts_C int64 [C >= 3], record_MK int32 [>= T, K])``: the plan kernel also adds the
            step's routed pairs, missed pairs and distinct missed experts copied here (C >= 4: distinct routed
            experts; C >= 5: distinct missing experts read from a lookahead row, needed with ``pf_row_E``) to
            ``counts_C`` and stores the ids into ``record_MK`` (:func:`count_step_reference` is the oracle).
        pf_row_E: optional ``[E]`` int32 row map written by :func:`prefetch_misses` (its copies ordered before
            this call): a missing expert with a row there is read from it, not copied.

    Returns:
        ``rows_TK`` ``[T, K]`` int32: ``slot_of_E[e]`` for resident experts, ``pf_row_E[e]`` for missing ones
        the lookahead copied, ``scratch_base + j`` for the j-th distinct other missing expert (ascending id), -1
        for ids outside [0, E). Without ``pf_row_E``, ``rows_TK >= scratch_base`` is the step's miss mask. Ids
        are not range-checked on the host (that would sync).
    """
    return serve_misses_plan(slot_of_E, topk_ids_TK, host_rows_ER, pool_rows_NR, scratch_base, config, stats,
                             pf_row_E).rows_TK


def serve_misses_plan(slot_of_E: torch.Tensor, topk_ids_TK: torch.Tensor, host_rows_ER: torch.Tensor,
                      pool_rows_NR: torch.Tensor, scratch_base: int, config: MissCopyConfig | None = None,
                      stats=None, pf_row_E: torch.Tensor | None = None, align_block_m: int | None = None) -> MissPlan:
    """:func:`serve_misses` returning the whole :class:`MissPlan`; with ``align_block_m`` its ``alignment`` holds the
    rows grouped for the tile kernels over all of ``pool_rows_NR``'s rows (see :func:`plan_misses`): pass it to
    ``decode_moe.decode_moe_nvfp4`` so that the alignment runs in the plan's launch."""
    plan = plan_misses(slot_of_E, topk_ids_TK, host_rows_ER, pool_rows_NR, scratch_base, stats, pf_row_E,
                       align_block_m=align_block_m)
    copy_misses(plan, host_rows_ER, pool_rows_NR, scratch_base, config)
    return plan
