"""Tensor parallelism on the CPU: two gloo ranks spawned with torch.multiprocessing on a free port.

The TP=2 runs happen in two spawned jobs (module fixtures: the equivalence job over 3 families x
3 formats, the mechanics job: monitor, forced divergence, hit-path disagreement, logs); the tests
below check one behaviour each on what the ranks returned. TP=1 references run in this process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
from math import prod
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import FAMILY_PRESETS, FORMATS
from moe_offload import log
from moe_offload.cli import main as cli_main
from moe_offload.checkpoint.reader import CheckpointReader, detect_format
from moe_offload.config import load_config
from moe_offload.engine import Engine
from moe_offload.formats import FormatError, get_format
from moe_offload.host_store import ExpertStore
from moe_offload.launch import build_tp_engine
from moe_offload.parallel import ResidencyDivergence, check_residency, close_tp, init_tp, make_reducer

WORLD = 2
PROMPT = list(range(10, 30))
NEW_TOKENS = 12
PREFILL_LENGTHS = (1, 7, 48)  # 1 and 7 take the decode path (<= decode.max_tokens), 48 the prefill path
# TP=2 vs TP=1 in float32 on the CPU. Every rank's weights are exactly the TP=1 weights (gate/up rows
# and down columns are split, NVFP4 blocks never straddle ranks), so the only difference is the order
# of the fp32 sum over I in the down projection: two partial sums of I/2 terms plus one add (the
# all-reduce) instead of one sum, ~I * 2**-24 ~ 2e-6 relative per MoE layer. Measured on logits of
# magnitude ~0.7: max |diff| 2.7e-7 over 3 families x 3 formats. 1e-5 leaves ~40x headroom for other
# BLAS blockings and stays ~3000x below a real defect (a rank's share missing or doubled moves the
# logits by 3.5e-2 to 7e-2 on these models).
ATOL = 1e-5


def _cfg(path: str, *overrides: str):
    return load_config(None, [f"model.checkpoint={path}", "model.format=auto", "device=cpu", "cache.budget=0.5",
                              "prefill.hit_copy=gather", "logging.level=INFO", *overrides])


# ------------------------------------------------------------------------------------- spawning
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn, port: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)  # two ranks share the CI machine's cores
    stream = io.StringIO()
    log.configure("INFO", "json", stream=stream)
    tp = init_tp(WORLD, torch.device("cpu"), rank=rank, world_size=WORLD, init_method=f"tcp://127.0.0.1:{port}")
    try:
        result = fn(tp, *args)
    finally:
        close_tp(tp)
    result["log"] = stream.getvalue()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def _run_ranks(fn, *args) -> list[dict]:
    """``fn(tp, *args)`` on each of WORLD spawned ranks; their returned dicts, in rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(fn, _free_port(), out_dir, args), nprocs=WORLD, join=True)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _prefill_logits(engine) -> dict[int, torch.Tensor]:
    out = {}
    for T in PREFILL_LENGTHS:
        ids = torch.randint(3, 300, (1, T), generator=torch.Generator().manual_seed(T))
        out[T], _ = engine.prefill(ids)
    return out


# ------------------------------------------------------------------------------------- rank jobs
def _equivalence_job(tp, paths: dict) -> dict:
    """TP=2 engines of every checkpoint: prefill logits, greedy tokens, expert bytes read, monitor checks."""
    out = {}
    for key, path in paths.items():
        rt = build_tp_engine(_cfg(path, f"parallel.tp={WORLD}", "parallel.check_interval=1"), tp, progress=False)
        logits = _prefill_logits(rt.engine)
        tokens = rt.engine.generate(PROMPT, NEW_TOKENS).token_ids
        out[key] = {"logits": logits, "tokens": tokens, "expert_bytes": rt.engine.store.reader_bytes,
                    "checks": rt.monitor.checks}
        rt.monitor.detach()
    # decode.lookahead on one checkpoint: each rank predicts and prefetches on its own, results must not move
    key = (FAMILY_PRESETS[0], "nvfp4-modelopt")
    rt = build_tp_engine(_cfg(paths[key], f"parallel.tp={WORLD}", "decode.lookahead=true"), tp, progress=False)
    out["lookahead"] = {"logits": _prefill_logits(rt.engine), "tokens": rt.engine.generate(PROMPT, NEW_TOKENS).token_ids,
                        "stats": rt.engine.cache.stats()["lookahead"], "key": key}
    return out


def _divergence(fn) -> dict | None:
    try:
        fn()
    except ResidencyDivergence as exc:
        return {"ranks": exc.ranks, "layer": exc.layer, "steps": exc.steps, "message": str(exc)}
    return None


