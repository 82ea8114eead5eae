"""HF checkpoint dirs: families (name tables), lazy validated reads, synthetic real-shaped checkpoints."""

from moe_offload.checkpoint.families import FAMILIES, Family, ModelGeometry, geometry_from_config
from moe_offload.checkpoint.reader import CheckpointError, CheckpointReader, detect_format

__all__ = ["FAMILIES", "Family", "ModelGeometry", "geometry_from_config", "CheckpointError", "CheckpointReader", "detect_format"]
