"""A stand-in for ``llama-server`` for lifecycle tests (the real one is used end to end).

It accepts llama-server's flags, answers ``--version``, serves ``/health`` (503 "Loading
model" while loading, then 200) and the OpenAI routes (chat completions and completions,
streamed or not, and embeddings), and has fault modes chosen with the environment
variable ``FAKE_LLAMA_MODE`` (comma-separated):

* ``load_s=<seconds>`` -- stay "loading" this long (default 0.2);
* ``hold_file=<path>`` -- past ``load_s``, stay "loading" while ``path`` exists: a test holds
  a launch (and its job) in progress for as long as it needs, then removes the file; once
  ready, the stand-in stays ready whatever happens to the file;
* ``exit_at_start`` -- print an error and exit with status 3 before listening;
* ``crash_after_ready_s=<seconds>`` -- exit with status 134 that long after becoming ready;
* ``hang`` -- listen but never become ready;
* ``ignore_sigterm`` -- ignore SIGTERM, printing ``SIGTERM ignored`` (only SIGKILL stops it);
* ``token_delay_s=<seconds>`` -- delay between streamed tokens (default 0.01);
* ``requests_log=<file>`` -- append one JSON line ``{"path", "body", "port"}`` per POST received,
  and ``{"event": "closed", "path", "after_s"}`` when the client closes its connection while
  the stand-in is still "generating" (``after_s``: seconds since the request arrived) --
  how a test sees that the gateway cancelled the engine's work.

Engine faults, for the gateway's supervision (each waits by watching the socket, so a client
that closes is noticed at once and logged as ``closed``):

* ``hang_completions`` -- ``/health`` answers 200, but chat completions and completions
  (plain or streamed) are never answered: no status line, the connection stays open;
* ``reply_delay_s=<seconds>`` -- a plain (non-streamed) completion is answered only after
  this long;
* ``first_token_delay_s=<seconds>`` -- a stream's headers go out at once, its first event
  this long after (llama-server itself sends the headers with the first event: this mode
  reaches the part of the gateway that relays an open stream);
* ``stall_after_events=<n>`` -- a stream stops after ``n`` events and then sends nothing
  more, keeping the connection open;
* ``drop_completions`` -- ``/health`` answers 200, but each chat completion and completion
  has its connection closed at once, before any status line (an engine that fails a request
  before answering it);
* ``peer_502=reached|unreached`` -- each completion is answered 502 ``upstream_unavailable``
  as a peer host's gateway answers when its engine failed, with ``X-Sbproxy-Engine-Reached:
  no`` for ``unreached`` (its engine's port refused the connection: nothing ran);
* ``cut_completions`` -- a plain (non-streamed) completion gets its status line and headers
  (``Content-Length`` of the whole answer), half its body, and then its connection closed
  (a server that fails while its answer is being read).

The end of a stream, spread out in time (each wait watches the socket like the faults
above), so that a client that stops reading at the last event or at ``data: [DONE]`` and
closes is certain to close before the engine's body has ended:

* ``done_delay_s=<seconds>`` -- wait this long between the last event and ``[DONE]``;
* ``end_delay_s=<seconds>`` -- wait this long between ``[DONE]`` and the end of the
  chunked body.

Usage is reported as llama-server does: in every plain answer; in the last event of a
streamed completion; and in a streamed chat completion only when
``stream_options.include_usage`` is true, as an extra last event with ``choices: []``.

``FAKE_LLAMA_RECORD=<file>`` makes it write its argv and environment there as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

VERSION_TEXT = "version: 9999 (fake)\nbuilt with fake for testing\n"


def _modes() -> dict[str, str]:
    modes: dict[str, str] = {}
    for item in os.environ.get("FAKE_LLAMA_MODE", "").split(","):
        key, _, value = item.strip().partition("=")
        if key:
            modes[key] = value
    return modes


# A launch with ``--seed 666`` exits at start like ``exit_at_start``: tests use it to make one
# generation of a deployment fail (its definition changed) while the prior one works.
FAIL_SEED = 666


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llama-server", add_help=False)
    parser.add_argument("--version", action="store_true")
    parser.add_argument("--model", "-m")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--ctx-size", "-c", type=int, default=4096)
    parser.add_argument("--parallel", "-np", type=int, default=1)
    parser.add_argument("--n-gpu-layers", "-ngl", type=int, default=0)
    parser.add_argument("--cache-type-k")
    parser.add_argument("--cache-type-v")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--ubatch-size", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--flash-attn", action="store_true")
    parser.add_argument("--no-mmap", action="store_true")
    parser.add_argument("--mlock", action="store_true")
    parser.add_argument("--split-mode")
    parser.add_argument("--tensor-split")
    return parser


class _State:
    def __init__(self, load_s: float, model: str | None, token_delay_s: float) -> None:
        self.ready_at = time.monotonic() + load_s
        self.model = model or "unknown.gguf"
        self.token_delay_s = token_delay_s
        self.hang = False
        self.hang_completions = False
        self.drop_completions = False
        self.cut_completions = False
        self.peer_502: bool | None = None
        self.requests_log: str | None = None
        self.log_lock = threading.Lock()
        self.reply_delay_s = 0.0
        self.first_token_delay_s = 0.0
        self.done_delay_s = 0.0
        self.end_delay_s = 0.0
        self.stall_after_events: int | None = None
        self.hold_file: str | None = None
        self.loaded = False

    @property
    def ready(self) -> bool:
        if not self.loaded:
            held = self.hold_file is not None and os.path.exists(self.hold_file)  # noqa: PTH110
            self.loaded = not self.hang and time.monotonic() >= self.ready_at and not held
        return self.loaded


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: _State
    started = 0.0  # monotonic time the current POST arrived

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        sys.stderr.write("fake-llama: " + (format % args) + "\n")

    def _json(
        self,
        status: int,
        body: dict[str, Any],
        *,
        cut: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data[: len(data) // 2] if cut else data)

    def do_GET(self) -> None:
        if self.path == "/health":
            if self.state.ready:
                self._json(200, {"status": "ok"})
            else:
                self._json(503, {"error": {"code": 503, "message": "Loading model"}})
        elif self.path in ("/v1/models", "/models"):
            self._json(
                200, {"object": "list", "data": [{"id": self.state.model, "object": "model"}]}
            )
        else:
            self._json(404, {"error": {"code": 404, "message": "not found"}})

    def _log(self, record: dict[str, Any]) -> None:
        if self.state.requests_log:
            with self.state.log_lock, open(self.state.requests_log, "a") as log:  # noqa: PTH123
                log.write(json.dumps(record) + "\n")

    def _log_closed(self) -> None:
        after_s = round(time.monotonic() - self.started, 3)
        self._log({"event": "closed", "path": self.path, "after_s": after_s})

    def _closed_within(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True (and a ``closed`` log line) as soon as the client
        has closed its connection."""
        deadline = time.monotonic() + seconds
        sock = self.connection
        while (remaining := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([sock], [], [], remaining)
            if not readable:
                continue
            try:
                peeked = sock.recv(1, socket.MSG_PEEK)
            except OSError:
                peeked = b""
            if peeked:  # bytes of a next request, not a close: just wait out the delay
                time.sleep(max(0.0, deadline - time.monotonic()))
                return False
            self._log_closed()
            return True
        return False

    def _hang(self) -> None:
        while not self._closed_within(3600):
            pass

    def do_POST(self) -> None:
        self.started = time.monotonic()
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            self._json(400, {"error": {"code": 400, "message": "bad json"}})
            return
        self._log(
            {"path": self.path, "body": body, "port": getattr(self.server, "server_port", None)}
        )
        if not self.state.ready:
            self._json(503, {"error": {"code": 503, "message": "Loading model"}})
            return
        if self.path == "/v1/embeddings":
            self._json(
                200,
                {
                    "object": "list",
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
                    "model": self.state.model,
                    "usage": {"prompt_tokens": 3, "total_tokens": 3},
                },
            )
            return
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            self._json(404, {"error": {"code": 404, "message": "not found"}})
            return
        self._complete(body)

    def _complete(self, body: dict[str, Any]) -> None:
        if self.state.hang_completions:
            self._hang()
            self.close_connection = True
            return
        if self.state.drop_completions:
            self.close_connection = True
            return
        if self.state.peer_502 is not None:
            # As a peer host's gateway answers when its engine failed: reached or not.
            error = {"message": "the engine did not answer", "code": "upstream_unavailable"}
            extra = {} if self.state.peer_502 else {"X-Sbproxy-Engine-Reached": "no"}
            self._json(502, {"error": error}, headers=extra)
            return
        chat = self.path == "/v1/chat/completions"
        words = ["fake", " reply", " from", " the", " stand-in"]
        words = words[: max(1, min(len(words), int(body.get("max_tokens") or len(words))))]
        if body.get("stream"):
            options = body.get("stream_options") or {}
            self._stream(words, chat=chat, include_usage=options.get("include_usage") is True)
            return
        if self.state.reply_delay_s and self._closed_within(self.state.reply_delay_s):
            self.close_connection = True
            return
        if self.state.cut_completions:
            self.close_connection = True
            self._json(200, {"content": "x" * 64}, cut=True)
            return
        text = "".join(words)
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            if chat
            else {"index": 0, "text": text, "finish_reason": "stop"}
        )
        self._json(
            200,
            {
                "id": "fake-1",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.state.model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": 5,
                    "completion_tokens": len(words),
                    "total_tokens": 5 + len(words),
                },
            },
        )

    def _stream(self, words: list[str], *, chat: bool, include_usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(payload: str) -> None:
            data = f"data: {payload}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        usage = {
            "prompt_tokens": 5,
            "completion_tokens": len(words),
            "total_tokens": 5 + len(words),
        }
        state = self.state
        try:
            if state.first_token_delay_s and self._closed_within(state.first_token_delay_s):
                self.close_connection = True
                return
            for index, word in enumerate(words):
                if state.stall_after_events is not None and index >= state.stall_after_events:
                    self._hang()
                    self.close_connection = True
                    return
                delta = {"content": word} if chat else None
                choice = (
                    {"index": 0, "delta": delta, "finish_reason": None}
                    if chat
                    else {"index": 0, "text": word, "finish_reason": None}
                )
                event: dict[str, Any] = {
                    "id": "fake-1",
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "model": self.state.model,
                    "choices": [choice],
                }
                if not chat and index == len(words) - 1:
                    event["usage"] = usage  # llama-server: always, on the last event
                send(json.dumps(event))
                if self._closed_within(state.token_delay_s):
                    self.close_connection = True
                    return
            if chat and include_usage:
                send(
                    json.dumps(
                        {
                            "id": "fake-1",
                            "object": "chat.completion.chunk",
                            "model": self.state.model,
                            "choices": [],
                            "usage": usage,
                        }
                    )
                )
            if state.done_delay_s and self._closed_within(state.done_delay_s):
                self.close_connection = True
                return
            send("[DONE]")
            if state.end_delay_s and self._closed_within(state.end_delay_s):
                self.close_connection = True
                return
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self._log_closed()
            self.close_connection = True