def _mechanics_job(tp, nvfp4_path: str, bf16_path: str) -> dict:
    out = {}
    # every expert resident: decode never misses, so residency changes only where the test forces it
    rt = build_tp_engine(_cfg(nvfp4_path, f"parallel.tp={WORLD}", "parallel.check_interval=2", "cache.budget=1.0"),
                         tp, progress=False)
    cache = rt.engine.cache
    rt.engine.generate(PROMPT, 9)  # 8 decode steps
    out["monitor"] = {"steps": rt.monitor.steps, "checks": rt.monitor.checks}
    out["agreeing_check_step"] = rt.check()

    layer = cache.store.layers[1]
    resident = {l: [int(e) for e in (cache.resident(l) >= 0).nonzero()[0]] for l in cache.store.layers}
    if tp.rank == 1:  # evict one expert on rank 1 only
        cache.set_residency({**resident, layer: resident[layer][1:]})
    out["evicted"] = {"layer": layer}
    out["on_demand"] = _divergence(lambda: check_residency(cache, tp.group))

    if tp.rank == 1:  # drop all of the layer on rank 1: 2 one-token decode steps re-route at most 8 of 16
        cache.set_residency({**resident, layer: []})
    out["periodic"] = _divergence(lambda: rt.engine.generate([PROMPT[0]], 4))
    rt.monitor.detach()

    # rank 0 copies prefill hits with the gather kernel, rank 1 declines on the CPU (full-layer copies)
    hit_copy = "gather" if tp.rank == 0 else "batch_memcpy"  # batch_memcpy declines on cpu
    rt2 = build_tp_engine(_cfg(bf16_path, f"parallel.tp={WORLD}", f"prefill.hit_copy={hit_copy}"), tp, progress=False)
    rt2.engine.generate(PROMPT, 2)
    out["hit_paths"] = rt2.hit_paths()

    # embedding: a host's own process group is joined as is (nothing created, nothing destroyed)
    host_group = dist.new_group(list(range(WORLD)))
    host_tp = init_tp(WORLD, torch.device("cpu"), group=host_group)
    summed = make_reducer(host_group, "runtime")(torch.full((3,), float(tp.rank + 1)))
    out["host_group"] = {"rank": host_tp.rank, "owns": host_tp.owns_default_group, "summed": summed.tolist(),
                         "host_reducer": make_reducer(host_group, "host"),
                         "check_step": check_residency(rt2.engine.cache, host_group)}
    return out


@pytest.fixture(scope="module")
def tp2_runs(tiny_ckpt):
    paths = {(p, f): tiny_ckpt(p, f) for p in FAMILY_PRESETS for f in FORMATS}
    return _run_ranks(_equivalence_job, paths)


@pytest.fixture(scope="module")
def mechanics(tiny_ckpt):
    return _run_ranks(_mechanics_job, tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), tiny_ckpt("tiny-qwen3-moe", "bf16"))


# ------------------------------------------------------------------------------------- TP=2 == TP=1
@pytest.fixture(scope="module")
def tp1(tiny_ckpt):
    cache = {}

    def get(preset, fmt):
        if (preset, fmt) not in cache:
            eng = Engine.from_config(_cfg(tiny_ckpt(preset, fmt)), progress=False)
            cache[preset, fmt] = {"logits": _prefill_logits(eng), "tokens": eng.generate(PROMPT, NEW_TOKENS).token_ids}
        return cache[preset, fmt]

    return get


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_tp2_prefill_logits_equal_tp1(tp2_runs, tp1, preset, fmt):
    want = tp1(preset, fmt)["logits"]
    for T in PREFILL_LENGTHS:
        torch.testing.assert_close(tp2_runs[0][preset, fmt]["logits"][T], want[T], atol=ATOL, rtol=0, msg=f"T={T}")


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_tp2_greedy_tokens_equal_tp1(tp2_runs, tp1, preset, fmt):
    assert tp2_runs[0][preset, fmt]["tokens"] == tp1(preset, fmt)["tokens"]


def test_tp2_with_the_lookahead_gives_the_bits_without_it(tp2_runs):
    for rank in tp2_runs:
        la = rank["lookahead"]
        want = rank[la["key"]]
        assert la["tokens"] == want["tokens"] and la["stats"]["copied"] > 0
        for T in PREFILL_LENGTHS:
            assert torch.equal(la["logits"][T], want["logits"][T]), f"T={T}"


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_both_ranks_compute_bitwise_identical_logits_and_tokens(tp2_runs, preset, fmt):
    r0, r1 = tp2_runs[0][preset, fmt], tp2_runs[1][preset, fmt]
    assert r0["tokens"] == r1["tokens"]
    for T in PREFILL_LENGTHS:
        assert torch.equal(r0["logits"][T], r1["logits"][T]), f"T={T}"


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_residency_monitor_checked_every_decode_step_without_a_false_alarm(tp2_runs, preset, fmt):
    # check_interval=1: the prefills of 1 and 7 tokens take the decode path, then generate's decode steps
    decode_steps = sum(T <= 16 for T in PREFILL_LENGTHS) + NEW_TOKENS - 1
    assert [r[preset, fmt]["checks"] for r in tp2_runs] == [decode_steps] * WORLD


