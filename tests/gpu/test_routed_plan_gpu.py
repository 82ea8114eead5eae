"""On CUDA: a routed fill's copy entries planned on the device (``prefill.routed_plan: device``,
kernels/routed_plan.py). The Triton program equals the plain-torch plan; on real-size rows (one Qwen3-30B-A3B layer)
a fill that hands the planned entries to the batched call stages every routed expert's bytes, counts what the
host plan counts, and declines nothing."""

import numpy as np
import pytest
import torch

from moe_offload.cache import OffloadMoeCache
from moe_offload.config import CacheConfig, PrefillConfig
from moe_offload.kernels.routed_plan import plan_reference, plan_routed_fill, plan_words

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def store(qwen3_layer_store):
    s = qwen3_layer_store(pin=True)
    yield s
    s.close()


@pytest.mark.parametrize("E,N,resident,dtype", [
    (128, 128, 0.37, torch.int64), (128, 2048, 0.0, torch.int64), (512, 160, 0.5, torch.int64),
    (130, 77, 1.0, torch.int64), (8, 13, 0.25, torch.int64), (60, 200, 0.37, torch.int32), (64, 32768, 0.5, torch.int64),
    (256, 5, 0.0, torch.int16)])
def test_the_program_on_the_gpu_writes_the_reference_plan(E, N, resident, dtype):
    """Layouts wider than BLOCK_E (E = 8 / 60 / 64: every lane replicated across the 128 threads), 32,768 ids (4,096
    tokens of top-8, the routed threshold's limit), narrow id types."""
    gen = torch.Generator(device="cuda").manual_seed(E + N)
    ids = torch.randint(0, E, (N,), device="cuda", generator=gen).to(dtype)
    ids[N // 2] = -1  # one id outside the layer: counted as bad, routed nowhere
    table = torch.where(torch.rand(E, device="cuda", generator=gen) < resident,
                        torch.randint(0, 99, (E,), device="cuda", generator=gen), -1).to(torch.int32)
    want = plan_reference(ids, table, 2654224, 1 << 40, 1 << 41)
    runs = int(want[0])
    out = torch.full((4 + 4 * E + 3,), -7, dtype=torch.int64, device="cuda")
    for out_P in (None, out):  # the second: the words before the scratch also copied into ``out`` (the graph plan)
        plan = torch.full((plan_words(E),), -5, dtype=torch.int64, device="cuda")
        plan_routed_fill(ids, table, plan, 2654224, 1 << 40, 1 << 41, out_P=out_P)
        for words in (plan, out) if out_P is not None else (plan,):
            assert torch.equal(words[:4], want[:4])
            for part in range(3):  # the entries: only the first ``runs`` words of each array are specified
                lo = 4 + part * E
                assert torch.equal(words[lo:lo + runs], want[lo:lo + runs]), part
            assert torch.equal(words[4 + 3 * E:4 + 4 * E], want[4 + 3 * E:4 + 4 * E])
    assert out[4 + 4 * E:].tolist() == [-7] * 3


@pytest.mark.parametrize("plan", ["device", "host"])
def test_a_planned_fill_on_real_rows_stages_the_routed_experts_bytes(store, plan):
    E, K, R = store.num_experts, store.geometry.top_k, store.bytes_per_expert
    cache = OffloadMoeCache(store, CacheConfig(budget="0.5"), PrefillConfig(hit_copy="gather", routed_copy="copy_engine",
                                                                           routed_plan=plan), "cuda")
    assert (cache.staging.plan is not None) == (plan == "device")  # the start-up check passed on this GPU
    layer = store.layers[0]
    cache.set_residency({layer: list(range(0, E, 4))})
    rng = np.random.default_rng(1)
    ids = torch.from_numpy(rng.integers(0, E, (16, K))).cuda()
    routed = np.unique(ids.cpu().numpy())
    with cache.prefill_pass(routed_fills=True):
        views, index_N = cache.stage_rows(layer, ids)
        got = {e: {name: view[int(index_N[e])].clone() for name, view in views.items()} for e in routed.tolist()}
        cache.done(layer)
    torch.cuda.synchronize()
    want = store.views(layer)
    for e, banks in got.items():
        for name, row in banks.items():
            assert torch.equal(row.cpu(), want[name][e]), (e, name)
    st = cache.stats()
    missing = int(np.count_nonzero(routed % 4 != 0))
    assert st["total"]["prefill_misses"] == missing and st["total"]["prefill_hits"] == routed.size - missing
    assert st["total"]["bytes"]["prefill_routed_h2d"] == missing * R
    assert not st["declined"], st["declined"]
    cache.close()


def test_the_program_writes_its_words_into_mapped_host_memory():
    """``prefill.routed_plan: device`` / ``graph`` (moe_offload/fill_plan.py): the program itself writes the words
    into mapped pinned host memory, which the host reads after one event; destinations are offsets from 0."""
    from moe_offload.fill_plan import RoutedPlanBuffers

    E, N, R = 128, 128, 2654224
    dev = torch.device("cuda", torch.cuda.current_device())
    buffers = RoutedPlanBuffers._buffers(E, dev, mapped=True)
    assert buffers.mapped_P is not None  # this GPU maps pinned host memory (the store's SM reads need it too)
    assert buffers.host_P.data_ptr() % 4096 == 0  # whole pages of its own: registering it cannot fail on a neighbour
    assert buffers.check_mapped(E, dev) is None
    gen = torch.Generator(device="cuda").manual_seed(7)
    ids = torch.randint(0, E, (N,), device="cuda", generator=gen)
    table = torch.where(torch.rand(E, device="cuda", generator=gen) < 0.37, 5, -1).to(torch.int32)
    want = plan_reference(ids, table, R, 0, 1 << 41).cpu().numpy()
    buffers.host_P.fill_(-5)
    buffers.launch(ids, table, R, 1 << 41)
    words = buffers.wait(torch.cuda.current_stream(dev))
    runs = int(want[0])
    assert runs > 0 and words[:4].tolist() == want[:4].tolist()
    for part in range(3):
        lo = 4 + part * E
        assert words[lo:lo + runs].tolist() == want[lo:lo + runs].tolist(), part
    assert words[4 + 3 * E:4 + 4 * E].tolist() == want[4 + 3 * E:4 + 4 * E].tolist()


def test_a_routed_fill_graph_with_the_plan_captured_replays_equal_to_its_eager_forward(tiny_ckpt, monkeypatch):
    """``prefill.routed_plan: graph``: the plan captured at the end of each stretch (prefill_graph.Segments); every
    replayed fill reads it (``prefill_graph_planned_fills``), and the replays equal the eager forward (whose fills
    launch the program themselves) bit for bit, and the replays of the device plan. The tiny model's rows are below this GPU's batched-copy
    minimum, so the minimum is set to 0 here (it only picks which copy is faster)."""
    from moe_offload import hit_copy
    from moe_offload.config import load_config
    from moe_offload.decode_graph import StaticDecoder
    from moe_offload.engine import Engine

    monkeypatch.setattr(hit_copy, "h2d_batch_min_row_bytes", lambda name: 0)
    path, prompt = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), list(range(9, 22))
    got = {}
    for plan in ("graph", "device"):
        cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "device=cuda", "dtype=bfloat16",
                                 "logging.level=WARNING", "prefill.routed_max_tokens=24", "cache.budget=8 slots",
                                 "cache.admit_per_step=0", "prefill.routed_copy=copy_engine",
                                 f"prefill.routed_plan={plan}"])
        eng = Engine.from_config(cfg, progress=False)
        dec = StaticDecoder(eng, 1, 128, graphs=True)
        assert dec.prefill_graphs.plan(1, len(prompt))[1] == "routed_fills"
        outs = []
        for _ in range(4):
            dec.reset()
            outs.append(dec.prefill(torch.tensor([prompt], device="cuda")).clone())
        st = eng.cache.stats()
        assert st["routed_path"]["routed_plan"] == plan
        assert st["compute"]["prefill_graph_piecewise_replays"] == 3 and st["compute"]["prefill_routed_fills"] > 0
        planned = st["compute"].get("prefill_graph_planned_fills", 0)
        assert (planned > 0) == (plan == "graph"), st["compute"]
        assert not any(k.startswith(("prefill_graph", "routed_plan")) for k in st["declined"]), st["declined"]
        for i, r in enumerate(outs[1:]):
            assert torch.equal(outs[0], r), f"{plan}: replay {i} differs from the eager forward"
        got[plan] = outs[-1]
    assert torch.equal(got["graph"], got["device"])
