"""On CUDA, in bf16: the decoder layers' residual adds fused into ``add_rms_norm`` and the MoE's sum over K give
the bits of the unfused adds (CUDA rounds to nearest as torch does, so bf16 is checked bit for bit here), the q/k
norms + rotary + KV write kernel gives the bits of the three kernels it replaces, and a whole model decodes to the
same logits with and without each fusion (graphs on).

Legend: T tokens, K top-k, H hidden.
"""

import pytest
import torch

from moe_offload.decode_graph import StaticDecoder
from moe_offload.kernels.rmsnorm import add_rms_norm, rms_norm
from test_decode_gpu import _engine, _run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_add_rms_norm_gives_the_bits_of_the_bf16_add_then_the_norm():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, res = (torch.randn(16, 1, 2048, device="cuda", generator=gen).bfloat16() for _ in range(2))
    w = torch.randn(2048, device="cuda", generator=gen).bfloat16()
    h, normed = add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(h, res + x) and torch.equal(normed, rms_norm(res + x, w, 1e-6))


@pytest.mark.parametrize("split_k", [128, 256])
def test_the_norms_split_activations_are_the_copys_bits_and_feed_the_swapped_tiles_unchanged(split_k):
    """``add_rms_norm_split`` at the real hidden size: the split rows are ``split_columns``' bits, and the swapped
    decode tiles give the same output from them as from their own copy."""
    from moe_offload.kernels.decode_moe import decode_moe_nvfp4
    from moe_offload.kernels.fused_moe_swap import split_columns
    from moe_offload.kernels.fused_moe_tuning import FusedMoeConfig, KernelTiles
    from moe_offload.kernels.rmsnorm import add_rms_norm_split
    from test_decode_moe import make_pool, routing

    T, K, N, H, I = 16, 8, 40, 2048, 128
    gen = torch.Generator(device="cuda").manual_seed(split_k)
    x, res = (torch.randn(T, H, device="cuda", generator=gen).bfloat16() for _ in range(2))
    w = torch.randn(H, device="cuda", generator=gen).bfloat16()
    h, normed, split = add_rms_norm_split(x, res, w, 1e-6, "weight", split_k)
    assert torch.equal(split, split_columns(normed, split_k))
    _, views = make_pool(N, H, I, seed=3)
    rows, weights = routing(T, K, N, "random", torch.Generator().manual_seed(4))
    config = FusedMoeConfig(16, KernelTiles(32, split_k, group_m=1, num_warps=2), KernelTiles(64, 128, group_m=1),
                            swap_ab=True)
    want = decode_moe_nvfp4(normed, rows, weights, views, config=config, residual_TH=h)
    assert torch.equal(decode_moe_nvfp4(normed, rows, weights, views, config=config, residual_TH=h, x_split=split,
                                        x_split_block_k=split_k), want)


