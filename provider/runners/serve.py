"""The endpoint runner: keeps one model loaded for the life of a lease and serves the
daemon's requests over the connected unix socket it gets as fd 0; stdout and stderr are the
job's log.

    python -m gpumarket.provider.runners.serve WORKDIR
    python -m gpumarket.provider.runners.serve --bench MODEL_DIR [ENGINE [REQUESTS [TOKENS]]]

The second form runs REQUESTS concurrent completions of TOKENS tokens in process through the
same Engine interface and prints the wall time and tokens/s (engine.py has the figures);
ENGINE "batch-calls" is the batcher's former path (one ``generate`` call at a time), kept
for that comparison.

The socket carries one JSON object a line each way, in the endpoint's engine protocol
(kinds/engine_protocol.py, which checks each request again here): the daemon sends requests
(complete, embed) and cancels, each with its "id". The runner answers its Ready line once
loaded, then per request its pieces and one final: figures, embeddings, or an error with its
status (400 a bad request, 429 too many in flight, 500 the engine failed; "id" is null for
a line with no usable id). A cancelled request gets nothing more. EOF on the socket ends the
runner with status 0.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from gpumarket.kinds.engine_protocol import (
    Answer, BadRequest, Complete, Embed, Final, Ready, answer_line, read_line,
)
from gpumarket.provider.runners.base import JobError, apply_share, read_job
from gpumarket.provider.runners.engine import Engine, load_engine

log = logging.getLogger(__name__)

MAX_LINE = 4 << 20  # bytes of one request line
READ_CHUNK = 1 << 16
IN_FLIGHT_PER_SLOT = 4  # requests in flight (running or waiting) per max_concurrency slot
BENCH_ROUNDS = 5
BENCH_PROMPTS = ["the quick brown fox", "a marketplace for idle gpus runs",
                 "providers advertise devices with a price and the broker",
                 "checkpoints let a job resume on another provider after a failure"]


async def lines(reader: asyncio.StreamReader) -> AsyncIterator[bytes | None]:
    """The socket's lines without their newline, until EOF; None in place of a line over
    MAX_LINE, whose bytes are skipped."""
    buf, scanned, skipping = bytearray(), 0, False
    while chunk := await reader.read(READ_CHUNK):
        buf += chunk
        while (end := buf.find(b"\n", scanned)) >= 0:
            line = bytes(buf[:end])
            del buf[:end + 1]
            scanned = 0
            if skipping:  # the end of a line already refused
                skipping = False
            else:
                yield line if len(line) <= MAX_LINE else None
        scanned = len(buf)
        if len(buf) > MAX_LINE:
            if not skipping:
                yield None
            buf.clear()
            scanned, skipping = 0, True


class Server:
    """One daemon connection: a task per request, every answer through one writer task."""

    def __init__(self, engine: Engine, writer: asyncio.StreamWriter) -> None:
        self.engine, self.writer = engine, writer
        self.outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.running: dict[str, asyncio.Task] = {}
        self.limit = IN_FLIGHT_PER_SLOT * engine.max_concurrency

    def send(self, line: bytes) -> None:
        self.outbox.put_nowait(line)

    def answer(self, request_id: str | None, message: Answer) -> None:
        self.send(answer_line(request_id, message))

    def refuse(self, request_id: str | None, why: str, status: int = 400) -> None:
        self.answer(request_id, Final.failed(why, status))

    async def write_all(self) -> None:
        try:
            while True:
                self.writer.write(await self.outbox.get())
                await self.writer.drain()
        except ConnectionError:
            log.info("the daemon's socket closed while answering")

    def handle(self, line: bytes | None) -> None:
        """Start, cancel or refuse what one line asks; never raises."""
        if line is None:
            return self.refuse(None, f"a line over {MAX_LINE} bytes")
        if not line.strip():
            return None
        try:
            rid, request = read_line(line)
        except BadRequest as exc:
            return self.refuse(exc.request_id, exc.message)
        if request is None:     # a cancel
            task = self.running.pop(rid, None)
            self.engine.cancel(rid)
            if task is not None:
                task.cancel()
            return None
        if rid in self.running:
            return self.refuse(rid, "a request with this id is already in flight")
        if len(self.running) >= self.limit:
            return self.refuse(rid, f"{len(self.running)} requests in flight, this"
                                    " replica's limit; retry later", 429)
        task = asyncio.get_running_loop().create_task(self.serve_one(rid, request))
        self.running[rid] = task
        task.add_done_callback(lambda t: self.running.pop(rid, None)
                               if self.running.get(rid) is t else None)
        return None

    async def serve_one(self, rid: str, request: Complete | Embed) -> None:
        try:
            if isinstance(request, Embed):
                self.answer(rid, await self.engine.embed(request.input))
            else:
                async for event in self.engine.complete(rid, request):
                    self.answer(rid, event)
        except Exception:
            log.exception("request %s failed", rid)
            self.refuse(rid, "the engine failed on this request", 500)

    async def stop(self) -> None:
        for task in list(self.running.values()):
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)


async def serve(engine: Engine, sock: socket.socket, model: str) -> None:
    """Answer the daemon until it closes the socket."""
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    server = Server(engine, writer)
    server.send(Ready(engine.description, engine.task, engine.max_concurrency,
                      engine.max_seq_len, model).line())
    writing = asyncio.get_running_loop().create_task(server.write_all())
    try:
        async for line in lines(reader):
            server.handle(line)
    except ConnectionError:
        pass
    finally:
        print("the daemon closed the socket: stopping", flush=True)
        await server.stop()
        await engine.close()
        writing.cancel()
        writer.close()


async def bench(model_dir: Path, engine_name: str, requests: int, tokens: int) -> str:
    """REQUESTS concurrent greedy completions of TOKENS tokens, BENCH_ROUNDS times after one
    warm-up request; returns a line of figures (the median round's wall time)."""
    import torch

    from gpumarket.kinds.runner_job import RunnerJob

    calls = engine_name == "batch-calls"
    job = RunnerJob(params={"model_name": model_dir.name,
                            "engine": "batch" if calls else engine_name},
                    model_dir=str(model_dir),
                    device="cuda" if torch.cuda.is_available() else "cpu")
    engine = load_engine(job, model_dir)
    if calls:
        from gpumarket.provider.runners.batching import BatchEngine
        from gpumarket.provider.runners.engine import Settings

        loaded = engine
        engine = BatchEngine(loaded.tokenizer, loaded.model, Settings.from_params(job.params),
                             loaded.max_seq_len, stepwise=False)
        await loaded.close()

    async def one(i: int) -> Final:
        request = Complete(prompt=BENCH_PROMPTS[i % len(BENCH_PROMPTS)], max_tokens=tokens,
                           temperature=0.0)
        return [event async for event in engine.complete(f"bench-{i}", request)][-1]

    await one(-1)
    walls, cpus = [], []
    for _ in range(BENCH_ROUNDS):
        began, cpu = time.perf_counter(), time.process_time()
        finals = await asyncio.gather(*(one(i) for i in range(requests)))
        walls.append(time.perf_counter() - began)
        cpus.append(time.process_time() - cpu)
    await engine.close()
    wall, cpu = sorted(walls)[len(walls) // 2], sorted(cpus)[len(cpus) // 2]
    produced = sum(f.output_tokens for f in finals)
    ttft = sorted(f.ttft_s for f in finals)[len(finals) // 2]
    # CPU time per token: steadier than tokens/s where other work shares the host
    return (f"{engine.description}, max_concurrency {engine.max_concurrency}: {requests} x"
            f" {tokens} tokens in {wall * 1000:.0f} ms wall, {produced} tokens,"
            f" {produced / wall:,.0f} tokens/s, {cpu * 1000 / max(1, produced):.2f} CPU ms"
            f" a token, ttft p50 {ttft * 1000:.0f} ms")


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    args = sys.argv[1:]
    if args[:1] == ["--bench"] and 2 <= len(args) <= 5:
        defaults = [args[1], "auto", "16", "16"]
        path, name, requests, tokens = args[1:] + defaults[len(args) - 1:]
        print(asyncio.run(bench(Path(path), name, int(requests), int(tokens))), flush=True)
        return 0
    if len(args) != 1:
        print("usage: python -m gpumarket.provider.runners.serve WORKDIR", file=sys.stderr)
        return 2
    workdir = Path(args[0])
    try:
        try:
            sock = socket.socket(fileno=0)
        except OSError as exc:
            raise JobError("fd 0 must be the daemon's connected unix socket") from exc
        for note in apply_share():      # its cores, or its share of a GPU
            print(f"note: {note}", file=sys.stderr)
        job = read_job(workdir)
        if job.check_of:    # a check of another replica's answers (answer_check.py)
            from gpumarket.provider.runners.answer_check import run_check
            from gpumarket.provider.runners.report import Reporter

            run_check(job, workdir, Reporter())
            return 0
        began = time.perf_counter()
        print("loading the model", flush=True)
        engine = load_engine(job, workdir)
    except JobError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"ready in {time.perf_counter() - began:.1f} s: {engine.description}", flush=True)
    params = job.params
    asyncio.run(serve(engine, sock, params.get("model_name") or params.get("model") or ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
