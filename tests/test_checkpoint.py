"""Checkpoint read/write for each family and format, and every validation error."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FAMILY_PRESETS, FORMATS
from moe_offload.checkpoint.families import UnknownFamilyError
from moe_offload.checkpoint.inspect import inspect_checkpoint
from moe_offload.checkpoint.reader import CheckpointError, CheckpointReader, detect_format
from moe_offload.host_store import ExpertStore, StoreError


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_synthetic_checkpoint_is_detected_and_inspected(tiny_ckpt, preset, fmt):
    path = tiny_ckpt(preset, fmt)
    info = inspect_checkpoint(path)
    assert info["format"] == fmt and info["experts"] > 0
    assert info["bytes_per_expert"] == sum(info["bytes_per_expert_per_bank"].values())
    assert detect_format(CheckpointReader(path)) == fmt


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_transformers_loads_the_bf16_checkpoint_with_matching_names(tiny_ckpt, preset):
    from transformers import AutoModelForCausalLM

    path = tiny_ckpt(preset, "bf16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reader = CheckpointReader(path)
    geo = reader.geometry
    # transformers merged our per-expert tensors into its fused parameters: compare one expert
    experts = model.model.layers[0].mlp.experts
    gate = reader.get(geo.family.expert_name(0, 1, "gate") + ".weight").float()
    down = reader.get(geo.family.expert_name(0, 1, "down") + ".weight").float()
    assert torch.equal(experts.gate_up_proj[1, : geo.inter], gate)
    assert torch.equal(experts.down_proj[1], down)


def test_mixtral_uses_its_own_on_disk_names(tiny_ckpt):
    names = CheckpointReader(tiny_ckpt("tiny-mixtral", "bf16")).names()
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names


def test_num_local_experts_and_num_experts_both_accepted(tiny_ckpt, tmp_path):
    src = tiny_ckpt("tiny-qwen3-moe", "bf16")
    dst = tmp_path / "c"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    n = cfg.pop("num_local_experts", None) or cfg.pop("num_experts")
    cfg["num_experts"] = n
    (dst / "config.json").write_text(json.dumps(cfg))
    assert CheckpointReader(dst).geometry.num_experts == n


def test_fused_bf16_expert_names_load_into_the_same_store(tiny_ckpt, tmp_path):
    src = tiny_ckpt("tiny-qwen3-moe", "bf16")
    reader = CheckpointReader(src)
    geo = reader.geometry
    tensors = load_file(f"{src}/model.safetensors")
    fam = geo.family
    for layer in geo.moe_layers:
        gu, dn = [], []
        for e in range(geo.num_experts):
            gu.append(torch.cat([tensors.pop(fam.expert_name(layer, e, w) + ".weight") for w in ("gate", "up")]))
            dn.append(tensors.pop(fam.expert_name(layer, e, "down") + ".weight"))
        tensors[fam.fused_gate_up.format(l=layer)] = torch.stack(gu)
        tensors[fam.fused_down.format(l=layer)] = torch.stack(dn)
    dst = tmp_path / "fused"
    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "model.safetensors"))
    a = ExpertStore.from_checkpoint(src, progress=False)
    b = ExpertStore.from_checkpoint(dst, progress=False)
    for layer in geo.moe_layers:
        for name in a.bank_bytes:
            assert torch.equal(a.bank(layer, name), b.bank(layer, name))


# --- validation errors: each writes the bad file itself -------------------------------------------
def _copy(tiny_ckpt, tmp_path, fmt="nvfp4-modelopt"):
    dst = tmp_path / "bad"
    shutil.copytree(tiny_ckpt("tiny-qwen3-moe", fmt), dst)
    return dst


def _edited(tiny_ckpt, tmp_path, edit):
    """A copy of the tiny checkpoint whose tensors dict went through ``edit(tensors)``."""
    dst = _copy(tiny_ckpt, tmp_path)
    t = load_file(str(dst / "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


def test_missing_expert_tensor_is_named(tiny_ckpt, tmp_path):
    dst = _edited(tiny_ckpt, tmp_path, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight_scale"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight_scale is missing"):
        ExpertStore.from_checkpoint(dst, progress=False)


def test_wrong_dtype_is_named(tiny_ckpt, tmp_path):
    name = "model.layers.0.mlp.experts.0.gate_proj.weight_scale"
    dst = _edited(tiny_ckpt, tmp_path, lambda t: t.update({name: t[name].float()}))
    with pytest.raises(CheckpointError, match=rf"{name}.*dtype torch.float32"):
        ExpertStore.from_checkpoint(dst, progress=False)


def test_wrong_shape_is_named(tiny_ckpt, tmp_path):
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    dst = _edited(tiny_ckpt, tmp_path, lambda t: t.update({name: t[name][:, :4].contiguous()}))
    with pytest.raises(CheckpointError, match=name):
        inspect_checkpoint(dst)


def test_truncated_file_is_named(tiny_ckpt, tmp_path):
    dst = _copy(tiny_ckpt, tmp_path)
    f = dst / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated or corrupt.*model.safetensors|model.safetensors.*truncated"):
        CheckpointReader(dst)


def test_corrupt_header_is_named(tiny_ckpt, tmp_path):
    dst = _copy(tiny_ckpt, tmp_path)
    f = dst / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"\x00garbage!!!\x00"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors.*corrupt"):
        CheckpointReader(dst)


def test_unknown_family_is_named(tiny_ckpt, tmp_path):
    dst = _copy(tiny_ckpt, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"] = "llama4"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnknownFamilyError, match="llama4.*qwen3_moe"):
        CheckpointReader(dst)


def _config_edited(tiny_ckpt, tmp_path, **changes):
    dst = _copy(tiny_ckpt, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("key, value, match", [
    ("num_hidden_layers", 0, "num_hidden_layers is 0; it must be an integer >= 1"),
    ("num_experts_per_tok", 0, "num_experts_per_tok is 0; it must be an integer >= 1"),
    ("num_experts_per_tok", 100, "num_experts_per_tok=100 routes each token to more experts than the 16"),
    ("hidden_size", "64", "hidden_size is '64'; it must be an integer >= 1 \\(a JSON number, not a string\\)"),
    ("moe_intermediate_size", 32.5, "moe_intermediate_size is 32.5"),
    ("vocab_size", True, "vocab_size is True"),
])
def test_a_config_json_number_that_is_no_count_is_named_with_its_key(tiny_ckpt, tmp_path, key, value, match):
    """Before: a top-k of 0 ran and routed nothing (exit 0), 100 blamed the cache budget, 0 layers divided by zero,
    a string reached transformers' config classes as a traceback."""
    with pytest.raises(UnknownFamilyError, match=match):
        CheckpointReader(_config_edited(tiny_ckpt, tmp_path, **{key: value}))


