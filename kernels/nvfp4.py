"""Triton NVFP4 dequantization: packed E2M1 codes + E4M3 block scales + FP32 globals -> dense weights.

Legend: N bank rows (experts or slots), R rows of one matrix, C its columns (the GEMM's K dim),
G row groups sharing one global (w13: 2 = gate, up; w2: 1), H hidden, I expert intermediate.

Value = E2M1[code] * float(e4m3 block scale) * global, the same as ``moe_offload.formats.nvfp4.dequantize``
(the torch reference). Codes are two per byte, element 2k in the low nibble; one scale per 16 columns.

Inputs are bank views: each matrix row is contiguous, the stride between bank rows (dim 0) is
arbitrary (views are column slices of ``[N, row_bytes]`` byte banks). The kernel runs natively on
CUDA and under ``TRITON_INTERPRET=1`` on CPU tensors (CI).
"""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from moe_offload.formats.nvfp4 import BLOCK

DEQUANT_TUNING_PATH = Path(__file__).with_name("dequant_tuning.json")


@dataclass(frozen=True)
class DequantTiles:
    """Tiles of the dequant kernel: ``block_r`` matrix rows x ``block_b`` packed bytes per program, warps, and
    how the two codes of a byte are written: ``split_store`` False interleaves them in registers
    (``tl.interleave``) and stores one contiguous row segment, True stores even and odd columns separately."""

    block_r: int = 16
    block_b: int = 128
    num_warps: int = 4
    split_store: bool = False

    def __post_init__(self):
        p2 = all(x >= 1 and not x & (x - 1) for x in (self.block_r, self.block_b, self.num_warps))
        if not p2 or self.block_b < BLOCK // 2 or self.num_warps > 16 or self.block_r * self.block_b > 1 << 16:
            raise ValueError(f"invalid dequant tiles {self}: block_r, block_b and num_warps powers of two, block_b >= "
                             f"{BLOCK // 2} (a whole scale block), num_warps <= 16, block_r * block_b <= 65536")

    def to_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=4)
def load_dequant_tuning(path: str | Path = DEQUANT_TUNING_PATH) -> dict[str, DequantTiles]:
    """``{device name or "default": DequantTiles}`` from ``dequant_tuning.json`` (written by
    ``benchmarks/tune_dequant.py``); raises ValueError naming the file and the bad entry."""
    path = Path(path)
    data = json.loads(path.read_text())
    if data.get("schema") != 1 or not isinstance(data.get("devices"), dict) or "default" not in data["devices"]:
        raise ValueError(f"{path}: expected {{'schema': 1, 'devices': {{'default': {{...}}, ...}}}}, got keys {sorted(data)}")
    table = {}
    for dev, d in data["devices"].items():
        try:
            table[dev] = DequantTiles(**d)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: devices[{dev!r}] = {d!r} is not a dequant tile entry ({exc}); expected "
                             '{"block_r", "block_b", "num_warps", "split_store"}') from exc
    return table


def dequant_tiles(device: torch.device) -> DequantTiles:
    """Tiles for ``device``: its GPU name's entry in the tuning table (or its ``SAME_DIE`` GPU's), else ``default``."""
    table = load_dequant_tuning()
    from moe_offload.kernels.fused_moe_tuning import tiles_key

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return table[tiles_key(name, table, "dequant_tuning.json")]

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BANK_KEYS = ("w13_q", "w13_s", "w2_q", "w2_s", "gs")


