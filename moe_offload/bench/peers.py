"""Peers of the TTFT benchmark, measured in the same run on the same checkpoint and prompts:

- ``accelerate``: transformers holding the experts in bf16 (dequantized as the oracle does), the
  experts modules offloaded by accelerate (``AlignDevicesHook(offload=True)``: the fused
  ``gate_up_proj``/``down_proj`` of a layer are copied whole from plain host memory on every forward),
  everything else on the GPU;
- ``full_gpu``: the same model entirely on the GPU, where it fits (the ceiling).

Both use transformers' own default experts implementation for these models (``grouped_mm``). On a
CPU device both are skipped with a note (accelerate's offload needs an execution GPU).

``--peer-layers N`` builds the peers from the first N decoder layers of the same checkpoint (a view
dir: a truncated config.json, links to the weight files) and scales their TTFT to the engine's
depth linearly (``ttft * layers / N``; embedding and LM head are scaled too, a small overestimate).
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moe_offload import log

# logits [T, V] in bf16 and their argmax, attention and MoE activations: a generous allowance on top
# of the weights before declaring that the full-GPU peer fits
_ACTIVATION_SLACK = 4 << 30


def truncated_view(path: Path, layers: int, into: Path) -> Path:
    """A checkpoint dir that reads as the first ``layers`` decoder layers of ``path`` (no copies)."""
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    into.mkdir(parents=True, exist_ok=True)
    (into / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in path.iterdir():
        if f.name != "config.json":
            (into / f.name).symlink_to(f.resolve())
    return into


@torch.inference_mode()
def _ttft(model: torch.nn.Module, ids_BT: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids_BT, use_cache=True, logits_to_keep=1)  # as the engine: last position only
    int(out.logits[0, -1].argmax().item())  # synchronizes: the first token is on the host
    return time.perf_counter() - t0


def _measure(model, prompts: dict[int, list[int]], device: torch.device, reps: int, layers: int,
             engine_layers: int) -> dict:
    out = {}
    for n, ids in prompts.items():
        ids_BT = torch.tensor([ids], dtype=torch.long, device=device)
        _ttft(model, ids_BT, device)  # untimed first pass of this shape
        times = [_ttft(model, ids_BT, device) for _ in range(reps)]
        med = statistics.median(times)
        out[str(n)] = {"median": med, "min": min(times), "max": max(times), "reps": times,
                       "per_layer_s": med / layers, "at_engine_layers_s": med * engine_layers / layers,
                       "extrapolated": layers != engine_layers}
    return out


def _experts_class(path: Path) -> type:
    from moe_offload.checkpoint.reader import CheckpointReader

    fam = CheckpointReader(path).geometry.family
    return getattr(importlib.import_module(fam.modeling_module), fam.experts_class)


def offload_experts(model: torch.nn.Module, experts_cls: type, device: torch.device) -> int:
    """accelerate's expert offload: non-expert tensors to ``device``; every experts module gets an
    ``AlignDevicesHook(offload=True)`` whose weights map holds its (plain host) tensors.
    Returns the bytes copied per forward (every experts module, whole)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    from accelerate.utils import set_module_tensor_to_device

    experts = {name: m for name, m in model.named_modules() if isinstance(m, experts_cls)}
    prefixes = tuple(f"{name}." for name in experts)
    for name, _t in [*model.named_parameters(), *model.named_buffers()]:
        if not name.startswith(prefixes):
            set_module_tensor_to_device(model, name, device)
    moved = 0
    for m in experts.values():
        weights = {n: p.detach() for n, p in m.named_parameters()}
        moved += sum(t.numel() * t.element_size() for t in weights.values())
        add_hook_to_module(m, AlignDevicesHook(execution_device=device, offload=True, weights_map=weights))
    return moved


def _fits(model: torch.nn.Module, device: torch.device) -> tuple[bool, int, int]:
    need = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) + _ACTIVATION_SLACK
    free, _ = torch.cuda.mem_get_info(device)
    return need <= free, need, free


def _skipped(names, reason: str) -> dict:
    return {n: {"status": "skipped", "reason": reason} for n in names}


def run_peers(path: Path, plan, prompts: dict[int, list[int]], device: torch.device, notes: list[str]) -> dict:
    """``{peer: {"status": "ok" | "skipped" | "failed", ...}}`` for every peer in ``plan.peers``."""
    if not plan.peers:
        return {}
    if device.type != "cuda":
        notes.append("peers skipped: the device is cpu (accelerate's expert offload needs a GPU to execute on)")
        return _skipped(plan.peers, "cpu device: accelerate offload and full-GPU peers need a GPU")
    from moe_offload.checkpoint.reader import CheckpointReader
    from moe_offload.integrations.reference import build_reference_model

    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    engine_layers = CheckpointReader(path).geometry.num_layers
    layers = min(plan.peer_layers or engine_layers, engine_layers)
    if layers != engine_layers:
        notes.append(f"peers ran on {layers} of {engine_layers} layers; their TTFT is scaled by "
                     f"{engine_layers}/{layers}")
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="moe-offload-peer-") as tmp:
        src = path if layers == engine_layers else truncated_view(path, layers, Path(tmp) / "view")
        common = {"layers": layers, "engine_layers": engine_layers, "dtype": "bfloat16",
                  "experts_implementation": "grouped_mm"}
        t0 = time.perf_counter()
        try:
            model = build_reference_model(str(src), torch.bfloat16, device="cpu", experts_implementation="grouped_mm")
        except Exception as exc:  # a peer that cannot be built must not lose the engine's figures
            return {n: _failed(n, exc, common) for n in plan.peers}
        common["build_s"] = time.perf_counter() - t0
        if "full_gpu" in plan.peers:
            result["full_gpu"] = _run_full_gpu(model, prompts, device, plan.peer_reps, layers, engine_layers, common)
        if "accelerate" in plan.peers:
            result["accelerate"] = _run_accelerate(model, _experts_class(src), prompts, device, plan.peer_reps,
                                                   layers, engine_layers, common)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return result


def _failed(name: str, exc: Exception, common: dict) -> dict:
    log.event("bench_peer_failed", logging.WARNING, peer=name, error=f"{type(exc).__name__}: {exc}")
    return {**common, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}


def _run_full_gpu(model, prompts, device, reps, layers, engine_layers, common) -> dict:
    ok, need, free = _fits(model, device)
    if not ok:
        return {**common, "status": "skipped",
                "reason": f"needs ~{need / 2**30:.1f} GiB on the GPU, {free / 2**30:.1f} GiB free; use --peer-layers"}
    try:
        model.to(device)
        return {**common, "status": "ok", "ttft_s": _measure(model, prompts, device, reps, layers, engine_layers)}
    except Exception as exc:  # recorded and logged: the engine's figures of this run are kept
        return _failed("full_gpu", exc, common)
    finally:
        model.to("cpu")
        gc.collect()
        torch.cuda.empty_cache()


def _run_accelerate(model, experts_cls, prompts, device, reps, layers, engine_layers, common) -> dict:
    try:
        moved = offload_experts(model, experts_cls, device)
        return {**common, "status": "ok", "bytes_h2d_per_forward": moved,
                "weights": "bf16 in plain host memory (accelerate's weights_map), copied whole per layer per forward",
                "ttft_s": _measure(model, prompts, device, reps, layers, engine_layers)}
    except Exception as exc:  # recorded and logged: the engine's figures of this run are kept
        return _failed("accelerate", exc, common)
