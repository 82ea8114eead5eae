"""ExpertStore: every expert of every MoE layer in host memory, one exact-size pinned allocation per
layer ``[E, row_bytes]``: an expert is ONE contiguous row holding all its banks side by side
(``bank(layer, name)`` is the column slice ``[E, bank_bytes]`` of that row; ``BankSpec.view`` gives
typed views). One row per expert means one copy entry per expert or per run of experts, and no
small rows (scales, global scales) in any copy: small entries in a cudaMemcpyBatchAsync call held
the host for the whole copy on the H200 (benchmarks/results/copy_paths_*).

Pinning: plain host memory registered with ``cudaHostRegister`` (exact size; torch's
``pin_memory()`` goes through a caching allocator that rounds sizes up), mapped and portable
(``cudaHostRegisterMapped | cudaHostRegisterPortable``), so kernels can read rows straight from host
memory over UVA: ``device_rows(layer, device)`` is the device view of ``rows(layer)``
(``moe_offload/uva.py``). Register (build the store) with the target device current. On a CPU-only
torch the banks stay in plain memory and one ``host_store_unpinned`` event says so.
Under TP each rank holds only its slice of every expert (gate/up rows, down columns of I).
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

import torch
from tqdm.auto import tqdm

from moe_offload import log, uva
from moe_offload.checkpoint.families import ModelGeometry
from moe_offload.checkpoint.reader import CheckpointReader, detect_format
from moe_offload.formats import BankSpec, ExpertFormat, FormatError, get_format
from moe_offload.formats.base import TpSlice


class StoreError(ValueError):
    pass


def _pin(t: torch.Tensor) -> bool:
    """Register ``t``'s memory as pinned (page-locked), mapped and portable; False without CUDA."""
    return uva.pin_mapped(t)


ROW_ALIGN = 16  # bytes, every row: see ExpertStore.bytes_per_expert
PAGE_ROW_ALIGN = 4096  # bytes, rows of at least PAGE_ROWS_FROM: each starts on a host page
PAGE_ROWS_FROM = 1 << 20  # data bytes from which a row is padded to a page (the padding then costs < 0.4 %)


