"""Real-export layouts (ModelOpt W4A16_NVFP4 / NVFP4, llm-compressor nvfp4-pack-quantized with and without
activation scales, llm-compressor's Mixtral expert names), value corruptions, expert-count mismatches and
pickle files: each is served correctly or refused with an error naming the file, the tensor and the fix."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from moe_offload import log
from moe_offload.checkpoint.inspect import inspect_checkpoint
from moe_offload.checkpoint.reader import W4A4_EVENT, CheckpointError, CheckpointReader, detect_format
from moe_offload.checkpoint.synthetic import make_checkpoint
from moe_offload.cli import main as cli_main
from moe_offload.formats import FormatError

FAMILIES = ("tiny-qwen3-moe", "tiny-qwen3-next", "tiny-mixtral")
#: (format, activations) of the exports served by `generate --checkpoint`
EXPORTS = (("bf16", "w4a16"), ("nvfp4-modelopt", "w4a16"), ("nvfp4-modelopt", "w4a4"), ("nvfp4-ct", "w4a16"),
           ("nvfp4-ct", "w4a4"))


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    built: dict[tuple, Path] = {}

    def get(preset: str, fmt: str, activations: str = "w4a16") -> Path:
        key = (preset, fmt, activations)
        if key not in built:
            built[key] = Path(make_checkpoint(preset, fmt, root / "-".join(key), progress=False,
                                              activations=activations)["path"])
        return built[key]

    return get


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path: Path, edit) -> Path:
    t = load_file(str(path / "model.safetensors"))
    edit(t)
    save_file(t, str(path / "model.safetensors"))
    return path


def _edit_config(path: Path, edit) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _generate(path: Path, *extra: str) -> tuple[int, dict, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["generate", "--checkpoint", str(path), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "3",
                       "--set", "device=cpu", "--set", "prefill.warmup=false", "--set", "logging.level=WARNING",
                       "--json", *extra])
    return rc, (json.loads(out.getvalue()) if rc == 0 else {}), err.getvalue()


# ------------------------------------------------------------------------------------ served exports
@pytest.mark.parametrize("fmt, activations", EXPORTS)
@pytest.mark.parametrize("preset", FAMILIES)
def test_generate_checkpoint_serves_every_export_of_every_family(exports, preset, fmt, activations):
    rc, out, err = _generate(exports(preset, fmt, activations))
    assert rc == 0, err
    assert len(out["token_ids"]) >= 1 and out["prompt_tokens"] == 4


@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "nvfp4-ct"])
def test_a_w4a4_export_gives_the_tokens_of_its_weight_only_twin(exports, fmt):
    # same seed, same weights: the activation scales are ignored (served weight-only)
    _, a, _ = _generate(exports("tiny-qwen3-moe", fmt, "w4a16"))
    _, b, _ = _generate(exports("tiny-qwen3-moe", fmt, "w4a4"))
    assert a["token_ids"] == b["token_ids"]


@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "nvfp4-ct"])
def test_a_w4a4_export_says_once_that_it_is_served_weight_only(exports, fmt, caplog):
    reader = CheckpointReader(exports("tiny-mixtral", fmt, "w4a4"))
    with caplog.at_level(logging.INFO, logger=log.LOGGER_NAME):
        assert detect_format(reader) == fmt
        detect_format(reader)
    events = [r for r in caplog.records if getattr(r, "event_fields", {}).get("event") == W4A4_EVENT]
    assert len(events) == 1 and "W4A16" in events[0].event_fields["served"]


def test_a_weight_only_modelopt_export_is_detected_without_the_w4a4_event(exports, caplog):
    path = exports("tiny-qwen3-moe", "nvfp4-modelopt", "w4a16")
    assert json.loads((path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "W4A16_NVFP4"
    with caplog.at_level(logging.INFO, logger=log.LOGGER_NAME):
        assert detect_format(CheckpointReader(path)) == "nvfp4-modelopt"
    assert not [r for r in caplog.records if getattr(r, "event_fields", {}).get("event") == W4A4_EVENT]


def test_an_unsupported_modelopt_algorithm_is_refused_naming_the_accepted_ones(exports, tmp_path):
    dst = _copy(exports("tiny-qwen3-moe", "nvfp4-modelopt"), tmp_path / "fp8")
    doc = json.loads((dst / "hf_quant_config.json").read_text())
    doc["quantization"]["quant_algo"] = "FP8"
    (dst / "hf_quant_config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"hf_quant_config.json: ModelOpt quant_algo 'FP8'.*W4A16_NVFP4"):
        detect_format(CheckpointReader(dst))


def test_llm_compressor_mixtral_expert_names_load_the_same_experts(exports, tmp_path):
    from moe_offload.host_store import ExpertStore

    src = exports("tiny-mixtral", "nvfp4-ct")
    names = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}

    def rename(t):
        for k in [k for k in t if ".experts." in k]:
            new = k
            for a, b in names.items():
                new = new.replace(a, b)
            t[new] = t.pop(k)

    dst = _edit_tensors(_copy(src, tmp_path / "llmc"), rename)
    assert CheckpointReader(dst).geometry.family.proj["gate"] == "gate_proj"
    a, b = ExpertStore.from_checkpoint(src, progress=False), ExpertStore.from_checkpoint(dst, progress=False)
    for layer in a.layers:
        assert torch.equal(a.rows(layer), b.rows(layer))


# ------------------------------------------------------------------------------------ corruptions
SCALE = "model.layers.1.mlp.experts.3.down_proj"


@pytest.mark.parametrize("fmt, suffix, value, needle", [
    ("nvfp4-modelopt", "weight_scale_2", float("nan"), "non-finite"),
    ("nvfp4-modelopt", "weight_scale_2", float("inf"), "non-finite"),
    ("nvfp4-modelopt", "weight_scale_2", 0.0, "is 0"),
    ("nvfp4-ct", "weight_global_scale", float("nan"), "non-finite"),
    ("nvfp4-ct", "weight_global_scale", 0.0, "is 0"),
    ("nvfp4-modelopt", "weight_scale", float("nan"), "non-finite"),
    ("nvfp4-ct", "weight_scale", float("nan"), "non-finite"),
    ("bf16", "weight", float("inf"), "non-finite"),
])
def test_a_corrupt_scale_or_weight_is_named_by_inspect_and_by_load(exports, tmp_path, fmt, suffix, value, needle):
    from moe_offload.host_store import ExpertStore

    name = f"{SCALE}.{suffix}"

    def corrupt(t):
        x = t[name].float().clone()
        x.view(-1)[0] = value
        t[name] = x.to(t[name].dtype)

    dst = _edit_tensors(_copy(exports("tiny-qwen3-moe", fmt), tmp_path / "bad"), corrupt)
    with pytest.raises((CheckpointError, FormatError), match=rf"{name}.*{needle}"):
        inspect_checkpoint(str(dst))
    with pytest.raises((CheckpointError, FormatError), match=rf"{name}.*{needle}"):
        ExpertStore.from_checkpoint(dst, progress=False)


@settings(max_examples=8, deadline=None)
@given(layer=st.integers(0, 3), expert=st.integers(0, 15), proj=st.sampled_from(["gate_proj", "up_proj", "down_proj"]),
       value=st.just(float("nan")))  # E4M3 has no Inf: NaN is its only non-finite value
def test_any_non_finite_block_scale_is_named_by_inspect(exports, tmp_path_factory, layer, expert, proj, value):
    name = f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight_scale"

    def corrupt(t):
        x = t[name].float().clone()
        x.view(-1)[-1] = value
        t[name] = x.to(t[name].dtype)

    dst = _edit_tensors(_copy(exports("tiny-qwen3-moe", "nvfp4-modelopt"), tmp_path_factory.mktemp("h") / "c"), corrupt)
    with pytest.raises(FormatError, match=rf"{name} holds 1 non-finite"):
        inspect_checkpoint(str(dst))


@pytest.mark.parametrize("claimed, needle", [(8, "num_experts=8 but layer 0 has tensors for expert 15"),
                                             (32, "num_experts=32 but layer 0 has tensors for 16 experts only")])
def test_a_config_expert_count_that_disagrees_with_the_tensors_is_named(exports, tmp_path, claimed, needle):
    dst = _edit_config(_copy(exports("tiny-qwen3-moe", "nvfp4-ct"), tmp_path / "n"), lambda c: c.update(num_experts=claimed))
    with pytest.raises(CheckpointError, match=needle):
        inspect_checkpoint(str(dst))


def test_pickle_weight_files_are_refused_by_name(exports, tmp_path):
    dst = _copy(exports("tiny-mixtral", "bf16"), tmp_path / "pickled")
    torch.save({"x": torch.zeros(1)}, dst / "pytorch_model.bin")
    (dst / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin.*only safetensors"):
        CheckpointReader(dst)


def test_non_finite_logits_are_a_request_error_naming_the_first_layer(exports, tmp_path):
    # a non-expert weight (not read by the expert loader's value checks) set to NaN in layer 1
    name = "model.layers.1.post_attention_layernorm.weight"
    dst = _edit_tensors(_copy(exports("tiny-qwen3-moe", "bf16"), tmp_path / "nan"),
                        lambda t: t.update({name: torch.full_like(t[name], float("nan"))}))
    rc, _, err = _generate(dst)
    assert rc == 1 and "non-finite logits" in err and "(layer 1)" in err and "Traceback" not in err


def test_linear_attention_projections_quantized_as_llm_compressor_does_are_served(exports, tmp_path):
    # llm-compressor quantizes every Linear but the router gates and lm_head: qwen3_next's in_proj_ba too
    from moe_offload.formats import get_format
    from moe_offload.formats.nvfp4 import quantize

    fmt = get_format("nvfp4-ct")

    def quantize_ba(t):
        for name in [k for k in t if k.endswith("linear_attn.in_proj_ba.weight")]:
            w = t.pop(name)
            t.update(fmt.to_disk(name[: -len(".weight")], *quantize(w.float())))

    dst = _edit_tensors(_copy(exports("tiny-qwen3-next", "nvfp4-ct"), tmp_path / "ba"), quantize_ba)
    assert any(k.endswith("in_proj_ba.weight_packed") for k in CheckpointReader(dst).names())
    rc, out, err = _generate(dst)
    assert rc == 0, err


@settings(max_examples=15, deadline=None)
@given(offset=st.integers(0, 400), byte=st.integers(0, 255))
def test_a_corrupt_safetensors_header_is_a_named_error_or_still_valid(exports, tmp_path_factory, offset, byte):
    # any single byte of the length prefix or the JSON header changed: a ValueError naming the file
    # (CheckpointError / FormatError), never another exception
    dst = _copy(exports("tiny-mixtral", "nvfp4-ct"), tmp_path_factory.mktemp("hdr") / "c")
    f = dst / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[offset] = byte
    f.write_bytes(bytes(data))
    try:
        inspect_checkpoint(str(dst))
    except ValueError as exc:
        assert str(dst) in str(exc)  # names the checkpoint (its file, or the dir for a missing tensor)
