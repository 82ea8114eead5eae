"""A routed fill's copy entries planned on the device, so that its one host read returns them ready to copy.

Legend: N routed ids (T tokens x K), E experts per layer, R bytes of one expert row, P the plan's int64 words.

A routed fill (``moe_offload/staging.py``) reads a layer's routing on the host and copies only the routed missing
experts over the copy engine. Planned on the host, the numpy work between the routing's arrival and the batched copy
call held the whole device idle (~87-149 us a layer on the lent H100 at feb415a, for work a hot loop does in ~17 us:
benchmarks/results/HISTORY.md). Here one program computes, on the stream of the routing, what the host needed:

    plan_P = [runs, routed, missing, bad,
              dst_ptr[E], src_ptr[E], size[E],     # one batched-copy entry per run of consecutive missing experts
              missing_E[E],                        # 1 where expert e is routed and not resident
              scratch[E]]                          # the program's own words

``bad`` counts ids outside ``[0, E)`` (the caller raises, naming the layer). Entries past ``runs`` are unspecified.
With ``out_P`` the program also copies the words before the scratch (``plan_words(E) - E``) into it, e.g. a device
view of mapped pinned host memory (``moe_offload/uva.py``): the host then waits for an event instead of a D2H copy,
and the program can run inside a CUDA graph (``moe_offload/prefill_graph.py``) with nothing for the host to launch.
A missing expert is one the device slot table (``SlotPool.table_LE``'s row) holds at -1: the table the compute reads
in the same stream order, so the plan copies exactly the rows the compute will read from the staging buffer.

:func:`plan_routed_fill` is one Triton program on CUDA and :func:`plan_reference` (plain torch, the oracle of the
tests) elsewhere.
"""

from __future__ import annotations

import torch

try:  # importing triton touches no CUDA
    import triton
    import triton.language as tl
except ImportError:
    triton = None

HEADER = 4  # runs, routed, missing, bad


def plan_words(E: int) -> int:
    """P: the plan's length in int64 words for ``E`` experts."""
    return HEADER + 5 * E


if triton is not None:

    @triton.jit(do_not_specialize=["N", "dst_base", "src_base"])
    def _plan_kernel(ids_ptr, N, table_ptr, plan_ptr, out_ptr, E, row_bytes, dst_base, src_base,
                     BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, COPY_OUT: tl.constexpr):
        """One program, no atomics (a lane's replicas in a layout wider than BLOCK_E store the same values). The routed
        flags are scattered into the scratch words (zeroed first) and read back per expert into the missing flags;
        each expert then reads its neighbours' flags (the runs' edges), the runs are compacted in order by a prefix
        sum, each run's last expert leaves its end in the scratch word of its run, and its first expert turns that
        into the size. Each phase ends in a CTA barrier, so every thread sees the words the others wrote. Work
        O(N + E): ids are scattered, not compared."""
        e = tl.arange(0, BLOCK_E)
        in_e = e < E
        sizes = plan_ptr + 4 + 2 * E
        flags = plan_ptr + 4 + 3 * E
        scratch = plan_ptr + 4 + 4 * E
        tl.store(scratch + e, tl.zeros([BLOCK_E], dtype=tl.int64), mask=in_e)
        tl.debug_barrier()
        bad = tl.zeros([CHUNK], dtype=tl.int32)
        for start in range(0, N, CHUNK):
            i = start + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + i, mask=i < N, other=0).to(tl.int64)
            valid = (i < N) & (ids >= 0) & (ids < E)
            bad += ((i < N) & ~valid).to(tl.int32)
            tl.store(scratch + ids, tl.full([CHUNK], 1, tl.int64), mask=valid)  # same-value stores may collide
        tl.debug_barrier()
        routed = (tl.load(scratch + e, mask=in_e, other=0) > 0) & in_e
        miss = routed & (tl.load(table_ptr + e, mask=in_e, other=0) < 0)
        tl.store(flags + e, miss.to(tl.int64), mask=in_e)
        tl.debug_barrier()  # the flags are written and the scratch words read
        miss_l = tl.load(flags + e - 1, mask=(e >= 1) & (e - 1 < E), other=0) > 0
        miss_r = tl.load(flags + e + 1, mask=e + 1 < E, other=0) > 0
        first = miss & ~miss_l
        last = miss & ~miss_r
        run = tl.cumsum(first.to(tl.int32), axis=0) - 1  # the run each missing expert belongs to
        off = e.to(tl.int64) * row_bytes
        tl.store(plan_ptr + 4 + run, dst_base + off, mask=first)
        tl.store(plan_ptr + 4 + E + run, src_base + off, mask=first)
        tl.store(scratch + run, off + row_bytes, mask=last)  # where the run ends
        tl.debug_barrier()
        tl.store(sizes + run, tl.load(scratch + run, mask=first, other=0) - off, mask=first)
        tl.store(plan_ptr + 0, tl.sum(first.to(tl.int64), axis=0))
        tl.store(plan_ptr + 1, tl.sum(routed.to(tl.int64), axis=0))
        tl.store(plan_ptr + 2, tl.sum(miss.to(tl.int64), axis=0))
        tl.store(plan_ptr + 3, tl.sum(bad.to(tl.int64), axis=0))
        if COPY_OUT:  # the words before the scratch, once every thread's stores are in
            tl.debug_barrier()
            for start in range(0, 4 + 4 * E, BLOCK_E):
                w = start + e
                tl.store(out_ptr + w, tl.load(plan_ptr + w, mask=w < 4 + 4 * E, other=0), mask=w < 4 + 4 * E)