def padded_row_bytes(data_bytes: int) -> int:
    """Bytes of an expert row holding ``data_bytes`` of banks: rounded up to ``PAGE_ROW_ALIGN`` from
    ``PAGE_ROWS_FROM`` data bytes (a real model's experts: Qwen3-30B-A3B's 2,654,220 become 2,658,304), else to
    ``ROW_ALIGN`` (the tiny models' rows of a few KiB stay near their size)."""
    align = PAGE_ROW_ALIGN if data_bytes >= PAGE_ROWS_FROM else ROW_ALIGN
    return -(-data_bytes // align) * align


def _unpin(ptrs: list[int]) -> None:
    if ptrs:
        uva.unpin(ptrs)


def bank_offsets(specs: list[BankSpec]) -> dict[str, tuple[int, int]]:
    """Byte offset and size of each bank inside an expert row (banks back to back, in spec order;
    every format keeps bank sizes multiples of 4 so fp32 views of later banks stay aligned)."""
    out, off = {}, 0
    for s in specs:
        out[s.name] = (off, s.nbytes)
        off += s.nbytes
    return out


def bank_views(specs: list[BankSpec], offsets: dict[str, tuple[int, int]], rows_NR: torch.Tensor) -> dict[str, torch.Tensor]:
    """Typed views ``[N, *shape]`` of every bank of ``rows_NR [N, bytes_per_expert]`` (no copy)."""
    return {s.name: s.view(rows_NR[:, offsets[s.name][0]:offsets[s.name][0] + s.nbytes]) for s in specs}


class ExpertStore:
    """Host banks of all MoE layers. ``bank(layer, name)`` is ``[E, row_bytes]`` uint8."""

    def __init__(self, geometry: ModelGeometry, fmt: ExpertFormat, tp_rank: int = 0, tp_size: int = 1, pin: bool = True):
        if not 0 <= tp_rank < tp_size:
            raise StoreError(f"tp_rank {tp_rank} is outside [0, tp_size={tp_size})")
        self.geometry = geometry
        self.format = fmt
        self.tp_rank, self.tp_size = tp_rank, tp_size
        if geometry.inter % tp_size:
            raise FormatError(f"expert intermediate size {geometry.inter} is not divisible by tp={tp_size}")
        self.inter = geometry.inter // tp_size
        TpSlice(tp_rank, tp_size).bounds(geometry.inter, fmt.tp_multiple)
        self.specs: list[BankSpec] = fmt.banks(geometry.hidden, self.inter)
        self.layers: tuple[int, ...] = geometry.moe_layers
        self.num_experts = geometry.num_experts
        self.offsets = bank_offsets(self.specs)
        self._rows: dict[int, torch.Tensor] = {}
        self._device_rows: dict[tuple[int, torch.device], torch.Tensor] = {}
        pinned_ptrs: list[int] = []
        E = self.num_experts
        try:
            for layer in self.layers:
                t = uva.page_aligned((E, self.bytes_per_expert), torch.uint8, zeroed=False)
                t[:, self.data_bytes_per_expert:].zero_()  # the row padding: defined bytes in every copy
                if pin and _pin(t):
                    pinned_ptrs.append(t.data_ptr())
                self._rows[layer] = t
        except BaseException:  # a layer failed to pin: unregister the ones before it, or their pages stay registered
            _unpin(pinned_ptrs)
            raise
        self.pinned = bool(pinned_ptrs)
        self._finalizer = weakref.finalize(self, _unpin, pinned_ptrs)
        if pin and not self.pinned and log.rank_info()[0] == 0:  # informational: rank 0 speaks for all
            log.log_once("host_store_unpinned", "host_store_unpinned", logging.INFO, reason="no_cuda",
                         detail="CPU-only torch: expert banks live in plain host memory")

    # --- geometry ------------------------------------------------------------------------------
    @property
    def data_bytes_per_expert(self) -> int:
        """Bytes of one expert's banks (what the checkpoint holds)."""
        return sum(s.nbytes for s in self.specs)

    @property
    def bytes_per_expert(self) -> int:
        """Bytes of one expert row: its banks padded to ``ROW_ALIGN``, so every row of the store, the slot
        pool and staging starts 16-byte aligned and the decode kernels read it with 16-byte vectors
        (UVA misses read at 46.5 instead of 41 GB/s on the H200,
        benchmarks/results/decode_kernels-c6e05d5-h200-20261202-2054.md); rows of a real model's size to a page
        (``padded_row_bytes``; the store's rows start on one), so a miss read from mapped host memory starts on a
        page: the miss copy read 3.5-3.8 % faster on an H200 and an H100, decode at residency 0.5 batch 16 ran 3.3 %
        faster (README Decisions, "Expert rows of a real model's size start on a host page"). Every copy moves whole
        rows."""
        return padded_row_bytes(self.data_bytes_per_expert)

    @property
    def bank_bytes(self) -> dict[str, int]:
        """Row bytes of each bank (one expert)."""
        return {s.name: s.nbytes for s in self.specs}

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_expert * self.num_experts * len(self.layers)

    @property
    def pinned_bytes(self) -> int:
        """Host bytes registered (pinned) for the banks now: every layer's rows while pinned, 0 unpinned or
        after ``close()`` (the soak benchmark samples it)."""
        if not (self.pinned and self._finalizer.alive):
            return 0
        return sum(t.numel() for t in self._rows.values())

    def rows(self, layer: int) -> torch.Tensor:
        """The layer's experts ``[E, bytes_per_expert]`` uint8 (pinned when CUDA is present)."""
        return self._rows[layer]

    def device_rows(self, layer: int, device) -> torch.Tensor:
        """``rows(layer)`` as a tensor on ``device`` aliasing the pinned host memory (UVA; cached): kernels
        read host rows over PCIe with no copy. On CPU, ``rows(layer)`` itself. Valid until ``close()``
        (keep the store alive while the views are used). Raises ``uva.UvaError`` when the GPU cannot
        map host memory or the store is not pinned."""
        dev = torch.device(device)
        if dev.type == "cpu":
            return self._rows[layer]
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        key = (layer, dev)
        if key not in self._device_rows:
            if not self.pinned:
                raise uva.UvaError(f"the expert store is not pinned, so {dev} cannot map its rows; build it with "
                                   "pin=True on a CUDA build of torch")
            self._device_rows[key] = uva.mapped_device_view(self._rows[layer], dev)
        return self._device_rows[key]

    def bank(self, layer: int, name: str) -> torch.Tensor:
        """Column slice ``[E, bank_bytes]`` of the layer's rows (a view)."""
        off, n = self.offsets[name]
        return self._rows[layer][:, off:off + n]

    def views(self, layer: int) -> dict[str, torch.Tensor]:
        return bank_views(self.specs, self.offsets, self._rows[layer])

    def close(self) -> None:
        """Unregister pinned memory now (also done when the store is garbage-collected); drops the
        device views of ``device_rows``."""
        self._device_rows.clear()
        self._finalizer()

    def describe(self) -> dict:
        return {
            "format": self.format.name, "layers": len(self.layers), "experts": self.num_experts,
            "tp_rank": self.tp_rank, "tp_size": self.tp_size, "pinned": self.pinned,
            "bytes_per_expert": self.bytes_per_expert, "bank_row_bytes": self.bank_bytes, "total_bytes": self.total_bytes,
        }

    # --- filling -------------------------------------------------------------------------------
    def put(self, layer: int, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write one expert's tensors into its rows. Every tensor is checked before any byte is written, so a bad
        one leaves the expert as it was (a half-written expert computed with mixed weights before)."""
        if layer not in self._rows:
            raise FormatError(f"put: layer {layer!r} is not a MoE layer of this store ({list(self.layers)[:8]}...)")
        if isinstance(expert, bool) or not isinstance(expert, int) or not 0 <= expert < self.num_experts:
            raise FormatError(f"put: expert {expert!r} of layer {layer} is outside 0..{self.num_experts - 1}")
        missing = [s.name for s in self.specs if s.name not in tensors]
        if missing:
            raise FormatError(f"put: layer {layer} expert {expert}: no tensor for bank(s) {missing}")
        for s in self.specs:
            t = tensors[s.name]
            if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                raise FormatError(f"bank {s.name}: got {tuple(t.shape)} {t.dtype}, expected {s.shape} {s.dtype}")
        for s in self.specs:
            self.bank(layer, s.name)[expert].copy_(tensors[s.name].contiguous().view(-1).view(torch.uint8))

    @classmethod
    def for_preset(cls, preset: str, layers: int | None = None, fmt: str = "nvfp4-modelopt",
                   pin: bool = True) -> "ExpertStore":
        """An unfilled store of ``preset``'s shape (``layers`` MoE layers deep): real-size pinned rows for link and
        copy measurements that need sizes, not weights."""
        from moe_offload.formats.registry import get_format
        from moe_offload.presets import preset_geometry

        return cls(preset_geometry(preset, layers), get_format(fmt), pin=pin)

    @classmethod
    def from_checkpoint(cls, path: str | Path | CheckpointReader, fmt: str | None = None, tp_rank: int = 0,
                        tp_size: int = 1, pin: bool = True, progress: bool = True) -> "ExpertStore":
        """Load every expert (this rank's slice) from an HF checkpoint dir into pinned banks."""
        reader = path if isinstance(path, CheckpointReader) else CheckpointReader(path)
        detected = detect_format(reader)
        if fmt not in (None, "auto") and fmt != detected:
            raise StoreError(
                f"{reader.path}: model.format is {fmt!r} but the checkpoint is {detected!r} (from config.json / "
                "hf_quant_config.json); set model.format to auto or to the checkpoint's format"
            )
        fmt_obj = get_format(detected)
        geo = reader.geometry
        store = cls(geo, fmt_obj, tp_rank, tp_size, pin)
        tp = TpSlice(tp_rank, tp_size)
        fam = geo.family
        total = len(store.layers) * geo.num_experts
        bar = tqdm(total=total, desc=f"load experts ({detected}, rank {tp_rank}/{tp_size})", unit="expert",
                   disable=not progress, unit_scale=True)
        for layer in store.layers:
            fused = reader.has(fam.fused_gate_up.format(l=layer))
            for e in range(geo.num_experts):
                if fused:
                    tensors = store._read_fused_bf16(reader, layer, e, tp)
                else:
                    tensors = fmt_obj.read_expert(reader, lambda w: fam.expert_name(layer, e, w), geo.hidden, store.inter, tp)
                store.put(layer, e, tensors)
            bar.update(geo.num_experts)
        bar.close()
        store.reader_bytes = reader.bytes_read
        return store

    def _read_fused_bf16(self, reader: CheckpointReader, layer: int, e: int, tp: TpSlice) -> dict[str, torch.Tensor]:
        fam = self.geometry.family
        if self.format.name != "bf16":
            raise StoreError(f"{reader.path}: fused expert tensors are only supported for bf16 checkpoints")
        I = self.geometry.inter
        i0, i1 = tp.bounds(I, 1)
        gu = fam.fused_gate_up.format(l=layer)
        gate = reader.get(gu, index=e, rows=(i0, i1), expect_dtype=torch.bfloat16)
        up = reader.get(gu, index=e, rows=(I + i0, I + i1), expect_dtype=torch.bfloat16)
        down = reader.get(fam.fused_down.format(l=layer), index=e, cols=(i0, i1), expect_dtype=torch.bfloat16)
        return {"w13": torch.cat([gate, up], 0), "w2": down}
