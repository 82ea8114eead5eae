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


@pytest.mark.parametrize("split_k", [2, 16, 64])
@pytest.mark.parametrize("shape", [(3, 1, 64), (2, 5, 128), (1, 192)])
def test_the_norm_also_writes_the_swapped_kernels_split_activations_bit_for_bit(split_k, shape):
    """``add_rms_norm_split``: ``add_rms_norm``'s outputs, and the normed rows in ``split_columns``' layout, the same
    bits as that copy (the swapped tile kernels' input); a chunk that does not divide H is refused by name."""
    from moe_offload.kernels.fused_moe_swap import split_columns
    from moe_offload.kernels.rmsnorm import add_rms_norm_split

    gen = torch.Generator().manual_seed(split_k + sum(shape))
    x, res = (torch.randn(*shape, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    w = torch.randn(shape[-1], generator=gen).to(DEVICE, torch.bfloat16)
    h, normed, split = add_rms_norm_split(x, res, w, 1e-6, "weight", split_k)
    want_h, want = add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(h, want_h) and torch.equal(normed, want)
    assert torch.equal(split, split_columns(want.reshape(-1, shape[-1]), split_k))
    assert add_rms_norm_split(x, res, w, 1e-6)[2] is None
    with pytest.raises(ValueError, match="split_k=48: must be a power of two >= 2 that divides H"):
        add_rms_norm_split(x, res, w, 1e-6, "weight", 48)


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

    # on the CPU even where CUDA exists: on CUDA the engine installs the fusions itself (no unfused baseline)
    cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "logging.level=WARNING", "dtype=float32",
                             "device=cpu", *extra])
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


# --- q/k norms + rotary + KV write in one launch (kernels/qk_norm_rope.py, integrations/fused_qkv.py) ---------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T, Hq, Hk, D, start", [(2, 1, 4, 2, 16, 5), (3, 4, 6, 2, 32, 0), (1, 3, 2, 1, 64, 30)])
def test_qk_norm_rope_write_is_the_three_kernels_in_a_row(dtype, B, T, Hq, Hk, D, start):
    """The same bits as rms_norm (q and k heads), apply_rotary and kv_write run one after the other, in fp32 and in
    bf16 (all four are Triton kernels here, so the interpreter's rounding is the same on both sides); a position
    past the cache's end is not written."""
    from moe_offload.kernels.kv_write import launch as kv_write_launch
    from moe_offload.kernels.qk_norm_rope import qk_norm_rope_write
    from moe_offload.kernels.rotary import apply_rotary

    gen = torch.Generator().manual_seed(B * 100 + T * 10 + D)
    y = torch.randn(B, T, (Hq + 2 * Hk) * D, generator=gen).to(DEVICE, dtype)
    wq, wk = (torch.randn(D, generator=gen).to(DEVICE, dtype) for _ in range(2))
    ang = torch.randn(B, T, D, generator=gen)
    cos, sin = ang.cos().to(DEVICE, dtype), ang.sin().to(DEVICE, dtype)
    R, P = B + 1, 32
    keys, values = (torch.full((R, Hk, P, D), -7.0, dtype=dtype, device=DEVICE) for _ in range(2))
    start_B = torch.tensor([start], device=DEVICE).expand(B)
    q = qk_norm_rope_write(y, (Hq, Hk), wq, wk, 1e-6, cos, sin, keys, values, start_B)

    qn = rms_norm(y[..., :Hq * D].view(B, T, Hq, D), wq, 1e-6).transpose(1, 2)
    kn = rms_norm(y[..., Hq * D:(Hq + Hk) * D].view(B, T, Hk, D), wk, 1e-6).transpose(1, 2)
    want_q, want_k = apply_rotary(qn, kn, cos, sin)
    want_keys, want_values = (torch.full_like(keys, -7.0) for _ in range(2))
    kv_write_launch(want_keys, want_values, want_k, y[..., (Hq + Hk) * D:].view(B, T, Hk, D).transpose(1, 2), start_B)
    assert torch.equal(q, want_q)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    assert (keys[B:] == -7.0).all() and (start + T <= P or (keys[:, :, P - 1] != -7.0).any())