def test_weights_of_more_layers_than_config_json_says_run_truncated_with_one_warning_event(tiny_ckpt, tmp_path,
                                                                                          events):
    """A config lowered to run a truncated model (a debugging habit) runs, but not silently: before, a 4-layer
    checkpoint whose config.json said 2 ran as a 2-layer model with no word."""
    from moe_offload import log

    log.reset_once_keys()
    dst = _config_edited(tiny_ckpt, tmp_path, num_hidden_layers=2)
    CheckpointReader(dst)
    CheckpointReader(dst)
    got = [e for e in events() if e.get("event") == "checkpoint_layers_ignored"]
    assert len(got) == 1 and got[0]["num_hidden_layers"] == 2 and got[0]["ignored_layers"] == "2..3"
    assert got[0]["change_with"] == "num_hidden_layers=4 in config.json to run them all"


@pytest.mark.parametrize("name", ["config.json", "hf_quant_config.json"])
def test_a_json_file_that_is_no_object_is_named(tiny_ckpt, tmp_path, name):
    dst = _copy(tiny_ckpt, tmp_path)
    (dst / name).write_text("[1]")
    with pytest.raises(CheckpointError, match=rf"{name}: a JSON list, where an object of keys belongs"):
        detect_format(CheckpointReader(dst))


@pytest.mark.parametrize("file, key, value, match", [
    ("generation_config.json", None, [1], "generation_config.json: a JSON list"),
    ("generation_config.json", "eos_token_id", "2", "generation_config.json: eos_token_id is '2'"),
    ("config.json", "eos_token_id", [1, "x"], "config.json: eos_token_id is \\[1, 'x'\\]"),
    ("config.json", "max_position_embeddings", "abc", "max_position_embeddings in config.json is 'abc'"),
])
def test_a_stop_token_or_position_count_of_the_wrong_type_is_named(tiny_ckpt, tmp_path, file, key, value, match):
    """Before: a string EOS id was dropped (generation never stopped at it), a string position count failed with
    int()'s message naming nothing."""
    from moe_offload.config import load_config
    from moe_offload.prompts import InputError, model_facts

    dst = _copy(tiny_ckpt, tmp_path)
    path = dst / file
    doc = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(value if key is None else {**doc, key: value}))
    with pytest.raises((InputError, CheckpointError), match=match):
        model_facts(load_config(None, [f"model.checkpoint={json.dumps(str(dst))}"]))


def test_format_mismatch_is_named(tiny_ckpt):
    with pytest.raises(StoreError, match="model.format is 'nvfp4-ct' but the checkpoint is 'nvfp4-modelopt'"):
        ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), fmt="nvfp4-ct", progress=False)


def test_quant_config_without_tensors_is_a_named_error(tiny_ckpt, tmp_path):
    """config.json claims compressed-tensors but the tensors are ModelOpt's."""
    dst = _copy(tiny_ckpt, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "hf_quant_config.json").unlink()
    with pytest.raises(CheckpointError, match="weight_packed is missing"):
        ExpertStore.from_checkpoint(dst, progress=False)


