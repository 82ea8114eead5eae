"""Bad input through the embedding API (an audit's findings): a named error, and the cache, decoder and store as
they were, so the next valid call gives what a fresh one gives."""

import numpy as np
import pytest
import torch

from moe_offload.cache import OffloadMoeCache
from moe_offload.config import CacheConfig, PrefillConfig
from moe_offload.decode_graph import StaticDecoder
from moe_offload.experts import offloaded_experts
from moe_offload.host_store import ExpertStore
from moe_offload.formats.base import FormatError

from test_decode_static import _engine


@pytest.fixture(scope="module")
def path(tiny_ckpt):
    return tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")


@pytest.fixture(scope="module")
def store(path):
    return ExpertStore.from_checkpoint(path, progress=False)


def _maps(cache):
    return cache.pool.residency_map().copy(), cache.pool.table_LE.clone(), cache.pool.owner_S.copy()


@pytest.mark.parametrize("bad, match", [
    ({0: [-1, 0]}, r"layer 0: expert ids \[-1\] are not integers in 0..15"),
    ({0: [16]}, r"expert ids \[16\]"),
    ({0: [1.5]}, r"expert ids \[1.5\]"),
    ({0: [2, 2]}, r"listed twice \[2\]"),
    ({99: [0]}, r"layer 99 is not a MoE layer"),
])
def test_set_residency_with_a_bad_id_or_layer_changes_nothing(store, bad, match):
    """Before: -1 wrapped to the last layer's expert 15 in the host map while the device table said otherwise (a
    prefill then read another layer's weights), and an unknown layer cleared the whole residency first."""
    cache = OffloadMoeCache(store, CacheConfig(budget="24 slots"), PrefillConfig(), "cpu")
    cache.set_residency({store.layers[0]: [1, 2], store.layers[-1]: [3]})
    before = _maps(cache)
    with pytest.raises(ValueError, match=match):
        cache.set_residency(bad)
    after = _maps(cache)
    assert np.array_equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert np.array_equal(before[2], after[2])


def test_a_commit_outside_the_layer_s_experts_changes_neither_map(store):
    cache = OffloadMoeCache(store, CacheConfig(budget="24 slots"), PrefillConfig(), "cpu")
    before = _maps(cache)
    with pytest.raises(ValueError, match="experts \\[16\\].*nothing committed"):
        cache.pool.commit_many([(store.layers[0], np.array([16]), [0])])  # would name layer 1's expert 0
    after = _maps(cache)
    assert np.array_equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_a_closed_cache_says_so_at_every_entry(store):
    cache = OffloadMoeCache(store, CacheConfig(budget="24 slots"), PrefillConfig(), "cpu")
    cache.close()
    ids = torch.zeros((1, store.geometry.top_k), dtype=torch.long)
    for call in (lambda: cache.set_residency({}), lambda: cache.decode_rows(store.layers[0], ids),
                 lambda: cache.stage_rows(store.layers[0]), lambda: cache.prefill_pass().__enter__()):
        with pytest.raises(RuntimeError, match="closed OffloadMoeCache"):
            call()


def test_the_decode_plan_takes_integer_2d_ids_of_a_known_layer(store):
    cache = OffloadMoeCache(store, CacheConfig(budget="24 slots"), PrefillConfig(), "cpu")
    K = store.geometry.top_k
    with pytest.raises(ValueError, match="an integer \\[T, K\\] tensor, got torch.float32"):
        cache.decode_rows(store.layers[0], torch.zeros((1, K)))  # 3.7 was truncated to 3 before
    with pytest.raises(ValueError, match="an integer \\[T, K\\] tensor, got torch.int64 of shape \\(4,\\)"):
        cache.decode_rows(store.layers[0], torch.zeros(K, dtype=torch.long))
    with pytest.raises(ValueError, match="layer 99 is not a MoE layer"):
        cache.decode_rows(99, torch.zeros((1, K), dtype=torch.long))