def main(argv: list[str] | None = None) -> int:
    args, unknown = _parser().parse_known_args(argv)
    if args.version:
        sys.stdout.write(VERSION_TEXT)
        return 0
    record = os.environ.get("FAKE_LLAMA_RECORD")
    if record:
        with open(record, "w") as handle:  # noqa: PTH123 - plain stdlib stand-in
            json.dump(
                {"argv": sys.argv[1:] if argv is None else argv, "env": dict(os.environ)}, handle
            )
    modes = _modes()
    if unknown:
        sys.stderr.write(f"error: invalid argument: {unknown[0]}\n")
        return 1
    if "exit_at_start" in modes or args.seed == FAIL_SEED:
        sys.stderr.write("error: failed to load model (fake exit_at_start)\n")
        return 3
    if "ignore_sigterm" in modes:

        def ignore(signum: int, frame: object) -> None:
            sys.stderr.write("fake-llama: SIGTERM ignored\n")
            sys.stderr.flush()

        signal.signal(signal.SIGTERM, ignore)
    state = _State(
        float(modes.get("load_s") or 0.2), args.model, float(modes.get("token_delay_s") or 0.01)
    )
    state.hang = "hang" in modes
    state.hold_file = modes.get("hold_file") or None
    state.hang_completions = "hang_completions" in modes
    state.drop_completions = "drop_completions" in modes
    state.cut_completions = "cut_completions" in modes
    if "peer_502" in modes:
        state.peer_502 = modes["peer_502"] == "reached"
    state.requests_log = modes.get("requests_log") or None
    state.reply_delay_s = float(modes.get("reply_delay_s") or 0)
    state.first_token_delay_s = float(modes.get("first_token_delay_s") or 0)
    state.done_delay_s = float(modes.get("done_delay_s") or 0)
    state.end_delay_s = float(modes.get("end_delay_s") or 0)
    if modes.get("stall_after_events"):
        state.stall_after_events = int(modes["stall_after_events"])
    _Handler.state = state
    server = ThreadingHTTPServer((args.host, args.port), _Handler)
    sys.stderr.write(f"main: server is listening on http://{args.host}:{args.port}\n")
    sys.stderr.flush()
    if "crash_after_ready_s" in modes:
        delay = float(modes["crash_after_ready_s"] or 0.5)

        def crash() -> None:
            while not state.ready:
                time.sleep(0.05)
            time.sleep(delay)
            sys.stderr.write("GGML_ASSERT: fake crash after ready\n")
            sys.stderr.flush()
            os._exit(134)

        threading.Thread(target=crash, daemon=True).start()
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
