"""``moe-offload`` command line: generate | make-checkpoint | inspect | probe | bench ttft.

Exit codes: 0 ok, 1 a request failed at run time (e.g. non-finite logits), 2 a bad input (flag,
config key, checkpoint) named in one line on stderr, 130 interrupted (Ctrl-C), 141 stdout closed.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

from moe_offload import log
from moe_offload.config import seed_arg
from moe_offload.output import TokenStream, print_error, print_result, show_progress, silence_broken_pipe
from moe_offload.presets import PRESET_NAMES

FORMAT_CHOICES = ("bf16", "nvfp4-modelopt", "nvfp4-ct")
DEFAULT_PROMPT = "The capital of France is"


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (the flag, the problem, where help is), exit 2."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message}; see {self.prog} --help\n")


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("moe-offload")
    except metadata.PackageNotFoundError:
        return "unknown (not installed; pip install -e .)"


def _int_at_least(low: int):
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    return conv


def _float_in(low: float, high: float, low_open: bool = False):
    def conv(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (low < v <= high if low_open else low <= v <= high):
            raise argparse.ArgumentTypeError(f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {text}")
        return v
    return conv


# ---------------------------------------------------------------------------------------- generate
def _overrides(a) -> list[str]:
    sets = []
    if a.checkpoint is not None:
        sets.append(f"model.checkpoint={json.dumps(a.checkpoint)}")  # JSON-quoted: YAML reads it as a string
    for key, value in (("temperature", a.temperature), ("top_p", a.top_p), ("top_k", a.top_k)):
        if value is not None:
            sets.append(f"decode.{key}={value}")
    return [*sets, *a.set]


def _prompt_ids(a, facts) -> tuple[list[int], str]:
    """(token ids, the flag they came from), validated against the model's vocab."""
    from moe_offload.prompts import InputError, check_ids, load_prompt_tokenizer, parse_prompt_ids, read_prompt_file

    if a.prompt_ids is not None:
        ids, flag = parse_prompt_ids(a.prompt_ids), "--prompt-ids"
    else:
        if a.prompt_file is not None:
            text, flag = read_prompt_file(a.prompt_file), f"--prompt-file {a.prompt_file}"
        else:
            text, flag = (DEFAULT_PROMPT if a.prompt is None else a.prompt), "--prompt"
        if not text:
            raise InputError(f"{flag} is empty; pass some text, --prompt-file FILE (- for stdin) or --prompt-ids 1,2,3")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # bytes the shell could not decode (surrogate escapes)
            raise InputError(f"{flag}: not valid UTF-8 text ({exc.reason} at character {exc.start}); pass UTF-8 "
                             "text or --prompt-ids") from None
        try:
            tokenizer = load_prompt_tokenizer(facts)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        ids = list(tokenizer.encode(text))
    check_ids(ids, facts, flag)
    return ids, flag


def cmd_generate(a) -> int:
    from moe_offload.config import load_config
    from moe_offload.prompts import check_lengths, check_tp, model_facts

    cfg = load_config(a.config, _overrides(a))
    log.configure(cfg.logging.level, cfg.logging.format)
    # everything that can be checked is checked here, before a weight is read
    facts = model_facts(cfg)
    check_tp(facts, cfg.parallel.tp, "parallel.tp")
    ids, _ = _prompt_ids(a, facts)
    given = a.max_new_tokens is not None
    max_new = a.max_new_tokens if given else cfg.decode.max_new_tokens
    check_lengths(len(ids), max_new, facts, "--max-new-tokens" if given else "decode.max_new_tokens")
    if cfg.decode.stop_at_eos and facts.eos_ids:
        cfg.decode.stop_token_ids = sorted(set(cfg.decode.stop_token_ids) | set(facts.eos_ids))
    if cfg.parallel.tp > 1:
        from moe_offload.launch import run_tp_generate

        request = SimpleNamespace(prompt=None, prompt_ids=",".join(map(str, ids)), max_new_tokens=max_new,
                                  seed=a.seed, json=a.json)
        return run_tp_generate(cfg, request)
    from moe_offload.engine import Engine

    engine = Engine.from_config(cfg, progress=show_progress(a.json))
    stream = TokenStream(engine.tokenizer, enabled=not a.json)
    try:
        res = engine.generate(ids, max_new, seed=a.seed, on_token=stream)
    except KeyboardInterrupt:
        stream.finish()
        partial = {"interrupted": True, "prompt_tokens": len(ids), "token_ids": stream.ids,
                   "text": engine.tokenizer.decode(stream.ids) if engine.tokenizer is not None else None,
                   "cache": {k: v for k, v in engine.cache.stats().items() if k != "per_layer"}}
        if stream.enabled:
            partial.pop("text")
        print_result(partial, a.json)
        return 130
    stream.finish()
    out = res.to_dict()
    if stream.enabled:
        out.pop("text")  # already streamed above
    print_result(out, a.json)
    return 0


