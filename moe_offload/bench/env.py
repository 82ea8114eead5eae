"""What every benchmark report records about its run: the commit, the versions, the device and the
model (``environment``, ``model_section``), and the file-name label of the model."""

from __future__ import annotations

import json
import os
import logging
import platform
import re
import statistics
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from moe_offload import log


def check_out_dir(out: str | os.PathLike | None, flag: str = "--out") -> None:
    """Before any work: ``out`` is (or can be made) a writable directory; a ``ValueError`` naming ``flag`` otherwise
    (a file there, no permission), so a long sweep does not end in a failed write."""
    if out is None:
        return
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {p} is a file; pass a directory for the results (it is created if missing)")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {p}: cannot create the directory ({exc.strerror}); pass a writable directory") \
            from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {p}: the directory is not writable; pass a writable directory")


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info(override: str | None) -> dict:
    if override:
        return {"sha": override, "dirty": None, "source": "--git-sha"}
    root = Path(__file__).resolve().parents[2]
    sha = _git(root, "rev-parse", "HEAD")
    if sha is None:
        return {"sha": "unknown", "dirty": None, "source": "no git repository here; pass --git-sha"}
    dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": bool(dirty), "source": "git"}


def add_git_sha_argument(p) -> None:
    """The benches' ``--git-sha`` option (``git_info``'s override; ``short_sha`` names the files with it)."""
    p.add_argument("--git-sha", help="record this commit (or a label such as <sha>-<variant>) when the tree has "
                   "no .git or a copy reports another; file names carry it whole")


def add_result_arguments(p, files: str, printed: str) -> None:
    """The options every bench shares: ``--set`` overrides, ``--out`` (where its ``files`` go), ``--git-sha`` and
    ``--json`` (print the JSON instead of the ``printed`` markdown)."""
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--out", default="benchmarks/results", help=f"directory for the {files} (default %(default)s)")
    add_git_sha_argument(p)
    p.add_argument("--json", action="store_true", help=f"print the JSON result instead of the {printed}")


def short_sha(git: dict) -> str:
    """The commit as file names and headers show it: 12 characters of a SHA git reported, or a ``--git-sha`` value
    whole (a label such as ``6395f5e-ptx-tuned`` must not be cut to ``6395f5e-ptx-``), characters other than
    letters, digits, ``.``, ``_`` and ``-`` replaced by ``-``."""
    if git.get("source") == "--git-sha":
        return re.sub(r"[^A-Za-z0-9._-]", "-", str(git["sha"]))
    return str(git["sha"])[:12]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device, git_sha: str | None) -> dict:
    from moe_offload.copy_paths import versions

    v = versions()
    env = {
        "git": git_info(git_sha),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     **{d: _version(d) for d in ("transformers", "accelerate", "triton", "safetensors", "moe-offload")},
                     "cuda_runtime": v["cuda_runtime"], "driver": v["driver"], "torch_cuda": torch.version.cuda},
        "device": {"type": device.type, "name": platform.processor() or platform.machine()},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device"] = {"type": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
                         "memory_bytes": props.total_memory, "sms": props.multi_processor_count}
    return env


def model_label(cfg) -> str:
    """File-name label: the preset (with ``-lN`` when truncated, the format unless NVFP4 ModelOpt)."""
    m = cfg.model
    if m.checkpoint:
        return Path(m.checkpoint).name
    label = m.preset + (f"-l{m.layers}" if m.layers else "")
    return label + ("" if m.format in ("auto", "nvfp4-modelopt") else f"-{m.format}")


def full_layers(cfg, layers: int) -> int:
    """Depth of the model a truncated preset stands for (the figures are extrapolated to it)."""
    if cfg.model.checkpoint:
        return layers
    from moe_offload.presets import get_preset

    return max(get_preset(cfg.model.preset).depth, layers)


def model_section(cfg, path, geo, store: dict) -> dict:
    """The report's ``model`` entry: label, checkpoint, geometry and expert bytes (``store`` is
    ``ExpertStore.describe()``)."""
    return {"label": model_label(cfg), "preset": None if cfg.model.checkpoint else cfg.model.preset,
            "checkpoint": str(path), "format": store["format"], "model_type": geo.model_type,
            "layers": geo.num_layers, "moe_layers": len(geo.moe_layers),
            "full_layers": full_layers(cfg, geo.num_layers), "experts": geo.num_experts, "top_k": geo.top_k,
            "hidden": geo.hidden, "intermediate": geo.inter,
            "bytes_per_expert": store["bytes_per_expert"], "all_expert_bytes": store["total_bytes"]}


