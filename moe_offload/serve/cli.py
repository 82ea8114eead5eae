"""``moe-offload serve``: the arguments and the command (moe_offload/cli.py registers them)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config (default: the embedded configs/tiny.yaml)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0 = an ephemeral port)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable); serve.* keys: max_batch, max_queue, max_model_len, "
                        "default_max_tokens, model_name")


def main(a: argparse.Namespace) -> int:
    from moe_offload import log
    from moe_offload.config import load_config
    from moe_offload.serve.server import serve

    cfg = load_config(a.config, a.set)  # serve.* keys are part of the config tree
    serve_cfg = cfg.serve
    log.configure(cfg.logging.level, cfg.logging.format)
    if cfg.parallel.tp > 1:  # rank 0 serves HTTP, the other ranks replay its forwards (serve/tp.py)
        from moe_offload.launch import run_on_ranks
        from moe_offload.serve.server import bind_socket
        from moe_offload.serve.tp import serve_rank

        bind_socket(a.host, a.port).close()  # a port in use or a bad host named before any rank loads the model
        run_on_ranks(cfg, serve_rank, serve_cfg.model_dump(), a.host, a.port)
        return 0
    return serve(cfg, serve_cfg, a.host, a.port)
