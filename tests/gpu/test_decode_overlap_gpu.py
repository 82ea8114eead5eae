"""On CUDA: ``decode.overlap_misses_from`` (a layer's miss copy forked onto a side stream while the pairs read from
slots compute, ``DecodeResidency.plan_split`` + ``decode_moe_nvfp4_split``) changes no bit of any step, eager or
replayed as a CUDA graph, while admissions change the residency; the counts stay the same; a step makes no host
sync; and where it does not apply it is declined with one event and a count."""

import pytest
import torch

from moe_offload.decode_graph import StaticDecoder

from test_decode_gpu import _eager_step_without_sync, _engine, _run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("batch", [1, 4])
def test_misses_copied_beside_the_resident_pairs_compute_change_no_bit(tiny_ckpt, monkeypatch, batch):
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    prompt = [list(range(10 + b, 42 + b)) for b in range(batch)]
    runs, counts = [], []
    for overlap in (1, 0):
        eng = _engine(path, "cache.budget=8 slots", "prefill.cuda_graphs=false", "compute.decode_kernel=tiles",
                      f"decode.overlap_misses_from={overlap}")
        calls = []
        real = eng.cache.decode_plan_split
        monkeypatch.setattr(eng.cache, "decode_plan_split", lambda *a, **k: calls.append(1) or real(*a, **k))
        eng.cache.reset()
        runs.append([_run(StaticDecoder(eng, batch, 64, graphs=g), prompt, 6) for g in (False, True)])
        counts.append(eng.cache.decode.counts())
        st = eng.cache.stats()
        assert st["declined"] == {}
        assert st["total"]["bytes"]["decode_h2d"] > 0 and st["total"]["evictions"] > 0  # misses, residency changed
        assert bool(calls) == bool(overlap)
        monkeypatch.undo()
    for graphs in (0, 1):
        for i, (a, b) in enumerate(zip(runs[0][graphs], runs[1][graphs])):
            assert torch.equal(a, b), f"graphs={graphs} step {i} differs"
    assert counts[0] == counts[1]


def test_an_overlapped_step_makes_no_host_sync(tiny_ckpt):
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-ct"), "cache.budget=0.37", "compute.decode_kernel=tiles",
                  "decode.overlap_misses_from=1")
    _eager_step_without_sync(eng, [list(range(5, 30)), list(range(7, 32))])
    assert eng.cache.streams.miss is not None  # the side stream was used


def test_under_the_lookahead_the_overlap_is_declined_with_one_event_and_a_count(tiny_ckpt, events):
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), "cache.budget=8 slots", "decode.lookahead=true",
                  "decode.overlap_misses_from=1")
    declined = [e for e in events() if e["event"] == "decode_miss_overlap_declined"]
    assert len(declined) == 1 and declined[0]["reason"] == "lookahead"
    eng.cache.reset()
    assert eng.cache.stats()["declined"].get("decode_miss_overlap:lookahead") == 1
    assert not eng.cache.decode_splits(4)


def test_a_padded_prompt_in_a_routed_prefill_graph_splits_and_changes_no_bit(tiny_ckpt, monkeypatch):
    """A 13-token prompt in a routed prefill graph (padded to its bucket, ``cache.pad_src_N`` set): with the overlap
    its layers take the split, captured with the side stream inside the graph; eager and every replay give the bits
    of the one-pass run."""
    from moe_offload.config import load_config
    from moe_offload.engine import Engine

    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    runs = []
    for overlap in (1, 0):
        cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "device=cuda", "dtype=bfloat16",
                                 "logging.level=WARNING", "prefill.routed_max_tokens=24", "cache.budget=8 slots",
                                 "cache.admit_per_step=0", "compute.decode_kernel=tiles",
                                 f"decode.overlap_misses_from={overlap}"])
        eng = Engine.from_config(cfg, progress=False)
        padded = []
        real = eng.cache.decode_plan_split
        monkeypatch.setattr(eng.cache, "decode_plan_split",
                            lambda *a, **k: padded.append(eng.cache.pad_src_N is not None) or real(*a, **k))
        dec = StaticDecoder(eng, 1, 128, graphs=True)
        assert dec.prefill_graphs.plan(1, 13)[1] == "routed"
        out = []
        for _ in range(4):  # the padded eager forward, the capture, then replays
            dec.reset()
            out.append(dec.prefill(torch.tensor([list(range(9, 22))], device="cuda")).clone())
        st = eng.cache.stats()
        assert st["compute"]["prefill_graph_replays"] == 3 and st["declined"] == {}
        assert (bool(padded) and all(padded)) == bool(overlap)
        runs.append(out)
        monkeypatch.undo()
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), f"prefill {i} differs"
