"""What the CLI writes to stdout: results (text ``key: value`` lines or one JSON document), streamed
tokens, and the one line per handled error on stderr. A closed stdout (``| head``) ends quietly."""

from __future__ import annotations

import json
import os
import sys


def print_result(obj: dict, as_json: bool) -> None:
    """A result dict as indented JSON, or as ``key: value`` lines (nested values as compact JSON)."""
    if as_json:
        print(json.dumps(obj, indent=2, default=str), flush=True)
    else:
        for k, v in obj.items():
            print(f"{k}: {json.dumps(v, default=str) if isinstance(v, (dict, list)) else v}")
        sys.stdout.flush()


def print_error(message: str) -> None:
    """One handled error, once, on stderr."""
    print(f"error: {message}", file=sys.stderr, flush=True)


def show_progress(as_json: bool) -> bool:
    """Progress bars only on an interactive stderr, never with --json output."""
    return not as_json and sys.stderr.isatty()


class TokenStream:
    """Writes decoded text to stdout as tokens arrive (text mode). Decodes the whole prefix each time
    and prints the new suffix, so multi-byte characters split over tokens come out whole."""

    def __init__(self, tokenizer, enabled: bool):
        self.tokenizer, self.enabled = tokenizer, enabled and tokenizer is not None
        self.ids: list[int] = []
        self._printed = ""

    def __call__(self, token_id: int) -> None:
        self.ids.append(token_id)
        if not self.enabled:
            return
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        new = text[len(self._printed):] if text.startswith(self._printed) else text
        self._printed = text
        sys.stdout.write(new)
        sys.stdout.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stdout.write("\n")
            sys.stdout.flush()


def silence_broken_pipe() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
        pass
