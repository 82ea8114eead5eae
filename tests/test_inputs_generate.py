"""Every bad generate input is refused before a weight is read, in one line naming the flag, the value
and the fix, with exit 2 (README "Inputs and outcomes")."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_offload.cli import main as cli_main
from moe_offload.config import load_config
from moe_offload.prompts import InputError, check_ids, check_lengths, check_tp, model_facts, parse_prompt_ids


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if anything tries to build the engine or a preset: validation must come first."""
    import moe_offload.checkpoint.synthetic as synthetic
    import moe_offload.engine as engine

    def boom(*a, **k):
        raise AssertionError("weights were loaded before the input was validated")

    monkeypatch.setattr(engine.Engine, "from_config", boom)
    monkeypatch.setattr(synthetic, "make_checkpoint", boom)


def _refused(capsys, *argv: str) -> str:
    assert cli_main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, needle", [
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt-ids", ""], "--prompt-ids is empty"),
    (["--prompt-ids", "1,x"], "'x' is not an integer"),
    (["--prompt-ids", "1,,2"], "empty entry"),
    (["--prompt-ids=-1,5"], "outside the vocab"),
    (["--prompt-ids", "320"], "outside the vocab of the preset tiny-qwen3-moe (0..319)"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    (["--max-new-tokens", "-1"], "must be >= 1, got -1"),
    (["--max-new-tokens", "5000"], "max_position_embeddings=4096"),
    (["--prompt-ids", ",".join(["5"] * 4096)], "allows 4096 positions"),
    (["--set", "parallel.tp=3"], "parallel.tp=3"),
    (["--set", "model.preset=tiny-nope"], "model.preset"),
    (["--temperature", "-1"], "--temperature: must be in [0, 100]"),
    (["--top-p", "0"], "--top-p: must be in (0, 1]"),
    (["--top-k", "-2"], "--top-k: must be >= 0"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file /nonexistent/prompt.txt: no such file"),
    (["--checkpoint", "/nonexistent/ckpt"], "is not a directory"),
])
def test_a_bad_generate_input_is_one_line_with_exit_2_before_any_weight_loads(argv, needle, capsys, no_weights):
    err = _refused(capsys, *argv)
    if needle is not None:
        assert needle in err


def test_an_explicit_format_that_disagrees_with_the_checkpoint_is_named(tiny_ckpt, capsys, no_weights):
    err = _refused(capsys, "--checkpoint", tiny_ckpt("tiny-mixtral", "nvfp4-ct"), "--set", "model.format=bf16")
    assert "model.format is 'bf16'" in err and "'nvfp4-ct'" in err


def test_tp_that_does_not_split_the_expert_intermediate_size_names_the_valid_sizes():
    facts = model_facts(load_config(None))  # tiny-qwen3-moe: I = 32, NVFP4 blocks of 16
    with pytest.raises(InputError, match=r"parallel.tp=4.*intermediate size 32.*tp = 1, 2"):
        check_tp(facts, 4)
    check_tp(facts, 2)


def test_bench_ttft_refuses_an_indivisible_tp_before_spawning_ranks(capsys, tmp_path, no_weights):
    argv = ["bench", "ttft", "--tp", "3", "--set", "device=cpu", "--set", f"model.cache_dir={tmp_path}",
            "--out", str(tmp_path / "out")]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "--tp=3" in err and "Traceback" not in err


def test_max_new_tokens_from_the_config_is_named_as_the_config_key():
    facts = model_facts(load_config(None))
    with pytest.raises(InputError, match=r"decode.max_new_tokens=4095.*pass decode.max_new_tokens <= 4090 or"):
        check_lengths(6, 4095, facts, "decode.max_new_tokens")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-10**6, 10**6), min_size=1, max_size=8))
def test_prompt_ids_are_accepted_exactly_when_every_id_is_inside_the_vocab(ids):
    facts = model_facts(load_config(None))
    text = ",".join(map(str, ids))
    parsed = parse_prompt_ids(text)
    assert parsed == ids
    if all(0 <= i < facts.vocab for i in ids):
        check_ids(parsed, facts, "--prompt-ids")
    else:
        with pytest.raises(InputError, match="outside the vocab"):
            check_ids(parsed, facts, "--prompt-ids")


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.sampled_from("0123456789, x-+."), max_size=12))
def test_prompt_id_text_either_parses_to_integers_or_raises_a_named_error(text):
    try:
        ids = parse_prompt_ids(text)
    except InputError as exc:
        assert "--prompt-ids" in str(exc)
    else:
        assert ids and all(isinstance(i, int) for i in ids)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["decode.max_new_tokens", "decode.temperature", "decode.top_p", "decode.top_k",
                        "parallel.tp", "model.layers", "cache.budget"]),
       st.one_of(st.integers(-5, 5), st.floats(-2, 2, allow_nan=False), st.text(max_size=4)))
def test_any_config_value_loads_or_raises_an_error_naming_the_key(key, value):
    from moe_offload.config import ConfigError

    try:
        load_config(None, [f"{key}={json.dumps(value)}"])
    except ConfigError as exc:
        assert key in str(exc)


def test_prompt_file_dash_reads_the_prompt_from_stdin(monkeypatch, capsys, no_weights):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    err = _refused(capsys, "--prompt-file", "-")
    assert "--prompt-file - is empty" in err