def test_qk_norm_rope_write_names_what_does_not_fit():
    from moe_offload.kernels.qk_norm_rope import qk_norm_rope_write

    y = torch.zeros(2, 1, (4 + 4) * 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    cos = torch.ones(2, 1, 16, device=DEVICE)
    keys = torch.zeros(2, 2, 8, 16, device=DEVICE)
    start = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit"):
        qk_norm_rope_write(y, (4, 3), w, w, 1e-6, cos, cos, keys, keys.clone(), start)
    with pytest.raises(ValueError, match="cos/sin"):
        qk_norm_rope_write(y, (4, 2), w, w, 1e-6, cos[..., :8], cos[..., :8], keys, keys.clone(), start)
    with pytest.raises(ValueError, match="start"):
        qk_norm_rope_write(y, (4, 2), w, w, 1e-6, cos, cos, keys, keys.clone(), start[:1])
    with pytest.raises(ValueError, match="dtypes"):
        qk_norm_rope_write(y, (4, 2), w, w, 1e-6, cos, cos, keys.double(), keys.double(), start)


def test_a_qwen3_moe_model_with_fused_qk_norm_rope_gives_the_same_logits(tiny_ckpt, monkeypatch):
    """Prefill and decode steps over the decoder's static cache with the q/k norms, rotary and KV write in one kernel
    give the logits of the module's own forward (fp32, both with the fused q/k/v GEMM and RMSNorm kernel), and the
    kernel ran for every attention call after each layer's first."""
    from moe_offload.integrations.fused_qkv import fuse_qk_norm_rope, fuse_qkv
    from moe_offload.integrations.fused_norms import fuse_rms_norms
    from moe_offload.kernels import qk_norm_rope as qnr

    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    base = _engine(path)
    fuse_rms_norms(base.model)
    fuse_qkv(base.model)
    want = _decode_logits(base)

    eng = _engine(path)
    fuse_rms_norms(eng.model)
    fuse_qkv(eng.model)
    assert fuse_qk_norm_rope(eng.model) == len(eng.model.model.layers)
    assert torch.equal(_decode_logits(eng), want)  # CPU tensors: the module's own forward unless on_cpu
    calls = []
    kernel = qnr.qk_norm_rope_write
    monkeypatch.setattr(qnr, "qk_norm_rope_write", lambda *a: calls.append(a[0].shape[1]) or kernel(*a))
    eng2 = _engine(path)
    fuse_rms_norms(eng2.model)
    fuse_qkv(eng2.model)
    fuse_qk_norm_rope(eng2.model, on_cpu=True)
    got = _decode_logits(eng2)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    # the decoder's cache layers initialize on the prefill (module forward there); the 3 steps then run the kernel
    assert calls.count(1) == 3 * len(eng2.model.model.layers)


def test_experts_sharded_without_a_reduce_refuse_a_residual_and_the_layer_adds_it_after(tiny_ckpt, monkeypatch):
    """Experts sharded over ranks with no reduce of their own (a host reduces their partial sums) must not add the
    residual (it would be added once per rank): the call is refused by name, and the fused layer forward adds it
    after the block, as the layer itself does (same logits)."""
    from moe_offload.experts import offloaded_experts
    from moe_offload.integrations.fused_norms import fuse_residual_adds, fuse_rms_norms

    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    base = _engine(path)
    fuse_rms_norms(base.model)
    want = _decode_logits(base, 1)
    eng = _engine(path)
    fuse_rms_norms(eng.model)
    fuse_residual_adds(eng.model, on_cpu=True)
    experts = offloaded_experts(eng.model)
    monkeypatch.setattr(experts[0].cache.store, "tp_size", 2)  # fault injection: the shard count the checks read
    h = torch.randn(3, experts[0].cache.store.geometry.hidden)
    ids, w = torch.zeros(3, experts[0].top_k, dtype=torch.long), torch.full((3, experts[0].top_k), 0.5)
    with pytest.raises(ValueError, match="partial sum"):
        experts[0](h, ids, w, residual_TH=h)
    assert torch.equal(_decode_logits(eng, 1), want)