# ------------------------------------------------------------------------------------- sharding
def _expected_expert_bytes(path: str, tp_size: int) -> int:
    """Bytes of expert tensors one rank must read: its 1/tp of every sliced tensor plus whole
    per-tensor NVFP4 global scales (one fp32 each, needed by every rank)."""
    reader = CheckpointReader(path)
    geo, fmt_name = reader.geometry, detect_format(reader)
    fmt = get_format(fmt_name)

    def nbytes(name):
        return prod(reader.shape_of(name)) * reader.dtype_of(name).itemsize

    sliced = whole = 0
    for layer in geo.moe_layers:
        for e in range(geo.num_experts):
            for which in ("gate", "up", "down"):
                prefix = geo.family.expert_name(layer, e, which)
                if fmt_name == "bf16":
                    sliced += nbytes(prefix + ".weight")
                else:
                    packed, scale, glob = fmt.suffixes
                    sliced += nbytes(f"{prefix}.{packed}") + nbytes(f"{prefix}.{scale}")
                    whole += nbytes(f"{prefix}.{glob}")
    return sliced // tp_size + whole


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_rank_reads_only_its_half_of_the_expert_bytes(tp2_runs, tiny_ckpt, preset, fmt):
    path = tiny_ckpt(preset, fmt)
    want = _expected_expert_bytes(path, WORLD)
    assert [r[preset, fmt]["expert_bytes"] for r in tp2_runs] == [want] * WORLD
    assert want < _expected_expert_bytes(path, 1)


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_rank_slices_concatenate_to_the_full_expert(tiny_ckpt, preset, fmt):
    path = tiny_ckpt(preset, fmt)
    full = ExpertStore.from_checkpoint(path, tp_rank=0, tp_size=1, progress=False)
    parts = [ExpertStore.from_checkpoint(path, tp_rank=r, tp_size=WORLD, progress=False) for r in range(WORLD)]
    fmt_obj = full.format
    for layer in full.layers:
        gate_up_EFH, down_EHI = fmt_obj.dequantize(full.views(layer), torch.float32)
        shards = [fmt_obj.dequantize(p.views(layer), torch.float32) for p in parts]
        i_rank = parts[0].inter  # each rank's bank is [gate rows of I/tp; up rows of I/tp]
        gate = torch.cat([gu[:, :i_rank] for gu, _ in shards], 1)
        up = torch.cat([gu[:, i_rank:] for gu, _ in shards], 1)
        # dequantization is elementwise, so the shards are bit-exact pieces of the full expert
        assert torch.equal(torch.cat([gate, up], 1), gate_up_EFH), f"layer {layer}"
        assert torch.equal(torch.cat([d for _, d in shards], 2), down_EHI), f"layer {layer}"


@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "nvfp4-ct"])
def test_nvfp4_with_i_over_tp_not_a_multiple_of_16_raises_a_named_error(tiny_ckpt, fmt):
    # the tiny presets have I=32: tp=4 leaves 8 per rank, half an NVFP4 block
    with pytest.raises(FormatError, match=r"32 / tp=4 = 8 is not a multiple of 16"):
        ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", fmt), tp_rank=0, tp_size=4, progress=False)


def test_bf16_has_no_block_constraint_on_i_over_tp(tiny_ckpt):
    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "bf16"), tp_rank=3, tp_size=4, progress=False)
    assert store.inter == 8


# ------------------------------------------------------------------------------------- residency
def test_residency_monitor_runs_the_check_every_check_interval_decode_steps(mechanics):
    assert [r["monitor"] for r in mechanics] == [{"steps": 8, "checks": 4}] * WORLD


def test_agreeing_ranks_pass_the_on_demand_check(mechanics):
    assert [r["agreeing_check_step"] for r in mechanics] == [mechanics[0]["agreeing_check_step"]] * WORLD


def test_an_expert_evicted_on_one_rank_only_is_detected_on_every_rank(mechanics):
    layer = mechanics[0]["evicted"]["layer"]
    for r in mechanics:
        d = r["on_demand"]
        assert d is not None and d["ranks"] == [1] and d["layer"] == layer
        assert "rank(s) [1]" in d["message"] and f"MoE layer {layer}" in d["message"]


def test_the_periodic_check_stops_decoding_when_residency_diverges(mechanics):
    layer = mechanics[0]["evicted"]["layer"]
    assert [(r["periodic"] or {}).get("layer") for r in mechanics] == [layer] * WORLD


