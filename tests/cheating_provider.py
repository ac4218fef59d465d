"""A dishonest provider, for the verification tests only (never part of the package): the
real provider daemon whose uploads are doctored at a chosen rate before they leave.

    python -m tests.cheating_provider run --broker ... (the gpumarket-provider arguments)

CHEAT_MODE: ``weights`` flips one bit of the weights in the checkpoints and final weights it
uploads (the state still loads and trains on, as a lazy or sloppy provider's would);
``text`` replaces its completions with another model's text; ``blank`` uploads black frames;
``output`` replaces each JSON output file (``*.json``) a script wrote with made-up figures;
``task`` replaces one JSON output file of the first task each job array lease reports with
made-up figures (the small files a task's results carry, before they are hashed and signed);
``fail`` reports every job it runs as failed by the job's own code (exit status 1, its real
log, and the error CHEAT_FAILURE), once the job ends or after CHEAT_FAIL_AFTER seconds (an
endpoint's replica never ends), signed like an honest provider's report.
CHEAT_RATE: the share of such uploads it doctors (default 1).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import struct
import tempfile
import zlib
from pathlib import Path

import dataclasses
import hashlib

from gpumarket.provider import daemon, executor, task_results
from gpumarket.provider.cli import main

MODE = os.environ.get("CHEAT_MODE", "weights")
RATE = float(os.environ.get("CHEAT_RATE", "1"))
DRAW = random.Random(os.environ.get("CHEAT_SEED"))


def _read(source: Path | int) -> bytes:
    if isinstance(source, int):
        os.lseek(source, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(source, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    return Path(source).read_bytes()


def flip_weight_bit(data: bytes, offset: int, size: int) -> bytes:
    """Flip the lowest bit of the last float32 of a safetensors file at ``offset``."""
    at = offset + size - 4
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]


def doctor(name: str, data: bytes) -> bytes | None:
    if MODE == "weights" and name == "checkpoint.tar":
        size = int(data[124:136].rstrip(b"\0 ").decode(), 8)   # the first member's size
        if data[:17] == b"model.safetensors":
            return flip_weight_bit(data, 512, size)
    if MODE == "weights" and name == "model.safetensors":
        return flip_weight_bit(data, 0, len(data))
    if MODE == "output" and name.endswith(".json"):
        return b'{"made_up": true}'
    if MODE == "text" and name == "completions.jsonl":
        lines = [json.loads(x) for x in data.decode().splitlines() if x.strip()]
        for r in lines:
            r["completion"] = "the quick brown fox jumps over the lazy dog"
        return "".join(json.dumps(r) + "\n" for r in lines).encode()
    if MODE == "blank" and name.startswith("frame_") and name.endswith(".png"):
        width, height = struct.unpack(">II", data[16:24])
        raw = b"".join(b"\0" + b"\0" * (width * 4) for _ in range(height))

        def chunk(kind: bytes, body: bytes) -> bytes:
            return (struct.pack(">I", len(body)) + kind + body
                    + struct.pack(">I", zlib.crc32(kind + body)))

        return (b"\x89PNG\r\n\x1a\n"
                + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return None


real_upload = daemon.ProviderDaemon.upload
_doctoring: asyncio.Lock | None = None


async def cheating_upload(self, source, name, digest=None):
    global _doctoring
    if DRAW.random() < RATE:
        doctored = doctor(name, _read(source))
        if doctored is not None:
            with tempfile.NamedTemporaryFile(delete=False) as f:
                f.write(doctored)
            # One at a time: doctored files may be alike (blank frames) where the originals
            # were not, so the daemon's one upload a content does not hold for them.
            _doctoring = _doctoring or asyncio.Lock()
            try:
                async with _doctoring:
                    return await real_upload(self, Path(f.name), name)
            finally:
                os.unlink(f.name)
    if isinstance(source, int):
        os.lseek(source, 0, os.SEEK_SET)
    return await real_upload(self, source, name, digest)


daemon.ProviderDaemon.upload = cheating_upload

FAILURE = os.environ.get("CHEAT_FAILURE", "CUDA error: an illegal memory access was encountered")
FAIL_AFTER = float(os.environ.get("CHEAT_FAIL_AFTER", "-1"))    # < 0: when the job ends
real_run = executor.JobProcess.run


async def failing_run(self):
    running = asyncio.ensure_future(real_run(self))
    if FAIL_AFTER >= 0:
        done, _ = await asyncio.wait({running}, timeout=FAIL_AFTER)
        if not done:
            await self.stop()
    outcome = await running
    return executor.Outcome(1, None, False, f"job exited with code 1: {FAILURE}",
                            outcome.wall_seconds, False)


real_read_outputs = task_results.TaskResults.read_outputs


def doctored_outputs(self, tasks):
    """The lease's first task's first small JSON output made up (its siblings' left alone):
    the receipt the provider signs for it names the made-up file."""
    found = real_read_outputs(self, tasks)
    if not hasattr(self, "cheat_task"):
        self.cheat_task = min(tasks)        # the first task the lease reports
    outs = found.get(self.cheat_task)
    if isinstance(outs, list):
        for i, o in enumerate(outs):
            if o.data is not None and o.name.endswith(".json"):
                data = b'{"made_up": true}'
                outs[i] = dataclasses.replace(o, data=data, size=len(data),
                                              sha256=hashlib.sha256(data).hexdigest())
                break
    return found


if MODE == "task":
    task_results.TaskResults.read_outputs = doctored_outputs

if MODE == "fail":
    executor.JobProcess.run = failing_run

if __name__ == "__main__":
    main()