@triton.jit
def e2m1_to_f32(code):
    """E2M1 codes (int32 in 0..15) -> exact fp32 values.

    The sign bit and the 3 magnitude bits are placed into an fp16 bit pattern (exponent field =
    E2M1 exponent, top mantissa bit = E2M1 mantissa), which is E2M1 * 2^-14 (0.5 lands on an fp16
    subnormal, converted exactly); the caller folds the 2^14 into the block scale."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


#: multiply ``e2m1_to_f32`` results by this (exact: a power of two).
E2M1_F16_SHIFT = tl.constexpr(16384.0)
#: columns per block scale, and packed bytes per block scale.
SCALE_BLOCK = tl.constexpr(BLOCK)
BYTES_PER_SCALE = tl.constexpr(BLOCK // 2)


# E2M1 codes -> bf16 in PTX, 4 bytes (8 codes) per call: each byte's low and high nibble are placed into a bf16
# bit pattern (sign -> bit 15, the 3 magnitude bits -> bits 6-8: exponent field e, top mantissa bit m) whose
# value is E2M1 * 2^-126 (the code 0.5 lands on a bf16 subnormal), then multiplied by its block scale times
# 2^112 (``ptx_scale``): E2M1 * scale * 2^-14, exact (<= 6 significant bits, in the normal range).
# $0-$1: the low-nibble values of elements 0-1 and 2-3, $2-$3: the high-nibble ones, $4-$5: the four
# elements' scales, $6: the four bytes. prmt puts bytes 0-1 (2-3) into the two 16-bit lanes of t0 (t1).
# Low nibble (bits 0-3 of a lane): (t << 6 | t << 12) & 0x81C081C0, one lop3 (0xA8 = (a | b) & c): t << 6
# has nothing at bits 15/31 and t << 12 nothing at bits 6-8/22-24, so the OR needs no mask of its own.
# High nibble (bits 4-7): x = t & 0x00F000F0, then x * 0x104 = x << 2 | x << 8 (the two copies do not
# overlap, so no carry), & 0x81C081C0. 3 instructions per register plus the multiply, 18 per 8 codes.
def _nibble_pair_ptx(out: int, lanes: str, high: bool, scale: int) -> str:
    """PTX of one output register: the two codes of ``lanes`` (bytes in 16-bit lanes), the low or high nibble,
    as bf16 bit patterns times the scales in register ``$scale``."""
    if high:
        bits = f"and.b32 u, {lanes}, 0x00F000F0;\nmul.lo.u32 u, u, 0x104;\nand.b32 u, u, 0x81C081C0;\n"
    else:
        bits = f"shl.b32 u, {lanes}, 6;\nshl.b32 v, {lanes}, 12;\nlop3.b32 u, u, v, 0x81C081C0, 0xA8;\n"
    return bits + f"fma.rn.bf16x2 ${out}, u, ${scale}, z;\n"


# The multiply is ``fma.rn.bf16x2`` with a -0.0 addend (register z): the same bits as ``mul.rn.bf16x2`` (x + -0 = x
# for every x, +0 included, with one rounding), and it assembles from sm_80 on, where mul.bf16x2 needs sm_90 (with
# it, ptxas refused the swapped kernels for sm_89, Ada GPUs such as the RTX 6000 Ada and L40S).
E2M1_TO_BF16_SCALED = tl.constexpr(
    "{\n.reg .b32 t0, t1, u, v, z;\nmov.b32 z, 0x80008000;\nprmt.b32 t0, $6, 0, 0x4140;\nprmt.b32 t1, $6, 0, 0x4342;\n"
    + "".join(_nibble_pair_ptx(out, lanes, high, scale)
              for out, high in ((0, False), (2, True))
              for out, lanes, scale in ((out, "t0", 4), (out + 1, "t1", 5)))
    + "}\n")

#: ``ptx_scale`` multiplies block scales by this (2^112, exact) for ``e2m1_halves_bf16``.
PTX_SCALE_SHIFT = tl.constexpr(5.192296858534828e33)


@triton.jit
def ptx_scale(scale):
    """E4M3 (or fp32) block scales -> the bf16 operand of ``E2M1_TO_BF16_SCALED``: scale * 2^112 (exact)."""
    return (scale.to(tl.float32) * PTX_SCALE_SHIFT).to(tl.bfloat16)


@triton.jit
def per_byte(scale):
    """``[R, S]`` block scales -> ``[R, S * BYTES_PER_SCALE]``: each repeated (in registers) for the 8 packed bytes
    it covers, the shape of the weight tile it scales."""
    R: tl.constexpr = scale.shape[0]
    S: tl.constexpr = scale.shape[1]
    return tl.reshape(tl.broadcast_to(scale[:, :, None], (R, S, BYTES_PER_SCALE)), (R, S * BYTES_PER_SCALE))


@triton.jit
def e2m1_halves_f32(packed, scale):
    """``(lo, hi)`` fp32 = ``code * block_scale`` (exact) of the uint8 bytes ``packed`` ``[R, C]``: lo the low
    nibbles (even K columns), hi the high ones; ``scale`` the ``[R, C / 8]`` block scales. Portable (the
    interpreter, any GPU): per-code integer ops, an fp16 -> fp32 conversion and an fp32 multiply."""
    s = per_byte(scale.to(tl.float32) * E2M1_F16_SHIFT)
    codes = packed.to(tl.int32)
    return e2m1_to_f32(codes & 15) * s, e2m1_to_f32(codes >> 4) * s


@triton.jit
def unshift(SHIFTED: tl.constexpr):
    """What a sum of products of ``e2m1_halves_bf16`` values (or of the fp16 form's, also times 2^-14) is
    multiplied by to remove their 2^-14: ``E2M1_F16_SHIFT`` when SHIFTED, else 1 (powers of two: the bits stay)."""
    if SHIFTED:
        return E2M1_F16_SHIFT
    return 1.0


@triton.jit
def e2m1_halves_bf16(packed, scale):
    """``(lo, hi)`` bf16 = ``code * block_scale * 2^-14`` (exact) of the uint8 bytes ``packed`` ``[R, C]``: lo the
    low nibbles (even K columns), hi the high ones; ``scale`` the ``[R, C / 8]`` block scales. ~2.25 instructions a
    weight on 32-bit registers (``E2M1_TO_BF16_SCALED``); CUDA on sm_80 or newer only (PTX ``fma.rn.bf16x2``; see
    ``ptx_conversion``)."""
    return tl.inline_asm_elementwise(E2M1_TO_BF16_SCALED, "=r,=r,=r,=r,r,r,r", [per_byte(ptx_scale(scale)), packed],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA ``device`` (the current one when it has no index), cached per index."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


#: the lowest compute capability whose Triton supports fp8e4nv, the type every NVFP4 kernel loads E4M3 block scales as
NVFP4_KERNELS_MIN_CAPABILITY = (8, 9)


def nvfp4_kernels_supported(device: torch.device) -> tuple[bool, str]:
    """``(ok, why_not)``: whether the NVFP4 Triton kernels (dequant, fused MoE, decode) compile for ``device``. They
    load E4M3 scales as ``fp8e4nv``, which Triton supports from sm_89 (Ada, Hopper, Blackwell); on an A100 (sm_80)
    the first compile would fail. Off CUDA (the Triton interpreter) always ``(True, "")``."""
    if device.type != "cuda":
        return True, ""
    cap = _device_capability(device)
    if cap >= NVFP4_KERNELS_MIN_CAPABILITY:
        return True, ""
    need = ".".join(map(str, NVFP4_KERNELS_MIN_CAPABILITY))
    return False, (f"the NVFP4 Triton kernels load E4M3 scales as fp8e4nv, which Triton supports from compute "
                   f"capability {need}; this GPU is {cap[0]}.{cap[1]}")


def nvfp4_kernel_report(device: torch.device) -> dict:
    """What ``moe-offload probe`` reports about the NVFP4 kernels on ``device`` (a CUDA device): its compute
    capability, whether the NVFP4 Triton kernels run there (else the torch dequantization fallback, and why), and
    whether the weight conversion takes the PTX form, and whether the swapped tiles' down launch sums over K itself
    (``compute.fused_moe_launches``; this Triton, ``fused_moe_swap.sum_in_down_supported``)."""
    ok, why = nvfp4_kernels_supported(device)
    cap = _device_capability(device)
    from moe_offload.kernels.fused_moe_swap import sum_in_down_supported  # it imports this module

    sum_ok, sum_why = sum_in_down_supported()
    return {"capability": f"{cap[0]}.{cap[1]}", "kernels": ok, "fallback": None if ok else "torch dequantize + grouped_mm",
            "reason": why or None, "ptx_weight_conversion": ok and ptx_conversion(device),
            "down_sums_over_k": ok and sum_ok, "down_sums_over_k_reason": None if sum_ok else sum_why}


def ptx_conversion(device: torch.device) -> bool:
    """Whether ``e2m1_halves_bf16`` runs on ``device``: CUDA with compute capability 8.0 or newer (``fma.rn.bf16x2``);
    never under the Triton interpreter (CPU tensors)."""
    if device.type != "cuda":
        return False
    return _device_capability(device) >= (8, 0)


@triton.jit
def _dequant_nvfp4_kernel(
    q_ptr, stride_qn, stride_qr,  # packed [N, R, C/2] u8, columns contiguous
    s_ptr, stride_sn, stride_sr,  # block scales [N, R, C/16] e4m3, columns contiguous
    g_ptr, stride_gn, stride_gg,  # globals [N, G] f32
    o_ptr, stride_on, stride_or,  # out [N, R, C], columns contiguous
    idx_ptr,  # [N] input row of each output row (HAS_INDEX), else unused
    R, C_BYTES, ROWS_PER_GROUP,
    BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, SPLIT_STORE: tl.constexpr, HAS_INDEX: tl.constexpr,
):
    pid = tl.program_id(0)
    out_n = tl.program_id(1).to(tl.int64)
    if HAS_INDEX:
        n = tl.load(idx_ptr + out_n).to(tl.int64)  # the input bank row
    else:
        n = out_n
    num_b = tl.cdiv(C_BYTES, BLOCK_B)
    pid_r = pid // num_b
    pid_b = pid % num_b

    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    mask = (offs_r[:, None] < R) & (offs_b[None, :] < C_BYTES)

    packed = tl.load(q_ptr + n * stride_qn + offs_r[:, None] * stride_qr + offs_b[None, :], mask=mask, other=0).to(tl.int32)
    # byte b holds columns 2b (low nibble) and 2b+1; both lie in scale block 2b // 16 = b // 8.
    scale = tl.load(s_ptr + n * stride_sn + offs_r[:, None] * stride_sr + (offs_b // BYTES_PER_SCALE)[None, :], mask=mask, other=0.0)
    scale = scale.to(tl.float32) * E2M1_F16_SHIFT
    glob = tl.load(g_ptr + n * stride_gn + (offs_r // ROWS_PER_GROUP) * stride_gg, mask=offs_r < R, other=0.0)

    # (code * scale) is exact in fp32 (<= 6 significant bits); then one rounding for * global,
    # the same two steps in the same order as the torch reference.
    lo = (e2m1_to_f32(packed & 15) * scale) * glob[:, None]
    hi = (e2m1_to_f32(packed >> 4) * scale) * glob[:, None]
    row_ptrs = o_ptr + out_n * stride_on + offs_r[:, None] * stride_or
    if SPLIT_STORE:  # column 2b from lo, 2b+1 from hi, two strided stores (no register shuffle)
        even_ptrs = row_ptrs + 2 * offs_b[None, :]
        tl.store(even_ptrs, lo.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(even_ptrs + 1, hi.to(o_ptr.dtype.element_ty), mask=mask)
    else:
        vals = tl.interleave(lo, hi)  # [BLOCK_R, 2 * BLOCK_B]: column 2b from lo, 2b+1 from hi
        offs_c = pid_b * (2 * BLOCK_B) + tl.arange(0, 2 * BLOCK_B)
        out_mask = (offs_r[:, None] < R) & (offs_c[None, :] < 2 * C_BYTES)
        tl.store(row_ptrs + offs_c[None, :], vals.to(o_ptr.dtype.element_ty), mask=out_mask)


def device_guard(device: torch.device):
    """Context that makes ``device`` current for a Triton launch (CUDA only; a no-op on CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def check_rows_contiguous(name: str, t: torch.Tensor) -> None:
    """Raise unless the last dim of ``t`` is contiguous (bank views: any dim-0 stride is fine)."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(t.stride())}")


def dequant_nvfp4(
    packed_NRB: torch.Tensor, scale_NRS: torch.Tensor, global_NG: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
    tiles: DequantTiles | None = None, index_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize a stack of NVFP4 matrices.

    Args:
        packed_NRB: ``[N, R, C/2]`` uint8, two E2M1 codes per byte (column 2k in the low nibble).
        scale_NRS: ``[N, R, C/16]`` float8_e4m3fn block scales (one per 16 columns).
        global_NG: ``[N, G]`` float32 multipliers; rows are split into G equal consecutive groups,
            group g uses ``global_NG[:, g]`` (w13: G=2 gate/up, w2: G=1).
        out_dtype: float32, bfloat16 or float16.
        tiles: kernel tiles (default: ``dequant_tiles(device)`` from ``dequant_tuning.json``); every
            choice gives the same bits.
        index_N: optional int32/int64 ``[N']`` rows of the inputs to dequantize (output row i is input
            row ``index_N[i]``; read on the device, not range-checked: a device table of valid rows).

    Returns:
        ``[N, R, C]`` (``[N', R, C]`` with ``index_N``) contiguous tensor of ``out_dtype`` on the inputs'
        device (computed in fp32, rounded once to ``out_dtype``; bit-identical to the torch reference).
    """
    if packed_NRB.dtype != torch.uint8 or packed_NRB.dim() != 3:
        raise ValueError(f"packed_NRB must be a 3-D uint8 tensor [N, R, C/2], got {packed_NRB.dtype} {tuple(packed_NRB.shape)}")
    N, R, c_bytes = packed_NRB.shape
    C = 2 * c_bytes
    if C % BLOCK:
        raise ValueError(f"packed_NRB: columns C = 2 * {c_bytes} = {C} must be a multiple of {BLOCK} (one scale per {BLOCK})")
    if scale_NRS.dtype != torch.float8_e4m3fn or tuple(scale_NRS.shape) != (N, R, C // BLOCK):
        raise ValueError(
            f"scale_NRS must be float8_e4m3fn {(N, R, C // BLOCK)} to match packed_NRB {tuple(packed_NRB.shape)}, "
            f"got {scale_NRS.dtype} {tuple(scale_NRS.shape)}"
        )
    if global_NG.dtype != torch.float32 or global_NG.dim() != 2 or global_NG.shape[0] != N:
        raise ValueError(f"global_NG must be a float32 tensor [N={N}, G], got {global_NG.dtype} {tuple(global_NG.shape)}")
    G = global_NG.shape[1]
    if G < 1 or R % G:
        raise ValueError(f"global_NG: {G} groups must split the R={R} rows of packed_NRB evenly")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    for name, t in (("scale_NRS", scale_NRS), ("global_NG", global_NG)):
        if t.device != packed_NRB.device:
            raise ValueError(f"{name} is on {t.device} but packed_NRB is on {packed_NRB.device}")
    check_rows_contiguous("packed_NRB", packed_NRB)
    check_rows_contiguous("scale_NRS", scale_NRS)

    if index_N is not None:
        if index_N.dim() != 1 or index_N.dtype not in (torch.int32, torch.int64) or index_N.device != packed_NRB.device:
            raise ValueError(f"index_N must be a 1-D int32/int64 tensor on {packed_NRB.device}, got "
                             f"{index_N.dtype} {tuple(index_N.shape)} on {index_N.device}")
        N = index_N.shape[0]
    out_NRC = torch.empty((N, R, C), dtype=out_dtype, device=packed_NRB.device)
    if out_NRC.numel() == 0:
        return out_NRC
    t = tiles if tiles is not None else dequant_tiles(packed_NRB.device)
    grid = (triton.cdiv(R, t.block_r) * triton.cdiv(c_bytes, t.block_b), N)
    with device_guard(packed_NRB.device):
        _dequant_nvfp4_kernel[grid](
            packed_NRB, packed_NRB.stride(0), packed_NRB.stride(1),
            scale_NRS, scale_NRS.stride(0), scale_NRS.stride(1),
            global_NG, global_NG.stride(0), global_NG.stride(1),
            out_NRC, out_NRC.stride(0), out_NRC.stride(1),
            index_N if index_N is not None else out_NRC,
            R, c_bytes, R // G,
            BLOCK_R=t.block_r, BLOCK_B=t.block_b, SPLIT_STORE=t.split_store, HAS_INDEX=index_N is not None,
            num_warps=t.num_warps,
        )
    return out_NRC


def bank_shapes(views: dict) -> tuple[int, int, int]:
    """Validate an NVFP4 expert bank dict (see ``Nvfp4ModelOptFormat.banks``) -> ``(N, H, I)``.

    Raises ValueError naming the bank whose key, dtype, shape, device or layout is wrong."""
    missing = [k for k in BANK_KEYS if k not in views]
    if missing:
        raise ValueError(f"NVFP4 bank views are missing {missing} (need {list(BANK_KEYS)})")
    w13_q = views["w13_q"]
    if w13_q.dtype != torch.uint8 or w13_q.dim() != 3 or w13_q.shape[1] % 2:
        raise ValueError(f"views['w13_q'] must be uint8 [N, 2I, H/2], got {w13_q.dtype} {tuple(w13_q.shape)}")
    N, two_i, h_half = w13_q.shape
    H, I = 2 * h_half, two_i // 2
    if H % BLOCK or I % BLOCK:
        raise ValueError(f"views['w13_q'] {tuple(w13_q.shape)}: H={H} and I={I} must be multiples of {BLOCK}")
    expected = {
        "w13_s": ((N, 2 * I, H // BLOCK), torch.float8_e4m3fn),
        "w2_q": ((N, H, I // 2), torch.uint8),
        "w2_s": ((N, H, I // BLOCK), torch.float8_e4m3fn),
        "gs": ((N, 3), torch.float32),
    }
    for key, (shape, dtype) in expected.items():
        t = views[key]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"views['{key}'] must be {dtype} {shape} (N={N}, H={H}, I={I} from w13_q), got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != w13_q.device:
            raise ValueError(f"views['{key}'] is on {t.device} but views['w13_q'] is on {w13_q.device}")
    for key in ("w13_q", "w13_s", "w2_q", "w2_s"):
        check_rows_contiguous(f"views['{key}']", views[key])
    return N, H, I


def dequant_banks(views: dict, dtype: torch.dtype = torch.bfloat16, tiles: DequantTiles | None = None,
                  index_N: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense weights of NVFP4 expert banks.

    Args:
        views: ``w13_q [N, 2I, H/2] u8``, ``w13_s [N, 2I, H/16] e4m3``, ``w2_q [N, H, I/2] u8``,
            ``w2_s [N, H, I/16] e4m3``, ``gs [N, 3] f32`` (gate, up, down multipliers).
        dtype: output dtype (float32, bfloat16, float16).
        tiles: kernel tiles (default: this device's entry of ``dequant_tuning.json``).
        index_N: optional ``[N']`` bank rows to dequantize, in this order (e.g. a layer's slots of the pool).

    Returns:
        ``(w13 [N, 2I, H], w2 [N, H, I])``: gate rows first, then up; equal to
        ``Nvfp4ModelOptFormat().dequantize(views, dtype)``.
    """
    bank_shapes(views)
    gs_N3 = views["gs"]
    w13_NFH = dequant_nvfp4(views["w13_q"], views["w13_s"], gs_N3[:, :2], dtype, tiles, index_N)
    w2_NHI = dequant_nvfp4(views["w2_q"], views["w2_s"], gs_N3[:, 2:], dtype, tiles, index_N)
    return w13_NFH, w2_NHI
