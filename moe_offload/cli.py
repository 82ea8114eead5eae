"""``moe-offload`` command line: generate | make-checkpoint | inspect | probe | bench ttft."""

from __future__ import annotations

import argparse
import json
import sys

from moe_offload import log


def _print(obj, as_json: bool) -> None:
    if as_json:
        print(json.dumps(obj, indent=2, default=str))
    else:
        for k, v in obj.items():
            print(f"{k}: {json.dumps(v, default=str) if isinstance(v, (dict, list)) else v}")


def cmd_generate(a) -> int:
    from moe_offload.config import load_config
    from moe_offload.engine import Engine

    cfg = load_config(a.config, a.set)
    log.configure(cfg.logging.level, cfg.logging.format)
    if cfg.parallel.tp > 1:
        from moe_offload.launch import run_tp_generate

        return run_tp_generate(cfg, a)
    engine = Engine.from_config(cfg)
    if a.prompt_ids:
        ids = [int(x) for x in a.prompt_ids.split(",") if x.strip()]
    else:
        ids = engine.encode(a.prompt)
    res = engine.generate(ids, a.max_new_tokens, seed=a.seed)
    out = res.to_dict()
    _print(out, a.json)
    return 0


def cmd_make_checkpoint(a) -> int:
    from moe_offload.checkpoint.synthetic import make_checkpoint

    summary = make_checkpoint(a.preset, a.format, a.out, layers=a.layers, seed=a.seed, progress=not a.json)
    _print(summary, a.json)
    return 0


def cmd_inspect(a) -> int:
    from moe_offload.checkpoint.inspect import inspect_checkpoint

    _print(inspect_checkpoint(a.path), a.json)
    return 0


def cmd_probe(a) -> int:
    from moe_offload.kernels.batch_memcpy import probe

    result = probe()
    _print(result, a.json)
    return 0 if result.get("ok") else 1


def cmd_bench_ttft(a) -> int:
    from moe_offload.bench.ttft import main as bench_main

    return bench_main(a)


def cmd_serve(a) -> int:
    from moe_offload.serve.cli import main as serve_main

    return serve_main(a)


def cmd_bench_serve(a) -> int:
    from moe_offload.serve.bench import main as bench_serve_main

    return bench_serve_main(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-offload", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text with offloaded experts (default: the embedded tiny model)")
    g.add_argument("--config", help="YAML config (default: the embedded configs/tiny.yaml)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="The capital of France is", help="text prompt")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    g.add_argument("--json", action="store_true")
    g.set_defaults(fn=cmd_generate)

    m = sub.add_parser("make-checkpoint", help="write a synthetic real-shaped checkpoint")
    m.add_argument("--preset", required=True)
    m.add_argument("--format", required=True, choices=["bf16", "nvfp4-modelopt", "nvfp4-ct"])
    m.add_argument("--out", required=True)
    m.add_argument("--layers", type=int, default=None)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=cmd_make_checkpoint)

    i = sub.add_parser("inspect", help="validate and describe a checkpoint dir")
    i.add_argument("path")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_inspect)

    pr = sub.add_parser("probe", help="resolve and validate the cudaMemcpyBatchAsync path")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(fn=cmd_probe)

    from moe_offload.serve.cli import add_arguments as add_serve_arguments

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    add_serve_arguments(sv)
    sv.set_defaults(fn=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    t = bsub.add_parser("ttft", help="TTFT vs residency per copy mode, with floors and peers")
    from moe_offload.bench.ttft import add_arguments

    add_arguments(t)
    t.set_defaults(fn=cmd_bench_ttft)

    from moe_offload.serve.bench import add_arguments as add_bench_serve_arguments

    bs = bsub.add_parser("serve", help="concurrent streaming clients against a live server")
    add_bench_serve_arguments(bs)
    bs.set_defaults(fn=cmd_bench_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if not log._logger.handlers:
        log.configure()
    try:
        return a.fn(a)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        log.event("error", 40, kind=type(exc).__name__, message=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
