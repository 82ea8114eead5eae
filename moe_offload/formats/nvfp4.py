"""NVFP4: E2M1 codes two per byte (element 2k in the low nibble), one FP8 E4M3 scale per 16 elements,
one FP32 global scale per tensor. Torch reference implementation (the Triton kernel in
``moe_offload.kernels.nvfp4`` is checked against it).

Layouts on disk:
- ModelOpt: ``weight`` uint8 [R, C/2], ``weight_scale`` e4m3 [R, C/16], ``weight_scale_2`` fp32 (multiplies),
  ``input_scale`` fp32, plus ``hf_quant_config.json``.  W = code * scale * weight_scale_2
- compressed-tensors ``nvfp4-pack-quantized``: ``weight_packed``, ``weight_scale``,
  ``weight_global_scale`` fp32 [1] (divides).  W = code * scale / weight_global_scale

In the store both become the same banks (global scales stored as multipliers):
``w13_q [2I, H/2] u8``, ``w13_s [2I, H/16] e4m3``, ``w2_q [H, I/2] u8``, ``w2_s [H, I/16] e4m3``,
``gs [3] fp32`` = (gate, up, down) multipliers.
"""

from __future__ import annotations

import numpy as np
import torch

from moe_offload.formats.base import BankSpec, ExpertFormat, FormatError, TpSlice, require_finite, require_global_scale

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: code -> value; bit 3 is the sign, bits 0-2 index [0, .5, 1, 1.5, 2, 3, 4, 6].
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_table(device=None, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def pack_codes(codes_RC: torch.Tensor) -> torch.Tensor:
    """uint8 codes (0..15) ``[..., C]`` -> packed bytes ``[..., C/2]`` (element 2k in the low nibble)."""
    if codes_RC.shape[-1] % 2:
        raise FormatError(f"cannot pack an odd number of FP4 codes ({codes_RC.shape[-1]})")
    c = codes_RC.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """packed bytes ``[..., C/2]`` -> uint8 codes ``[..., C]``."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (uint8) for each value of ``x`` (already divided by its scales)."""
    mags = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=x.device)
    # midpoints between consecutive magnitudes; bucketize gives the nearest index (ties go up).
    mids = (mags[1:] + mags[:-1]) / 2
    idx = torch.bucketize(x.abs().float().clamp(max=E2M1_MAX), mids, right=True).to(torch.uint8)
    sign = (x < 0).to(torch.uint8) << 3
    return idx | sign


