"""Running the reference engine under TP: one engine per rank (``build_tp_engine``), the launcher for
any per-rank function (``run_on_ranks``: torchrun, or spawned workers), and ``generate`` under TP.
Group handling, the reduction and the residency checks live in ``moe_offload.parallel``."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from moe_offload import log
from moe_offload.config import ConfigError, OffloadConfig, parse_bytes
from moe_offload.parallel import (
    ResidencyMonitor, TpGroup, agreed_auto_budget, check_residency, close_tp, gather_hit_paths,
    gather_per_rank_bytes, init_tp, make_reducer, rank_device, torchrun_identity,
)


# ---------------------------------------------------------------------------------------- engine
@dataclass
class TpRuntime:
    """One rank's engine with its group and (when ``check_interval`` > 0) its residency monitor."""

    engine: object
    tp: TpGroup
    monitor: ResidencyMonitor | None = None

    def check(self) -> int:
        """On-demand residency check (a collective: every rank must call it)."""
        return check_residency(self.engine.cache, self.tp.group)

    def hit_paths(self) -> list[dict]:
        return gather_hit_paths(self.engine.cache, self.tp.group)


def build_tp_engine(cfg: OffloadConfig, tp: TpGroup, progress: bool = True) -> TpRuntime:
    """This rank's reference ``Engine`` (experts sharded, non-expert weights replicated), all-reduce
    in the experts, a residency check right after startup and the monitor when configured."""
    from moe_offload.engine import Engine, ensure_checkpoint

    if cfg.parallel.reduce != "runtime":
        raise ConfigError(
            "parallel.reduce=host leaves the expert output partial for the host stack to reduce; the built-in "
            "engine has no such stack. Use parallel.reduce: runtime here, or embed OffloadedExperts in your stack"
        )
    if tp.rank == 0:  # one rank builds a preset checkpoint; the others wait for it
        ensure_checkpoint(cfg.model, progress)
    tp.barrier()
    rcfg = cfg.model_copy(deep=True)
    rcfg.model.checkpoint = str(ensure_checkpoint(cfg.model, False))
    rcfg.device = str(tp.device)
    if cfg.cache.budget.kind == "auto" and tp.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(tp.device)
        rcfg.cache.budget = agreed_auto_budget(free, parse_bytes(cfg.cache.auto_reserve), tp.group)
    engine = Engine.from_config(rcfg, tp_rank=tp.rank, tp_size=tp.world_size,
                                reduce=make_reducer(tp.group, "runtime"), progress=progress)
    check_residency(engine.cache, tp.group)
    monitor = None
    if cfg.parallel.check_interval > 0:
        monitor = ResidencyMonitor(engine.cache, tp.group, cfg.parallel.check_interval).attach(engine.model)
    log.info_rank0("tp_ready", tp=tp.world_size, backend=dist.get_backend(tp.group), device=str(tp.device),
                   check_interval=cfg.parallel.check_interval, expert_bytes_per_rank=engine.store.total_bytes)
    return TpRuntime(engine, tp, monitor)


# ---------------------------------------------------------------------------------------- launching
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_rank(rank: int, cfg: OffloadConfig, fn: Callable, args: tuple, port: int, out_dir: str) -> None:
    log.configure(cfg.logging.level, cfg.logging.format)
    log.set_rank(rank, cfg.parallel.tp)
    device = rank_device(cfg.device, rank, cfg.parallel.tp)
    if device.type == "cpu":  # the ranks share this host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.parallel.tp))
    tp = init_tp(cfg.parallel.tp, device, rank=rank, world_size=cfg.parallel.tp, init_method=f"tcp://127.0.0.1:{port}",
                 timeout_s=cfg.parallel.timeout_s)
    try:
        result = fn(cfg, tp, *args)
    finally:
        close_tp(tp)
    if rank == 0:
        with open(Path(out_dir, "rank0.pkl"), "wb") as f:
            pickle.dump(result, f)
    exit_without_teardown(0)


#: True once this process has run ``run_on_ranks`` as one torchrun rank (its group created and destroyed here):
#: the CLI then leaves through ``exit_without_teardown`` after printing (``cli.main``)
torchrun_rank_done = False


