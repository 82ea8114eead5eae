"""A byte-level tokenizer for synthetic checkpoints (id = byte + 3; 0 pad, 1 bos, 2 eos), and the
loader that picks it or the checkpoint's own HF tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

_FILE = "moe_offload_tokenizer.json"


class ByteTokenizer:
    pad_id, bos_id, eos_id, offset = 0, 1, 2, 3

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return data.decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        (Path(directory) / _FILE).write_text(json.dumps({"type": "bytes", "offset": self.offset, "pad": 0, "bos": 1, "eos": 2}))


class TokenizerError(ValueError):
    pass


def load_tokenizer(directory: str | Path):
    """The checkpoint's tokenizer: ours (byte-level) or transformers' AutoTokenizer."""
    d = Path(directory)
    if (d / _FILE).is_file():
        return ByteTokenizer()
    if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        # never run code shipped in the checkpoint dir (tokenizer classes from the hub are refused)
        return AutoTokenizer.from_pretrained(str(d), trust_remote_code=False)
    raise TokenizerError(f"{d}: no tokenizer files (tokenizer.json or {_FILE}); pass token ids with --prompt-ids instead")
