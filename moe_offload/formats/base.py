"""The format seam: how one expert's weights are laid out in banks, read from a checkpoint and dequantized.

Legend: N rows of a bank (experts or slots), H hidden, I expert intermediate (per TP rank), R bytes of a
row; a matrix's own rows/cols are named in words.
An expert is a set of banks; bank ``b`` of a layer is one tensor ``[E, row_bytes(b)]`` of raw bytes in
the host store, the slot pool and the staging buffers. ``BankSpec`` says how to view a row.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from moe_offload.checkpoint.reader import CheckpointReader


class FormatError(ValueError):
    """A tensor does not match its format (names the tensor and the fix)."""


def require_finite(t: torch.Tensor, where: str) -> None:
    """Raise a FormatError naming ``where`` (file: tensor) when ``t`` holds NaN or Inf (a corrupt export)."""
    bad = t.numel() - int(torch.isfinite(t.float()).sum())
    if bad:
        raise FormatError(f"{where} holds {bad} non-finite value(s) (NaN/Inf) of {t.numel()}; the checkpoint is "
                          "corrupt: re-export or re-download it")


def require_global_scale(g: torch.Tensor, where: str) -> None:
    """A per-tensor global scale must be finite and non-zero (zero makes every weight 0 or Inf)."""
    require_finite(g, where)
    if bool((g == 0).any()):
        raise FormatError(f"{where} is 0 (an NVFP4 global scale must be non-zero); the checkpoint is corrupt: "
                          "re-export or re-download it")


@dataclass(frozen=True)
class BankSpec:
    """One bank of an expert: a row of ``nbytes`` bytes viewed as ``dtype`` with ``shape``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize  # no tensor: read on every admission

    def view(self, raw_NR: torch.Tensor) -> torch.Tensor:
        """``[N, nbytes] uint8`` (rows contiguous, row stride free) -> ``[N, *shape] dtype`` (no copy)."""
        typed = raw_NR.view(self.dtype)
        return typed.as_strided((raw_NR.shape[0], *self.shape),
                                (typed.stride(0), *torch.empty(self.shape, device="meta").stride()))


@dataclass(frozen=True)
class TpSlice:
    """This rank's part of the expert intermediate dim: ``[start, start + size)`` of I."""

    rank: int = 0
    size_ranks: int = 1

    def bounds(self, inter: int, multiple: int) -> tuple[int, int]:
        if inter % self.size_ranks:
            raise FormatError(f"expert intermediate size {inter} is not divisible by tp={self.size_ranks}")
        part = inter // self.size_ranks
        if part % multiple:
            raise FormatError(
                f"expert intermediate size {inter} / tp={self.size_ranks} = {part} is not a multiple of "
                f"{multiple} (NVFP4 block size); use a tp that keeps I/tp a multiple of {multiple}"
            )
        return self.rank * part, (self.rank + 1) * part


class ExpertFormat(ABC):
    """How a format stores one expert (gate_up [2I, H], down [H, I]) and how to get bf16 back."""

    name: str
    #: True when expert weights are stored as codes + scales (dequantized in the GEMM), False for plain floats
    is_quantized: bool = False
    #: I/tp must be a multiple of this (NVFP4: 16-element blocks along K of down_proj).
    tp_multiple: int = 1

    #: on-disk suffix of the per-tensor global scale (finite and non-zero), None for unscaled formats
    global_scale_suffix: str | None = None

    @abstractmethod
    def disk_tensors(self, rows: int, cols: int) -> dict[str, tuple[tuple[int, ...] | None, torch.dtype]]:
        """What one ``[rows, cols]`` linear is on disk: suffix -> (shape or None for a scalar, dtype)."""

    @abstractmethod
    def banks(self, hidden: int, inter: int) -> list[BankSpec]:
        """Bank layout of one expert at hidden size H and (per-rank) intermediate size I."""

    def bytes_per_expert(self, hidden: int, inter: int) -> int:
        return sum(b.nbytes for b in self.banks(hidden, inter))

    @abstractmethod
    def read_expert(
        self, reader: "CheckpointReader", proj_name: Callable[[str], str], hidden: int, inter: int, tp: TpSlice
    ) -> dict[str, torch.Tensor]:
        """Read one expert's tensors (this rank's slice only) -> {bank: tensor of the bank's shape/dtype}.

        ``proj_name("gate"|"up"|"down")`` gives the checkpoint prefix of that projection.
        """

    @abstractmethod
    def dequantize(self, views: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Bank views ``[N, ...]`` -> ``(gate_up_NFH [N, 2I, H], down_NHI [N, H, I])`` in ``dtype``."""

    @abstractmethod
    def read_linear(self, reader: "CheckpointReader", prefix: str, dtype: torch.dtype) -> torch.Tensor | None:
        """A non-expert linear's weight ``[out, in]`` in ``dtype`` if stored quantized under ``prefix``."""
