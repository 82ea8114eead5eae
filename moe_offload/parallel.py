"""Tensor parallelism (TP): experts sharded along the intermediate dim, one store and one cache per rank.

What is sharded and what is not:
- Experts: rank r holds rows ``[r*I/tp, (r+1)*I/tp)`` of gate and up and the same columns of down
  (NVFP4 packed bytes and block scales split consistently; ``I/tp`` must be a multiple of 16 or
  ``FormatError`` names the fix). Each rank's ``ExpertStore`` reads only its slice from the
  safetensors files, and each rank's ``OffloadMoeCache`` owns its slots and moves only its bytes.
  ``OffloadedExperts`` computes ``act(x G_r^T) * (x U_r^T) @ D_r^T``, the rank's partial sum of the
  layer output; ``make_reducer`` turns it into the full output (an all-reduce sum) or leaves it
  partial when the host stack owns the reduction (``parallel.reduce: host``).
- Non-expert weights (embeddings, attention, norms, routers, shared experts, lm_head) are
  REPLICATED on every rank by the reference engine (``Engine``): each rank runs the whole dense
  part of the model on the same tokens. Only the expert reduction is distributed. A host stack
  that shards attention itself embeds ``OffloadedExperts`` with its own process group instead.

Residency: the router runs on replicated weights over identical (all-reduced) hidden states, so
every rank routes identically and the caches evict in step. ``check_residency`` verifies it: an
all-gather of one CRC per MoE layer of the resident set (which (layer, expert) are resident, not
which slot) plus the decode step counter; a mismatch raises ``ResidencyDivergence`` naming the
ranks and the first differing layer instead of computing garbage. ``ResidencyMonitor`` runs it every
``parallel.check_interval`` decode steps (a forward hook on the last MoE layer; 0 = on demand only).

Launching (the process group: NCCL on CUDA, gloo on the CPU):
- ``torchrun --nproc-per-node 2 -m moe_offload.cli generate --config configs/tp2.yaml``: rank and
  world size come from the launcher's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_*``
  variables (read when the group is created, never at import). Rank r uses ``cuda:LOCAL_RANK``.
- ``python -m moe_offload.cli generate --config configs/tp2.yaml`` (no launcher): ``cfg.parallel.tp``
  worker processes are spawned (gloo on the CPU; NCCL with one GPU per rank when there are enough
  GPUs, else an error) and rank 0's result is printed as ``generate`` prints it. ``moe_offload.launch.run_on_ranks``
  is that launcher for any per-rank function (benchmarks use it too).
- Embedding under a host's own process group (an existing ``ProcessGroup``; nothing is created)::

      tp = init_tp(cfg.parallel.tp, device, group=host_tp_group)    # rank and size from the group
      rt = launch.build_tp_engine(cfg, tp)                          # the reference engine, or the host's model:
      store = ExpertStore.from_checkpoint(path, fmt, tp.rank, tp.world_size)   # this rank's slice only
      cache = OffloadMoeCache(store, cfg.cache, cfg.prefill, device)
      reduce = make_reducer(host_tp_group, cfg.parallel.reduce)     # None: the host reduces the output
      experts = OffloadedExperts(layer, cache, compute, cfg.decode.max_tokens, reduce)
      ResidencyMonitor(cache, host_tp_group, cfg.parallel.check_interval).attach(host_model)
      gather_hit_paths(cache, host_tp_group)                        # after the first prefill

Legend: W world size (TP ranks), L MoE layers, E experts per layer, T tokens, H hidden.
"""

from __future__ import annotations

import datetime

import logging
import os
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moe_offload import log
from moe_offload.config import ConfigError

ProcessGroup = dist.ProcessGroup

#: copy paths whose bytes cross the host link (the rest stay on the device)
_H2D_PATHS = ("decode_h2d", "prefill_full_h2d", "prefill_miss_h2d", "prefill_routed_h2d")