def test_inspect_cli_exits_non_zero_with_the_error(tiny_ckpt, tmp_path):
    dst = _copy(tiny_ckpt, tmp_path)
    (dst / "model.safetensors").write_bytes(b"\x01\x02")
    r = subprocess.run([sys.executable, "-m", "moe_offload.cli", "inspect", str(dst), "--json"], capture_output=True, text=True)
    assert r.returncode != 0 and "model.safetensors" in r.stderr


def test_inspect_cli_json_reports_the_geometry(tiny_ckpt):
    r = subprocess.run([sys.executable, "-m", "moe_offload.cli", "inspect", tiny_ckpt("tiny-mixtral", "nvfp4-ct"), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["family"] == "mixtral" and info["format"] == "nvfp4-ct" and info["top_k"] == 2


def test_sharded_checkpoint_with_index_reads(tmp_path, monkeypatch):
    from moe_offload.checkpoint import synthetic

    monkeypatch.setattr(synthetic, "_SHARD_BYTES", 100_000)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-sharded", synthetic.Preset("qwen3_moe", synthetic.PRESETS["tiny-qwen3-moe"].config, False))
    synthetic.make_checkpoint("tiny-sharded", "nvfp4-ct", tmp_path / "s", progress=False)
    assert (tmp_path / "s" / "model.safetensors.index.json").is_file()
    store = ExpertStore.from_checkpoint(tmp_path / "s", progress=False)
    assert store.num_experts == 16


def test_qwen3_next_truncation_without_full_attention_is_refused(tmp_path):
    from moe_offload.checkpoint.synthetic import PresetError, make_checkpoint

    with pytest.raises(PresetError, match="--layers >= 4"):
        make_checkpoint("flash-next", "nvfp4-ct", tmp_path / "x", layers=2, progress=False)


def test_a_depth_beyond_the_preset_is_refused_naming_the_range(tmp_path):
    from moe_offload.checkpoint.synthetic import PresetError, make_checkpoint

    with pytest.raises(PresetError, match=r"--layers 5 .*outside 1\.\.4"):
        make_checkpoint("tiny-qwen3-moe", "bf16", tmp_path / "x", layers=5, progress=False)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "bf16"])
def test_a_real_size_build_s_bytes_do_not_depend_on_the_drawing_threads(tmp_path, monkeypatch, fmt):
    """Real-size presets draw each expert matrix from its own seed on ``_DRAW_THREADS`` threads (NumPy releases the
    GIL); the seeds are drawn in order, so 1 and 4 threads write the same files. Run on the tiny shape with the
    preset marked real-size (the real-size path at test cost), and loaded by the store as a real checkpoint."""
    from moe_offload.checkpoint import synthetic
    from moe_offload.presets import PRESETS, Preset

    base = PRESETS["tiny-qwen3-moe"]
    monkeypatch.setitem(PRESETS, "real-path-tiny", Preset(base.model_type, base.config, tiny=False))
    digests = []
    for threads in (1, 4):
        monkeypatch.setattr(synthetic, "_DRAW_THREADS", threads)
        out = tmp_path / f"t{threads}"
        synthetic.make_checkpoint("real-path-tiny", fmt, out, progress=False)
        digests.append({f.name: f.read_bytes() for f in sorted(out.glob("*.safetensors"))})
    assert digests[0] and digests[0] == digests[1]
    store = ExpertStore.from_checkpoint(tmp_path / "t4", progress=False)
    assert store.num_experts == base.config["num_experts"] and len(store.layers) == base.config["num_hidden_layers"]


def test_a_quantized_attention_linear_whose_codes_and_scales_disagree_is_named(tiny_ckpt, tmp_path):
    """Before: torch's "The size of tensor a (62) must match ..." naming no tensor or file."""
    from moe_offload.config import load_config
    from moe_offload.engine import Engine

    name = "model.layers.1.self_attn.q_proj.weight"
    dst = _edited(tiny_ckpt, tmp_path, lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    with pytest.raises(CheckpointError, match=r"the quantized linear model\.layers\.1\.self_attn\.q_proj .*does not "
                                              r"dequantize: its tensors' shapes disagree"):
        Engine.from_config(load_config(None, [f"model.checkpoint={json.dumps(str(dst))}"]), progress=False)


def test_a_damaged_cached_preset_says_to_delete_its_build(tmp_path):
    from moe_offload.config import load_config
    from moe_offload.engine import Engine

    cfg = load_config(None, [f"model.cache_dir={json.dumps(str(tmp_path))}", "logging.level=WARNING"])
    Engine.from_config(cfg, progress=False).close()
    build = next(tmp_path.glob("tiny-qwen3-moe-*"))
    f = build / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"cached build of preset tiny-qwen3-moe: delete {build}"):
        Engine.from_config(cfg, progress=False)
