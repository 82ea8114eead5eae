"""The CLI as a user meets it: version, help on every flag, make-checkpoint's safe writes, streaming,
EOS from generation_config.json, Ctrl-C with partial output, closed pipes, progress bars."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_offload.cli import build_parser
from moe_offload.cli import main as cli_main
from moe_offload.output import show_progress
from moe_offload.presets import PRESET_NAMES

PROMPT20 = ",".join(str(i) for i in range(10, 30))  # longer than decode.max_tokens: the prefill path


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def _parsers(p: argparse.ArgumentParser):
    yield p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from _parsers(sub)


def test_version_prints_the_installed_version_and_exits_0():
    rc, out, _ = _run("--version")
    assert rc == 0 and out.startswith("moe-offload ")


#: the commands of issue 13 (serve and bench serve belong to the serving work)
COMMANDS = ("moe-offload", "moe-offload generate", "moe-offload make-checkpoint", "moe-offload inspect",
            "moe-offload probe", "moe-offload bench ttft")


def test_every_flag_of_every_command_has_help_text():
    missing = [f"{p.prog} {'/'.join(a.option_strings) or a.dest}" for p in _parsers(build_parser()) for a in p._actions
               if p.prog in COMMANDS and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
               and not a.help]
    assert missing == []


def test_make_checkpoint_help_lists_every_preset():
    rc, out, _ = _run("make-checkpoint", "--help")
    assert rc == 0 and all(name in out for name in PRESET_NAMES)


def test_no_help_text_points_at_an_issue_number():
    texts = [a.help or "" for p in _parsers(build_parser()) for a in p._actions]
    assert not [t for t in texts if "issue" in t.lower()]


# ------------------------------------------------------------------------------------ make-checkpoint
def test_make_checkpoint_refuses_an_existing_file_as_out(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = _run("make-checkpoint", "--preset", "tiny-mixtral", "--format", "bf16", "--out", str(f))
    assert rc == 2 and "is an existing file" in err and err.count("error:") == 1


def test_make_checkpoint_refuses_a_non_empty_out_without_force(tmp_path):
    (tmp_path / "old.txt").write_text("keep me")
    rc, _, err = _run("make-checkpoint", "--preset", "tiny-mixtral", "--format", "bf16", "--out", str(tmp_path))
    assert rc == 2 and "--force" in err and (tmp_path / "old.txt").read_text() == "keep me"


def test_make_checkpoint_force_replaces_the_dir_leaving_no_stale_files(tmp_path):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_text("stale")
    rc, stdout, err = _run("make-checkpoint", "--preset", "tiny-mixtral", "--format", "nvfp4-ct", "--out", str(out),
                           "--force", "--json")
    assert rc == 0, err
    assert not (out / "model-00001-of-00009.safetensors").exists()
    summary = json.loads(stdout)
    assert summary["bytes"] == sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary dir left beside it


def test_make_checkpoint_refuses_more_layers_than_the_preset_has(tmp_path):
    rc, _, err = _run("make-checkpoint", "--preset", "tiny-mixtral", "--format", "bf16", "--out", str(tmp_path / "x"),
                      "--layers", "100")
    assert rc == 2 and "outside 1..2" in err and not (tmp_path / "x").exists()


def test_a_second_preset_build_waits_for_the_first_and_reuses_it(tmp_path, monkeypatch):
    import threading

    from moe_offload.checkpoint import synthetic

    target = tmp_path / "preset"
    builds = []
    monkeypatch.setattr(synthetic, "make_checkpoint", lambda *a, **k: builds.append(a) or {})
    done = threading.Event()
    # the first process: holds the lock while it builds
    with synthetic._file_lock(tmp_path / ".preset.lock"):
        waiter = threading.Thread(target=lambda: (synthetic.ensure_preset("tiny-mixtral", "bf16", target,
                                                                          progress=False), done.set()))
        waiter.start()
        assert not done.wait(0.5)  # the second one waits for the lock
        target.mkdir()
        (target / synthetic.COMPLETE_MARKER).write_text("ok\n")
    waiter.join(10)
    assert done.is_set() and builds == []  # it reused the first build


# ------------------------------------------------------------------------------------ generate
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from moe_offload.checkpoint.synthetic import make_checkpoint

    return Path(make_checkpoint("tiny-qwen3-moe", "nvfp4-modelopt", tmp_path_factory.mktemp("g") / "c",
                                progress=False)["path"])


def _gen(path: Path, *extra: str) -> tuple[int, str, str]:
    return _run("generate", "--checkpoint", str(path), "--set", "device=cpu", "--set", "prefill.warmup=false",
                "--set", "logging.level=WARNING", *extra)


def test_text_mode_streams_the_text_before_the_result_lines(ckpt):
    rc, out, err = _gen(ckpt, "--prompt-ids", PROMPT20, "--max-new-tokens", "1")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[1].startswith("prompt_tokens: 20") and not any(x.startswith("text:") for x in lines)


def test_generation_stops_at_the_eos_of_generation_config(ckpt, tmp_path):
    rc, out, _ = _gen(ckpt, "--prompt-ids", PROMPT20, "--max-new-tokens", "1", "--json")
    first = json.loads(out)["token_ids"][0]
    dst = Path(shutil.copytree(ckpt, tmp_path / "eos"))
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": [first]}))
    rc, out, err = _gen(dst, "--prompt-ids", PROMPT20, "--max-new-tokens", "5", "--json")
    assert rc == 0, err and json.loads(out)["token_ids"] == [first]


def test_ctrl_c_prints_the_tokens_generated_so_far_and_exits_130(ckpt, monkeypatch):
    from moe_offload import output

    real = output.TokenStream.__call__

    def interrupted(self, token_id):
        real(self, token_id)
        raise KeyboardInterrupt

    monkeypatch.setattr(output.TokenStream, "__call__", interrupted)
    rc, out, err = _gen(ckpt, "--prompt-ids", PROMPT20, "--max-new-tokens", "5", "--json")
    res = json.loads(out)
    assert rc == 130 and res["interrupted"] is True and len(res["token_ids"]) == 1 and "cache" in res
    assert "Traceback" not in err


def test_json_output_has_no_progress_bars_and_bars_need_a_terminal(monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    assert show_progress(as_json=True) is False and show_progress(as_json=False) is True
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    assert show_progress(as_json=False) is False


def test_a_closed_stdout_ends_quietly(ckpt):
    r, w = os.pipe()
    os.close(r)
    p = subprocess.run([sys.executable, "-m", "moe_offload.cli", "inspect", str(ckpt), "--json"], stdout=w,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(w)
    assert p.returncode == 141 and "Traceback" not in p.stderr and "Exception ignored" not in p.stderr


@pytest.mark.parametrize("argv", [["generate"], ["make-checkpoint", "--out", "unused"], ["bench", "decode"],
                                  ["bench", "ttft"], ["bench", "soak"], ["bench", "serve"]])
@pytest.mark.parametrize("seed", ["99999999999999999999999", "18446744073709551616", "-1"])
def test_a_seed_outside_64_bits_is_named_by_its_flag_before_any_work(argv, seed):
    """Before: torch's "Overflow when unpacking long long", naming nothing (bench decode only after loading)."""
    rc, _, err = _run(*argv, "--seed", seed)
    assert rc == 2 and "--seed" in err and "a 64-bit seed" in err