def test_a_put_that_fails_leaves_the_expert_as_it_was(store):
    fresh = ExpertStore(store.geometry, store.format, pin=False)
    layer = fresh.layers[0]
    tensors = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in fresh.specs}
    fresh.put(layer, 5, tensors)
    before = fresh.rows(layer)[5].clone()
    last = fresh.specs[-1].name
    bad = {**{k: torch.ones_like(v) for k, v in tensors.items()}, last: tensors[last].reshape(-1)[:1]}
    with pytest.raises(FormatError, match=f"bank {last}"):
        fresh.put(layer, 5, bad)
    assert torch.equal(fresh.rows(layer)[5], before)  # the earlier banks were written before (half an expert)
    with pytest.raises(FormatError, match="expert -1 of layer"):
        fresh.put(layer, -1, tensors)  # overwrote expert E-1 before


def test_a_decoder_step_or_prefill_that_fails_leaves_its_position_and_the_next_steps_as_a_fresh_one_s(path):
    eng = _engine(path, "cache.budget=1.0")
    prompt = torch.tensor([list(range(10, 20))])
    a, b = StaticDecoder(eng, 1, 64, graphs=False), StaticDecoder(eng, 1, 64, graphs=False)
    la, lb = a.prefill(prompt), b.prefill(prompt)
    with pytest.raises(ValueError, match=r"token ids \[320\] are outside the vocab"):
        b.step(torch.tensor([320]))  # before: an IndexError in the embedding after the position advanced
    with pytest.raises(ValueError, match="one integer token id per sequence"):
        b.step(torch.tensor([1.0]))
    assert b.length == a.length == 10
    for _ in range(3):
        la, lb = a.step(la.argmax(-1)), b.step(lb.argmax(-1))
        assert torch.equal(la, lb)
    c = StaticDecoder(eng, 1, 64, graphs=False)
    with pytest.raises(ValueError, match="a prefill of 2 sequences on a decoder of 1"):
        c.prefill(torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(ValueError, match="63 fit"):
        c.prefill(torch.zeros((1, 64), dtype=torch.long))
    assert c.length == 0


def test_generate_names_bad_prompt_ids_and_a_bad_max_new_tokens(path):
    eng = _engine(path, "cache.budget=1.0")
    for bad, match in (([5.9, 6.2], r"token ids \[5.9, 6.2\] are not integers"), ([5, 320], r"\[320\]"),
                       ([-1], r"\[-1\]"), ([], "non-empty")):
        with pytest.raises(ValueError, match=match):
            eng.generate(bad, 2)
    for bad in (0, -3, 2.5):  # 0 ran the default 16 tokens, -3 one, 2.5 three
        with pytest.raises(ValueError, match=f"max_new_tokens={bad!r}: an integer >= 1"):
            eng.generate([5, 6], bad)
    with pytest.raises(ValueError, match="exceed the model's 4096 positions"):
        eng.generate([5] * 4090, 10)
    assert eng.generate([5, 6, 7], 3).token_ids == _engine(path, "cache.budget=1.0").generate([5, 6, 7], 3).token_ids


def test_experts_called_with_ids_that_do_not_match_the_hidden_rows_are_refused(path):
    eng = _engine(path, "cache.budget=1.0")
    m = offloaded_experts(eng.model)[0]
    H, K = eng.model.config.hidden_size, eng.reader.geometry.top_k
    ids, w = torch.zeros((40, K), dtype=torch.long), torch.full((40, K), 1.0 / K)
    with pytest.raises(ValueError, match="must agree"):
        m(torch.randn(40, H), ids[:1], w[:1])  # returned [1, H] for 40 rows before
    with pytest.raises(ValueError, match="must agree"):
        m(torch.randn(2, H), ids[:2].float(), w[:2])


@pytest.mark.parametrize("kw, match", [({"decode_max_tokens": -4}, "decode_max_tokens=-4"),
                                       ({"decode_max_tokens": 0}, "decode_max_tokens=0"),
                                       ({"miss_copy": "bogus"}, "miss_copy='bogus'"),
                                       ({"decode_path": "fast"}, "decode_path='fast'"),
                                       ({"overlap_misses_from": -1}, "overlap_misses_from=-1")])
def test_a_cache_built_with_a_bad_argument_says_which(store, kw, match):
    """Before: decode_max_tokens=-4 built a cache with a threshold of -4, miss_copy='bogus' silently meant uva."""
    with pytest.raises(ValueError, match=match):
        OffloadMoeCache(store, CacheConfig(budget="24 slots"), PrefillConfig(), "cpu", **kw)


def test_a_decoder_of_no_rows_and_a_prefill_of_no_tokens_are_refused_by_name(path):
    eng = _engine(path, "cache.budget=1.0")
    for batch, max_len, match in ((0, 64, "batch=0"), (-1, 64, "batch=-1"), (1, -5, "max_len=-5")):
        with pytest.raises(ValueError, match=match):
            StaticDecoder(eng, batch, max_len, graphs=False)
    for bad in ([], [[]], [1.5, 2.5]):
        with pytest.raises(ValueError, match="prefill: token ids"):
            eng.prefill(bad)


def test_routed_fill_and_route_calls_with_bad_ids_or_logits_are_named(store):
    cache = OffloadMoeCache(store, CacheConfig(budget="1.0"), PrefillConfig(hit_copy="gather",
                                                                           routed_copy="copy_engine"), "cpu")
    cache.set_residency({layer: [0] for layer in store.layers})
    layer, K = store.layers[0], store.geometry.top_k
    with pytest.raises(ValueError, match=f"layer {layer}: routed expert ids include -1"):
        with cache.prefill_pass(routed_fills=True):
            cache.stage_rows(layer, torch.full((2, K), -1, dtype=torch.long))  # numpy's bincount message before
    with pytest.raises(ValueError, match="layer 99 is not a MoE layer"):
        cache.stage_rows(99)
    with pytest.raises(ValueError, match="layer 99 is not a MoE layer"):
        cache.decode.route(99, torch.zeros(1, store.num_experts), K, True, torch.float32)
    with pytest.raises(ValueError, match=r"exceeds the \d+ tokens this cache was sized for \(decode.max_tokens"):
        cache.decode.route(layer, torch.zeros(1000, store.num_experts), K, True, torch.float32)


def test_a_commit_to_a_slot_outside_the_pool_changes_neither_map(store):
    """The device table is written before the host map: a slot past the pool must be refused before either."""
    cache = OffloadMoeCache(store, CacheConfig(budget="4 slots"), PrefillConfig(), "cpu")
    before = _maps(cache)
    with pytest.raises(ValueError, match=r"slots \[7\] outside .* 0..3; nothing committed"):
        cache.pool.commit_many([(store.layers[0], np.array([3]), [7])])
    after = _maps(cache)
    assert np.array_equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_a_step_whose_boundary_fails_keeps_the_decoder_s_position(path, monkeypatch):
    eng = _engine(path, "cache.budget=1.0")
    dec = StaticDecoder(eng, 1, 64, graphs=False)
    logits = dec.prefill(torch.tensor([list(range(10, 20))]))

    def fail(*a, **k):  # fault injection: the model call of the step raises (e.g. a device OOM)
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(eng, "run_model", fail)
    with pytest.raises(torch.OutOfMemoryError):
        dec.step(logits.argmax(-1))
    assert dec.length == 10


def test_the_model_s_positions_count_an_extending_rope_scaling():
    """Qwen3-30B-A3B documents 131072 tokens with YaRN factor 4 over 32768: serve.max_model_len and the prompt
    checks must allow them when config.json says so, and only then."""
    from moe_offload.prompts import max_positions

    base = {"max_position_embeddings": 40960}
    assert max_positions(base) == 40960
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert max_positions({**base, "rope_scaling": yarn}) == 131072
    assert max_positions({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == 40960
    assert max_positions({**base, "rope_scaling": {"type": "linear", "factor": 2}}) == 81920
    assert max_positions({}) is None