def out_words(E: int) -> int:
    """The words ``out_P`` receives: the header, the entries and the missing flags (the plan less its scratch)."""
    return HEADER + 4 * E


def plan_routed_fill(ids_N: torch.Tensor, table_E: torch.Tensor, plan_P: torch.Tensor, row_bytes: int, dst_base: int,
                     src_base: int, out_P: torch.Tensor | None = None) -> None:
    """Write the plan of a routed fill into ``plan_P`` (int64, ``plan_words(E)``, on the device of ``ids_N``) on the
    current stream, without a host sync: ``ids_N`` the routed ids (any integer dtype, flat), ``table_E`` the layer's
    slot table (int32, -1 = not resident), ``dst_base`` / ``src_base`` the addresses of row 0 of the staging buffer
    and of the layer's pinned host rows (rows ``row_bytes`` apart in both; a base of 0 gives offsets). ``out_P``
    (int64, at least ``out_words(E)``, on the same device): the program also writes the words before the scratch
    there (module docstring). Capturable in a CUDA graph (no host work but the launch)."""
    E = table_E.shape[0]
    if plan_P.dtype != torch.int64 or plan_P.numel() != plan_words(E):
        raise ValueError(f"plan_P must be int64 [{plan_words(E)}], got {plan_P.dtype} [{plan_P.numel()}]")
    if out_P is not None and (out_P.dtype != torch.int64 or out_P.numel() < out_words(E) or not out_P.is_contiguous()
                              or out_P.device != plan_P.device):
        raise ValueError(f"out_P must be a contiguous int64 tensor of at least {out_words(E)} words on {plan_P.device}, "
                         f"got {out_P.dtype} [{out_P.numel()}] on {out_P.device}")
    if ids_N.device.type != "cuda" or triton is None:
        plan_P.copy_(plan_reference(ids_N, table_E, row_bytes, dst_base, src_base))
        if out_P is not None and out_P.data_ptr() != plan_P.data_ptr():  # off CUDA the buffers may be one
            out_P[:out_words(E)].copy_(plan_P[:out_words(E)])
        return
    _plan_kernel[(1,)](ids_N.contiguous(), ids_N.numel(), table_E, plan_P, plan_P if out_P is None else out_P, E,
                       row_bytes, dst_base, src_base, BLOCK_E=triton.next_power_of_2(E), CHUNK=64,
                       COPY_OUT=out_P is not None, num_warps=4)


def plan_reference(ids_N: torch.Tensor, table_E: torch.Tensor, row_bytes: int, dst_base: int, src_base: int
                   ) -> torch.Tensor:
    """The plan in plain torch (the oracle; the path off CUDA), entries past ``runs`` and the scratch words zero."""
    E, dev = table_E.shape[0], table_E.device
    ids = ids_N.reshape(-1).to(device=dev, dtype=torch.int64)
    valid = (ids >= 0) & (ids < E)
    routed = torch.zeros(E, dtype=torch.bool, device=dev)
    routed[ids[valid]] = True
    miss = routed & (table_E < 0)
    pad = torch.zeros(1, dtype=torch.bool, device=dev)
    prev, nxt = torch.cat([pad, miss[:-1]]), torch.cat([miss[1:], pad])
    firsts = torch.nonzero(miss & ~prev).flatten()
    lasts = torch.nonzero(miss & ~nxt).flatten()
    plan = torch.zeros(plan_words(E), dtype=torch.int64, device=dev)
    n = firsts.numel()
    plan[:HEADER] = torch.tensor([n, int(routed.sum()), int(miss.sum()), int((~valid).sum())], device=dev)
    plan[HEADER:HEADER + n] = dst_base + firsts * row_bytes
    plan[HEADER + E:HEADER + E + n] = src_base + firsts * row_bytes
    plan[HEADER + 2 * E:HEADER + 2 * E + n] = (lasts - firsts + 1) * row_bytes
    plan[HEADER + 3 * E:HEADER + 4 * E] = miss.to(torch.int64)
    return plan


def check_program(device: torch.device, E: int, N: int = 200) -> str | None:
    """Run the program once on ``device`` on seeded ids (a few outside the layer) and a ~37 % resident table, and
    compare the words it specifies with ``plan_reference``, with and without ``out_P``: None when they agree, else what
    differs (a cache then declines the device plan, ``moe_offload/fill_plan.py``). A start-up check (it synchronizes),
    as the batched copy's."""
    gen = torch.Generator().manual_seed(E)
    ids = torch.randint(-1, E + 1, (N,), generator=gen)
    table = torch.where(torch.rand(E, generator=gen) < 0.37, torch.randint(0, 99, (E,), generator=gen), -1)
    table = table.to(torch.int32)
    R, dst, src = 2654224, 1 << 40, 1 << 41
    want = plan_reference(ids, table, R, dst, src)
    runs = int(want[0])
    spans = [(0, HEADER), (HEADER + 3 * E, HEADER + 4 * E)] + [(HEADER + k * E, HEADER + k * E + runs) for k in range(3)]
    for copy_out in (False, True):  # both forms: the second also compiles the one a prefill graph captures
        got = torch.full((plan_words(E),), -5, dtype=torch.int64, device=device)
        out = torch.full((out_words(E),), -5, dtype=torch.int64, device=device) if copy_out else None
        plan_routed_fill(ids.to(device), table.to(device), got, R, dst, src, out_P=out)
        for name, words in (("plan", got.cpu()), ("out words", None if out is None else out.cpu())):
            if words is None:
                continue
            for lo, hi in spans:
                if not torch.equal(words[lo:hi], want[lo:hi]):
                    return f"words {lo}-{hi} of the {name} of {N} ids over {E} experts differ from the reference"
    return None
