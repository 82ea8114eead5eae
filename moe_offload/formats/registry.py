"""Format names -> format classes (kept apart from ``base`` so the base imports no concrete format)."""

from __future__ import annotations

from moe_offload.formats.base import ExpertFormat, FormatError
from moe_offload.formats.bf16 import Bf16Format
from moe_offload.formats.nvfp4 import Nvfp4CompressedTensorsFormat, Nvfp4ModelOptFormat

FORMATS: dict[str, type[ExpertFormat]] = {
    f.name: f for f in (Bf16Format, Nvfp4ModelOptFormat, Nvfp4CompressedTensorsFormat)
}
FORMAT_NAMES: tuple[str, ...] = tuple(FORMATS)


def get_format(name: str) -> ExpertFormat:
    if name not in FORMATS:
        raise FormatError(f"unknown format {name!r}; accepted: {', '.join(FORMATS)}")
    return FORMATS[name]()
