"""Weight formats: one class per format behind `ExpertFormat` (bank layout, bytes, dequantize)."""

from moe_offload.formats.base import BankSpec, ExpertFormat, FormatError
from moe_offload.formats.bf16 import Bf16Format
from moe_offload.formats.nvfp4 import Nvfp4CompressedTensorsFormat, Nvfp4ModelOptFormat
from moe_offload.formats.registry import FORMAT_NAMES, get_format

__all__ = [
    "BankSpec", "ExpertFormat", "FormatError", "get_format", "FORMAT_NAMES",
    "Bf16Format", "Nvfp4ModelOptFormat", "Nvfp4CompressedTensorsFormat",
]
