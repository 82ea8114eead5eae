"""Staged prefill vs routed-only copies per token count (moe_offload/prefill_path.py): the cost model's
choice, its data table, its resolution per cache, and equal outputs on both paths."""

import io
import json

import pytest
import torch

from moe_offload import log
from moe_offload.cache import OffloadMoeCache
from moe_offload.config import ROUTED_MAX_TOKENS_LIMIT, CacheConfig, ConfigError, PrefillConfig, load_config
from moe_offload.engine import Engine
from moe_offload.host_store import ExpertStore
from moe_offload.prefill_path import DEFAULT, TABLE_PATH, cost_model, load_table, resolve, shape_key

H200 = "NVIDIA H200"
QWEN3 = (128, 8, 2658304)  # experts, top-k, NVFP4 row bytes (padded to a page) of the qwen3-30b-a3b preset
FLASH_NEXT = (512, 10, 2768896)


def _routed_prefers(model, T, shape, resident):
    E, K, R = shape
    return model.routed_s(T, E, K, R, resident) < model.staged_s(T, E, K, R, resident)


def test_the_h200_model_routes_one_token_and_stages_1024_tokens_for_qwen3_at_residency_037():
    model, entry = cost_model(H200, *QWEN3)
    assert entry == f"{H200}/{shape_key(*QWEN3)}"
    assert _routed_prefers(model, 1, QWEN3, 0.37)
    assert not _routed_prefers(model, 1024, QWEN3, 0.37)


@pytest.mark.parametrize("shape", [QWEN3, FLASH_NEXT], ids=["qwen3", "flash-next"])
@pytest.mark.parametrize("resident", [0.0, 0.37, 0.5, 0.75])
def test_the_choice_is_monotone_in_tokens_routed_up_to_the_threshold_and_staged_beyond(shape, resident):
    model, _ = cost_model(H200, *shape)
    T_max = model.threshold(*shape, resident, ROUTED_MAX_TOKENS_LIMIT)
    chosen = [T <= T_max for T in range(1, 1025)]
    assert chosen == sorted(chosen, reverse=True)  # a prefix of routed, then staged: one crossover
    assert all(_routed_prefers(model, T, shape, resident) for T in range(1, T_max + 1))
    assert 1 <= T_max <= model.max_tokens  # never extrapolated past the measured token counts


def test_more_experts_keep_the_routed_path_longer_because_fewer_of_them_are_routed():
    qwen3, _ = cost_model(H200, *QWEN3)
    flash, _ = cost_model(H200, *FLASH_NEXT)
    assert flash.threshold(*FLASH_NEXT, 0.37, 4096) > 2 * qwen3.threshold(*QWEN3, 0.37, 4096)


def test_an_unknown_gpu_uses_the_documented_default_entry():
    _, entry = cost_model("Some Future GPU", *QWEN3)
    assert entry == f"{DEFAULT}/{DEFAULT}"
    assert "Unknown GPU" in load_table()[DEFAULT][DEFAULT]["why"]


def test_every_table_entry_says_where_its_numbers_came_from():
    for device, shapes in load_table().items():
        for key, entry in shapes.items():
            assert entry.get("sources"), f"{device}/{key} has no sources"


def test_a_table_entry_missing_a_constant_is_a_named_error(tmp_path):
    table = json.loads(TABLE_PATH.read_text())
    del table["devices"][DEFAULT][DEFAULT]["uva_GBps"]
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps(table))
    with pytest.raises(ValueError, match="uva_GBps"):
        load_table(bad)


def test_auto_on_a_cpu_keeps_the_decode_cap_and_says_why():
    choice = resolve("auto", 16, *QWEN3, 0.37, torch.device("cpu"), fused_decode=True)
    assert (choice.max_tokens, choice.reason) == (16, "cpu_device")


def test_auto_on_cuda_takes_the_cost_models_threshold(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H200)
    choice = resolve("auto", 16, *QWEN3, 0.37, torch.device("cuda", 0), fused_decode=True)
    model, _ = cost_model(H200, *QWEN3)
    assert choice.reason == "cost_model" and choice.model_tokens == model.threshold(*QWEN3, 0.37, 4096)
    assert choice.max_tokens == max(16, choice.model_tokens)
    assert choice.entry == f"{H200}/{shape_key(*QWEN3)}"


def test_auto_with_the_unfused_decode_compute_keeps_the_decode_cap(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H200)
    choice = resolve("auto", 16, *FLASH_NEXT, 0.37, torch.device("cuda", 0), fused_decode=False)
    assert (choice.max_tokens, choice.reason) == (16, "row_gather_decode")