class ResidencyDivergence(RuntimeError):
    """TP ranks hold different resident expert sets (or are at different decode steps).

    ``ranks``: the ranks that disagree with rank 0; ``layer``: the first MoE layer (model layer
    index) where they differ, None when only the step counters differ; ``steps``: each rank's step.
    """

    def __init__(self, message: str, ranks: list[int], layer: int | None, steps: list[int]):
        super().__init__(message)
        self.ranks, self.layer, self.steps = ranks, layer, steps


# ---------------------------------------------------------------------------------------- group
@dataclass(frozen=True)
class TpGroup:
    """This process's place in the TP group. ``group`` None means the default (world) group."""

    rank: int
    world_size: int
    device: torch.device
    group: ProcessGroup | None = None
    owns_default_group: bool = False

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


def rank_device(cfg_device: str, local_rank: int, tp: int) -> torch.device:
    """The device of one TP rank: ``cuda:local_rank`` (one GPU per rank) or the CPU."""
    from moe_offload.engine import resolve_device

    dev = resolve_device(cfg_device)
    if dev.type != "cuda":
        return dev
    if cfg_device.startswith("cuda:"):
        raise ConfigError(
            f"device={cfg_device!r} pins one GPU, but parallel.tp={tp} puts rank r on cuda:LOCAL_RANK; "
            "set device: cuda (or auto)"
        )
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise ConfigError(
            f"parallel.tp={tp} needs one GPU per rank on this host (local rank {local_rank}), but {n} GPU(s) are "
            "visible; lower parallel.tp, or set device: cpu to run the ranks on the CPU with gloo"
        )
    return torch.device("cuda", local_rank)


