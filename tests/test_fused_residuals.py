"""The decoder layers' residual adds fused into their neighbours' launches: ``add_rms_norm`` (kernels/rmsnorm.py),
the MoE's sum over K with the residual (kernels/moe_sum.py, used by decode_moe and decode_gemv) and the layer
forward that uses both (integrations/fused_norms.py ``fuse_residual_adds``).

Legend: T tokens, K top-k, H hidden.
Without CUDA the kernels run in the Triton interpreter on CPU tensors. The interpreter truncates fp32 -> bf16 where
CUDA rounds to nearest, so bit-for-bit claims are checked in fp32 here (and in bf16 by the GPU tests).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from moe_offload.kernels.moe_sum import sum_pairs  # noqa: E402
from moe_offload.kernels.rmsnorm import add_rms_norm, rms_norm, rms_norm_reference  # noqa: E402
from test_decode_moe import DEVICE, make_pool, routing  # noqa: E402


@pytest.mark.parametrize("scale", ["weight", "one_plus_weight"])
@pytest.mark.parametrize("shape", [(3, 1, 64), (2, 5, 48), (7, 33)])
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(scale, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x, res = (torch.randn(*shape, generator=gen).to(DEVICE) for _ in range(2))
    w = torch.randn(shape[-1], generator=gen).to(DEVICE)
    h, normed = add_rms_norm(x, res, w, 1e-6, scale)
    assert torch.equal(h, res + x)
    assert torch.equal(normed, rms_norm(res + x, w, 1e-6, scale))
    torch.testing.assert_close(normed, rms_norm_reference(res + x, w, 1e-6, scale), atol=1e-5, rtol=1e-5)


def test_add_rms_norm_reads_strided_rows_and_names_mismatches():
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 2, 96, generator=gen).to(DEVICE)
    x = wide[..., 16:80]  # rows with a stride of 96: read in place
    res = torch.randn(4, 2, 64, generator=gen).to(DEVICE)
    w = torch.randn(64, generator=gen).to(DEVICE)
    h, normed = add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(h, res + x) and torch.equal(normed, rms_norm(res + x, w, 1e-5))
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, res[:, :1], w, 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, res.double(), w, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, res, w[:32], 1e-5)
    h, normed = add_rms_norm(x[:0], res[:0], w, 1e-5)
    assert h.shape == normed.shape == (0, 2, 64)


@pytest.mark.parametrize("T, K, H", [(1, 8, 48), (5, 3, 80), (4, 1, 32)])
def test_the_pair_sum_adds_the_residual_as_the_layer_does(T, K, H):
    gen = torch.Generator().manual_seed(T * K)
    part = torch.randn(T * K, H, generator=gen).to(DEVICE)
    res = torch.randn(T, H, generator=gen).to(DEVICE)
    plain = sum_pairs(part, K, torch.empty(T, H, device=DEVICE))
    # fixed order k = 0..K-1 in fp32
    want = part.view(T, K, H)[:, 0].clone()
    for k in range(1, K):
        want += part.view(T, K, H)[:, k]
    assert torch.equal(plain, want)
    assert torch.equal(sum_pairs(part, K, torch.empty(T, H, device=DEVICE), res), res + plain)


def _moe_case(T, K, N, H, I, seed):
    _, views = make_pool(N, H, I, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE)
    rows, weights = routing(T, K, N, "random", gen)
    residual = torch.randn(T, H, generator=gen).to(DEVICE)
    return hidden, rows, weights, views, residual


@pytest.mark.parametrize("kernel", ["tiles", "tiles-swap", "gemv", "gemv-pair-down"])
@pytest.mark.parametrize("T, K", [(1, 8), (5, 3), (3, 1)])
def test_the_decode_kernels_add_the_residual_in_their_last_launch(kernel, T, K):
    """decode_moe / decode_gemv with ``residual_TH``: the output is ``residual + (their output without it)``,
    bit for bit (fp32 here: the interpreter's bf16 rounding is not CUDA's)."""
    from moe_offload.kernels.decode_gemv import decode_gemv_nvfp4
    from moe_offload.kernels.decode_moe import decode_moe_nvfp4
    from test_decode_gemv import PAIR_DOWN, PER_PAIR
    from test_decode_moe import SMALL, SWAP

    fn, config = {"tiles": (decode_moe_nvfp4, SMALL), "tiles-swap": (decode_moe_nvfp4, SWAP),
                  "gemv": (decode_gemv_nvfp4, PER_PAIR), "gemv-pair-down": (decode_gemv_nvfp4, PAIR_DOWN)}[kernel]
    hidden, rows, weights, views, residual = _moe_case(T, K, max(K, 4) + 2, 32, 32, seed=T + K)
    plain = fn(hidden, rows, weights, views, config=config)
    fused = fn(hidden, rows, weights, views, config=config, residual_TH=residual)
    assert torch.equal(fused, residual + plain)
    assert not torch.equal(fused, plain)


def test_a_residual_of_the_wrong_shape_or_dtype_is_named():
    from moe_offload.kernels.decode_moe import decode_moe_nvfp4

    hidden, rows, weights, views, residual = _moe_case(2, 2, 4, 32, 32, seed=5)
    with pytest.raises(ValueError, match="residual_TH must be"):
        decode_moe_nvfp4(hidden, rows, weights, views, residual_TH=residual[:1])
    with pytest.raises(ValueError, match="residual_TH is"):
        decode_moe_nvfp4(hidden, rows, weights, views, residual_TH=residual.double())


def _engine(path, *extra):
    from moe_offload.config import load_config
    from moe_offload.engine import Engine

    cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "logging.level=WARNING", "dtype=float32",
                             *extra])
    return Engine.from_config(cfg, progress=False)


def _decode_logits(eng, steps=3):
    from moe_offload.decode_graph import StaticDecoder

    dec = StaticDecoder(eng, 2, 40, graphs=False)
    logits = [dec.prefill(torch.tensor([list(range(7, 26)), list(range(60, 79))]))]
    for _ in range(steps):
        logits.append(dec.step(logits[-1].argmax(-1)))
    return torch.stack(logits)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_fused_residual_layers_give_the_bits_of_the_layers_own_forward(tiny_ckpt, monkeypatch, preset):
    """A whole model (prefill of two prompts, then decode steps on the sync-free path) with every decoder layer's
    residual adds fused gives the logits of the same model with the layers' own forward, bit for bit (fp32; both
    with the fused RMSNorm kernel, so only the residual fusion differs), and the MoE calls receive the residual."""
    from moe_offload.experts import OffloadedExperts
    from moe_offload.integrations.fused_norms import fuse_residual_adds, fuse_rms_norms

    path = tiny_ckpt(preset, "nvfp4-modelopt")
    base = _engine(path, "cache.budget=0.37")
    fuse_rms_norms(base.model)
    want = _decode_logits(base)

    eng = _engine(path, "cache.budget=0.37")
    fuse_rms_norms(eng.model)
    assert fuse_residual_adds(eng.model) == len(eng.model.model.layers)
    seen = []
    forward = OffloadedExperts.forward

    def spy(self, hidden_TH, top_k_index, top_k_weights, residual_TH=None):
        seen.append((hidden_TH.shape[0], residual_TH is not None))
        return forward(self, hidden_TH, top_k_index, top_k_weights, residual_TH)

    monkeypatch.setattr(OffloadedExperts, "forward", spy)
    # on CPU tensors the fused forward stands aside unless asked (its kernels run only in the interpreter here)
    assert torch.equal(_decode_logits(eng), want) and not any(r for _, r in seen)
    eng2 = _engine(path, "cache.budget=0.37")
    fuse_rms_norms(eng2.model)
    fuse_residual_adds(eng2.model, on_cpu=True)
    seen.clear()  # the engine's own warmup forwards ran before the fusion
    got = _decode_logits(eng2)
    assert torch.equal(got, want)
    assert seen and all(r for _, r in seen)  # every MoE call, prefill (19 x 2 tokens) and decode (2), got it
    assert {t for t, _ in seen} == {38, 2}, seen
