"""An endpoint replica's link to its engine (docs/serving.md): the engine child's stdin is one
end of a Unix socket pair, the daemon holds the other. Requests from the broker go down it
as JSON lines; what the engine writes back (ready, text pieces, the final answer) goes to the
broker as InferenceChunks over the provider's own session. The engine is the job's code:
its lines are bounded, checked for their request id, and never parsed beyond that."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable

from gpumarket.proto.v1 import gateway_pb2 as gw

log = logging.getLogger(__name__)

MAX_LINE = 1 << 20          # one line from the engine (a chunk of text, or embeddings)
MAX_CHUNK = 64 * 1024       # what one InferenceChunk carries; longer lines are cut into pieces
MAX_OPEN = 4096             # requests open on one replica at once


class EngineLink:
    def __init__(self, send: Callable[[gw.ProviderMessage], None],
                 on_ready: Callable[[gw.ReplicaReady], None]) -> None:
        self.send = send
        self.on_ready = on_ready
        self.ready: gw.ReplicaReady | None = None
        self.open: set[str] = set()        # request ids sent to the engine, not yet answered
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
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError:
                break       # the engine closed its end: it exited
            except asyncio.LimitOverrunError:
                log.warning("replica engine wrote a line over %d bytes; closing it", MAX_LINE)
                break
            self._handle(line)
        self.close()

    def _handle(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            return
        if not isinstance(message, dict):
            return
        if message.get("event") == "ready" and self.ready is None:
            def count(key: str) -> int:
                value = message.get(key)
                return value if type(value) is int and 0 < value < 2**31 else 0
            self.ready = gw.ReplicaReady(
                engine=str(message.get("engine", ""))[:200],
                task=str(message.get("task", ""))[:20],
                max_concurrency=count("max_concurrency"), max_seq_len=count("max_seq_len"))
            self.on_ready(self.ready)
            return
        request_id = message.get("id")
        if not isinstance(request_id, str) or request_id not in self.open:
            return
        last = bool(message.get("done"))
        if last:
            self.open.discard(request_id)
        for i in range(0, max(len(line), 1), MAX_CHUNK):
            piece = line[i:i + MAX_CHUNK]
            self.send(gw.ProviderMessage(chunk=gw.InferenceChunk(
                request_id=request_id, data=piece, last=last and i + MAX_CHUNK >= len(line))))

    def forward(self, request: gw.InferenceRequest) -> str:
        """Hand a request to the engine; "" if taken, else why not."""
        if self._writer is None or self._writer.is_closing() or self.ready is None:
            return "the replica is not ready"
        if len(self.open) >= MAX_OPEN or request.request_id in self.open:
            return "the replica has too many open requests"
        try:
            body = json.loads(request.body)
        except ValueError:
            return "the request is not JSON"
        if not isinstance(body, dict):
            return "the request is not a JSON object"
        body["id"] = request.request_id
        self.open.add(request.request_id)
        self._writer.write(json.dumps(body).encode() + b"\n")
        return ""

    def cancel(self, request_id: str) -> None:
        if request_id in self.open and self._writer is not None and not self._writer.is_closing():
            self.open.discard(request_id)
            self._writer.write(json.dumps({"id": request_id, "op": "cancel"}).encode() + b"\n")

    def close(self) -> None:
        """The engine is gone (or the replica stops): what it still owed ends in an error."""
        for request_id in sorted(self.open):
            self.send(gw.ProviderMessage(chunk=gw.InferenceChunk(
                request_id=request_id, last=True,
                data=json.dumps({"error": "the replica stopped", "status": 503,
                                 "done": True}).encode())))
        self.open.clear()
        if self._writer is not None:
            self._writer.close()
        elif self._ours.fileno() >= 0:
            self._ours.close()
        if self._reader_task is not None and self._reader_task is not asyncio.current_task():
            self._reader_task.cancel()