# ---------------------------------------------------------------------------------------- the others
def cmd_make_checkpoint(a) -> int:
    from moe_offload.checkpoint.synthetic import make_checkpoint

    if a.activations is not None and not a.format.startswith("nvfp4"):
        raise ValueError(f"--activations {a.activations} applies to the NVFP4 formats only; drop it for --format "
                         f"{a.format}")
    summary = make_checkpoint(a.preset, a.format, a.out, layers=a.layers, seed=a.seed,
                              progress=show_progress(a.json), force=a.force, activations=a.activations or "w4a16")
    print_result(summary, a.json)
    return 0


def cmd_inspect(a) -> int:
    from moe_offload.checkpoint.inspect import inspect_checkpoint

    print_result(inspect_checkpoint(a.path), a.json)
    return 0


def cmd_probe(a) -> int:
    from moe_offload.kernels.batch_memcpy_probe import probe

    result = probe()
    print_result(result, a.json)
    return 0 if result.get("ok") else 1


def cmd_bench_ttft(a) -> int:
    from moe_offload.bench.ttft import main as bench_main

    return bench_main(a)


def cmd_bench_decode(a) -> int:
    from moe_offload.bench.decode import main as bench_decode_main

    return bench_decode_main(a)


def cmd_bench_soak(a) -> int:
    from moe_offload.bench.soak import main as bench_soak_main

    return bench_soak_main(a)


def cmd_serve(a) -> int:
    from moe_offload.serve.cli import main as serve_main

    return serve_main(a)