def exit_without_teardown(code: int) -> None:
    """Flush stdout, stderr and the logs, then end the process with ``code`` and no interpreter teardown.

    Decision: a rank whose work is done (group destroyed, result written or printed) leaves this way. On the CI
    machine a gloo rank that had returned normally aborted in teardown ("terminate called without an active
    exception", SIGABRT), first a spawned one, then (CI at d6c7ce0; d80111d alike) a torchrun one in 1 of 8-16
    runs of ``moe-offload generate``, whose exit code then said failure after a correct result: gloo's worker
    threads can still hold work objects whose release needs the interpreter being torn down. Nothing is left to
    release that the OS does not (files are closed, logs flushed here)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
            pass
    logging.shutdown()
    os._exit(code)


def run_on_ranks(cfg: OffloadConfig, fn: Callable, *args):
    """Run ``fn(cfg, tp: TpGroup, *args)`` on every one of the ``parallel.tp`` ranks; rank 0's result.

    Under torchrun (``RANK`` and ``WORLD_SIZE`` set) this process is one rank and the other ranks get None.
    Otherwise ``parallel.tp`` ranks are spawned (``fn`` and its result must pickle) after a preset
    checkpoint is built here once, and rank 0's result is returned to this process.
    """
    launched = torchrun_identity()
    if launched is not None:  # started by torchrun: the launcher gives this process its rank
        tp = init_tp(cfg.parallel.tp, rank_device(cfg.device, launched[2], cfg.parallel.tp),
                     timeout_s=cfg.parallel.timeout_s)
        global torchrun_rank_done
        try:
            result = fn(cfg, tp, *args)
        finally:
            close_tp(tp)
            torchrun_rank_done = True  # on an error too: its exit code, not a teardown abort's
        return result if tp.rank == 0 else None

    import torch.multiprocessing as mp
    from moe_offload.engine import ensure_checkpoint

    rank_device(cfg.device, cfg.parallel.tp - 1, cfg.parallel.tp)  # enough GPUs? fail before spawning
    cfg = cfg.model_copy(deep=True)
    cfg.model.checkpoint = str(ensure_checkpoint(cfg.model))  # built once here, not raced by the ranks
    log.info_rank0("tp_spawn", tp=cfg.parallel.tp, device=cfg.device)
    with tempfile.TemporaryDirectory(prefix="moe-offload-tp-") as out_dir:
        try:
            mp.spawn(_spawned_rank, args=(cfg, fn, args, _free_port(), out_dir), nprocs=cfg.parallel.tp, join=True)
        except mp.ProcessRaisedException as exc:
            raise RuntimeError(f"a TP rank failed:{exc}") from None
        except mp.ProcessExitedException as exc:
            raise RuntimeError(f"a TP rank exited: {exc}") from None
        with open(Path(out_dir, "rank0.pkl"), "rb") as f:
            return pickle.load(f)


# ---------------------------------------------------------------------------------------- generate
def _generate_rank(cfg: OffloadConfig, tp: TpGroup, prompt: dict) -> dict:
    rt = build_tp_engine(cfg, tp, progress=tp.rank == 0)
    eng = rt.engine
    ids = [int(x) for x in prompt["ids"].split(",") if x.strip()] if prompt["ids"] else eng.encode(prompt["text"])
    res = eng.generate(ids, prompt["max_new_tokens"], seed=prompt["seed"])
    rt.hit_paths()
    per_rank = gather_per_rank_bytes(eng.cache, tp.group)
    log.info_rank0("tp_bytes", host_bytes=[r["host_bytes"] for r in per_rank], h2d_bytes=[r["h2d_bytes"] for r in per_rank])
    return res.to_dict()


def run_tp_generate(cfg: OffloadConfig, args) -> int:
    """``moe-offload generate`` with ``parallel.tp`` > 1 (torchrun or spawned ranks); prints rank 0's result
    as ``generate`` prints it."""
    from moe_offload.output import print_result

    if cfg.parallel.reduce != "runtime":
        raise ConfigError("parallel.reduce=host: `moe-offload generate` owns the whole model; use parallel.reduce: runtime")
    prompt = {"text": args.prompt, "ids": args.prompt_ids, "max_new_tokens": args.max_new_tokens, "seed": args.seed}
    out = run_on_ranks(cfg, _generate_rank, prompt)
    if out is not None:
        print_result(out, args.json)
    return 0
