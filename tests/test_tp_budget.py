"""``cache.budget: auto`` under TP: ranks with different free memory agree on one budget (gloo, CPU)."""

from moe_offload.config import load_config
from moe_offload.launch import run_on_ranks


def _agree(cfg, tp, free_by_rank):
    from moe_offload.parallel import agreed_auto_budget

    b = agreed_auto_budget(free_by_rank[tp.rank], 1 << 30, tp.group)
    import torch.distributed as dist

    views = [None] * tp.world_size
    dist.all_gather_object(views, (b.kind, b.value), group=tp.group)
    return views


def test_ranks_with_different_free_memory_get_the_same_byte_budget(tiny_ckpt):
    cfg = load_config(None, [f"model.checkpoint={tiny_ckpt('tiny-qwen3-moe', 'bf16')}", "device=cpu",
                             "parallel.tp=2", "logging.level=WARNING"])
    views = run_on_ranks(cfg, _agree, [40 << 30, 25 << 30])  # rank 1 has 15 GiB less free
    assert views == [("bytes", float((25 << 30) - (1 << 30)))] * 2  # the smallest, minus the reserve