def cmd_bench_serve(a) -> int:
    from moe_offload.serve.bench import main as bench_serve_main

    return bench_serve_main(a)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moe-offload", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"moe-offload {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    presets = ", ".join(PRESET_NAMES)

    g = sub.add_parser("generate", help="generate text with offloaded experts (default: the embedded tiny model)",
                       description="Generate from a prompt. The embedded tiny model has random weights: its text is "
                       "random bytes, by design. Text streams to stdout as it is decoded (not with --json).")
    g.add_argument("--config", help="YAML config (default: the embedded configs/tiny.yaml)")
    g.add_argument("--checkpoint", metavar="DIR", help="serve this HF checkpoint dir (sets model.checkpoint; "
                   "bf16, ModelOpt NVFP4 or compressed-tensors NVFP4, detected)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help=f"prompt text (default {DEFAULT_PROMPT!r})")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt text from FILE (- for standard input)")
    src.add_argument("--prompt-ids", metavar="IDS", help="comma-separated token ids, e.g. 1,2,3 (no tokenizer needed)")
    g.add_argument("--max-new-tokens", type=_int_at_least(1), metavar="N",
                   help="tokens to generate, >= 1 (default decode.max_new_tokens)")
    g.add_argument("--temperature", type=_float_in(0.0, 100.0), help="sampling temperature, 0 = greedy (decode.temperature)")
    g.add_argument("--top-p", type=_float_in(0.0, 1.0, low_open=True), help="nucleus sampling mass in (0, 1] (decode.top_p)")
    g.add_argument("--top-k", type=_int_at_least(0), help="sample among the k most likely tokens, 0 = all (decode.top_k)")
    g.add_argument("--seed", type=seed_arg, default=0, help="sampling seed (default 0)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON document at the end (no streaming, no progress bars)")
    g.set_defaults(fn=cmd_generate)

    m = sub.add_parser("make-checkpoint", help="write a synthetic real-shaped checkpoint",
                       description=f"Write a synthetic checkpoint (random weights) of a preset: {presets}.")
    m.add_argument("--preset", required=True, choices=PRESET_NAMES, metavar="PRESET", help=f"one of: {presets}")
    m.add_argument("--format", required=True, choices=FORMAT_CHOICES, help="expert/linear weight layout")
    m.add_argument("--out", required=True, metavar="DIR", help="new or empty directory (built beside it, then renamed)")
    m.add_argument("--force", action="store_true", help="replace a non-empty --out")
    m.add_argument("--layers", type=_int_at_least(1), metavar="N", help="truncate to N layers (at most the preset's depth)")
    m.add_argument("--activations", choices=("w4a16", "w4a4"),
                   help="NVFP4 only: weight-only export (w4a16, the default) or W4A4 (activation scales written, "
                   "served weight-only)")
    m.add_argument("--seed", type=seed_arg, default=0, help="weights seed (default 0)")
    m.add_argument("--json", action="store_true", help="print the summary as JSON (no progress bars)")
    m.set_defaults(fn=cmd_make_checkpoint)

    i = sub.add_parser("inspect", help="validate and describe a checkpoint dir",
                       description="Validate every expert tensor's presence, dtype and shape, the expert count, and "
                       "the values of every float tensor (finite; NVFP4 global scales non-zero).")
    i.add_argument("path", metavar="DIR", help="HF checkpoint dir")
    i.add_argument("--json", action="store_true", help="print the description as JSON")
    i.set_defaults(fn=cmd_inspect)

    pr = sub.add_parser("probe", help="resolve and validate the cudaMemcpyBatchAsync path")
    pr.add_argument("--json", action="store_true", help="print the probe result as JSON")
    pr.set_defaults(fn=cmd_probe)

    from moe_offload.serve.cli import add_arguments as add_serve_arguments

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    add_serve_arguments(sv)
    sv.set_defaults(fn=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH")
    t = bsub.add_parser("ttft", help="TTFT vs residency per copy mode, with floors and peers")
    from moe_offload.bench.ttft import add_arguments

    add_arguments(t)
    t.set_defaults(fn=cmd_bench_ttft)
    from moe_offload.bench.decode import add_arguments as add_bench_decode_arguments

    dc = bsub.add_parser("decode", help="decode tok/s vs residency and batch, with HBM/PCIe floors and peers")
    add_bench_decode_arguments(dc)
    dc.set_defaults(fn=cmd_bench_decode)
    from moe_offload.bench.soak import add_arguments as add_bench_soak_arguments

    sk = bsub.add_parser("soak", help="long randomized run per residency: answers vs all-resident, memory growth")
    add_bench_soak_arguments(sk)
    sk.set_defaults(fn=cmd_bench_soak)

    from moe_offload.serve.bench import add_arguments as add_bench_serve_arguments

    bs = bsub.add_parser("serve", help="concurrent streaming clients against a live server")
    add_bench_serve_arguments(bs)
    bs.set_defaults(fn=cmd_bench_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        a = parser.parse_args(argv)
    except SystemExit as exc:  # usage error (2, already printed in one line), --help or --version (0)
        return int(exc.code or 0)
    if not log._logger.handlers:
        log.configure()
    code = _run(a)
    launch = sys.modules.get("moe_offload.launch")
    if launch is not None and launch.torchrun_rank_done:  # one torchrun rank of a TP command: no teardown abort
        launch.exit_without_teardown(code)
    return code


def _run(a) -> int:
    """The parsed command ``a`` -> its exit code; the errors a user can act on as one line (``output.py``)."""
    from moe_offload.guards import NonFiniteLogitsError

    try:
        return a.fn(a)
    except KeyboardInterrupt:
        print_error("interrupted")
        return 130
    except BrokenPipeError:  # stdout closed early (e.g. `| head -1`): nothing left to say
        silence_broken_pipe()
        return 141
    except NonFiniteLogitsError as exc:
        print_error(str(exc))
        return 1
    except (ValueError, OSError, RuntimeError) as exc:
        print_error(str(exc))
        return 2


if __name__ == "__main__":
    sys.exit(main())
