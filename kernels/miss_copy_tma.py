"""The routed path's miss copy with SM reads through the Tensor Memory Accelerator (``decode.miss_copy: tma``).

Legend: E experts per layer, N pool rows, R bytes of one expert row, X missing experts of a step, W int32 words of a
row (R / 4), Q whole lines of ``COLS`` words in a row (W // COLS), tail the W - Q * COLS words after them.

Same contract as ``decode_miss.copy_misses``'s plain-load kernel (the plan's missing experts' host rows into their
scratch rows, the count read on the device, capturable, no host sync), but each work item reads ``BOX`` lines of a
host row with one tensor-descriptor load (``cp.async.bulk.tensor`` into shared memory on sm_90) instead of
``ld.global``. The host rows are described as int32 ``[E, Q, COLS]`` (their own row stride), so every box lies inside
one expert's row; the box past a row's last whole line reads zeros (the TMA's out-of-bounds fill) and its store is
masked; the tail words, where a row has them, go with plain loads in the row's last work item.

Why: plain SM loads of mapped host memory ran at 0.84-0.88 x the copy engine's rate on fast H100 hosts and ~0.5 x on
slow ones (benchmarks/results/HISTORY.md), which bounds the captured decode steps with misses and short prompts.
Whether the TMA reads that memory faster is what ``benchmarks/tma_probe.py`` measures; this path is the experiment
that follows it. Needs Triton's host tensor descriptors, a GPU with a TMA (sm_90+), rows whose stride and base are
16-byte aligned and at least one whole line: ``unsupported`` says which is missing, and the cache checks one copy at
start-up (``check``) before it takes this path. Inside ``pdl.launches(True)`` it launches with programmatic dependent
launch as the plain-load copy does (``pdl_enter`` first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.kernels import pdl
from moe_offload.kernels.nvfp4 import device_guard
from moe_offload.kernels.pdl import pdl_enter

COLS = 256  # int32 words a line: 1 KiB, the widest inner extent of a TMA box (256 elements)
#: a box of 64 lines is 64 KiB of shared memory and 128 registers a thread at 4 warps; 256 would not fit an H100's SM
MAX_BOX_LINES = 64

try:  # Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - the declared Triton has it
    TensorDescriptor = None


@triton.jit
def _tma_copy_kernel(src_desc, src_ptr, dst_ptr, miss_ptr, count_ptr, q_lines, tail_words, src_stride_w, dst_stride_w,
                     scratch_base, chunks, BOX: tl.constexpr, C: tl.constexpr, TAIL: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    """Work item w = (x, c): lines [c*BOX, (c+1)*BOX) of host row miss[x] -> pool row scratch_base + x (the lines
    past ``q_lines`` are not stored); the last chunk of a row also copies its ``tail_words`` (``TAIL`` words at most,
    a power of two)."""
    pdl_enter(USE_PDL)
    r = tl.arange(0, BOX)[:, None]
    col = tl.arange(0, C)[None, :]
    total = tl.load(count_ptr) * chunks
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        x = w // chunks
        c = w - x * chunks
        e = tl.load(miss_ptr + x)
        tile = tl.reshape(src_desc.load([e, c * BOX, 0]), (BOX, C))
        line = c * BOX + r
        dst_row = dst_ptr + (scratch_base + x).to(tl.int64) * dst_stride_w
        tl.store(dst_row + line * C + col, tile, mask=line < q_lines)
        if TAIL > 0:
            if c == chunks - 1:
                t = tl.arange(0, TAIL)
                inside = t < tail_words
                src_row = src_ptr + e.to(tl.int64) * src_stride_w
                tl.store(dst_row + q_lines * C + t, tl.load(src_row + q_lines * C + t, mask=inside), mask=inside)


def unsupported(host_rows_ER: torch.Tensor, pool_rows_NR: torch.Tensor) -> str | None:
    """Why these rows cannot take the TMA copy, or None: no tensor descriptors in this Triton, a GPU without a TMA,
    rows whose byte count, stride or base is not 16-byte aligned, or rows shorter than one line."""
    if TensorDescriptor is None:
        return f"triton {triton.__version__} has no host tensor descriptors (triton.tools.tensor_descriptor)"
    dev = pool_rows_NR.device
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (9, 0):
        cap = ".".join(map(str, torch.cuda.get_device_capability(dev)))
        return f"compute capability {cap}: the TMA needs 9.0 or newer"
    R = host_rows_ER.shape[1]
    for name, t in (("host rows", host_rows_ER), ("pool rows", pool_rows_NR)):
        if t.dtype != torch.uint8 or t.stride(1) != 1 or t.stride(0) % 16 or t.data_ptr() % 16:
            return (f"{name}: uint8 rows with a 16-byte aligned base and stride are needed, got {t.dtype} strides "
                    f"{tuple(t.stride())} at {t.data_ptr():#x}")
    if R % 4 or R < COLS * 4:
        return f"{R}-byte rows: a multiple of 4 bytes and at least {COLS * 4} are needed"
    return None


def copy_misses_tma(miss_experts_X: torch.Tensor, num_missing_1: torch.Tensor, host_rows_ER: torch.Tensor,
                    pool_rows_NR: torch.Tensor, scratch_base: int, box_lines: int, ctas_per_sm: int,
                    num_warps: int):
    """Enqueue the copy of the ``num_missing_1[0]`` experts listed in ``miss_experts_X`` (device int32) from
    ``host_rows_ER`` (a mapped view) into pool rows ``scratch_base + x``; ``box_lines`` lines (of ``COLS`` words) per
    work item, a power of two <= ``MAX_BOX_LINES``. Returns Triton's handle of the launch (None when nothing can be
    missing). Raises ValueError where ``unsupported`` names a reason."""
    why = unsupported(host_rows_ER, pool_rows_NR)
    if why is not None:
        raise ValueError(f"decode.miss_copy tma: {why}; use decode.miss_copy=uva")
    if box_lines < 1 or box_lines > MAX_BOX_LINES or box_lines & (box_lines - 1):
        raise ValueError(f"box_lines={box_lines}: a power of two in 1..{MAX_BOX_LINES}")
    X = min(miss_experts_X.numel(), host_rows_ER.shape[0])
    if X == 0:
        return None
    E, R = host_rows_ER.shape
    W = R // 4
    Q, tail = divmod(W, COLS)
    box = min(box_lines, triton.next_power_of_2(Q))
    src = host_rows_ER.view(torch.int32)
    lines = torch.as_strided(src, (E, Q, COLS), (src.stride(0), COLS, 1))
    desc = TensorDescriptor(lines, list(lines.shape), list(lines.stride()), [1, box, COLS])
    dst = pool_rows_NR.view(torch.int32)
    chunks = triton.cdiv(Q, box)
    dev = pool_rows_NR.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    grid = (min(X * chunks, ctas_per_sm * sms),)
    with device_guard(dev):
        return _tma_copy_kernel[grid](desc, src, dst, miss_experts_X, num_missing_1, Q, tail, src.stride(0),
                                      dst.stride(0), scratch_base, chunks, BOX=box, C=COLS,
                                      TAIL=triton.next_power_of_2(tail) if tail else 0, num_warps=num_warps,
                                      **pdl.launch_kwargs())


def check(host_rows_ER: torch.Tensor, pool_rows_NR: torch.Tensor, scratch_base: int, box_lines: int,
          ctas_per_sm: int, num_warps: int) -> str | None:
    """A start-up check on the cache's own rows: the first two experts (or one) copied into the first scratch rows
    and compared with their host bytes, and on CUDA the compiled kernel's PTX holding the TMA copy (a compiler that
    lowered the descriptor load to plain loads would pass as ``tma`` otherwise). None where both hold, else why (a
    compile or launch error, wrong bytes, no TMA instruction); the scratch rows are left as the copy wrote them
    (nothing reads them between steps). Raises RuntimeError naming the fix where a failed copy left the CUDA context
    unusable (a fault in the kernel is sticky: declining would only move the crash to the plain-load copy)."""
    why = unsupported(host_rows_ER, pool_rows_NR)
    if why is not None:
        return why
    n = min(2, host_rows_ER.shape[0], pool_rows_NR.shape[0] - scratch_base)
    if n < 1:
        return "no scratch row to check the copy with"
    dev = pool_rows_NR.device
    ids = torch.arange(n, dtype=torch.int32, device=dev)
    count = torch.tensor([n], dtype=torch.int32, device=dev)
    try:
        launch = copy_misses_tma(ids, count, host_rows_ER, pool_rows_NR, scratch_base, box_lines, ctas_per_sm,
                                 num_warps)
        got = pool_rows_NR[scratch_base:scratch_base + n].cpu()
        want = host_rows_ER[:n].cpu()
    except Exception as exc:  # e.g. this driver's TMA refuses mapped host memory
        if dev.type == "cuda":
            _context_usable(dev, exc)
        return f"{type(exc).__name__}: {exc}"[:300]
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[0].tolist()
        return f"wrong bytes: expert {bad[0]}, byte {bad[1]}"
    ptx = getattr(launch, "asm", {}).get("ptx") if dev.type == "cuda" else None
    if ptx is not None and "cp.async.bulk.tensor" not in ptx:
        return "the compiled copy holds no cp.async.bulk.tensor: this Triton lowered the descriptor load to plain loads"
    return None


def _context_usable(dev: torch.device, exc: Exception) -> None:
    """Raise where ``exc`` left ``dev``'s CUDA context unusable (a synchronize fails after it)."""
    try:
        torch.cuda.synchronize(dev)
    except Exception as sticky:
        raise RuntimeError(f"decode.miss_copy tma: the start-up check's copy failed ({type(exc).__name__}: "
                           f"{exc}) and left the CUDA context unusable ({type(sticky).__name__}); set "
                           "decode.miss_copy=uva") from exc