def quantize(w_RC: torch.Tensor, global_amax: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``[R, C]`` (C % 16 == 0) -> ``(packed u8 [R, C/2], scale e4m3 [R, C/16], global fp32 [])``.

    The global scale is a multiplier (ModelOpt's ``weight_scale_2``): amax / (448 * 6), so block
    scales use the full E4M3 range. W ~= code * scale * global.
    """
    R, C = w_RC.shape
    if C % BLOCK:
        raise FormatError(f"NVFP4 needs the input dim to be a multiple of {BLOCK}, got {C}")
    w = w_RC.float()
    amax = float(w.abs().max()) if global_amax is None else global_amax
    g = torch.tensor(max(amax, 1e-12) / (E4M3_MAX * E2M1_MAX), dtype=torch.float32)
    blocks = w.view(R, C // BLOCK, BLOCK)
    block_amax = blocks.abs().amax(-1)
    scale = (block_amax / (E2M1_MAX * g)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = (scale.float() * g).unsqueeze(-1)
    q = torch.where(denom > 0, blocks / torch.where(denom > 0, denom, 1.0), torch.zeros_like(blocks))
    codes = round_to_e2m1(q).view(R, C)
    return pack_codes(codes), scale, g


def dequantize(packed: torch.Tensor, scale: torch.Tensor, global_mult: torch.Tensor | float, dtype=torch.float32) -> torch.Tensor:
    """``packed [..., R, C/2]``, ``scale [..., R, C/16]``, global multiplier (broadcastable to ``[..., R, 1]``)
    -> ``[..., R, C]`` in ``dtype`` (computed in fp32)."""
    codes = unpack_codes(packed).long()
    vals = e2m1_table(packed.device)[codes]
    C = vals.shape[-1]
    blocks = vals.view(*vals.shape[:-1], C // BLOCK, BLOCK) * scale.float().unsqueeze(-1)
    g = global_mult if isinstance(global_mult, torch.Tensor) else torch.tensor(global_mult)
    return (blocks.view(*vals.shape) * g.float().to(packed.device)).to(dtype)


def random_seed(generator: torch.Generator) -> int:
    """One seed drawn from ``generator`` for a NumPy stream (``random_nvfp4_seeded``, ``random_normal_seeded``)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def random_nvfp4(R: int, C: int, generator: torch.Generator, target_std: float = 0.02):
    """Valid NVFP4 tensor data written directly (no float quantization): for real-size synthetic
    checkpoints at memory speed. Returns ``(packed [R, C/2], scale e4m3 [R, C/16], global fp32 [])``.

    Codes and scales come from a NumPy PCG64 stream seeded by one draw of ``generator`` (``random_seed``), so a
    seeded generator gives the same tensors every time. ``torch.randint`` on uint8 ran at ~120 MB/s on the CPU
    and set the build time of the real-size presets (7.0 ms per 0.8 MB matrix, against 1.1 ms for NumPy's
    integers); NumPy also releases the GIL, so the builder draws experts on several threads."""
    return random_nvfp4_seeded(R, C, random_seed(generator), target_std)


def random_nvfp4_seeded(R: int, C: int, seed: int, target_std: float = 0.02):
    """``random_nvfp4`` from an explicit seed (thread-safe: its own generator)."""
    rng = np.random.default_rng(seed)
    packed = torch.from_numpy(rng.integers(0, 256, (R, C // 2), dtype=np.uint8))
    # E4M3 scales in [0.5, 2) * 64 keep most of the E4M3 range unused but valid and varied.
    scale = torch.from_numpy(64.0 * (0.5 + 1.5 * rng.random((R, C // BLOCK), dtype=np.float32))).to(torch.float8_e4m3fn)
    # uniform codes have rms ~2.93; mean scale ~80 -> pick g so the weight std ~ target_std.
    g = torch.tensor(target_std / (2.93 * 80.0), dtype=torch.float32)
    return packed, scale, g


def random_normal_seeded(shape: tuple[int, ...], seed: int, std: float, dtype: torch.dtype = torch.bfloat16):
    """Normal(0, ``std``) weights from an explicit seed (NumPy's float32 ziggurat, thread-safe), cast to ``dtype``."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).to(dtype)


class _Nvfp4Base(ExpertFormat):
    is_quantized = True
    tp_multiple = BLOCK
    #: suffixes (packed, block scale, global scale) on disk
    suffixes: tuple[str, str, str]

    @property
    def global_scale_suffix(self) -> str:
        return self.suffixes[2]

    def disk_tensors(self, rows, cols):
        sq, ss, sg = self.suffixes
        return {sq: ((rows, cols // 2), torch.uint8), ss: ((rows, cols // BLOCK), torch.float8_e4m3fn),
                sg: (None, torch.float32)}

    def banks(self, hidden: int, inter: int) -> list[BankSpec]:
        for dim, what in ((hidden, "hidden size"), (inter, "expert intermediate size (per TP rank)")):
            if dim % BLOCK:
                raise FormatError(f"NVFP4 needs the {what} to be a multiple of {BLOCK}, got {dim}")
        return [
            BankSpec("w13_q", (2 * inter, hidden // 2), torch.uint8),
            BankSpec("w13_s", (2 * inter, hidden // BLOCK), torch.float8_e4m3fn),
            BankSpec("w2_q", (hidden, inter // 2), torch.uint8),
            BankSpec("w2_s", (hidden, inter // BLOCK), torch.float8_e4m3fn),
            BankSpec("gs", (3,), torch.float32),
        ]

    def global_multiplier(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored global scale -> multiplier (ModelOpt multiplies, compressed-tensors divides)."""
        raise NotImplementedError

    def _read_proj(self, reader, prefix: str, rows=None, cols=None):
        sq, ss, sg = self.suffixes
        c0 = c1 = None
        if cols is not None:
            c0, c1 = cols
        packed = reader.get(f"{prefix}.{sq}", rows=rows, cols=None if cols is None else (c0 // 2, c1 // 2), expect_dtype=torch.uint8)
        scale = reader.get(
            f"{prefix}.{ss}", rows=rows, cols=None if cols is None else (c0 // BLOCK, c1 // BLOCK), expect_dtype=torch.float8_e4m3fn
        )
        g = reader.get(f"{prefix}.{sg}", expect_dtype=torch.float32)
        if g.numel() != 1:
            raise FormatError(f"{reader.file_of(prefix + '.' + sg)}: tensor {prefix}.{sg} must hold one value, has shape {tuple(g.shape)}")
        require_global_scale(g, f"{reader.file_of(prefix + '.' + sg)}: tensor {prefix}.{sg}")
        require_finite(scale, f"{reader.file_of(prefix + '.' + ss)}: tensor {prefix}.{ss}")
        return packed, scale, self.global_multiplier(g.reshape(()))

    def read_expert(self, reader, proj_name, hidden, inter, tp: TpSlice):
        i0, i1 = tp.bounds(inter * tp.size_ranks, self.tp_multiple)
        gq, gs, gg = self._read_proj(reader, proj_name("gate"), rows=(i0, i1))
        uq, us, ug = self._read_proj(reader, proj_name("up"), rows=(i0, i1))
        dq, ds, dg = self._read_proj(reader, proj_name("down"), cols=(i0, i1))
        return {
            "w13_q": torch.cat([gq, uq], 0),
            "w13_s": torch.cat([gs, us], 0),
            "w2_q": dq,
            "w2_s": ds,
            "gs": torch.stack([gg, ug, dg]).float(),
        }

    def dequantize(self, views, dtype):
        gs_N3 = views["gs"]
        two_i = views["w13_q"].shape[1]
        g13 = torch.repeat_interleave(gs_N3[:, :2], two_i // 2, dim=1).unsqueeze(-1)  # [N, 2I, 1]
        w13 = dequantize(views["w13_q"], views["w13_s"], g13, dtype)
        w2 = dequantize(views["w2_q"], views["w2_s"], gs_N3[:, 2].view(-1, 1, 1), dtype)
        return w13, w2

    def read_linear(self, reader, prefix, dtype):
        if not reader.has(f"{prefix}.{self.suffixes[0]}") or not reader.has(f"{prefix}.{self.suffixes[2]}"):
            return None
        packed, scale, g = self._read_proj(reader, prefix)
        return dequantize(packed, scale, g, dtype)


class Nvfp4ModelOptFormat(_Nvfp4Base):
    """ModelOpt layout: ``weight``, ``weight_scale``, ``weight_scale_2`` (a multiplier)."""

    name = "nvfp4-modelopt"
    suffixes = ("weight", "weight_scale", "weight_scale_2")

    def global_multiplier(self, stored):
        return stored.float()

    def to_disk(self, prefix: str, packed, scale, g_mult, w4a4: bool = False) -> dict[str, torch.Tensor]:
        """The tensors ModelOpt writes for one linear (``input_scale`` only in a W4A4 export)."""
        out = {
            f"{prefix}.weight": packed,
            f"{prefix}.weight_scale": scale,
            f"{prefix}.weight_scale_2": g_mult.reshape(()).float(),
        }
        if w4a4:
            out[f"{prefix}.input_scale"] = torch.tensor(1.0, dtype=torch.float32)
        return out


class Nvfp4CompressedTensorsFormat(_Nvfp4Base):
    """compressed-tensors ``nvfp4-pack-quantized``: ``weight_packed``, ``weight_scale``,
    ``weight_global_scale`` (a divisor: W = q * s / g)."""

    name = "nvfp4-ct"
    suffixes = ("weight_packed", "weight_scale", "weight_global_scale")

    def global_multiplier(self, stored):
        return 1.0 / stored.float()

    def to_disk(self, prefix: str, packed, scale, g_mult, w4a4: bool = False) -> dict[str, torch.Tensor]:
        """The tensors llm-compressor writes for one linear (``input_global_scale`` only in a W4A4 export)."""
        out = {
            f"{prefix}.weight_packed": packed,
            f"{prefix}.weight_scale": scale,
            f"{prefix}.weight_global_scale": (1.0 / g_mult.float()).reshape(1),
        }
        if w4a4:
            out[f"{prefix}.input_global_scale"] = torch.ones(1, dtype=torch.float32)
        return out
