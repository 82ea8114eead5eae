"""benchmarks/conditional_copy.py on a CPU: its one-layer store is a real ExpertStore of the preset's shape with a mark
in every row (the GPU parts, the graphs and their copies, run on the lent GPU only)."""

import importlib.util
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("conditional_copy", ROOT / "benchmarks" / "conditional_copy.py")
conditional_copy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(conditional_copy)


def test_the_store_is_the_preset_s_shape_and_each_row_carries_its_own_nonzero_mark():
    store = conditional_copy.one_layer_store("qwen3-30b-a3b")
    rows_ER = store.rows(store.layers[0])
    assert (store.num_experts, store.bytes_per_expert) == (128, 2_658_304) and len(store.layers) == 1
    marks = rows_ER[:, ::4096]
    want = (torch.arange(128) % 251 + 1).to(torch.uint8)[:, None].expand_as(marks)
    assert torch.equal(marks, want)
    assert int(rows_ER[:, 1:4096].count_nonzero()) == 0  # between marks: zeros, so a copy's rows are told apart


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only check")
def test_without_a_gpu_the_probe_says_so_and_exits_2(capsys):
    assert conditional_copy.main(["--out", "unused"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
