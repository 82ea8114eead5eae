"""Building an Engine from an ``OffloadConfig``: the device and dtype, the checkpoint dir (a preset built into the
cache dir on first use), the pinned host store of experts, the device cache, the compute paths, the transformers
model with its experts offloaded, the tokenizer, and the warmup.

``Engine.from_config`` is ``load_engine``; this module's public names are importable from engine.py too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moe_offload import log
from moe_offload.cache import OffloadMoeCache
from moe_offload.checkpoint.reader import CheckpointError, CheckpointReader, detect_format
from moe_offload.config import ModelConfig, OffloadConfig
from moe_offload.compute import make_compute, nvfp4_kernels_usable, prefill_compute
from moe_offload.compute.decode import DecodeCompute
from moe_offload.experts import OffloadedExperts
from moe_offload.formats import get_format
from moe_offload.host_store import ExpertStore
from moe_offload.integrations.hf import attach_experts, build_skeleton, check_no_meta, hf_config, load_non_expert_weights

if TYPE_CHECKING:
    from moe_offload.engine import Engine

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={name!r} but torch has no CUDA here; set device: cpu or auto")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "moe-offload"


def ensure_checkpoint(model_cfg: ModelConfig, progress: bool = True) -> Path:
    """The checkpoint dir: ``model.checkpoint`` as given, or the preset built once into the cache dir."""
    if model_cfg.checkpoint:
        path = Path(model_cfg.checkpoint).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"model.checkpoint {path} is not a directory; point it at an HF checkpoint dir")
        return path
    from moe_offload.checkpoint.synthetic import ensure_preset

    fmt = "nvfp4-modelopt" if model_cfg.format == "auto" else model_cfg.format
    root = Path(model_cfg.cache_dir).expanduser() if model_cfg.cache_dir else default_cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"model.cache_dir {root}: cannot create the directory presets are built in ({exc.strerror}); "
                      "set model.cache_dir to a writable directory") from None
    layers = f"-l{model_cfg.layers}" if model_cfg.layers else ""
    path = root / f"{model_cfg.preset}-{fmt}{layers}-s{model_cfg.seed}"
    return ensure_preset(model_cfg.preset, fmt, path, model_cfg.layers, model_cfg.seed, progress)


def make_cache(store: ExpertStore, cfg: OffloadConfig, device: torch.device, fused_decode: bool) -> OffloadMoeCache:
    """The engine's cache over ``store`` from ``cfg`` (its cache, prefill and decode settings)."""
    return OffloadMoeCache(store, cfg.cache, cfg.prefill, device, cfg.decode.max_tokens, fused_decode=fused_decode,
                           decode_path=cfg.decode.path, observe_routing=True, lookahead=cfg.decode.lookahead,
                           miss_copy=cfg.decode.miss_copy, overlap_misses_from=cfg.decode.overlap_misses_from)


def load_engine(engine_cls: type[Engine], cfg: OffloadConfig, tp_rank: int = 0, tp_size: int = 1, reduce=None,
                progress: bool = True) -> Engine:
    """``Engine.from_config``: the parts ``cfg`` names, built and put together into ``engine_cls``, then warmed up
    (``prefill.warmup``). ``engine_cls`` is the class ``from_config`` was called on; it is passed in because
    engine.py imports this module."""
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    dtype = resolve_dtype(cfg.dtype, device)
    path = ensure_checkpoint(cfg.model, progress and tp_rank == 0)
    try:
        reader = CheckpointReader(path)
    except CheckpointError as exc:
        if cfg.model.checkpoint:
            raise
        # a preset this process (or an earlier one) built into the cache dir: damaged since, e.g. a full disk
        raise CheckpointError(f"{exc}. It is a cached build of preset {cfg.model.preset}: delete {path} and "
                              "run again to rebuild it") from None
    fmt_name = detect_format(reader)
    store = ExpertStore.from_checkpoint(reader, cfg.model.format, tp_rank, tp_size, progress=progress and tp_rank == 0)
    fmt = get_format(fmt_name)
    fused_decode = cfg.compute.backend != "torch" and (device.type != "cuda" or not fmt.is_quantized
                                                      or nvfp4_kernels_usable(fmt, device))
    cache = make_cache(store, cfg, device, fused_decode)
    compute = make_compute(cfg, fmt, store, device, dtype)
    graphed = prefill_compute(cfg, compute, device, dtype)
    decode = DecodeCompute(fmt, compute, device, fused=cfg.compute.backend != "torch",
                           kernel=cfg.compute.decode_kernel, fused_launches=cfg.compute.fused_moe_launches,
                           route_max_pairs=cfg.compute.route_plan_max_pairs,
                           sum_in_down=cfg.compute.moe_sum_in_down,
                           overlap=cfg.decode.overlap_misses_from > 0)
    geo = reader.geometry
    model = build_skeleton(geo.family, hf_config(reader.config), dtype, empty=True)
    load_non_expert_weights(model, reader, get_format(fmt_name), dtype)
    # < max_tokens only with decode.path auto (or fills, or host wherever the link rates were measured)
    routed_rows = min(cfg.decode.max_tokens, cache.routed_max_tokens)
    attach_experts(model, lambda layer, _p: OffloadedExperts(layer, cache, compute, routed_rows, reduce,
                                                             graphed, decode))
    model.to(device).eval()
    check_no_meta(model)
    if cfg.compute.fused_norms and device.type == "cuda":
        from moe_offload.integrations.fused_norms import fuse_decode_ops

        fuse_decode_ops(model, cfg.compute)
    tokenizer = None
    try:
        from moe_offload.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path)
    except ValueError:
        log.info_rank0("no_tokenizer", path=str(path), detail="text prompts need --prompt-ids")
    engine = engine_cls(cfg, model, cache, store, reader, tokenizer, device, dtype)
    log.info_rank0("engine_ready", model_type=geo.model_type, format=fmt_name, layers=len(store.layers),
                   experts=geo.num_experts, top_k=geo.top_k, device=str(device), dtype=str(dtype).replace("torch.", ""),
                   expert_bytes=store.total_bytes, pinned=store.pinned, compute=getattr(graphed or compute, "name", "?"))
    if cfg.prefill.warmup:
        engine.warmup(progress=progress and tp_rank == 0)
    else:
        cache.resolve_hit_path()
    return engine