def _same_bits_eager_and_replayed(run):
    """``run(True)`` (a launch that sums over K itself) equals ``run(False)`` (the sum launch) bit for bit, eagerly three
    times and replayed from a CUDA graph three times."""
    want = run(False)
    for _ in range(3):
        assert torch.equal(run(True), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.parametrize("T", [4, 16, 64])
def test_the_swapped_down_launchs_sum_over_k_gives_the_sum_launchs_bits_eager_and_replayed(T):
    """``sum_in_down`` at the real layer shape with the tuned swapped tiles: the programs of many CTAs race to store
    each token's terms; the last one sums them. The output equals the separate sum launch's bit for bit, eagerly
    three times and in a CUDA graph replayed three times (gate_up zeroes the counters on every replay)."""
    from moe_offload.kernels.decode_moe import DECODE_TUNING_PATH, decode_moe_nvfp4, load_tuning
    from test_decode_moe import layer_inputs

    K, N, H, I = 8, 96, 2048, 768
    config = load_tuning(DECODE_TUNING_PATH).lookup("NVIDIA H200", H, I, T * K)
    assert config.swap_ab
    views, hidden, residual, rows, weights = layer_inputs(T, K, N, H, I, "random", seed=T, residual=True)

    def run(fused):
        return decode_moe_nvfp4(hidden, rows, weights, views, config=config, residual_TH=residual, sum_in_down=fused)

    _same_bits_eager_and_replayed(run)


@pytest.mark.parametrize("T", [1, 2])
def test_the_gemv_pair_down_launchs_sum_over_k_gives_the_sum_launchs_bits_eager_and_replayed(T):
    """The GEMV's per-pair down summing over K itself (the last of a token's pair programs per column tile), at the
    real layer shape with the H100's T = 1 / 2 tiles (per-pair down): the sum launch's output bit for bit, eagerly three
    times and replayed three times."""
    from moe_offload.kernels.decode_gemv import decode_gemv_nvfp4
    from moe_offload.kernels.decode_gemv_tuning import load_gemv_tuning
    from test_decode_moe import layer_inputs

    K, N, H, I = 8, 24, 2048, 768
    config = load_gemv_tuning()["NVIDIA H100 80GB HBM3"]["H2048_I768"].config(T * K)
    assert config.down_per_pair
    views, hidden, residual, rows, weights = layer_inputs(T, K, N, H, I, "random", seed=20 + T, residual=True)

    def run(fused):
        return decode_gemv_nvfp4(hidden, rows, weights, views, config=config, residual_TH=residual, sum_in_down=fused)

    _same_bits_eager_and_replayed(run)


@pytest.mark.parametrize("kernel", ["tiles", "gemv", "gemv-pair-down"])
def test_the_decode_kernels_residual_add_gives_the_bits_of_the_layers_bf16_add(kernel):
    from moe_offload.kernels.decode_gemv import decode_gemv_nvfp4
    from moe_offload.kernels.decode_moe import decode_moe_nvfp4
    from test_decode_gemv import PAIR_DOWN
    from test_decode_moe import make_pool, routing

    T, K, N, H, I = 16, 8, 40, 256, 128
    _, views = make_pool(N, H, I, seed=1)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(T, H, generator=gen).cuda().bfloat16()
    residual = torch.randn(T, H, generator=gen).cuda().bfloat16()
    rows, weights = routing(T, K, N, "random", gen)
    fn, config = {"tiles": (decode_moe_nvfp4, None), "gemv": (decode_gemv_nvfp4, None),
                  "gemv-pair-down": (decode_gemv_nvfp4, PAIR_DOWN)}[kernel]
    plain = fn(hidden, rows, weights, views, config=config)
    assert torch.equal(fn(hidden, rows, weights, views, config=config, residual_TH=residual), residual + plain)


PROMPTS = [list(range(10, 42)), list(range(50, 82))]


@pytest.mark.parametrize("preset, part", [("tiny-qwen3-moe", "layer"), ("tiny-mixtral", "layer"),
                                          ("tiny-qwen3-moe", "self_attn")])
def test_a_model_with_each_fusion_decodes_to_the_bits_of_the_unfused_forward(tiny_ckpt, preset, part):
    """``layer``: the decoder layers' residual adds (fuse_residual_adds); ``self_attn``: the q/k norms + rotary + KV
    write kernel (fuse_qk_norm_rope). Removing that one per-instance forward leaves every other fusion in place."""
    path = tiny_ckpt(preset, "nvfp4-modelopt")
    fused = _engine(path, "cache.budget=0.37", "compute.fused_qk_rope=true")
    plain = _engine(path, "cache.budget=0.37", "compute.fused_qk_rope=true")
    for layer in plain.model.model.layers:
        module = layer if part == "layer" else layer.self_attn
        assert "forward" in vars(module)  # compute.fused_norms installed it
        del module.forward
    want = _run(StaticDecoder(plain, 2, 64, graphs=True), PROMPTS, 8)
    got = _run(StaticDecoder(fused, 2, 64, graphs=True), PROMPTS, 8)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"step {i} differs"


def test_qk_norm_rope_write_gives_the_bits_of_the_three_kernels_in_bf16():
    from moe_offload.kernels.kv_write import kv_write
    from moe_offload.kernels.qk_norm_rope import qk_norm_rope_write
    from moe_offload.kernels.rotary import apply_rotary

    B, T, Hq, Hk, D, P = 16, 1, 32, 4, 128, 1152  # Qwen3-30B-A3B's attention at a batch-16 decode step
    gen = torch.Generator(device="cuda").manual_seed(4)
    y = torch.randn(B, T, (Hq + 2 * Hk) * D, device="cuda", generator=gen).bfloat16()
    wq, wk = (torch.randn(D, device="cuda", generator=gen).bfloat16() for _ in range(2))
    ang = torch.randn(B, T, D, device="cuda", generator=gen)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    start = torch.tensor([1000], device="cuda").expand(B)
    keys, values = (torch.zeros(B, Hk, P, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = qk_norm_rope_write(y, (Hq, Hk), wq, wk, 1e-6, cos, sin, keys, values, start)
    qn = rms_norm(y[..., :Hq * D].view(B, T, Hq, D), wq, 1e-6).transpose(1, 2)
    kn = rms_norm(y[..., Hq * D:(Hq + Hk) * D].view(B, T, Hk, D), wk, 1e-6).transpose(1, 2)
    want_q, want_k = apply_rotary(qn, kn, cos, sin)
    want_keys, want_values = torch.zeros_like(keys), torch.zeros_like(values)
    kv_write(want_keys, want_values, want_k, y[..., (Hq + Hk) * D:].view(B, T, Hk, D).transpose(1, 2), start)
    assert torch.equal(q, want_q) and torch.equal(keys, want_keys) and torch.equal(values, want_values)