def test_an_integer_below_the_decode_cap_keeps_the_decode_cap():
    assert resolve(4, 16, *QWEN3, 0.5, torch.device("cpu"), True).max_tokens == 16
    assert resolve(40, 16, *QWEN3, 0.5, torch.device("cpu"), True).max_tokens == 40


@pytest.mark.parametrize("value", ["-1", str(ROUTED_MAX_TOKENS_LIMIT + 1), "true", "fast"])
def test_a_bad_routed_max_tokens_is_a_config_error_naming_the_key(value):
    with pytest.raises(ConfigError, match="prefill.routed_max_tokens"):
        load_config(None, [f"prefill.routed_max_tokens={value}"])


def test_old_configs_load_with_routed_max_tokens_auto():
    assert load_config(None).prefill.routed_max_tokens == "auto"


@pytest.fixture(scope="module")
def store(tiny_ckpt):
    return ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)


@pytest.mark.parametrize("routed, rows", [(0, 4), (2, 8), (3, 12), (100, 16)])  # K = 4, E = 16
def test_the_cache_sizes_its_scratch_rows_from_the_chosen_threshold(store, routed, rows):
    cache = OffloadMoeCache(store, CacheConfig(budget=0.5), PrefillConfig(routed_max_tokens=routed), "cpu",
                            decode_max_tokens=1)
    assert cache.routed_max_tokens == max(routed, 1)
    assert cache.plan.scratch_rows == rows  # min(threshold * K, E)
    assert cache.decode_num_rows == cache.num_slots + rows


def test_the_choice_is_one_structured_event_and_is_reported_in_stats(store):
    buf = io.StringIO()
    log.configure("INFO", "json", stream=buf)
    try:
        cache = OffloadMoeCache(store, CacheConfig(budget=0.5), PrefillConfig(routed_max_tokens=40), "cpu")
    finally:
        log.configure("WARNING", "text")
    events = [r for r in map(json.loads, buf.getvalue().splitlines()) if r["event"] == "prefill_path_chosen"]
    assert len(events) == 1
    assert events[0]["routed_max_tokens"] == 40 and events[0]["change_with"] == "prefill.routed_max_tokens"
    assert cache.stats()["routed_path"]["max_tokens"] == 40


def _engine(path, *extra):
    cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "device=cpu", "cache.budget=0.37",
                             "prefill.hit_copy=gather", "logging.level=WARNING", *extra])
    return Engine.from_config(cfg, progress=False)


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    """The same tiny model: every forward above decode.max_tokens staged, and routed up to 100 tokens."""
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    return _engine(path, "prefill.routed_max_tokens=0"), _engine(path, "prefill.routed_max_tokens=100")


@pytest.mark.parametrize("T, routed", [(8, True), (40, True), (100, True), (101, False), (300, False)])
def test_a_forward_takes_the_routed_path_up_to_the_threshold_and_stages_beyond(engines, T, routed):
    _, eng = engines
    eng.cache.reset()
    eng.prefill(torch.randint(3, 300, (1, T), generator=torch.Generator().manual_seed(T)))
    st = eng.cache.stats()
    assert (st["decode_steps"], st["prefills"]) == ((1, 0) if routed else (0, 1))


@pytest.mark.parametrize("T", [40, 100, 300])
def test_logits_agree_between_the_staged_and_the_routed_engine_below_and_above_the_threshold(engines, T):
    staged, routed = engines
    ids = torch.randint(3, 300, (1, T), generator=torch.Generator().manual_seed(T))
    want, _ = staged.prefill(ids)
    got, _ = routed.prefill(ids)
    # fp32 on the CPU: the routed path computes each (token, expert) pair on its own gathered rows, the
    # staged path groups tokens per expert; the same sums in another order. 1e-4 is the oracle tests'
    # tolerance (tests/test_oracle.py): ~100x that noise, far below a wrong expert (> 1e-2)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("prompt_len", [40, 120])
def test_greedy_tokens_are_equal_on_both_paths(engines, prompt_len):
    staged, routed = engines
    prompt = list(range(10, 10 + prompt_len))
    assert routed.generate(prompt, 12).token_ids == staged.generate(prompt, 12).token_ids


