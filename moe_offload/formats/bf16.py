"""bf16: the plain format. Banks: ``w13 [2I, H]`` (gate rows then up rows) and ``w2 [H, I]``."""

from __future__ import annotations

import torch

from moe_offload.formats.base import BankSpec, ExpertFormat, TpSlice, require_finite


class Bf16Format(ExpertFormat):
    name = "bf16"
    is_quantized = False
    tp_multiple = 1

    def disk_tensors(self, rows, cols):
        return {"weight": ((rows, cols), torch.bfloat16)}

    def banks(self, hidden: int, inter: int) -> list[BankSpec]:
        return [BankSpec("w13", (2 * inter, hidden), torch.bfloat16), BankSpec("w2", (hidden, inter), torch.bfloat16)]

    def read_expert(self, reader, proj_name, hidden, inter, tp: TpSlice):
        i0, i1 = tp.bounds(inter * tp.size_ranks, self.tp_multiple)
        gate = reader.get(proj_name("gate") + ".weight", rows=(i0, i1), expect_dtype=torch.bfloat16)
        up = reader.get(proj_name("up") + ".weight", rows=(i0, i1), expect_dtype=torch.bfloat16)
        down = reader.get(proj_name("down") + ".weight", cols=(i0, i1), expect_dtype=torch.bfloat16)
        for which, t in (("gate", gate), ("up", up), ("down", down)):
            name = proj_name(which) + ".weight"
            require_finite(t, f"{reader.file_of(name)}: tensor {name}")
        return {"w13": torch.cat([gate, up], 0), "w2": down}

    def dequantize(self, views, dtype):
        return views["w13"].to(dtype), views["w2"].to(dtype)

    def read_linear(self, reader, prefix, dtype):
        return None
