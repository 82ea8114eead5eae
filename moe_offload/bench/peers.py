"""Peers of the TTFT benchmark, measured in the same run on the same checkpoint and prompts:

- ``accelerate``: transformers holding the experts in bf16 (dequantized as the oracle does), the
  experts modules offloaded by accelerate (``AlignDevicesHook(offload=True)``: the fused
  ``gate_up_proj``/``down_proj`` of a layer are copied whole from plain host memory on every forward),
  everything else on the GPU;
- ``full_gpu``: the same model entirely on the GPU, where it fits (the ceiling).

Both use transformers' own default experts implementation for these models (``grouped_mm``). On a
CPU device both are skipped with a note (accelerate's offload needs an execution GPU).

Peers run at the engine's depth when ``--peer-layers`` is not given. ``--peer-layers`` builds them from
the first layers of the same checkpoint (a view dir: a truncated config.json, links to the weight
files) at two depths A < B (``A,B``, or ``N``: N and a shallower depth, ``peer_depths``) and scales
their TTFT to the engine's depth L by the per-layer slope of the two:
``t(B) + (L - B) * (t(B) - t(A)) / (B - A)``. The fixed costs (embedding, LM head, generate and launch
overhead) are then counted once; a ratio ``t(N) * L / N`` would multiply them by L / N and overstate
the peer (the more, the fewer layers it ran).
For hybrid models (qwen3_next: ``layer_types`` repeats linear- and full-attention layers) B - A is a
multiple of the repeat, so the slope is that of whole repeats.
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


def _measure(model, prompts: dict[int, list[int]], device: torch.device, reps: int) -> dict:
    """``{str(n): {"median", "min", "max", "reps"}}`` seconds per prompt at this model's depth."""
    out = {}
    for n, ids in prompts.items():
        ids_BT = torch.tensor([ids], dtype=torch.long, device=device)
        _ttft(model, ids_BT, device)  # untimed first pass of this shape
        times = [_ttft(model, ids_BT, device) for _ in range(reps)]
        out[str(n)] = {"median": statistics.median(times), "min": min(times), "max": max(times), "reps": times}
    return out


def layer_repeat(config: dict) -> int:
    """Smallest period of ``layer_types`` (qwen3_next: 3 linear + 1 full attention -> 4); 1 without it."""
    types = config.get("layer_types")
    if not isinstance(types, list) or not types:
        return 1
    return next(p for p in range(1, len(types) + 1) if all(types[i] == types[i % p] for i in range(len(types))))


