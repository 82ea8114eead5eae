"""The decode step's expert compute: routed experts read in place from the slot pool by row index.

Legend: T tokens, K top-k, H hidden, I intermediate, N rows of the pool views (slots + scratch rows).

NVFP4 on CUDA: a fused W4A16 decode kernel reads codes, block scales and global scales straight from
the pool rows (fp32 accumulation, no bf16 copy of any weight), chosen by ``kernel``:
- ``"gemv"``: ``kernels/decode_gemv.py`` (no tensor-core dot; for few tokens per expert);
- ``"tiles"``: ``kernels/decode_moe.py`` (16-row tensor-core tiles);
- ``"auto"``: gemv when T*K <= ``gemv_max_pairs`` of ``decode_gemv_tuning.json`` for the device and
  shape (T and K are host-known shapes, so the choice is fixed per captured graph), else tiles.
Other formats and devices: the T*K routed rows are gathered (one ``index_select`` per bank, no host
sync) and the configured compute runs on them. Either way nothing is read back to the host.
"""

from __future__ import annotations

import torch

KERNELS = ("auto", "gemv", "tiles")


class DecodeCompute:
    """``(hidden_TH, rows_TK, weights_TK, pool_views, num_rows) -> out_TH`` for decode-sized T."""

    def __init__(self, fmt, inner, device: torch.device, fused: bool, kernel: str = "auto", fused_launches: bool = True,
                 route_max_pairs: int = 0, sum_in_down: bool = False, overlap: bool = False):
        """``fused_launches`` (``compute.fused_moe_launches``): the fused kernels take the rows grouped by the miss plan's
        launch (``align_block_m``) and the swapped tiles take their split activations from the norm before the MoE
        (``split_block_k``); with it, ``OffloadedExperts.route`` runs the router's top-k in the plan's launch for steps
        of up to ``route_max_pairs`` routed pairs (``compute.route_plan_max_pairs``) and, with ``sum_in_down``
        (``compute.moe_sum_in_down``), the swapped tiles' and the GEMV's per-pair down launches sum over K
        themselves. ``overlap``: the cache may fork a step's miss copy (``decode.overlap_misses_from``), and the tile
        kernels then take the pairs read from slots first (``split``; the GEMVs never split)."""
        if kernel not in KERNELS:
            raise ValueError(f"DecodeCompute kernel={kernel!r}: expected one of {KERNELS}")
        self.inner = inner
        self.kernel = kernel
        self.fused_launches = fused_launches
        self.route_max_pairs = route_max_pairs if fused_launches else 0
        self.sum_in_down = fused_launches and sum_in_down
        self.overlap = overlap
        self._stats = None
        self._triton_sums_in_down = True  # this Triton sums over K in the swapped down launch (checked when fused)
        if fused and fmt.is_quantized and device.type == "cuda":
            from moe_offload.compute import nvfp4_kernels_usable

            fused = nvfp4_kernels_usable(fmt, device)
        self.fused = fused and fmt.is_quantized and device.type == "cuda"
        self.name = "triton_decode" if self.fused else f"{inner.name}+row_gather"
        if self.fused:
            from moe_offload.kernels.decode_gemv import decode_gemv_nvfp4
            from moe_offload.kernels.decode_moe import decode_moe_nvfp4
            from moe_offload.kernels.fused_moe_swap import sum_in_down_supported

            self._gemv, self._tiles = decode_gemv_nvfp4, decode_moe_nvfp4
            self._triton_sums_in_down = sum_in_down_supported()[0]

    def bind(self, stats) -> None:
        self.inner.bind(stats)
        self._stats = stats

    def pick(self, device: torch.device, T: int, K: int, H: int, I: int) -> str:
        """``"gemv"`` or ``"tiles"`` for a call of T tokens, top-K, layer shape (H, I) on ``device``."""
        if self.kernel != "auto":
            return self.kernel
        from moe_offload.kernels.decode_gemv_tuning import gemv_entry

        return "gemv" if T * K <= gemv_entry(device, H, I).gemv_max_pairs else "tiles"

    def _fused_call(self, hidden_TH: torch.Tensor, K: int, views):
        """``(kernel, device, H, I, pairs)`` of the fused call for ``hidden_TH`` ([T, H]) tokens at top-K, or None
        where the fused launches are off (``compute.fused_moe_launches``) or the kernels are not fused."""
        if not (self.fused and self.fused_launches):
            return None
        dev, (T, H), I = hidden_TH.device, hidden_TH.shape, views["w2_q"].shape[2] * 2
        return self.pick(dev, T, K, H, I), dev, H, I, T * K

    def align_block_m(self, hidden_TH: torch.Tensor, K: int, views) -> int | None:
        """The block of pairs the fused kernel for ``hidden_TH`` ([T, H]) tokens at top-K groups the routed rows in
        (what the miss plan may align them to in its own launch), or None where it groups nothing."""
        call = self._fused_call(hidden_TH, K, views)
        if call is None:
            return None
        kernel, dev, H, I, pairs = call
        if kernel == "gemv":
            from moe_offload.kernels.decode_gemv_tuning import gemv_config_for

            block_m = gemv_config_for(dev, H, I, pairs).block_m
            return block_m if block_m > 1 else None
        from moe_offload.kernels.decode_moe import decode_config_for

        return decode_config_for(dev, H, I, pairs).block_m

    def splits(self, hidden_TH: torch.Tensor, K: int, views) -> bool:
        """Whether ``split`` serves a call of ``hidden_TH`` ([T, H]) tokens at top-K: the fused tile kernels with
        ``overlap`` on (a step the GEMVs serve has few pairs: its compute is short and a split would double its
        launches)."""
        if not (self.fused and self.overlap):
            return False
        H, I = hidden_TH.shape[1], views["w2_q"].shape[2] * 2
        return self.pick(hidden_TH.device, hidden_TH.shape[0], K, H, I) == "tiles"

    def split(self, hidden_TH, rows_TK, weights_TK, views, scratch_base: int, join, residual_TH=None, x_split=None):
        """As ``__call__`` with the tile kernels, in two passes: the pairs read from slots (``rows_TK <
        scratch_base``), then ``join()`` (the miss copy is done), then the missed pairs, one sum over K
        (``kernels/decode_moe.py`` ``decode_moe_nvfp4_split``: the bits of the one-pass call). Where ``splits``."""
        from moe_offload.kernels.decode_moe import decode_moe_nvfp4_split

        K = rows_TK.shape[1]
        return decode_moe_nvfp4_split(hidden_TH, rows_TK, weights_TK, views, scratch_base, join,
                                      out_dtype=hidden_TH.dtype, residual_TH=residual_TH, x_split=x_split,
                                      x_split_block_k=None if x_split is None else self.split_block_k(hidden_TH, K,
                                                                                                      views))

    def split_block_k(self, hidden_TH: torch.Tensor, K: int, views) -> int | None:
        """The K chunk of the swapped tile kernels' split activation layout for ``hidden_TH`` ([T, H]) tokens at top-K
        (``fused_moe_swap.split_columns``), where those kernels run and H is a whole number of chunks; else None."""
        call = self._fused_call(hidden_TH, K, views)
        if call is None or call[0] == "gemv":
            return None
        from moe_offload.kernels.decode_moe import decode_config_for

        _, dev, H, I, pairs = call
        config = decode_config_for(dev, H, I, pairs)
        return config.gate_up.block_k if config.swap_ab and H % config.gate_up.block_k == 0 else None

    def __call__(self, hidden_TH, rows_TK, weights_TK, views, num_rows, residual_TH=None, alignment=None,
                 x_split=None):
        """``out_TH``, or ``residual_TH + out_TH`` (rounded as the decoder layer's add) when a residual is given:
        the fused kernels add it in their last launch, the other computes with a torch add. ``alignment``: the
        rows already grouped for the fused kernel (``align_block_m``; the miss plan's), else it groups them.
        ``x_split``: ``hidden_TH`` in the swapped tiles' split layout (``split_block_k``), else they copy it so."""
        T, K = rows_TK.shape
        if self.fused:
            H, I = hidden_TH.shape[1], views["w2_q"].shape[2] * 2
            if self.pick(hidden_TH.device, T, K, H, I) == "gemv":
                return self._gemv(hidden_TH, rows_TK, weights_TK, views, out_dtype=hidden_TH.dtype,
                                  residual_TH=residual_TH, alignment=alignment, sum_in_down=self.sum_in_down)
            if self.sum_in_down and not self._triton_sums_in_down and self._stats is not None and K > 1:
                self._stats.declined["fused_moe_sum:triton_version"] += 1  # the kernel logs the event once
            return self._tiles(hidden_TH, rows_TK, weights_TK, views, out_dtype=hidden_TH.dtype,
                               residual_TH=residual_TH, alignment=alignment, x_split=x_split,
                               sum_in_down=self.sum_in_down,
                               x_split_block_k=None if x_split is None else self.split_block_k(hidden_TH, K, views))
        flat_M = rows_TK.reshape(-1).long()
        routed = {name: v.index_select(0, flat_M) for name, v in views.items()}
        pair_rows_TK = torch.arange(T * K, device=rows_TK.device).view(T, K)
        out = self.inner(hidden_TH, pair_rows_TK, weights_TK, routed, T * K)
        return out if residual_TH is None else residual_TH + out
