"""``bench soak``'s command line: its options, the soak they ask for (``Plan``: residencies, minutes, the
workloads' prompt lengths and batch sizes, memory sampling) and the config the soak runs, with the keys it sets
itself whatever ``--set`` says (``decode.max_tokens``, ``decode.max_cache_len``, greedy, no stop ids). The soak
itself is ``soak.py``'s."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from moe_offload.bench.env import add_result_arguments
from moe_offload.bench.ttft import BenchError, _csv
from moe_offload.config import OffloadConfig, load_config, seed_arg

# The embedded default is the CI smoke test: seconds on a CPU, so short prompts, small batches.
DEFAULTS = {"smoke": {"prompt_lens": "16..256", "max_batch": 3, "max_batch_tokens": 1024, "new_tokens": 8,
                      "workloads": 6, "minutes": 0.1},
            "model": {"prompt_lens": "16..8192", "max_batch": 4, "max_batch_tokens": 16384, "new_tokens": 32,
                      "workloads": 8, "minutes": 5.0}}


@dataclass(frozen=True)
class Plan:
    residencies: tuple[float, ...]
    minutes: float
    prompt_lens: tuple[int, int]  # inclusive range, drawn log-uniform
    max_batch: int
    max_batch_tokens: int
    new_tokens: int
    workloads: int
    sample_s: float
    seed: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    d, s = DEFAULTS["model"], DEFAULTS["smoke"]

    def both(key: str) -> str:
        return f"(default {d[key]}; {s[key]} for the tiny presets)"

    p.add_argument("--config", help="YAML config (default: the embedded tiny model, the CI smoke test)")
    p.add_argument("--residencies", default="0.1,0.5",
                   help="comma-separated fractions of each layer's experts resident, soaked in turn (default %(default)s)")
    p.add_argument("--minutes", type=float, help=f"minutes of requests per residency {both('minutes')}; when the "
                   "warm passes over the workloads take longer than a fifth of it, the run is extended so that four "
                   "fifths of it follow them")
    p.add_argument("--prompt-lens", help=f"LO..HI prompt tokens, drawn log-uniform {both('prompt_lens')}")
    p.add_argument("--max-batch", type=int, help=f"largest batch of a workload {both('max_batch')}")
    p.add_argument("--max-batch-tokens", type=int, help="largest batch x prompt tokens of a workload (long prompts "
                   f"come in smaller batches) {both('max_batch_tokens')}")
    p.add_argument("--new-tokens", type=int, help=f"greedy tokens decoded per request {both('new_tokens')}")
    p.add_argument("--workloads", type=int, help=f"seeded workloads with reference answers {both('workloads')}")
    p.add_argument("--sample-s", type=float, default=2.0, help="seconds between memory samples (default %(default)s)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the workloads, their order and the resident sets")
    add_result_arguments(p, "JSON, markdown and PNG", "markdown report")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="run nothing: write one report (JSON, markdown, PNG) "
                   "from the runs of earlier soak results of the same model and settings, e.g. one residency per "
                   "command where a command's length is limited")


def _range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in str(text).split(".."))
    except ValueError:
        raise BenchError(f"--prompt-lens {text!r}: expected LO..HI, e.g. 16..8192") from None
    if not 1 <= lo <= hi:
        raise BenchError(f"--prompt-lens {text!r}: expected 1 <= LO <= HI, e.g. 16..8192")
    return lo, hi


def make_plan(a: argparse.Namespace, cfg: OffloadConfig) -> Plan:
    """The soak from the options; a tiny preset (the embedded default) gets the smoke-test defaults."""
    d = DEFAULTS["smoke" if cfg.model.checkpoint is None and cfg.model.preset.startswith("tiny-") else "model"]

    def pick(name: str):
        value = getattr(a, name)
        return d[name] if value is None else value

    res = _csv(a.residencies, "--residencies", float, lambda r: 0.0 <= r < 1.0,
               "fractions in [0, 1), e.g. 0.1,0.5 (1 is the reference itself)")
    plan = Plan(res, float(pick("minutes")), _range(pick("prompt_lens")), pick("max_batch"), pick("max_batch_tokens"),
                pick("new_tokens"), pick("workloads"), a.sample_s, a.seed)
    for name, value in (("--max-batch", plan.max_batch), ("--new-tokens", plan.new_tokens),
                        ("--workloads", plan.workloads)):
        if value < 1:
            raise BenchError(f"{name} must be >= 1, got {value}")
    if plan.max_batch_tokens < plan.prompt_lens[1]:
        raise BenchError(f"--max-batch-tokens {plan.max_batch_tokens} is below the longest prompt "
                         f"({plan.prompt_lens[1]}): a workload of one such prompt would not fit; raise it")
    if not plan.minutes > 0 or not plan.sample_s > 0:
        raise BenchError(f"--minutes and --sample-s must be > 0, got {plan.minutes} and {plan.sample_s}")
    return plan


def bench_config(a: argparse.Namespace) -> tuple[OffloadConfig, Plan, list[str]]:
    """Config file (or embedded default) < --set; then what the soak needs whatever --set says (module doc)."""
    cfg = load_config(a.config, a.set)
    plan = make_plan(a, cfg)
    if cfg.parallel.tp > 1:
        raise BenchError("bench soak runs at parallel.tp=1 (a TP soak is not written yet)")
    forced = {"decode.max_tokens": max(cfg.decode.max_tokens, plan.max_batch),
              "decode.max_cache_len": max(plan.prompt_lens[1] + plan.new_tokens + 1, 16),
              "decode.temperature": 0.0, "decode.stop_token_ids": []}
    notes = [f"--set {key} is replaced: the soak sets it itself"
             for key in sorted({s.split("=", 1)[0].strip() for s in a.set} & {*forced, "cache.budget"})]
    for key, value in forced.items():
        setattr(cfg.decode, key.split(".")[1], value)  # validated on assignment
    return cfg, plan, notes
