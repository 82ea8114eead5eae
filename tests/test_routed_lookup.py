"""``decode_path.routed_lookup``: a decode boundary's host lookup of the last step's routing against the slot map
(one numpy pass over every layer; the admissions and the policy's touches follow its order)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_offload.decode_path import routed_lookup


def _reference(record_LTK, tokens, slot_of_LE):
    """Per layer, in layer order: the distinct routed experts ascending (np.unique), split by residency."""
    hits, misses = [], []
    for lp in sorted(tokens):
        experts = np.unique(record_LTK[lp, :tokens[lp]])
        slots = slot_of_LE[lp, experts]
        hits.append(slots[slots >= 0].tolist())
        misses.append(experts[slots < 0].tolist())
    return hits, misses


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_the_mask_lookup_gives_each_layers_distinct_experts_in_the_order_of_a_sorted_unique(data):
    L, E, K, T = (data.draw(st.integers(1, n)) for n in (6, 24, 4, 5))
    seed = data.draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    record = rng.integers(0, E, (L, T + 2, K)).astype(data.draw(st.sampled_from([np.int32, np.int64])))
    slot_of_LE = np.where(rng.random((L, E)) < 0.5, rng.permutation(L * E).reshape(L, E), -1)
    layers = data.draw(st.lists(st.integers(0, L - 1), min_size=1, unique=True))
    tokens = {lp: data.draw(st.integers(1, T)) for lp in layers}  # shorter forwards leave some layers' rows stale
    lps, slots_LE, hit_LE, miss_LE = routed_lookup(record, tokens, slot_of_LE)
    want_hits, want_misses = _reference(record, tokens, slot_of_LE)
    assert lps.tolist() == sorted(tokens)
    assert slots_LE[hit_LE].tolist() == [s for h in want_hits for s in h]  # the touch order: layers, experts ascending
    assert [np.flatnonzero(row).tolist() for row in miss_LE] == want_misses
    assert [slots_LE[i][hit_LE[i]].tolist() for i in range(len(lps))] == want_hits
    slots_LE[:] = -7  # a copy: the pool's map is not written
    assert (slot_of_LE != -7).all()