def test_a_hosts_own_process_group_is_joined_as_is(mechanics):
    hosts = [r["host_group"] for r in mechanics]
    assert [(h["rank"], h["owns"]) for h in hosts] == [(0, False), (1, False)]
    assert all(h["summed"] == [3.0, 3.0, 3.0] and h["check_step"] == hosts[0]["check_step"] for h in hosts)


def test_host_reduction_leaves_the_partial_output_to_the_host(mechanics):
    assert [r["host_group"]["host_reducer"] for r in mechanics] == [None] * WORLD


# ------------------------------------------------------------------------------------- hit paths, logs
def _records(result) -> list[dict]:
    return [json.loads(line) for line in result["log"].splitlines()]


def test_ranks_with_different_hit_paths_are_listed_together(mechanics):
    views = mechanics[0]["hit_paths"]
    assert views == mechanics[1]["hit_paths"]
    assert [(v["rank"], v["hit_path"], v["fallbacks"]) for v in views] == [
        (0, "gather", []), (1, "full_layer_copy", ["cpu_device"])]


def test_rank0_logs_one_hit_path_disagreement_warning(mechanics):
    events = [[rec for rec in _records(r) if rec["event"] == "tp_hit_path_disagreement"] for r in mechanics]
    assert [len(e) for e in events] == [1, 0]
    assert events[0][0]["level"] == "WARNING"
    assert events[0][0]["per_rank"] == "rank0=gather;rank1=full_layer_copy(cpu_device)"


def test_every_log_record_carries_its_rank_and_world_size(mechanics):
    for rank, r in enumerate(mechanics):
        recs = _records(r)
        assert recs and all((rec["rank"], rec["world_size"]) == (rank, WORLD) for rec in recs)


def test_informational_events_come_from_rank0_only(mechanics):
    names = [{rec["event"] for rec in _records(r) if rec["level"] == "INFO"} for r in mechanics]
    assert {"engine_ready", "tp_ready", "cache_ready"} <= names[0]
    assert names[1] == set()


def test_a_rank_warns_about_its_own_fallback_with_its_rank(mechanics):
    fallbacks = [[rec for rec in _records(r) if rec["event"] == "prefill_hit_d2d_unavailable"] for r in mechanics]
    assert [len(f) for f in fallbacks] == [0, 1] and fallbacks[1][0]["rank"] == 1


def test_divergence_is_logged_as_an_error_on_every_rank(mechanics):
    for r in mechanics:
        assert any(rec["event"] == "tp_residency_divergence" and rec["level"] == "ERROR" for rec in _records(r))


# ------------------------------------------------------------------------------------- launching
TP2_YAML = Path(__file__).resolve().parents[1] / "configs" / "tp2.yaml"


def _generate_args(path: str, *extra: str) -> list[str]:
    return ["generate", "--config", str(TP2_YAML), "--set", f"model.checkpoint={path}", "--set", "device=cpu",
            "--set", "logging.level=WARNING", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "6",
            "--json", *extra]


@pytest.fixture(scope="module")
def tp1_cli_tokens(tiny_ckpt):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(_generate_args(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), "--set", "parallel.tp=1")) == 0
    return json.loads(buf.getvalue())["token_ids"]


def test_generate_without_a_launcher_spawns_the_ranks_and_prints_rank0s_result(tiny_ckpt, tp1_cli_tokens, capsys):
    assert cli_main(_generate_args(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"))) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == tp1_cli_tokens and out["prompt_tokens"] == len(PROMPT)


@pytest.mark.parametrize("fails", [False, True])
def test_the_cli_leaves_a_torchrun_rank_without_interpreter_teardown(tiny_ckpt, monkeypatch, capsys, fails):
    """``moe_offload.launch.exit_without_teardown`` (the gloo teardown abort) after a TP command's own output, with its
    exit code; injected here: the flag a torchrun rank sets, and the exit recorded instead of taken."""
    import moe_offload.launch as launch

    left = []
    monkeypatch.setattr(launch, "torchrun_rank_done", True)
    monkeypatch.setattr(launch, "exit_without_teardown", left.append)
    args = _generate_args(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"))
    if fails:  # an error a user can act on: its one line and exit code 2, then the same exit
        args = [*args, "--set", "model.checkpoint=/nonexistent/ckpt"]
    code = cli_main([*args, "--set", "parallel.tp=1"])
    assert left == [code] and code == (2 if fails else 0)
    if not fails:
        assert json.loads(capsys.readouterr().out)["prompt_tokens"] == len(PROMPT)


def test_generate_under_torchrun_prints_rank0s_result_once(tiny_ckpt, tp1_cli_tokens):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           "-m", "moe_offload.cli", *_generate_args(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"))]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)  # one JSON document: only rank 0 printed
    assert out["token_ids"] == tp1_cli_tokens
