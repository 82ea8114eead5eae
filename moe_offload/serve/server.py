"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the Scheduler.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` -> server-sent
events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).
Errors: 400 bad request (OpenAI error body naming the param), 429 queue full, 503 scheduler stopped.
A client that disconnects cancels its request (its batch row and KV are freed at the next step).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moe_offload import log
from moe_offload.serve.config import ServeConfig
from moe_offload.serve.metrics import Metrics
from moe_offload.serve.protocol import (ChatCompletionRequest, CompletionRequest, TextTracker, chat_prompt_ids,
                                        completion_prompt_ids, error_body, sse)
from moe_offload.serve.sampling import RequestError
from moe_offload.serve.scheduler import Overloaded, Scheduler, SchedulerClosed

#: how often a non-streaming request checks whether its client is still connected (seconds)
_DISCONNECT_POLL_S = 0.25


class Mailbox:
    """Outputs from the scheduler's loop thread to the HTTP event loop, one wake-up per burst. A decode step
    emits one Output per running row; ``call_soon_threadsafe`` per Output writes the loop's self-pipe and
    schedules a callback each time, on the scheduler's thread and GIL (64 rows: 64 wake-ups a step). Here
    the first Output of a burst schedules one ``_drain`` and the rest join the list it will drain; each
    request's Outputs keep their order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, object]] = []
        self.wakeups = 0

    def post(self, queue: asyncio.Queue, out) -> None:
        """From any thread: ``out`` reaches ``queue`` on the loop (raises RuntimeError if the loop is closed)."""
        with self._lock:
            first = not self._items
            self._items.append((queue, out))
        if first:
            self.wakeups += 1
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except BaseException:  # a closed loop: nothing will drain; every later post must raise too
                with self._lock:
                    self._items.clear()
                raise

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, out in items:
            queue.put_nowait(out)


def _mailbox(app: FastAPI, loop: asyncio.AbstractEventLoop) -> Mailbox:
    box = getattr(app.state, "mailbox", None)
    if box is None or box.loop is not loop:
        box = app.state.mailbox = Mailbox(loop)
    return box


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def model_name(engine, serve_cfg: ServeConfig) -> str:
    if serve_cfg.model_name:
        return serve_cfg.model_name
    path = getattr(engine.reader, "path", None)
    return Path(path).name if path else "moe-offload"


def build_app(scheduler: Scheduler, serve_cfg: ServeConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``scheduler`` (already started; the caller stops it)."""
    serve_cfg = serve_cfg or scheduler.cfg
    engine = scheduler.engine
    name = model_name(engine, serve_cfg)
    metrics = Metrics(scheduler)
    created = int(time.time())
    app = FastAPI(title="moe-offload", version="0.1.0")
    app.state.scheduler, app.state.metrics = scheduler, metrics

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_request: Request, exc: RequestValidationError):
        errs = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errs):  # its loc is a character offset, not a field
            return _error(400, "the request body is not valid JSON (an object of the OpenAI API's fields, with "
                          "content-type application/json)", "invalid_request_error", None)
        first = errs[0] if errs else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errs)
        return _error(400, msg or "invalid request body", "invalid_request_error", param)

    @app.get("/health")
    async def health():
        body = {"status": "ok" if scheduler.alive else "unavailable", "running": scheduler.num_running,
                "waiting": scheduler.num_waiting}
        return JSONResponse(body, status_code=200 if scheduler.alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "moe-offload",
                                            "max_model_len": scheduler.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _serve(body, request, chat=True)

    async def _serve(body, request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            bad = body.unsupported()
            if bad:
                raise RequestError(bad[0][1], bad[0][0])
            prompt_ids = chat_prompt_ids(body, engine.tokenizer) if chat else completion_prompt_ids(body, engine)
            max_tokens = body.max_tokens
            if chat and body.max_completion_tokens is not None:
                max_tokens = body.max_completion_tokens
            max_tokens = serve_cfg.default_max_tokens if max_tokens is None else max_tokens
            params = body.sampling(max_tokens, engine.cfg.decode.temperature)
            stops = body.stop_strings()
            box = _mailbox(app, asyncio.get_running_loop())
            queue: asyncio.Queue = asyncio.Queue()
            req = scheduler.submit(prompt_ids, params, lambda out: box.post(queue, out),
                                   request_id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24])
        except RequestError as exc:
            metrics.requests.labels(endpoint, "bad_request").inc()
            return _error(400, str(exc), "invalid_request_error", exc.param)
        except Overloaded as exc:
            metrics.requests.labels(endpoint, "overloaded").inc()
            return _error(429, str(exc), "overloaded_error", None, "queue_full")
        except SchedulerClosed as exc:
            metrics.requests.labels(endpoint, "unavailable").inc()
            return _error(503, str(exc), "service_unavailable", None, "scheduler_closed")
        metrics.prompt_tokens.inc(len(prompt_ids))
        run = _Run(req, queue, TextTracker(engine.tokenizer, stops), scheduler, metrics, endpoint, name, chat)
        if body.stream:
            return StreamingResponse(run.stream(body.include_usage), media_type="text/event-stream")
        return await run.whole(request)

    return app


class _Run:
    """One request's life on the HTTP side: collect or stream its Outputs, cancel it if abandoned."""

    def __init__(self, req, queue, tracker: TextTracker, scheduler, metrics: Metrics, endpoint: str, model: str, chat: bool):
        self.req, self.queue, self.tracker, self.scheduler = req, queue, tracker, scheduler
        self.metrics, self.endpoint, self.model, self.chat = metrics, endpoint, model, chat
        self.created = int(time.time())
        self.done = False

    def _finish(self, outcome: str) -> None:
        if self.done:
            return
        self.done = True
        if outcome != "ok":
            self.scheduler.cancel(self.req)
        self.metrics.requests.labels(self.endpoint, outcome).inc()
        self.metrics.observe_finished(self.req)

    def _next(self, out) -> tuple[str, str | None]:
        """(new text, finish_reason or None) for one Output; a stop string ends the request."""
        text = self.tracker.add(out.token_ids, final=out.finished)
        reason = out.finish_reason
        if self.tracker.stopped:
            reason = "stop"
        return text, reason

    def _usage(self) -> dict:
        p, c = len(self.req.prompt_ids), len(self.req.output_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _choice(self, text: str, ids: list[int], reason: str | None, stream: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "token_ids": ids}
        if stream:
            return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": reason,
                    "token_ids": ids}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason, "token_ids": ids}

    def _envelope(self, choices: list, stream: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        return {"id": self.req.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    async def whole(self, request: Request):
        ids: list[int] = []
        text = []
        reason = None
        try:
            while reason is None:
                try:
                    out = await asyncio.wait_for(self.queue.get(), _DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        self._finish("disconnected")
                        return Response(status_code=499)
                    continue
                if out.error:
                    self._finish("error")
                    return _error(500, out.error, "server_error")
                ids.extend(out.token_ids)
                piece, reason = self._next(out)
                text.append(piece)
        finally:
            if not self.done and reason is None:
                self._finish("disconnected")
        self._finish("ok" if self.req.finish_reason == reason else "stopped")
        body = self._envelope([self._choice("".join(text), ids, reason, False)], False)
        body["usage"] = self._usage()
        return JSONResponse(body)

    async def stream(self, include_usage: bool):
        try:
            if self.chat:
                first = self._choice("", [], None, True)
                first["delta"] = {"role": "assistant", "content": ""}
                yield sse(self._envelope([first], True))
            reason = None
            while reason is None:
                out = await self.queue.get()
                if out.error:
                    self._finish("error")
                    yield sse(error_body(out.error, "server_error"))
                    return
                text, reason = self._next(out)
                yield sse(self._envelope([self._choice(text, out.token_ids, reason, True)], True))
            self._finish("ok" if self.req.finish_reason == reason else "stopped")
            if include_usage:
                usage = self._envelope([], True)
                usage["usage"] = self._usage()
                yield sse(usage)
            yield sse("[DONE]")
        finally:
            # the client went away (the stream task is cancelled) or the response ended early
            self._finish("disconnected")


class ServerThread:
    """A uvicorn server on a background thread (tests, benchmarks): ``port`` 0 takes an ephemeral port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="moe-offload-http", daemon=True)
        self.host = host

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"uvicorn did not start on {self.host} within {timeout} s")
            time.sleep(0.01)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def bind_socket(host: str, port: int):
    """The listening address taken before the model loads (minutes at full size), so a port in use or a host that
    does not resolve is named at once (``ValueError`` naming ``--host`` / ``--port``), not after the load by uvicorn."""
    import socket

    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: a TCP port is in [0, 65535]")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        # IPv4 first where a name has both (localhost -> ::1 and 127.0.0.1): clients of http://127.0.0.1 reach it, as
        # they reached uvicorn's own bind
        family, kind, proto, _, addr = sorted(infos, key=lambda i: i[0] != socket.AF_INET)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: cannot resolve it ({exc.strerror}); pass an address such as 127.0.0.1 or "
                         "0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({exc.strerror}); pick a free port "
                         "(--port 0 takes any) or stop what holds it") from None
    sock.set_inheritable(True)
    return sock


def serve(cfg, serve_cfg: ServeConfig, host: str, port: int) -> int:
    """``moe-offload serve``: take the address, build the engine, start the scheduler, run uvicorn until
    interrupted."""
    import uvicorn

    from moe_offload.engine import Engine

    sock = bind_socket(host, port)
    scheduler = None
    try:
        engine = Engine.from_config(cfg)
        scheduler = Scheduler(engine, serve_cfg).start()
        app = build_app(scheduler, serve_cfg)
        log.info_rank0("serve_listening", host=host, port=sock.getsockname()[1], model=model_name(engine, serve_cfg),
                       max_batch=serve_cfg.max_batch, max_queue=serve_cfg.max_queue,
                       max_model_len=scheduler.max_model_len)
        try:
            uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off")).run(sockets=[sock])
        except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down gracefully, then re-raised the signal; a clean exit
            pass
    finally:
        if scheduler is not None:
            scheduler.stop()
        sock.close()
    return 0
