"""The OpenAI wire format: request bodies (validated), prompts -> token ids, the chat template,
incremental detokenization with stop strings, and OpenAI-style error bodies.

Extensions over the OpenAI API (vLLM names): ``top_k``, ``stop_token_ids``, ``ignore_eos`` in the
request; every choice carries ``token_ids`` (the generated ids of that response or chunk). A request
without ``temperature`` samples with the config's ``decode.temperature`` (0 = greedy by default).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from moe_offload.serve.sampling import RequestError, SamplingParams

#: used when the checkpoint's tokenizer has no chat template: one "role: content" line per message,
#: then "assistant:" for the model to continue
PLAIN_CHAT_TEMPLATE = "{role}: {content}\n"
PLAIN_GENERATION_PROMPT = "assistant:"


class _Common(BaseModel):
    # clients send fields we do not use (user, metadata, ...): accepted and ignored unless listed below
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 64) - 1)  # torch.manual_seed's range (config.SEED_MIN/MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, why) of every set parameter this server does not implement."""
        out = []
        if self.n != 1:
            out.append(("n", "only n=1 is supported"))
        if self.presence_penalty or self.frequency_penalty:
            out.append(("presence_penalty", "penalties are not supported; send 0"))
        extra = self.model_extra or {}
        for name in ("logprobs", "top_logprobs", "best_of", "echo", "suffix", "logit_bias", "tools", "functions"):
            v = extra.get(name)
            if v not in (None, False) and not (name == "best_of" and v == 1):
                out.append((name, f"{name} is not supported by this server"))
        return out

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise RequestError("stop strings must be non-empty", "stop")
        return stops

    def sampling(self, max_tokens: int, default_temperature: float) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens,
                              temperature=default_temperature if self.temperature is None else self.temperature,
                              top_k=self.top_k, top_p=self.top_p, seed=0 if self.seed is None else self.seed,
                              stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise RequestError(f"message content of type {part.get('type')!r} is not supported; send text", "messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


def completion_prompt_ids(req: CompletionRequest, engine) -> list[int]:
    """The prompt as token ids: a string (tokenized), a list of ids, or a one-element list of either."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise RequestError("a list of several prompts is not supported; send one prompt per request", "prompt")
        p = p[0]
    if isinstance(p, str):
        try:
            return list(engine.encode(p))
        except ValueError as exc:
            raise RequestError(str(exc), "prompt") from None
    return list(p)


def chat_prompt_ids(req: ChatCompletionRequest, tokenizer) -> list[int]:
    """Messages -> ids through the tokenizer's chat template, else ``PLAIN_CHAT_TEMPLATE``."""
    if tokenizer is None:
        raise RequestError("this checkpoint has no tokenizer; use /v1/completions with token ids", "messages")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "".join(PLAIN_CHAT_TEMPLATE.format(**m) for m in messages) + PLAIN_GENERATION_PROMPT
    return list(tokenizer.encode(text))


class TextTracker:
    """Incremental detokenization: ``add(ids)`` -> the new text safe to send (not ending in a partial
    UTF-8 sequence, not a possible prefix of a stop string); ``stopped`` once a stop string appears
    (the text is cut before it)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""
        self.stopped = False
        self._hold = max((len(s) for s in stops), default=1) - 1

    def add(self, ids: list[int], final: bool = False) -> str:
        if self.tokenizer is None or self.stopped:
            return ""
        self.ids.extend(ids)
        self.text = self.tokenizer.decode(self.ids)
        for s in self.stops:
            at = self.text.find(s)
            if at >= 0:
                self.text, self.stopped, final = self.text[:at], True, True
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):
                end -= 1
            end = max(self.sent, end - self._hold)
        delta, self.sent = self.text[self.sent:end], max(self.sent, end)
        return delta


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