#: a cell whose cache measured a link rate below this share of the run's median is named in the report's notes
LINK_OUTLIER = 0.8


def link_notes(cells: list[dict]) -> list[str]:
    """Notes naming the cells whose cache measured the copy engine or the SM reads at under ``LINK_OUTLIER`` x the
    median of the run's cells (``cell["link"]``, ``prefill.measure_link``): their path choices used that rate, so read
    such a cell as decided on a disturbed measurement (benchmarks/results/HISTORY.md "04e15c0": 28.7 against ~54.5
    GB/s kept a batch routed that the other caches would have staged). Cells without measured rates are skipped."""
    measured = [c for c in cells if isinstance(c.get("link"), dict) and "h2d_GBps" in c["link"]]
    notes = []
    for key, what in (("h2d_GBps", "the copy engine"), ("uva_GBps", "SM reads of host memory")):
        if len(measured) < 2:
            continue
        mid = statistics.median(c["link"][key] for c in measured)
        for c in measured:
            if c["link"][key] < LINK_OUTLIER * mid:
                where = ", ".join(f"{k} {c[k]}" for k in ("prompt_len", "residency", "batch", "variant") if k in c)
                notes.append(f"the cache of the cell ({where}) measured {what} at {c['link'][key]:.1f} GB/s against a "
                             f"median of {mid:.1f} over the run's cells: its path choices used that rate")
    return notes


def on_cuda(result: dict) -> bool:
    """Whether a report's run had a GPU (its targets apply only then)."""
    return result.get("device", {}).get("type") == "cuda"


def partial_mark(done: int, planned: int, peers: tuple, device: torch.device) -> dict:
    """The ``partial`` entry of a report rewritten after each cell (``cells_done`` counts failed cells too)."""
    why = "none requested" if not peers else "skipped: the device is cpu" if device.type == "cpu" else "not run yet"
    return {"cells_done": done, "cells_planned": planned, "peers": why}


def partial_lines(result: dict, rerun: str) -> list[str]:
    """The markdown notice of a partial report (none for a complete one); ``rerun``: the options that select cells."""
    part = result.get("partial")
    if not part:
        return []
    return ["", f"**Partial report: {part['cells_done']} of {part['cells_planned']} cells done (failed ones included), "
            f"peers {part['peers']}. The run stopped before the rest (a time limit or a crash): rerun the missing "
            f"cells with {rerun}.**"]


def no_peers_line(result: dict) -> str:
    """What a report's peer table says when it has no peers: why, for a partial report."""
    return result.get("partial", {}).get("peers", "none requested")


def write_partial(kind: str, write) -> None:
    """Run ``write()`` (a partial report); an error in it is logged once per call as ``bench_<kind>_partial_failed``
    and does not stop the measurements (the complete report is still written at the end)."""
    try:
        write()
    except Exception as exc:  # noqa: BLE001 - a report is never worth the run's remaining cells
        log.event(f"bench_{kind}_partial_failed", logging.WARNING, reason=f"{type(exc).__name__}: {exc}"[:300],
                  fix="the complete report is written at the end; report this error")


def write_files(result: dict, out: Path, stem: str, markdown, plot=None, kind: str = "bench") -> dict:
    """Write ``<stem>.json`` and ``.md`` (and ``.png`` when ``plot`` is given) under ``out``; returns the
    paths and the markdown text. Without matplotlib the PNG is skipped, noted in ``result["notes"]`` and
    logged once as ``bench_<kind>_png_skipped``; the JSON and markdown are still written. The stem is
    joined as text (a label with dots keeps its tail, which ``with_suffix`` would cut)."""
    out.mkdir(parents=True, exist_ok=True)
    paths: dict = {}
    if plot is not None:
        png = out / f"{stem}.png"
        try:
            plot(result, png)
        except ImportError as exc:
            png = None
            result["notes"].append(f"PNG not written: {exc} (pip install matplotlib)")
            log.event(f"bench_{kind}_png_skipped", logging.WARNING, reason=str(exc), fix="pip install matplotlib")
        paths["png"] = png
    elif result.get("partial"):
        (out / f"{stem}.png").unlink(missing_ok=True)  # an earlier complete run's plot is not this run's
    text = markdown(result)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md", **paths, "markdown_text": text}
    _replace(paths["json"], json.dumps(result, indent=2, default=str) + "\n")
    _replace(paths["md"], text)
    return paths


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a process killed mid-write keeps the last good file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