def torchrun_identity() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` that torchrun gave this process (its ``RANK`` / ``WORLD_SIZE``
    / ``LOCAL_RANK``: the launcher's contract, not a behaviour switch), or None when not under torchrun."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))


def init_tp(tp: int, device: torch.device, *, group: ProcessGroup | None = None, rank: int | None = None,
            world_size: int | None = None, init_method: str | None = None, timeout_s: float | None = None) -> TpGroup:
    """Join (or create) the TP process group of ``tp`` ranks; sets the log rank.

    - ``group`` given (embedding in a host's process group): used as is, rank and size from it.
    - ``torch.distributed`` already initialised: the default group.
    - otherwise the default group is created with NCCL (CUDA ``device``) or gloo (CPU): rank and world
      size from the arguments, else from the launcher's ``RANK`` / ``WORLD_SIZE`` (torchrun);
      ``init_method`` defaults to ``env://`` (``MASTER_ADDR`` / ``MASTER_PORT``).
    The group size must equal ``tp`` (``parallel.tp``). ``timeout_s`` (``parallel.timeout_s``) bounds every
    collective of a group created here: a dead or hung peer fails the others instead of hanging them.
    """
    owns = False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if group is None and not dist.is_initialized():
        launched = torchrun_identity()
        if launched is not None:
            rank = launched[0] if rank is None else rank
            world_size = launched[1] if world_size is None else world_size
        if rank is None or world_size is None:
            raise ConfigError(
                f"parallel.tp={tp} but no process group: launch with torchrun (it sets RANK and WORLD_SIZE), "
                "let `moe-offload generate` spawn the ranks, or pass rank= and world_size= (or a host's group=)"
            )
        backend = "nccl" if device.type == "cuda" else "gloo"
        extra = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                                world_size=world_size, device_id=device if device.type == "cuda" else None, **extra)
        owns = True
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size != tp:
        if owns:
            dist.destroy_process_group()
        raise ConfigError(
            f"parallel.tp={tp} but the process group has {size} ranks; set parallel.tp={size} or launch {tp} ranks"
        )
    log.set_rank(rank, size)
    return TpGroup(rank, size, device, group, owns)


def close_tp(tp: TpGroup) -> None:
    """Destroy the default group if ``init_tp`` created it (a host's group is left alone)."""
    if tp.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- reduction
class AllReduceSum:
    """``reduce`` of ``OffloadedExperts``: sums the ranks' partial outputs ``[T, H]`` in place."""

    def __init__(self, group: ProcessGroup | None):
        self.group = group

    def __call__(self, partial_TH: torch.Tensor) -> torch.Tensor:
        out = partial_TH.contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def __repr__(self) -> str:
        return "AllReduceSum()"


def make_reducer(group: ProcessGroup | None, mode: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``parallel.reduce``: ``runtime`` -> all-reduce sum over ``group``; ``host`` -> None (partial output)."""
    if mode == "runtime":
        return AllReduceSum(group)
    if mode == "host":
        return None
    raise ConfigError(f"parallel.reduce={mode!r}; accepted: runtime, host")


# ---------------------------------------------------------------------------------------- residency
def residency_digest(cache, step: int) -> np.ndarray:
    """``[1 + L]`` int64: the step, then a CRC32 of each MoE layer's resident set (bit e = expert e)."""
    resident_LE = cache.residency_map()
    crcs = [zlib.crc32(np.packbits(row).tobytes()) for row in resident_LE]
    return np.asarray([step, *crcs], dtype=np.int64)


def _comm_device(group: ProcessGroup | None) -> torch.device:
    """NCCL moves CUDA tensors only; gloo moves CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compare_digests(digests_WD: np.ndarray, layers: tuple[int, ...]) -> tuple[list[int], int | None]:
    """Ranks whose digest differs from rank 0's, and the first differing MoE layer (None: steps only)."""
    ranks = [r for r in range(1, digests_WD.shape[0]) if not np.array_equal(digests_WD[r], digests_WD[0])]
    if not ranks:
        return [], None
    differs_L = (digests_WD[ranks, 1:] != digests_WD[0, 1:]).any(0)
    lp = np.flatnonzero(differs_L)
    return ranks, (int(layers[lp[0]]) if lp.size else None)


def check_residency(cache, group: ProcessGroup | None = None, step: int | None = None) -> int:
    """All ranks of ``group`` must hold the same resident experts at the same step; a collective.

    ``step`` defaults to the cache's decode step counter. Returns the step; raises
    ``ResidencyDivergence`` (the same on every rank) when they disagree.
    """
    step = cache.decode_steps if step is None else int(step)
    W = dist.get_world_size(group)
    if W == 1:
        return step
    mine_D = torch.from_numpy(residency_digest(cache, step))
    dev = _comm_device(group)
    parts = [torch.empty_like(mine_D, device=dev) for _ in range(W)]
    dist.all_gather(parts, mine_D.to(dev), group=group)
    digests_WD = torch.stack(parts).cpu().numpy()  # HOST SYNC (NCCL): only at check intervals
    ranks, layer = compare_digests(digests_WD, cache.store.layers)
    if not ranks:
        return step
    steps = digests_WD[:, 0].tolist()
    where = f"first at MoE layer {layer}" if layer is not None else "in their decode step counters only"
    msg = (f"TP residency diverged at decode step {steps[0]} (steps per rank: {steps}): rank(s) {ranks} hold a "
           f"different resident expert set than rank 0, {where}. Routing must be identical on every rank "
           "(same checkpoint, config and inputs); outputs would be wrong, so the run stops here")
    log.event("tp_residency_divergence", logging.ERROR, ranks=ranks, layer=layer, steps=steps)
    raise ResidencyDivergence(msg, ranks, layer, steps)


class ResidencyMonitor:
    """Runs ``check_residency`` every ``interval`` decode steps (after the last MoE layer of a step)."""

    def __init__(self, cache, group: ProcessGroup | None, interval: int):
        if interval < 1:
            raise ConfigError(f"parallel.check_interval={interval}: a monitor needs an interval >= 1 (0 = on demand only)")
        self.cache, self.group, self.interval = cache, group, interval
        self.steps = 0  # decode steps seen by this monitor
        self.checks = 0
        self._handle = None

    def attach(self, model: nn.Module) -> "ResidencyMonitor":
        from moe_offload.experts import offloaded_experts

        mods = offloaded_experts(model, self.cache)
        if not mods:
            raise ValueError("no OffloadedExperts of this cache in the model: attach after attach_experts()")
        last = max(mods, key=lambda m: m.layer_idx)
        self._handle = last.register_forward_hook(self._after_last_layer, with_kwargs=True)
        return self

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _after_last_layer(self, module, args, kwargs, _output) -> None:
        hidden_TH = args[0] if args else next(iter(kwargs.values()))
        if not module.uses_decode_path(hidden_TH.shape[0]):
            return
        self.steps += 1
        if self.steps % self.interval == 0:
            check_residency(self.cache, self.group, self.steps)
            self.checks += 1


# ---------------------------------------------------------------------------------------- reports
def gather_hit_paths(cache, group: ProcessGroup | None = None) -> list[dict]:
    """Every rank's ``{rank, hit_path, fallbacks}`` (prefill hit path; fallback reasons counted since the
    last ``reset``, so call it after a prefill). A collective. When ranks disagree, rank 0 logs one
    WARNING ``tp_hit_path_disagreement`` listing them (each rank has already logged its own fallback)."""
    views: list[dict | None] = [None] * dist.get_world_size(group)
    rank = dist.get_rank(group)
    mine = {"rank": rank, "hit_path": cache.hit_path,
            "fallbacks": sorted(cache.stats()["hit_d2d_fallbacks"])}
    dist.all_gather_object(views, mine, group=group)
    if len({(v["hit_path"], tuple(v["fallbacks"])) for v in views}) > 1 and rank == 0:
        per_rank = ";".join(f"rank{v['rank']}={v['hit_path']}" + (f"({','.join(v['fallbacks'])})" if v["fallbacks"] else "")
                            for v in views)
        log.warning("tp_hit_path_disagreement", per_rank=per_rank, setting="prefill.hit_copy",
                    detail="ranks copy prefill hits differently; the slowest rank sets the pace")
    return views


def per_rank_bytes(cache) -> dict:
    """This rank's bytes: expert bytes held on the host and the device, and bytes moved per copy path."""
    store = cache.store
    moved = cache.stats()["total"]["bytes"]
    return {
        "tp_rank": store.tp_rank, "tp_size": store.tp_size,
        "bytes_per_expert": store.bytes_per_expert, "host_bytes": store.total_bytes,
        "device_bytes": cache.plan.total_bytes, "h2d_bytes": sum(moved[p] for p in _H2D_PATHS),
        "moved": dict(moved),
    }


def gather_per_rank_bytes(cache, group: ProcessGroup | None = None) -> list[dict]:
    """``per_rank_bytes`` of every rank, in rank order (a collective)."""
    out: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, per_rank_bytes(cache), group=group)
    return out


# ---------------------------------------------------------------------------------------- budgets
def agreed_auto_budget(free_bytes: int, reserve_bytes: int, group: ProcessGroup | None = None):
    """``cache.budget: auto`` under TP: every rank sizes its pool from the SMALLEST free memory of the
    group (a collective), so all ranks get the same slot count and stay in residency agreement.
    Returns the byte budget (staging included, as ``auto`` is) every rank then uses."""
    from moe_offload.config import Budget

    mine = torch.tensor([int(free_bytes)], dtype=torch.int64, device=_comm_device(group))
    if dist.get_world_size(group) > 1:
        dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=group)
    agreed = max(0, int(mine.item()) - int(reserve_bytes))  # HOST SYNC: once, at start-up
    log.info_rank0("tp_budget_agreed", free_bytes_min=int(mine.item()), budget_bytes=agreed)
    return Budget(kind="bytes", value=float(agreed))