def test_a_prompt_that_is_not_utf8_is_named_by_its_flag(tmp_path, monkeypatch):
    rc, _, err = _run("generate", "--prompt", "\udce9x")  # what a shell hands over for a lone byte 0xe9
    assert rc == 2 and "--prompt: not valid UTF-8 text" in err and "Traceback" not in err

    class Stdin:
        buffer = io.BytesIO(b"\xff\xfe")

    monkeypatch.setattr(sys, "stdin", Stdin())
    rc, _, err = _run("generate", "--prompt-file", "-")
    assert rc == 2 and "--prompt-file -: standard input is not UTF-8 text" in err
    rc, _, err = _run("generate", "--prompt-file", str(tmp_path))
    assert rc == 2 and "is a directory" in err


@pytest.mark.parametrize("bench", ["ttft", "decode", "soak", "serve"])
def test_an_out_that_is_a_file_is_refused_before_any_work(tmp_path, bench):
    """Before: bench ttft ran its whole sweep, then failed to write ([Errno 17] File exists)."""
    f = tmp_path / "results.txt"
    f.write_text("")
    rc, _, err = _run("bench", bench, "--out", str(f))
    assert rc == 2 and f"--out {f} is a file" in err


def test_bench_serve_against_no_server_and_soak_merge_of_a_foreign_json_are_named(tmp_path):
    rc, _, err = _run("bench", "serve", "--url", "http://127.0.0.1:1")
    assert rc == 2 and "--url http://127.0.0.1:1: no OpenAI-compatible server answered" in err
    rc, _, err = _run("bench", "serve", "--url", "notaurl")
    assert rc == 2 and "--url notaurl" in err and "Traceback" not in err
    (tmp_path / "e.json").write_text("{}")
    rc, _, err = _run("bench", "soak", "--merge", str(tmp_path / "e.json"), "--out", str(tmp_path))
    assert rc == 2 and "not a bench soak result" in err


def test_serve_on_a_port_in_use_or_a_host_that_does_not_resolve_fails_before_loading_the_model(monkeypatch):
    """Before: the engine loaded first (minutes at full size), then uvicorn printed the error and exited 3."""
    import socket

    from moe_offload import engine

    monkeypatch.setattr(engine.Engine, "from_config", lambda *a, **k: pytest.fail("the model was loaded"))
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        rc, _, err = _run("serve", "--host", "127.0.0.1", "--port", str(port))
        assert rc == 2 and f"--port {port}: cannot listen there" in err
    finally:
        holder.close()
    rc, _, err = _run("serve", "--host", "no-such-host.invalid", "--port", "0")
    assert rc == 2 and "--host no-such-host.invalid: cannot resolve it" in err


def test_activations_for_a_bf16_checkpoint_and_inspect_of_a_missing_or_file_path_are_named(tmp_path):
    rc, _, err = _run("make-checkpoint", "--preset", "tiny-qwen3-moe", "--format", "bf16", "--activations", "w4a4",
                      "--out", str(tmp_path / "ck"))
    assert rc == 2 and "--activations w4a4 applies to the NVFP4 formats only" in err  # was silently ignored
    assert not (tmp_path / "ck").exists()
    rc, _, err = _run("inspect", str(tmp_path / "nope"))
    assert rc == 2 and "does not exist" in err
    (tmp_path / "f").write_text("")
    rc, _, err = _run("inspect", str(tmp_path / "f"))
    assert rc == 2 and "is a file" in err


def test_a_preset_cache_dir_that_cannot_be_made_is_named_by_its_key(tmp_path):
    (tmp_path / "f").write_text("")
    rc, _, err = _run("generate", "--set", f"model.cache_dir={tmp_path / 'f'}")
    assert rc == 2 and f"model.cache_dir {tmp_path / 'f'}: cannot create the directory" in err
