"""``bench decode``'s command line: its options, the sweep they ask for (``Plan``: residencies, batch sizes,
prompt length, steps, reps, peers, budget) and the config the bench runs, with the keys it sets itself whatever
``--set`` says (``decode.max_tokens``, ``decode.max_cache_len``, greedy, no stop ids). Measuring is ``decode.py``'s."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pydantic import ValidationError

from moe_offload.bench.env import add_result_arguments
from moe_offload.bench.ttft import BUDGETS, BenchError, _csv
from moe_offload.config import FORMATS, PRESETS, OffloadConfig, load_config, seed_arg

PEERS = ("eager", "compiled")
# The embedded default is the CI smoke test: seconds on a CPU, so shorter prompts and fewer steps.
DEFAULTS = {"smoke": {"batches": "1,2", "prompt_len": 32, "steps": 4, "reps": 1},
            "model": {"batches": "1,4,16,64", "prompt_len": 1024, "steps": 64, "reps": 3}}


@dataclass(frozen=True)
class Plan:
    residencies: tuple[float, ...]  # largest first: the engine is built with the largest pool
    batches: tuple[int, ...]
    prompt_len: int
    steps: int
    reps: int
    peers: tuple[str, ...]
    peer_batches: tuple[int, ...]
    compiled_batches: tuple[int, ...]
    peer_layers: int | None
    peer_reps: int
    seed: int
    budget: str


def add_arguments(p: argparse.ArgumentParser) -> None:
    d, s = DEFAULTS["model"], DEFAULTS["smoke"]
    p.add_argument("--config", help="YAML config (default: the embedded tiny model, the CI smoke test)")
    p.add_argument("--preset", choices=PRESETS, help="override model.preset")
    p.add_argument("--format", choices=FORMATS, help="override model.format")
    p.add_argument("--layers", type=int, help="truncate the preset to N layers (the tok/s targets are then "
                   "checked on figures scaled to the preset's full depth)")
    p.add_argument("--residency", default="0,0.37,0.5,1",
                   help="comma-separated fractions of each layer's experts resident (default %(default)s)")
    p.add_argument("--batch", help=f"comma-separated batch sizes, sequences decoded together (default "
                   f"{d['batches']}; {s['batches']} for the tiny presets)")
    p.add_argument("--prompt-len", type=int, help=f"prompt tokens per sequence, prefilled before decoding "
                   f"(default {d['prompt_len']}; {s['prompt_len']} for the tiny presets)")
    p.add_argument("--steps", type=int, help=f"timed decode steps per run (default {d['steps']}; "
                   f"{s['steps']} for the tiny presets)")
    p.add_argument("--reps", type=int, help=f"timed runs per cell (default {d['reps']}; {s['reps']} for the tiny "
                   "presets); one untimed run per cell first")
    p.add_argument("--budget", choices=BUDGETS, default="residency",
                   help="slot pool per residency (residency: exactly the resident experts) or once for the largest "
                   "(max: prefill fills the free slots, so low residencies warm up)")
    p.add_argument("--peers", default="eager,compiled", help=f"comma-separated transformers bf16 full-GPU peers "
                   f"({', '.join(PEERS)}: DynamicCache eager; StaticCache + torch.compile reduce-overhead) or "
                   "'none'; CUDA only")
    p.add_argument("--peer-batches", help="batch sizes of the eager peer (default: --batch; those that do not fit "
                   "are reported as not measured)")
    p.add_argument("--compiled-batches", default="1", help="batch sizes of the compiled peer (default %(default)s: "
                   "every batch size is its own compile, minutes at 48 layers)")
    p.add_argument("--peer-layers", type=int, help="run the peers on the first N layers and scale ms/step linearly "
                   "(default: as many layers as the engine)")
    p.add_argument("--peer-reps", type=int, default=2, help="timed runs per peer and batch (default %(default)s)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the prompts and of the resident sets")
    add_result_arguments(p, "JSON, markdown and PNG", "markdown table")


def _ints(text: str, option: str) -> tuple[int, ...]:
    return tuple(sorted(_csv(text, option, int, lambda n: n >= 1, "positive integers, e.g. 1,4,16")))


def make_plan(a: argparse.Namespace, cfg: OffloadConfig) -> Plan:
    """The sweep from the options; a tiny preset (the embedded default) gets the smoke-test defaults."""
    d = DEFAULTS["smoke" if cfg.model.checkpoint is None and cfg.model.preset.startswith("tiny-") else "model"]
    res = _csv(a.residency, "--residency", float, lambda r: 0.0 <= r <= 1.0, "fractions in [0, 1], e.g. 0,0.37,1")
    batches = _ints(a.batch or d["batches"], "--batch")
    peers = () if str(a.peers).strip().lower() == "none" else _csv(
        a.peers, "--peers", str, lambda m: m in PEERS, f"a comma-separated subset of {', '.join(PEERS)}, or none")
    prompt_len = d["prompt_len"] if a.prompt_len is None else a.prompt_len  # 0 is an error below, not "the default"
    steps = d["steps"] if a.steps is None else a.steps
    reps = d["reps"] if a.reps is None else a.reps
    for name, value in (("--prompt-len", prompt_len), ("--steps", steps), ("--reps", reps),
                        ("--peer-reps", a.peer_reps), ("--peer-layers", a.peer_layers), ("--layers", a.layers)):
        if value is not None and value < 1:
            raise BenchError(f"{name} must be >= 1, got {value}")
    return Plan(tuple(sorted(res, reverse=True)), batches, prompt_len, steps, reps, peers,
                _ints(a.peer_batches, "--peer-batches") if a.peer_batches else batches,
                _ints(a.compiled_batches, "--compiled-batches"), a.peer_layers, a.peer_reps, a.seed, a.budget)


def bench_config(a: argparse.Namespace) -> tuple[OffloadConfig, Plan, list[str]]:
    """Config file (or embedded default) < --preset/--format/--layers < --set; then what the bench
    needs whatever --set says: decode.max_tokens = the largest batch, decode.max_cache_len = prompt +
    steps + 1, greedy with no stop ids (every run decodes exactly --steps steps)."""
    base = [f"model.preset={a.preset}"] if a.preset else []
    base += [f"model.format={a.format}"] if a.format else []
    base += [f"model.layers={a.layers}"] if a.layers else []
    cfg = load_config(a.config, [*base, *a.set])
    plan = make_plan(a, cfg)
    if cfg.parallel.tp > 1:
        raise BenchError("bench decode runs at parallel.tp=1 (the TP decode step is not benchmarked yet)")
    notes = []
    forced = {"decode.max_tokens": max(plan.batches), "decode.max_cache_len": max(plan.prompt_len + plan.steps + 1, 16),
              "decode.temperature": 0.0, "decode.stop_token_ids": []}
    overridden = {s.split("=", 1)[0].strip() for s in a.set} & {*forced, "cache.budget"}
    for key in sorted(overridden):
        notes.append(f"--set {key} is replaced: the bench sets it itself")
    for key, value in forced.items():
        try:
            setattr(cfg.decode, key.split(".")[1], value)  # validated on assignment
        except ValidationError as exc:
            detail = exc.errors()[0]
            raise BenchError(f"{key}={value} (what --batch / --prompt-len / --steps ask for) is out of range: "
                             f"{detail['msg']}; use smaller values") from None
    return cfg, plan, notes
