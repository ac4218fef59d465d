"""An endpoint replica's link to its engine (docs/serving.md): the engine child's stdin is one
end of a Unix socket pair, the daemon holds the other. Requests from the broker are checked
and go down it as lines of the engine protocol (kinds/engine_protocol.py); what the engine writes back (ready, text pieces, the final answer) goes to the
broker as InferenceChunks over the provider's own session. The engine is the job's code:
its lines are bounded, checked for their request id, and never parsed beyond that."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from gpumarket.kinds.engine_protocol import (
    BadRequest, Final, decode_request, encode_answer, request_line,
)
from gpumarket.proto.ratelimit import RateLimiter
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.provider import reports

log = logging.getLogger(__name__)

MAX_LINE = 1 << 20          # one line from the engine (a chunk of text, or embeddings)
MAX_CHUNK = 64 * 1024       # what one InferenceChunk carries; longer lines are cut into pieces
MAX_OPEN = 4096             # requests open on one replica at once
MAX_ANSWER = 64 << 20       # bytes of one request's answer (the broker's limit too)
MAX_UNREAD = 64 << 20       # request bytes the engine has not read yet
# Chunks all of this daemon's replicas may send, half what the broker takes from a session
# (sessions.CHUNKS_PER_S): an engine past it has its link closed (its replica fails) before
# the broker would end the provider's whole session. Lines the engine writes within one pass
# of the event loop go out as one chunk per request, so a busy replica sends fewer.
CHUNKS_PER_S = 10_000
CHUNKS = RateLimiter(CHUNKS_PER_S, CHUNKS_PER_S * 2)


class EngineLink:
    def __init__(self, send: Callable[[gw.ProviderMessage], None],
                 on_ready: Callable[[gw.ReplicaReady], None]) -> None:
        self.send = send
        self.on_ready = on_ready
        self.ready: gw.ReplicaReady | None = None
        self.open: dict[str, int] = {}     # request id sent to the engine -> answer bytes so far
        self._out: dict[str, bytearray] = {}   # lines not sent yet, by request
        self._ending: set[str] = set()         # ... of which this is the last
        self._flushing = False
        self._ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._ours.setblocking(False)
        self.child_fd = theirs.detach()     # the engine's stdin; JobProcess closes it here
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None

    async def start(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(sock=self._ours,
                                                                  limit=MAX_LINE + 1)
        self._reader_task = asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                try:
                    line = await reader.readuntil(b"\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    break       # the engine closed its end: it exited
                except asyncio.LimitOverrunError:
                    log.warning("replica engine wrote a line over %d bytes; closing it",
                                MAX_LINE)
                    break
                self._handle(line)
        finally:
            self.close()

    def _handle(self, line: bytes) -> None:
        try:
            message = reports.engine_line(line)
        except reports.Malformed:
            return
        if isinstance(message, reports.EngineReady):
            if self.ready is None:
                self.ready = gw.ReplicaReady(
                    engine=message.engine, task=message.task,
                    max_concurrency=message.max_concurrency, max_seq_len=message.max_seq_len)
                self.on_ready(self.ready)
            return
        request_id = message.request_id
        if request_id not in self.open:
            return
        last = message.last
        self.open[request_id] += len(line)
        if self.open[request_id] > MAX_ANSWER and not last:
            self.cancel(request_id)
            self._out.pop(request_id, None)
            self._fail(request_id, "the replica's answer is too large", 502)
            return
        if last:
            del self.open[request_id]
            self._ending.add(request_id)
        self._out.setdefault(request_id, bytearray()).extend(line)
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send what the engine wrote since the last pass, one chunk per request (or one per
        MAX_CHUNK of it)."""
        self._flushing = False
        out, self._out = self._out, {}
        for request_id, data in out.items():
            last = request_id in self._ending
            self._ending.discard(request_id)
            for i in range(0, len(data), MAX_CHUNK):
                if not CHUNKS.allow(""):
                    log.warning("replica engines wrote more than %d chunks a second; closing"
                                " this one", CHUNKS_PER_S)
                    self.close()
                    return
                self.send(gw.ProviderMessage(chunk=gw.InferenceChunk(
                    request_id=request_id, data=bytes(data[i:i + MAX_CHUNK]),
                    last=last and i + MAX_CHUNK >= len(data))))

    def forward(self, request: gw.InferenceRequest) -> str:
        """Hand a request to the engine; "" if taken, else why not."""
        if self._writer is None or self._writer.is_closing() or self.ready is None:
            return "the replica is not ready"
        if len(self.open) >= MAX_OPEN or request.request_id in self.open:
            return "the replica has too many open requests"
        if self._writer.transport.get_write_buffer_size() > MAX_UNREAD:
            return "the replica is not reading its requests"
        try:
            body = decode_request(request.body)
        except BadRequest as exc:
            return exc.message
        self.open[request.request_id] = 0
        self._writer.write(request_line(request.request_id, body))
        return ""

    def cancel(self, request_id: str) -> None:
        if request_id in self.open and self._writer is not None and not self._writer.is_closing():
            del self.open[request_id]
            self._writer.write(request_line(request_id, None))

    def _fail(self, request_id: str, why: str, status: int) -> None:
        self.send(gw.ProviderMessage(chunk=gw.InferenceChunk(
            request_id=request_id, last=True, data=encode_answer(Final.failed(why, status)))))

    def close(self) -> None:
        """The engine is gone (or the replica stops): what it still owed ends in an error."""
        self._out.clear()
        owed = set(self.open) | self._ending
        self._ending.clear()
        for request_id in sorted(owed):
            self._fail(request_id, "the replica stopped", 503)
        self.open.clear()
        if self._writer is not None:
            self._writer.close()
        elif self._ours.fileno() >= 0:
            self._ours.close()
        if self._reader_task is not None and self._reader_task is not asyncio.current_task():
            self._reader_task.cancel()
