"""Config tree: YAML + --set, named errors, budgets."""

import pytest

from moe_offload.config import Budget, ConfigError, load_config, parse_bytes


def test_embedded_default_loads_from_any_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config()
    assert cfg.model.preset == "tiny-qwen3-moe"


def test_unknown_key_is_named_with_the_accepted_keys(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("cache:\n  polcy: lru\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "cache.polcy" in msg and "budget" in msg and "policy" in msg and str(p) in msg


def test_bad_value_names_key_value_and_accepted_values():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["prefill.hit_copy=fastest"])
    msg = str(e.value)
    assert "prefill.hit_copy" in msg and "fastest" in msg and "batch_memcpy" in msg


def test_out_of_range_value_is_rejected():
    with pytest.raises(ConfigError, match="decode.max_tokens"):
        load_config(None, ["decode.max_tokens=0"])


def test_set_overrides_are_typed():
    cfg = load_config(None, ["prefill.overlap=false", "decode.max_new_tokens=5", "cache.budget=12GiB"])
    assert cfg.prefill.overlap is False and cfg.decode.max_new_tokens == 5
    assert cfg.cache.budget == Budget(kind="bytes", value=12 * 2**30)


@pytest.mark.parametrize("raw,kind,value", [
    (0.37, "fraction", 0.37), ("37%", "fraction", 0.37), ("300 slots", "slots", 300.0),
    ("auto", "auto", 0.0), ("1.5GB", "bytes", 1.5e9), (1, "fraction", 1.0),
])
def test_budget_forms_parse(raw, kind, value):
    b = Budget.parse(raw)
    assert b.kind == kind and b.value == pytest.approx(value)


@pytest.mark.parametrize("raw", [0, 1.5, "lots", "-3 slots", True])
def test_bad_budgets_say_what_is_accepted(raw):
    with pytest.raises(ValueError):
        Budget.parse(raw)


def test_bad_budget_in_config_is_a_named_error():
    with pytest.raises(ConfigError, match="cache.budget"):
        load_config(None, ["cache.budget=2.5"])


def test_parse_bytes_units():
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2kb") == 2000


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_the_embedded_default_detects_the_checkpoint_format():
    # a checkpoint passed with --checkpoint / model.checkpoint must not need --set model.format=...
    assert load_config().model.format == "auto"


def test_config_and_the_checkpoint_writer_share_one_preset_table():
    from moe_offload import config, presets
    from moe_offload.checkpoint import synthetic

    assert config.PRESETS == tuple(presets.PRESETS) and synthetic.PRESETS is presets.PRESETS


def test_the_deprecated_hit_d2d_switch_still_turns_the_hit_copy_off_with_one_event():
    import io
    import json

    from moe_offload import log

    buf = io.StringIO()
    log.configure("INFO", "json", stream=buf)
    cfg = load_config(None, ["prefill.hit_d2d=false"])  # the embedded file says hit_copy: auto
    assert cfg.prefill.hit_copy == "off"
    events = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [e["old_key"] for e in events if e["event"] == "config_key_deprecated"] == ["prefill.hit_d2d"]


def test_a_serve_section_is_part_of_the_config_tree(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("serve:\n  max_batch: 8\n  max_queue: 3\n")
    cfg = load_config(f, ["serve.model_name=mine"])
    assert (cfg.serve.max_batch, cfg.serve.max_queue, cfg.serve.model_name) == (8, 3, "mine")
    with pytest.raises(ConfigError, match="serve.max_batch"):
        load_config(None, ["serve.max_batch=0"])


@pytest.mark.parametrize("key", ["model.checkpoint", "model.cache_dir"])
def test_an_empty_path_is_refused_by_name_not_read_as_the_default(key):
    """An unset shell variable (--checkpoint "$DIR") must not silently run the synthetic preset."""
    with pytest.raises(ConfigError, match=f"{key}.*an empty path"):
        load_config(None, [f"{key}="])
    with pytest.raises(ConfigError, match=f"{key}.*an empty path"):
        load_config(None, [f'{key}="  "'])


def test_a_set_value_that_is_not_yaml_and_a_config_that_is_not_utf8_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"--set 'cache.budget=\[1,': the value is not valid YAML"):
        load_config(None, ["cache.budget=[1,"])
    p = tmp_path / "latin1.yaml"
    p.write_bytes("cache:\n  policy: lru # d\xe9j\xe0\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"config file {p} is not UTF-8 text"):
        load_config(p)


def test_a_key_given_twice_and_a_directory_as_config_are_named(tmp_path):
    """Before: YAML kept the last of two keys silently; a directory was reported as a file that does not exist."""
    p = tmp_path / "dup.yaml"
    p.write_text("cache:\n  budget: 0.5\n  policy: lru\n  budget: 0.9\n")
    with pytest.raises(ConfigError, match=rf"(?s){p} is not valid YAML: the key .budget. is given twice.*line 4"):
        load_config(p)
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory"):
        load_config(tmp_path)
    ok = tmp_path / "ok.yaml"
    ok.write_text("cache:\n  budget: 0.5\ndecode:\n  max_tokens: 8\n")  # the same key in two sections is fine
    assert load_config(ok).cache.budget.value == 0.5


def test_yaml_merge_keys_still_load(tmp_path):
    p = tmp_path / "merge.yaml"
    p.write_text("cache:\n  <<: {budget: 0.25, policy: balanced}\n  policy: lru\n")  # "<<" is no duplicate key
    cfg = load_config(p)
    assert cfg.cache.budget.value == 0.25 and cfg.cache.policy == "lru"