def peer_depths(requested: tuple[int, ...] | None, engine_layers: int, repeat: int = 1) -> tuple[int, ...]:
    """Depths the peers run at: ``(engine_layers,)`` when nothing smaller is asked for; else two depths
    A < B <= engine_layers with B - A a multiple of ``repeat`` and A >= ``repeat`` (a hybrid model needs
    one whole repeat). ``(N,)``: B = N and A = N minus about half of N in whole repeats (or, when N is a
    single repeat, A = N and B = N + repeat). Raises ValueError naming ``--peer-layers``."""
    if not requested or (len(requested) == 1 and requested[0] >= engine_layers):
        return (engine_layers,)
    if len(requested) == 1:
        n = requested[0]
        step = repeat * max(1, (n // 2) // repeat)
        depths = (n - step, n) if n - step >= repeat else (n, n + repeat)
    else:
        depths = tuple(sorted(requested))
    a, b = depths
    if not (repeat <= a < b <= engine_layers) or (b - a) % repeat:
        raise ValueError(f"--peer-layers {','.join(map(str, requested))}: needs two depths A < B <= {engine_layers} "
                         f"(the engine's), A >= {repeat} and B - A a multiple of {repeat} (the model's layer "
                         f"repeat); got {a},{b}")
    return depths


def scale_to_depth(by_depth: dict[int, dict], engine_layers: int) -> dict:
    """Per prompt: the TTFT at the engine's depth from one measured depth (itself) or two (the slope)."""
    depths = sorted(by_depth)
    out = {}
    for n in by_depth[depths[-1]]:
        t = {d: by_depth[d][n]["median"] for d in depths}
        if len(depths) == 1:
            out[n] = {**by_depth[depths[0]][n], "per_layer_s": t[depths[0]] / engine_layers,
                      "at_engine_layers_s": t[depths[0]], "extrapolated": False}
            continue
        a, b = depths
        slope = (t[b] - t[a]) / (b - a)
        out[n] = {**by_depth[b][n], "depths": {str(d): by_depth[d][n] for d in depths}, "per_layer_s": slope,
                  "fixed_s": t[a] - a * slope, "at_engine_layers_s": t[b] + (engine_layers - b) * slope,
                  "extrapolated": True, "method": "per-layer slope of two depths"}
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
    reader = CheckpointReader(path)
    engine_layers = reader.geometry.num_layers
    depths = peer_depths(plan.peer_layers, engine_layers, layer_repeat(reader.config))
    if len(depths) == 2:
        a, b = depths
        notes.append(f"peers ran at {a} and {b} of {engine_layers} layers; their TTFT at {engine_layers} layers is "
                     f"t({b}) + ({engine_layers} - {b}) x the per-layer slope (t({b}) - t({a})) / ({b} - {a})")
    runs: dict[str, dict[int, dict]] = {name: {} for name in plan.peers}
    with tempfile.TemporaryDirectory(prefix="moe-offload-peer-") as tmp:
        for d in depths:
            src = path if d == engine_layers else truncated_view(path, d, Path(tmp) / f"view-{d}")
            common = {"layers": d, "engine_layers": engine_layers, "dtype": "bfloat16",
                      "experts_implementation": "grouped_mm"}
            t0 = time.perf_counter()
            try:
                model = build_reference_model(str(src), torch.bfloat16, device="cpu",
                                              experts_implementation="grouped_mm")
            except Exception as exc:  # a peer that cannot be built must not lose the engine's figures
                for name in plan.peers:
                    runs[name][d] = _failed(name, exc, common)
                continue
            common["build_s"] = time.perf_counter() - t0
            if "full_gpu" in plan.peers:
                runs["full_gpu"][d] = _run_full_gpu(model, prompts, device, plan.peer_reps, common)
            if "accelerate" in plan.peers:
                runs["accelerate"][d] = _run_accelerate(model, _experts_class(src), prompts, device, plan.peer_reps,
                                                        common)
            del model
            gc.collect()
            torch.cuda.empty_cache()
    return {name: _combine(by_depth, depths, engine_layers) for name, by_depth in runs.items()}


def _combine(by_depth: dict[int, dict], depths: tuple[int, ...], engine_layers: int) -> dict:
    """One peer's result: the deepest run's fields, TTFT scaled to the engine's depth; the first failed or
    skipped depth when a depth did not run."""
    bad = next((by_depth[d] for d in depths if by_depth[d]["status"] != "ok"), None)
    if bad is not None:
        return bad
    last = by_depth[depths[-1]]
    out = {**last, "layers": depths[-1], "ttft_s": scale_to_depth({d: by_depth[d]["ttft_s"] for d in depths},
                                                                   engine_layers)}
    if len(depths) == 2:
        out["depths"] = list(depths)
    return out


def _failed(name: str, exc: Exception, common: dict) -> dict:
    log.event("bench_peer_failed", logging.WARNING, peer=name, error=f"{type(exc).__name__}: {exc}")
    return {**common, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}


def _run_full_gpu(model, prompts, device, reps, common) -> dict:
    ok, need, free = _fits(model, device)
    if not ok:
        return {**common, "status": "skipped",
                "reason": f"needs ~{need / 2**30:.1f} GiB on the GPU, {free / 2**30:.1f} GiB free; use --peer-layers"}
    try:
        model.to(device)
        return {**common, "status": "ok", "ttft_s": _measure(model, prompts, device, reps)}
    except Exception as exc:  # recorded and logged: the engine's figures of this run are kept
        return _failed("full_gpu", exc, common)
    finally:
        model.to("cpu")
        gc.collect()
        torch.cuda.empty_cache()


def _run_accelerate(model, experts_cls, prompts, device, reps, common) -> dict:
    try:
        moved = offload_experts(model, experts_cls, device)
        return {**common, "status": "ok", "bytes_h2d_per_forward": moved,
                "weights": "bf16 in plain host memory (accelerate's weights_map), copied whole per layer per forward",
                "ttft_s": _measure(model, prompts, device, reps)}
    except Exception as exc:  # recorded and logged: the engine's figures of this run are kept
        return _failed("accelerate", exc, common)
