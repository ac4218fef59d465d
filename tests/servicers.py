"""The middle layer of tests: the broker's servicers called in-process over a real SQLite
store and a real artifact store — no processes, no sockets, no TLS — so a test of what a call
answers and writes takes milliseconds. ``Servicers`` is one broker's state with its
Marketplace and Artifacts servicers; ``call`` runs one RPC as a given key (the caller that
api/auth would have checked), and a refusal comes back as ``Refused`` with the gRPC status
code and message a client would read."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import grpc

from gpumarket.broker.api import auth
from gpumarket.broker.api.artifacts import ArtifactsServicer
from gpumarket.broker.api.marketplace import MarketplaceServicer
from gpumarket.broker.config import BrokerConfig
from gpumarket.broker.money import ledger
from gpumarket.broker.state import BrokerState
from gpumarket.broker.store.artifact_store import ArtifactStore
from gpumarket.broker.store.store import Store, is_postgres, open_store
from gpumarket.client import jobfile
from gpumarket.client.submit import build_spec
from gpumarket.proto.envelope import seal
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import artifacts_pb2 as ap
from gpumarket.proto.v1 import marketplace_pb2 as mp
from gpumarket.proto.v1 import types_pb2 as pb

# The tables a submission writes (tests check that a refused one wrote none of them).
SUBMIT_TABLES = ("jobs", "nonces", "events", "array_tasks", "ledger_postings", "artifact_refs")


class Refused(Exception):
    """What a servicer answered instead of a response: the status a client sees."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


class Context:
    """The part of grpc's ServicerContext the servicers use."""

    async def abort(self, code: grpc.StatusCode, message: str):
        raise Refused(code, message)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


class Servicers:
    """One broker's state over a fresh store, and its servicers: SQLite in ``where``, or
    the PostgreSQL database at ``location`` (a ``postgresql://`` URL, the broker's schema
    applied: conftest's ``store_location``); its artifacts in ``where``. One event loop
    serves every call (``close`` ends it)."""

    def __init__(self, where: Path, location: str = "", **config) -> None:
        self.store = open_store(location, None) if is_postgres(location) \
            else Store(where / "broker.db")
        self.store.open()
        self.state = BrokerState(BrokerConfig(data_dir=where, **config), Identity.generate(),
                                 self.store, ArtifactStore(where / "artifacts", 1 << 30))
        self.marketplace = MarketplaceServicer(self.state)
        self.artifacts = ArtifactsServicer(self.state)
        self._loop = asyncio.Runner()

    def close(self) -> None:
        self._loop.close()
        self.store.close()

    def run(self, coro):
        return self._loop.run(coro)

    def call(self, method: str, request, key: Identity | str):
        """Marketplace.``method``(``request``) as ``key`` (an identity or a key id): its
        response, or Refused."""
        async def go():
            auth._caller.set(key if isinstance(key, str) else key.id)
            return await getattr(self.marketplace, method)(request, Context())
        return self.run(go())

    def stream(self, method: str, request, key: Identity | str) -> list:
        """A server-streaming Marketplace call, read to its end."""
        async def go():
            auth._caller.set(key if isinstance(key, str) else key.id)
            return [m async for m in getattr(self.marketplace, method)(request, Context())]
        return self.run(go())

    def read(self, fn, *args):
        return self.run(self.store.read(fn, *args))

    def write(self, fn, *args):
        return self.run(self.store.write(fn, *args))

    def credit(self, key: Identity, credits: float = 1000.0) -> None:
        self.write(ledger.credit, key.id, ledger.units(credits), "client", "", "operator",
                   f"test-{key.id}-{credits}", now_ms())

    def upload(self, key: Identity, job: jobfile.JobFile) -> list[pb.ArtifactRef]:
        """The job file's inputs, uploaded whole as the client's (Artifacts.UploadBlobs)."""
        named = {}
        for item in job.inputs:
            if item.data is not None:
                named[item.name] = item.data
            elif item.path.is_dir():
                named[item.name] = jobfile.pack_directory(item.path)
            else:
                named[item.name] = item.path.read_bytes()
        return self.put(key, named)

    def put(self, key: Identity, named: dict[str, bytes]) -> list[pb.ArtifactRef]:
        """These bytes, uploaded whole as ``key``'s; a reference to each by its name."""
        blobs = [ap.Blob(sha256=hashlib.sha256(data).hexdigest(), data=data)
                 for data in named.values()]

        async def go():
            async def each():
                yield ap.Blobs(blobs=blobs)
            auth._caller.set(key.id)
            return await self.artifacts.UploadBlobs(each(), Context())
        if blobs:
            self.run(go())
        return [pb.ArtifactRef(name=name, sha256=b.sha256, size_bytes=len(b.data))
                for name, b in zip(named, blobs)]

    def spec(self, key: Identity, path: Path) -> pb.JobSpec:
        """The spec the client builds from the job file at ``path`` (its inputs uploaded)."""
        job = jobfile.load(path)
        return build_spec(job, self.upload(key, job), now_ms())

    def submit(self, key: Identity, spec: pb.JobSpec) -> mp.SubmitJobResponse:
        return self.call("SubmitJob", mp.SubmitJobRequest(spec=seal(key, spec)), key)

    def counts(self, tables=SUBMIT_TABLES) -> dict[str, int]:
        """Rows in each table (what a refused call must leave as it found)."""
        def count(db):
            return {t: db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables}
        return self.read(count)
