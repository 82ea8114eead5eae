"""On CUDA: pinned banks, real streams, the hit paths and the oracle (run on the H200)."""

import io
import json

import pytest
import torch

from moe_offload import log
from moe_offload.config import load_config
from moe_offload.engine import Engine
from moe_offload.integrations.reference import build_reference_model

pytestmark = pytest.mark.gpu

FAMILIES = ("tiny-qwen3-moe", "tiny-qwen3-next", "tiny-mixtral")
FORMATS = ("bf16", "nvfp4-modelopt", "nvfp4-ct")


def _engine(path, *extra):
    cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "device=cuda", "logging.level=WARNING", *extra])
    return Engine.from_config(cfg, progress=False)


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("budget", ["0.37", "1.0"])
def test_cuda_prefill_matches_the_oracle(tiny_ckpt, preset, fmt, budget):
    path = tiny_ckpt(preset, fmt)
    eng = _engine(path, f"cache.budget={budget}", "dtype=float32")
    assert eng.store.pinned
    ref = build_reference_model(path, torch.float32, "cpu")
    for T in (1, 7, 300):
        ids = torch.randint(3, 300, (1, T), generator=torch.Generator().manual_seed(T))
        got, _ = eng.prefill(ids)
        want = ref(ids).logits
        # fp32 on both sides; CUDA matmuls may use other summation orders (and index_add_ atomics):
        # 1e-3 is ~100x the fp32 noise seen at these sizes and far below a wrong expert (>1e-2)
        torch.testing.assert_close(got.cpu(), want, atol=1e-3, rtol=0, msg=f"T={T}")


@pytest.mark.parametrize("preset", FAMILIES)
def test_cuda_bf16_greedy_tokens_match_between_tiny_and_full_cache(tiny_ckpt, preset):
    path = tiny_ckpt(preset, "nvfp4-modelopt")
    small = _engine(path, "cache.budget=4 slots").generate(list(range(10, 40)), 16).token_ids
    full = _engine(path, "cache.budget=1.0").generate(list(range(10, 40)), 16).token_ids
    assert small == full


@pytest.fixture(scope="module")
def real_rows_ckpt(tmp_path_factory):
    """qwen3-30b-a3b NVFP4 shapes (2.65 MB experts), 3 layers: real row sizes for the copy paths."""
    from moe_offload.checkpoint.synthetic import make_checkpoint

    out = tmp_path_factory.mktemp("q30") / "ckpt"
    make_checkpoint("qwen3-30b-a3b", "nvfp4-modelopt", out, layers=3, progress=False)
    return str(out)


def _set_residency(eng, fraction):
    E = eng.store.num_experts
    n = round(fraction * E)
    eng.cache.set_residency({layer: list(range(n)) for layer in eng.store.layers})


@pytest.mark.parametrize("residency", [0.25, 0.5, 0.9])
def test_outputs_identical_with_hit_d2d_on_both_kinds_and_off(real_rows_ckpt, residency):
    ids = torch.randint(3, 150000, (1, 512), generator=torch.Generator().manual_seed(0))
    outs = {}
    for mode in ("batch_memcpy", "gather", "off"):
        extra = ["prefill.hit_copy=off"] if mode == "off" else [f"prefill.hit_copy={mode}"]
        eng = _engine(real_rows_ckpt, "cache.budget=1.0", *extra)
        _set_residency(eng, residency)
        eng.cache.reset()
        outs[mode], _ = eng.prefill(ids)
        st = eng.cache.stats()
        if mode == "off":
            assert st["total"]["bytes"]["prefill_full_h2d"] > 0
        else:
            assert st["hit_path"] == mode and st["hit_d2d_fallbacks"] == {}
            assert st["total"]["prefill_hits"] == round(residency * eng.store.num_experts) * len(eng.store.layers)
        del eng
        torch.cuda.empty_cache()
    # identical staging bytes and a deterministic compute (no float atomics): identical bits
    assert torch.equal(outs["batch_memcpy"], outs["off"])
    assert torch.equal(outs["gather"], outs["off"])


def test_no_fallback_event_after_a_warmed_up_prefill(real_rows_ckpt):
    buf = io.StringIO()
    log.configure("INFO", "json", stream=buf)
    eng = _engine(real_rows_ckpt, "cache.budget=0.5", "prefill.hit_copy=batch_memcpy", "prefill.warmup=true")
    eng.prefill(torch.randint(3, 150000, (1, 256)))
    events = [json.loads(x)["event"] for x in buf.getvalue().splitlines()]
    assert "prefill_hit_d2d_unavailable" not in events
    assert eng.cache.hit_path == "batch_memcpy" and eng.cache.stats()["hit_d2d_fallbacks"] == {}
