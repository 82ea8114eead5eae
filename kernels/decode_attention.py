"""Grouped-query decode attention in two Triton launches (split-K "flash decoding"); one with
``AttnConfig.direct`` when S is not split.

Legend: B batch rows, Hkv key/value heads, G query heads per KV head, S cached positions, D head dim,
SP splits of the S axis, GP = G padded to a power of two >= 16 (the tensor-core tile).

    out[b, h, g] = softmax(scale * q[b, h, g] . k[b, h, :]  (+ mask[b, :])) @ v[b, h, :]

what ``F.scaled_dot_product_attention(q_BHGD, k_BHSD, v_BHSD, attn_mask=mask_B11S)`` computes for one
query position whose G query heads were folded into the query-length dim
(``integrations/fused_norms.py`` ``gqa_decode_sdpa``).

Why: in the H200 decode profile (benchmarks/results/profile-decode-l8-r1.0-78928ef71643.txt) cuDNN's
SDPA took 26.7 us per layer for one query over ~1.1k cached positions: with the expert kernels, the
largest item of a ~143 us decode layer, for ~2 MB of K/V per layer (<1 us of HBM time). Decode attention
is latency-bound: one program per (row, KV head) walks S serially. Here ``_partial_kernel`` runs one
program per (row, KV head, split of S) with an online softmax over BLOCK_S-position tiles (fp32 max,
sum and accumulator; ``tl.dot`` of the [GP, D] query tile with each key tile), and ``_combine_kernel``
merges the SP partial results per (row, KV head). Each program first reads its split's mask in one
vector load and runs its tile loop only from the first to the last visible position (``AttnConfig.bound``):
a static cache of ``decode.max_cache_len`` positions holding a shorter sequence then reads only what it
holds, and the loop has no branch, so Triton pipelines its K/V loads. Hidden positions inside that range
are masked off the loads (not read) and weigh 0. On the H200 (benchmarks/results/
decode_attention_sweep-cf9c69a-20261205-1028.md, 48 launch configs) this took 66.6 -> 43.2 us per layer at
64 rows and 25.2 -> 20.9 at 16 (the per-tile branch it replaces stays as ``bound=False``). The 971877e sweep
(``decode_attention_sweep-971877e-20261205-1223.md``, with direct and fewer splits) then set
``direct`` on (64 rows: 44.2 -> 42.6 us) and at least two tiles per split (1 row: 16.6 -> 12.6 us).

Masks: bool (True = attend) or additive float, shaped ``[B or 1, 1, 1, S]``; None attends everywhere.
Masked scores are set to -1e30 (finite: a tile with no visible position gives weight 0, not NaN), and an
additive value at or below -1e30 counts as masked (its tile may be skipped); a larger one (an fp16 model's
-65504) is added as it is. A row whose mask hides every position gets 0, where SDPA gives NaN (bool) or the
mean of the values (a finite float mask); decode never asks for it (the current token is always visible).
Grids depend on host-known shapes only: capturable in a CUDA graph. Under ``TRITON_INTERPRET=1`` the
same kernels run on CPU tensors (CI).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # importing triton touches no CUDA
    import triton
    import triton.language as tl
    from moe_offload.kernels import pdl
    from moe_offload.kernels.pdl import pdl_enter
except ImportError:
    triton = None

BLOCK_S = 64  # positions per tile

if triton is not None:
    _MASKED = tl.constexpr(-1.0e30)  # a masked score: finite, so an all-masked tile gives weight 0, not NaN

    @triton.jit
    def _mask_tile(m_row, offs, sms, inside, MASK_KIND: tl.constexpr):
        """``(keep, bias)`` of positions ``offs`` of one mask row (``inside`` limits the read): which may be
        attended, and the additive float mask's value there (0 for bool and no mask)."""
        bias = tl.zeros(offs.shape, tl.float32)
        if MASK_KIND == 1:  # bool: attend where True
            keep = inside & (tl.load(m_row + offs * sms, mask=inside, other=0) != 0)
        elif MASK_KIND == 2:  # additive float
            bias = tl.load(m_row + offs * sms, mask=inside, other=_MASKED).to(tl.float32)
            keep = inside & (bias > _MASKED)
        else:
            keep = inside
        return keep, bias

    @triton.jit
    def _tile(q, k_row, sks, v_row, svs, offs_s, offs_d, D, keep, bias, m_i, l_i, acc, scale,
              DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
        """One BLOCK-position tile of the online softmax: ``(m_i, l_i, acc)`` updated."""
        kv_mask = keep[:, None] & (offs_d[None, :] < D)
        k = tl.load(k_row + offs_s[:, None].to(tl.int64) * sks + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        v = tl.load(v_row + offs_s[:, None].to(tl.int64) * svs + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale + bias[None, :]
        scores = tl.where(keep[None, :], scores, _MASKED)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(keep[None, :], tl.exp(scores - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PREC).to(tl.float32)
        return m_new, l_i, acc

    @triton.jit
    def _partial_kernel(q_ptr, sqb, sqh, sqg,
                        k_ptr, skb, skh, sks,
                        v_ptr, svb, svh, svs,
                        m_ptr, smb, sms,
                        m_out, l_out, acc_out, out_ptr, sob, soh, sog,
                        Hkv, G, S, D, per_split, scale,
                        MASK_KIND: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, PREC: tl.constexpr, BOUND: tl.constexpr, MAXT: tl.constexpr,
                        DIRECT: tl.constexpr, USE_PDL: tl.constexpr = False):
        pdl_enter(USE_PDL)
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        nsp = tl.num_programs(1)
        b = (bh // Hkv).to(tl.int64)
        h = (bh % Hkv).to(tl.int64)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, DP)
        q = tl.load(q_ptr + b * sqb + h * sqh + offs_g[:, None] * sqg + offs_d[None, :],
                    mask=(offs_g[:, None] < G) & (offs_d[None, :] < D), other=0.0).to(DOT_DTYPE)
        m_i = tl.full((GP,), _MASKED, tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, DP), tl.float32)
        s_begin = sp * per_split
        s_end = tl.minimum(s_begin + per_split, S)
        lo = s_begin
        hi = s_end
        m_row = m_ptr + b * smb
        k_row = k_ptr + b * skb + h * skh
        v_row = v_ptr + b * svb + h * svh
        if BOUND and MASK_KIND != 0:  # one mask read bounds the loop to the split's visible tiles
            offs_a = s_begin + tl.arange(0, MAXT * BLOCK)
            vis, _ = _mask_tile(m_row, offs_a, sms, offs_a < s_end, MASK_KIND)
            first = tl.min(tl.where(vis, offs_a, s_end), axis=0)
            lo = s_begin + ((first - s_begin) // BLOCK) * BLOCK
            hi = tl.max(tl.where(vis, offs_a + 1, s_begin), axis=0)
        for s0 in range(lo, hi, BLOCK):
            offs_s = s0 + tl.arange(0, BLOCK)
            keep, bias = _mask_tile(m_row, offs_s, sms, offs_s < s_end, MASK_KIND)
            # BOUND: no branch in the loop (so Triton can pipeline its loads); hidden positions' lanes are
            # masked off the loads (not read) and weigh 0. Else a tile nobody may see is skipped by a branch.
            if BOUND:
                m_i, l_i, acc = _tile(q, k_row, sks, v_row, svs, offs_s, offs_d, D, keep, bias, m_i, l_i, acc, scale,
                                      DOT_DTYPE, PREC)
            elif tl.max(keep.to(tl.int32), axis=0) > 0:
                m_i, l_i, acc = _tile(q, k_row, sks, v_row, svs, offs_s, offs_d, D, keep, bias, m_i, l_i, acc, scale,
                                      DOT_DTYPE, PREC)
        if DIRECT:  # one split: the output itself (what _combine_kernel computes from one partial, bit for bit)
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + b * sob + h * soh + offs_g[:, None] * sog + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=(offs_g[:, None] < G) & (offs_d[None, :] < D))
        else:
            row = bh * nsp + sp
            tl.store(m_out + row * GP + offs_g, m_i)
            tl.store(l_out + row * GP + offs_g, l_i)
            tl.store(acc_out + (row * GP + offs_g[:, None]) * DP + offs_d[None, :], acc)

    @triton.jit
    def _combine_kernel(m_in, l_in, acc_in, out_ptr, sob, soh, sog,
                        Hkv, G, D, SP,
                        GP: tl.constexpr, DP: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False):
        """Program (row x KV head, BLOCK_D columns of D): the SP partials merged. Every program recomputes the
        (tiny) max and sum over the splits, so each output element is the same arithmetic whatever BLOCK_D is;
        only the real G query rows of a partial's accumulator are read (padding rows are never stored)."""
        pdl_enter(USE_PDL)
        bh = tl.program_id(0)
        b = (bh // Hkv).to(tl.int64)
        h = (bh % Hkv).to(tl.int64)
        offs_g = tl.arange(0, GP)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        m_all = tl.full((GP,), _MASKED, tl.float32)
        for sp in range(0, SP):
            m_all = tl.maximum(m_all, tl.load(m_in + (bh * SP + sp) * GP + offs_g))
        l_all = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, BLOCK_D), tl.float32)
        for sp in range(0, SP):
            row = bh * SP + sp
            w = tl.exp(tl.load(m_in + row * GP + offs_g) - m_all)
            l_all += w * tl.load(l_in + row * GP + offs_g)
            acc += w[:, None] * tl.load(acc_in + (row * GP + offs_g[:, None]) * DP + offs_d[None, :],
                                        mask=offs_g[:, None] < G, other=0.0)
        out = acc / tl.where(l_all > 0, l_all, 1.0)[:, None]
        tl.store(out_ptr + b * sob + h * soh + offs_g[:, None] * sog + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(offs_g[:, None] < G) & (offs_d[None, :] < D))


@dataclass(frozen=True)
class AttnConfig:
    """Launch choices of ``decode_attention``. ``block``: positions per tile; ``warps``/``stages``: Triton's
    num_warps/num_stages of ``_partial_kernel``; ``target_programs``: how many (row, head, split) programs
    ``splits_for`` aims at; ``bound``: bound each split's loop by one read of its mask (a branch-free loop)
    instead of skipping hidden tiles with a branch per tile; ``direct``: with one split, the partial kernel
    writes the output itself (one launch, no combine; same bits); ``min_split_tiles``: at most tiles //
    min_split_tiles splits (the last split may hold fewer tiles than the others); ``combine_block_d``: D columns per
    ``_combine_kernel`` program (same bits at any value). The combine had one program per (row, KV head): at batch 1
    four programs, each merging 8 splits of 16 x 128 fp32 in series, 6.5 us per layer in the H100 profile at 10cd002
    (``profile-decode-l8-r1.0-b1-10cd002-h100``) for ~0.3 MB; 32 columns give 4 x 4 programs, and the padding rows of
    the query group are no longer read. Not re-timed on a GPU yet.

    The defaults are the H200 sweep's (``decode_attention_sweep-971877e-*``, 1,100 of 1,152 positions visible):
    ``direct`` took 44.2 -> 42.6 us per layer at 64 rows (one split there at any target) and changed nothing
    elsewhere; two tiles per split at least took 1 row from 16.6 us (18 one-tile splits) to 12.6 (9 of two), the
    same at 4-64 rows."""
    block: int = BLOCK_S
    warps: int = 4
    stages: int = 3
    target_programs: int = 256
    bound: bool = True
    direct: bool = True
    min_split_tiles: int = 2
    combine_block_d: int = 32

    def __post_init__(self):
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"AttnConfig.block={self.block}: must be a power of two >= 16 (tl.dot's K)")
        if (self.warps not in (1, 2, 4, 8, 16) or self.stages < 1 or self.target_programs < 1
                or self.min_split_tiles < 1):
            raise ValueError(f"invalid {self}: warps a power of two <= 16, stages, target_programs and "
                             f"min_split_tiles >= 1")
        if self.combine_block_d < 16 or self.combine_block_d & (self.combine_block_d - 1):
            raise ValueError(f"AttnConfig.combine_block_d={self.combine_block_d}: must be a power of two >= 16")


DEFAULT_CONFIG = AttnConfig()
MAX_SPLIT_TILES = 64  # bound: one split's mask is read as one vector of at most this many tiles


def splits_for(S: int, programs_per_split: int, target_programs: int = 256, block: int = BLOCK_S,
               min_tiles: int = 1) -> int:
    """How many splits of S: enough programs (``target_programs`` over all (row, head) pairs) while every
    split keeps at least ``min_tiles`` whole tiles (one split where S has fewer)."""
    tiles = max(1, -(-S // block))
    return max(1, min(tiles // min_tiles, -(-target_programs // max(1, programs_per_split))))


def split_plan(S: int, pairs: int, cfg: AttnConfig, splits: int | None = None) -> tuple[int, int]:
    """``(splits, positions per split)`` of a call over S positions and ``pairs`` (row, KV head) pairs: ``splits``
    (default ``splits_for``), raised where ``cfg.bound`` needs it so that no split exceeds ``MAX_SPLIT_TILES``
    tiles (its mask is read as one vector), then trimmed to the splits that hold a position."""
    tiles = max(1, -(-S // cfg.block))
    sp = splits if splits is not None else splits_for(S, pairs, cfg.target_programs, cfg.block, cfg.min_split_tiles)
    sp = max(sp, -(-tiles // MAX_SPLIT_TILES)) if cfg.bound else sp
    per_split = cfg.block * -(-tiles // sp)
    return (max(1, -(-S // per_split)) if S > 0 else 1), per_split


def decode_attention(q_BHGD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                     mask: torch.Tensor | None, scale: float, splits: int | None = None,
                     config: AttnConfig | None = None) -> torch.Tensor:
    """``[B, Hkv, G, D]`` attention output in ``q``'s dtype; see the module docstring.

    ``k``/``v`` may be views (a static cache's first S positions): the last dim must be contiguous.
    ``mask``: None, or bool/float ``[B or 1, 1, 1, S]``. ``splits``: override the split count (tests; with
    ``bound`` it is raised where a split would exceed ``MAX_SPLIT_TILES`` tiles, see ``split_plan``).
    ``config``: launch choices (default ``DEFAULT_CONFIG``)."""
    cfg = config or DEFAULT_CONFIG
    if triton is None:
        raise RuntimeError("decode_attention needs triton (pip install triton)")
    if q_BHGD.dim() != 4 or k_BHSD.dim() != 4 or v_BHSD.shape != k_BHSD.shape:
        raise ValueError(f"q [B, Hkv, G, D], k and v [B, Hkv, S, D] expected, got {tuple(q_BHGD.shape)}, "
                         f"{tuple(k_BHSD.shape)}, {tuple(v_BHSD.shape)}")
    B, Hkv, G, D = q_BHGD.shape
    S = k_BHSD.shape[2]
    if k_BHSD.shape[0] != B or k_BHSD.shape[1] != Hkv or k_BHSD.shape[3] != D:
        raise ValueError(f"k/v {tuple(k_BHSD.shape)} do not match q {tuple(q_BHGD.shape)} (B, Hkv, D)")
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1
                             or mask.shape[3] != S or mask.shape[0] not in (1, B)):
        raise ValueError(f"mask must be [B or 1, 1, 1, S={S}], got {tuple(mask.shape)}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_BHGD, k_BHSD, v_BHSD))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = torch.empty((B, Hkv, G, D), dtype=q.dtype, device=q.device)
    if B * Hkv == 0 or G == 0:
        return out
    GP = max(16, triton.next_power_of_2(G))
    DP = max(16, triton.next_power_of_2(D))
    if splits is not None and splits < 1:
        raise ValueError(f"splits={splits}: must be >= 1 (or None: splits_for)")
    block = cfg.block
    sp, per_split = split_plan(S, B * Hkv, cfg, splits)
    direct = cfg.direct and sp == 1
    parts = 1 if direct else B * Hkv * sp  # one split written directly needs no partials
    m_part = torch.empty((parts, GP), dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty((parts, GP, DP), dtype=torch.float32, device=q.device)
    if mask is None:
        kind, m_arg, smb, sms = 0, q, 0, 0
    else:
        kind = 1 if mask.dtype == torch.bool else 2
        m_arg = mask.view(torch.uint8) if kind == 1 else mask  # bool as bytes, no copy
        smb = 0 if m_arg.shape[0] == 1 else m_arg.stride(0)
        sms = m_arg.stride(3)
    from moe_offload.kernels.fused_moe_ab import _dot_setup
    from moe_offload.kernels.nvfp4 import device_guard

    dot_dtype, precision = _dot_setup(q.dtype, q.device)  # fp32 dots on the interpreter (see there)
    with device_guard(q.device):
        _partial_kernel[(B * Hkv, sp)](q, q.stride(0), q.stride(1), q.stride(2),
                                       k, k.stride(0), k.stride(1), k.stride(2),
                                       v, v.stride(0), v.stride(1), v.stride(2),
                                       m_arg, smb, sms, m_part, l_part, acc_part,
                                       out, out.stride(0), out.stride(1), out.stride(2),
                                       Hkv, G, S, D, per_split, float(scale),
                                       MASK_KIND=kind, GP=GP, DP=DP, BLOCK=block, DOT_DTYPE=dot_dtype, PREC=precision,
                                       BOUND=cfg.bound,
                                       MAXT=triton.next_power_of_2(per_split // block) if cfg.bound and kind else 1,
                                       DIRECT=direct, num_warps=cfg.warps, num_stages=cfg.stages, **pdl.launch_kwargs())
        if not direct:
            block_d = min(DP, cfg.combine_block_d)
            _combine_kernel[(B * Hkv, DP // block_d)](m_part, l_part, acc_part, out, out.stride(0), out.stride(1),
                                                      out.stride(2), Hkv, G, D, sp, GP=GP, DP=DP, BLOCK_D=block_d,
                                                      num_warps=4 if block_d * GP >= 2048 else 2, **pdl.launch_kwargs())
    return out
