"""Serving under tensor parallelism: rank 0 runs HTTP and the scheduler; every rank runs the same forwards.

Rank 0's scheduler drives a ``BroadcastExecutor``: each forward and KV edit is broadcast before it runs,
and ranks 1..N-1 replay them (``executor.follow``). Sampling and stop decisions happen on rank 0 only;
its sampled ids reach the other ranks as the next decode op's input, so a bitwise logit difference across
ranks can never feed different tokens into the all-reduce or stop one rank alone.

``moe-offload serve --set parallel.tp=2`` spawns the ranks itself; under ``torchrun --nproc-per-node 2 -m
moe_offload.cli serve ...`` each process is one rank (``launch.run_on_ranks``).
"""

from __future__ import annotations

from moe_offload import log
from moe_offload.serve.config import ServeConfig
from moe_offload.serve.executor import BroadcastExecutor, LocalExecutor, follow, make_batch


def _src(tp) -> int:
    import torch.distributed as dist

    return dist.get_global_rank(tp.group, 0) if tp.group is not None else 0


def leader_scheduler(rt, serve_cfg: ServeConfig, kv: str | None = None):
    """Rank 0's started Scheduler over the TP runtime ``rt`` (``launch.build_tp_engine``); ``kv``: the decode
    batch kind (``executor.make_batch``; None = the config's)."""
    from moe_offload.serve.scheduler import Scheduler

    ex = BroadcastExecutor(rt.engine, serve_cfg, rt.tp.group, _src(rt.tp), make_batch(rt.engine, serve_cfg, kv))
    return Scheduler(rt.engine, serve_cfg, ex).start()


def follow_rank(rt, serve_cfg: ServeConfig, kv: str | None = None) -> int:
    """Ranks 1..N-1: replay rank 0's ops until it stops -> ops replayed. ``serve_cfg`` and ``kv`` are rank
    0's: the decode batch (its kind and rows) is made the same way on every rank."""
    ex = LocalExecutor(rt.engine, serve_cfg, make_batch(rt.engine, serve_cfg, kv))
    n = follow(ex, rt.tp.group, _src(rt.tp))
    log.event("serve_follower_done", ops=n)
    return n


def serve_rank(cfg, tp, serve_cfg: dict, host: str, port: int) -> dict | None:
    """One rank of ``moe-offload serve`` under TP (for ``launch.run_on_ranks``)."""
    import uvicorn

    from moe_offload.launch import build_tp_engine
    from moe_offload.serve.server import build_app, model_name

    rt = build_tp_engine(cfg, tp, progress=tp.rank == 0)
    scfg = ServeConfig.model_validate(serve_cfg)
    if tp.rank != 0:
        follow_rank(rt, scfg)
        return None
    scheduler = leader_scheduler(rt, scfg)
    log.info_rank0("serve_listening", host=host, port=port, model=model_name(rt.engine, scfg), tp=tp.world_size,
                   max_batch=scfg.max_batch, max_queue=scfg.max_queue, max_model_len=scheduler.max_model_len)
    try:
        uvicorn.run(build_app(scheduler, scfg), host=host, port=port, log_level="warning", lifespan="off")
    finally:
        scheduler.stop()  # its loop broadcasts "stop": the followers return
    return {"steps": scheduler.steps}


def generate_rank(cfg, tp, serve_cfg: dict, jobs: list[tuple[list[int], dict]],
                  kv: str | None = None) -> list[list[int]] | None:
    """Every job ``(prompt_ids, SamplingParams kwargs)`` submitted at once to rank 0's scheduler (no HTTP)
    -> each job's output ids (rank 0), None on the other ranks. Tests and benchmarks use it; ``kv``: the
    decode batch kind (None = the config's)."""
    import threading

    from moe_offload.launch import build_tp_engine
    from moe_offload.serve.sampling import SamplingParams

    rt = build_tp_engine(cfg, tp, progress=False)
    scfg = ServeConfig.model_validate(serve_cfg)
    if tp.rank != 0:
        follow_rank(rt, scfg, kv)
        return None
    scheduler = leader_scheduler(rt, scfg, kv)
    try:
        events, reqs = [], []
        for prompt, params in jobs:
            done = threading.Event()
            reqs.append(scheduler.submit(prompt, SamplingParams(**params),
                                         lambda o, d=done: d.set() if o.finished else None))
            events.append(done)
        for e in events:
            if not e.wait(300):
                raise TimeoutError("a TP serving request did not finish in 300 s")
        return [r.output_ids for r in reqs]
    finally:
        scheduler.stop()