def test_the_h200_entries_are_what_the_fit_script_makes_of_the_committed_results():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("fit_prefill_path", root / "benchmarks" / "fit_prefill_path.py")
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    dk = root / "benchmarks/results/decode_kernels-c6e05d5-h200-20261202-2054.json"
    fm = root / "benchmarks/results/fused_moe-20261202-1000.json"
    gpu, entries = fit.fit(json.loads(dk.read_text()), json.loads(fm.read_text()),
                           f"benchmarks/results/{dk.name}", f"benchmarks/results/{fm.name}")
    assert gpu == H200
    assert entries == json.loads(TABLE_PATH.read_text())["devices"][H200]


# ------------------------------------------------------------------ decode.path: auto (large decode batches staged)
def _resolve_on_h200(monkeypatch, decode_max_tokens, decode_path, resident=0.37, setting="auto"):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H200)  # the table's entry, no GPU needed
    return resolve(setting, decode_max_tokens, *QWEN3, resident, torch.device("cuda", 0), True, decode_path)


def test_decode_path_routed_keeps_decode_max_tokens_as_the_floor_and_auto_lets_the_model_stage_64_row_steps(monkeypatch):
    model, _ = cost_model(H200, *QWEN3)
    chosen = model.threshold(*QWEN3, 0.37, ROUTED_MAX_TOKENS_LIMIT)
    assert 1 <= chosen < 64  # the H200 constants: a 64-row step at residency 0.37 is cheaper staged
    assert not _routed_prefers(model, 64, QWEN3, 0.37)
    assert _resolve_on_h200(monkeypatch, 64, "routed").max_tokens == 64
    auto = _resolve_on_h200(monkeypatch, 64, "auto")
    assert (auto.max_tokens, auto.model_tokens, auto.decode_path) == (chosen, chosen, "auto")
    # all resident: nothing to copy, the routed path stays cheaper through the measured 64 tokens
    assert _resolve_on_h200(monkeypatch, 64, "auto", resident=1.0).max_tokens == 64


def test_decode_path_auto_honours_a_setting_below_decode_max_tokens_but_never_below_one(monkeypatch):
    assert _resolve_on_h200(monkeypatch, 16, "auto", setting=4).max_tokens == 4
    assert _resolve_on_h200(monkeypatch, 16, "auto", setting=0).max_tokens == 1
    assert _resolve_on_h200(monkeypatch, 16, "routed", setting=4).max_tokens == 16


def test_decode_path_auto_without_a_cost_model_keeps_decode_max_tokens(store):
    cache = OffloadMoeCache(store, CacheConfig(budget=0.5), PrefillConfig(), "cpu", decode_max_tokens=8,
                            decode_path="auto")
    assert cache.routed_max_tokens == 8 and cache.routed_path.reason == "cpu_device"


@pytest.fixture(scope="module")
def batch_engines(tiny_ckpt):
    """decode.max_tokens 8 on both; decode.path routed (4-row steps routed) and auto with the threshold set
    to 2 (4-row steps staged, as the cost model stages 64-row steps at low residency on the H200)."""
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    return (_engine(path, "decode.max_tokens=8", "prefill.routed_max_tokens=2"),
            _engine(path, "decode.max_tokens=8", "prefill.routed_max_tokens=2", "decode.path=auto"))


def test_decode_steps_above_the_auto_threshold_are_staged_and_give_the_routed_steps_greedy_tokens(batch_engines):
    routed, auto = batch_engines
    assert (routed.cache.routed_max_tokens, auto.cache.routed_max_tokens) == (8, 2)
    prompts = [list(range(10 + 7 * b, 50 + 7 * b)) for b in range(4)]  # 4 rows of 40 tokens
    for eng in batch_engines:
        eng.cache.reset()
    want = [r.token_ids for r in routed.generate_batch(prompts, 10)]
    st_routed = routed.cache.stats()
    got = [r.token_ids for r in auto.generate_batch(prompts, 10)]
    st_auto = auto.cache.stats()
    assert got == want
    # routed: 9 decode steps of 4 rows on the routed path, 1 staged prefill; auto: all 10 forwards staged
    assert (st_routed["decode_steps"], st_routed["prefills"]) == (9, 1)
    assert (st_auto["decode_steps"], st_auto["prefills"]) == (0, 10)
    # a one-row step is still routed under auto
    auto.cache.reset()
    auto.generate(prompts[0], 4)
    assert auto.cache.stats()["decode_steps"] == 3


def test_decode_path_is_validated_by_name():
    with pytest.raises(ConfigError, match="decode.path"):
        load_config(None, ["decode.path=staged"])
    assert load_config(None).decode.path == "host"  # routed or auto by this host's link (test_routed_fills.py)
