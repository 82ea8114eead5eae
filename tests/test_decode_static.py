"""The static-cache decoder (the graph path's eager twin on CPU) and the sync-free decode path agree
with the dynamic-cache path and with plain transformers."""

import pytest
import torch

from moe_offload.config import load_config
from moe_offload.decode_graph import StaticDecoder
from moe_offload.engine import Engine


def _engine(path, *extra):
    cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "logging.level=WARNING", *extra])
    return Engine.from_config(cfg, progress=False)


def _static_greedy(eng, prompt, n):
    dec = StaticDecoder(eng, 1, 64, graphs=False)
    logits = dec.prefill(torch.tensor([prompt]))
    out = []
    for _ in range(n):
        tok = logits.argmax(-1)
        out.append(int(tok))
        logits = dec.step(tok)
    return out


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_static_cache_decoding_gives_the_dynamic_cache_tokens(tiny_ckpt, preset):
    eng = _engine(tiny_ckpt(preset, "nvfp4-modelopt"), "cache.budget=0.37")
    prompt = list(range(10, 30))
    want = eng.generate(prompt, 12).token_ids
    assert _static_greedy(eng, prompt, 12) == want


@pytest.mark.parametrize("write", ["reference", "kernel"])
@pytest.mark.parametrize("chunk", [1024, 16])
def test_shared_start_layers_give_the_bits_of_transformers_static_layers(tiny_ckpt, monkeypatch, write, chunk):
    """The decoder's attention layers write through one shared device start (kernels/kv_write.py) instead
    of StaticLayer's own counter and two index copies: prefill (whole, or in chunks starting past 0) and
    steps give the same logits, bitwise, with the torch write (CPU) and with the Triton kernel (interpreted)."""
    from transformers import StaticCache

    from moe_offload.decode_graph import SharedStartLayer
    from moe_offload.kernels import kv_write as kw

    if write == "kernel":
        monkeypatch.setattr(kw, "kv_write_reference", kw.launch)
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "bf16"), f"prefill.chunk_tokens={chunk}")
    ours, theirs = StaticDecoder(eng, 2, 48, graphs=False), StaticDecoder(eng, 2, 48, graphs=False)
    assert all(type(layer) is SharedStartLayer for layer in ours.kv.layers)
    theirs.kv = StaticCache(config=eng.model.config, max_cache_len=48)
    windowed = StaticDecoder(eng, 2, 48, graphs=False)
    ours._windowed = []  # attention over the whole cache, as StaticLayer's: the write is what differs
    prompts = torch.tensor([list(range(7, 26)), list(range(60, 79))])
    a, b = ours.prefill(prompts), theirs.prefill(prompts)
    # a prefill's attention over the positions filled so far (SharedStartLayer.window): the same logits up to
    # the order of the softmax sums
    torch.testing.assert_close(windowed.prefill(prompts), b, atol=1e-5, rtol=1e-5)
    for _ in range(4):
        assert torch.equal(a, b)  # the same ops but the cache write, which is a copy: bitwise
        tok = a.argmax(-1)
        a, b = ours.step(tok), theirs.step(tok)
    assert torch.equal(a, b)
    for mine, ref in zip(ours.kv.layers, theirs.kv.layers):
        assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)
    assert int(ours.kv.get_seq_length()) == 19 + 3  # the start of the last step: what was cached before it
    with pytest.raises(NotImplementedError, match="crop"):
        ours.kv.layers[0].crop(-1)


def test_a_reset_decoder_serves_the_next_request_from_position_zero(tiny_ckpt):
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "bf16"))
    dec = StaticDecoder(eng, 1, 64, graphs=False)
    first = dec.prefill(torch.tensor([list(range(5, 25))])).clone()
    dec.step(first.argmax(-1))
    dec.reset()
    again = dec.prefill(torch.tensor([list(range(5, 25))]))
    torch.testing.assert_close(again, first, atol=0, rtol=0)  # same cache, same positions: bitwise


def test_batched_generation_gives_each_sequence_its_single_sequence_tokens(tiny_ckpt):
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-ct"), "cache.budget=0.25")
    prompts = [list(range(3, 19)), list(range(40, 56)), list(range(100, 116))]
    alone = [eng.generate(p, 10).token_ids for p in prompts]
    together = [r.token_ids for r in eng.generate_batch(prompts, 10)]
    assert together == alone


def test_prompts_of_different_lengths_are_refused_with_the_lengths(tiny_ckpt):
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "bf16"))
    with pytest.raises(ValueError, match=r"\[3, 4\]"):
        eng.generate_batch([[5, 6, 7], [5, 6, 7, 8]], 4)


def test_a_second_thread_gets_a_clear_error_instead_of_sharing_the_engine(tiny_ckpt):
    import threading

    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "bf16"))
    started, release = threading.Event(), threading.Event()

    def hold(t):  # streaming callback: keeps the first thread inside generate
        started.set()
        release.wait(30)

    t = threading.Thread(target=lambda: eng.generate(list(range(5, 15)), 3, on_token=hold))
    t.start()
    assert started.wait(60)
    try:
        with pytest.raises(RuntimeError, match="another thread"):
            eng.generate(list(range(5, 15)), 2)
    finally:
        release.set()
        t.join(60)
    assert eng.generate(list(range(5, 15)), 2).token_ids  # free again once the first call returned
