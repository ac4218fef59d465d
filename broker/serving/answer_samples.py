"""A sample of each endpoint's answers, kept for a check of them (docs/verification.md,
Endpoint answers): the request as its replica's engine got it, the token ids the replica says
it generated and the fingerprints it committed to in its final message (an embed endpoint's:
the vectors it returned). The router draws and
bounds the sample in memory (no write for an answer not kept); each answer kept is written
to the store as it is kept (``keep``, table ``answer_samples``, one small transaction by
``StoreWriter``), and the autoscaler takes a window's kept answers from there when it settles
the replica's pay (``take_stored``; broker/checks/answers.py turns them into a check), so a
broker restart or a new leader still checks the window. No grpc here.

Which answers: each with probability ``rate`` (the broker's ``answer_check_rate``), drawn
from the system's random source when the request arrives, before any replica is chosen, and
never told to the replica (every answer of a generate replica must carry its token ids
and, unless its engine is vLLM, its fingerprints, whatever its engine: so a replica cannot
tell which are kept). A replica of a provider still in its
warm-up (its check rate 1, broker/checks/verification.py) also has the first answer of each
window kept, so every window of a new provider's replica is checked. A stranger's prompts are
hostile in size: a replica's window keeps at most MAX_PER_WINDOW answers and
MAX_REPLICA_BYTES, an endpoint's replicas MAX_ENDPOINT_BYTES together; an answer that does not
fit is not kept (a later, smaller one may be)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass, field

from sqlite_utils import Database

from gpumarket.proto.jobspec import now_ms

log = logging.getLogger(__name__)

MAX_PER_WINDOW = 64               # answers kept per replica per window (answer_check.MAX_SAMPLES)
MAX_REPLICA_BYTES = 2 << 20       # request + token ids + fingerprints kept per replica per window
MAX_ENDPOINT_BYTES = 8 << 20      # ... and over all of an endpoint's replicas
DEFAULT_RATE = 0.02
EMBED_VALUE_BYTES = 24            # a kept vector's number as JSON text, at most (-1.23...e-05)


@dataclass
class Window:
    """What one replica lease's current window kept."""

    lease_id: str
    job_id: str
    endpoint_id: str
    provider_id: str
    answers: int = 0                              # answers it gave in the window
    drawn: int = 0                                # of the kept, those the rate drew
    samples: list[dict] = field(default_factory=list)
    bytes: int = 0


@dataclass(frozen=True)
class Kept:
    """One answer kept, as it is written to the store (``keep``)."""

    lease_id: str
    job_id: str
    endpoint_id: str
    provider_id: str
    answers: int            # answers the replica had given in its window when this was kept
    drawn: bool             # drawn at the rate (False: kept as a warm-up window's first)
    sample: dict            # {"request", "token_ids", "fingerprints"}
    bytes: int              # its size as the bounds count it


class AnswerSamples:
    def __init__(self, rate: float = DEFAULT_RATE, draw=None, keep=None) -> None:
        self.rate = rate
        self.draw = draw or random.SystemRandom().random
        # Called with each Kept as it is kept (None: held in memory only): the broker's
        # StoreWriter, which writes it to the store.
        self.keep = keep
        self.windows: dict[str, Window] = {}      # by replica lease id
        self.endpoint_bytes: dict[str, int] = {}
        # Providers past their warm-up (set by the autoscaler from their check records): only
        # their replicas go without the first-answer minimum. Unknown = new.
        self.settled: frozenset[str] = frozenset()

    def wants(self, endpoint_id: str, replicas) -> bool | None:
        """At a request's arrival: True if it is drawn at the rate; None if it is not but a
        replica of the endpoint (``replicas``: router Replicas) that checks its answers has
        no sample yet this window (kept only if that replica answers it); False otherwise."""
        if self.rate > 0 and self.draw() < self.rate:
            return True
        for r in replicas:
            if r.fingerprinted and r.provider_id not in self.settled:
                w = self.windows.get(r.lease_id)
                if w is None or not w.samples:
                    return None
        return False

    def offer(self, replica, request: bytes | None, final, drawn: bool) -> bool:
        """A completion ``final`` (engine_protocol.Final) answered ``request`` (its bytes as
        the engine got them; None where ``wants`` said no: only counted) on ``replica``:
        keep it if ``drawn``, or as the window's first of a replica in its warm-up. Returns
        whether it was kept."""
        if not replica.fingerprinted:
            return False
        w = self.windows.get(replica.lease_id)
        if w is None:
            w = self.windows[replica.lease_id] = Window(
                replica.lease_id, replica.job_id, replica.endpoint_id, replica.provider_id)
        w.answers += 1
        first = not w.samples and replica.provider_id not in self.settled
        if request is None or not (drawn or first) or len(w.samples) >= MAX_PER_WINDOW:
            return False
        try:
            as_dict = json.loads(request)
        except ValueError:
            return False
        if final.embeddings is not None:
            # An embed endpoint's answer is its vectors: a checker embeds the same inputs
            # (kinds/endpoint.py compare_embeddings). Counted as their JSON text may take
            # (up to EMBED_VALUE_BYTES a number), so a window's sample stays in its bounds.
            sample = {"request": as_dict, "embeddings": final.embeddings}
            size = len(request) + EMBED_VALUE_BYTES * sum(len(v) for v in final.embeddings)
        else:
            # None where the replica sent none: judged a failed check (it was asked for them)
            sample = {"request": as_dict, "token_ids": final.token_ids,
                      "fingerprints": final.fingerprints}
            if replica.tokens_only:
                sample["tokens_only"] = True    # vLLM's, or a batch engine's fallback:
                                                # judged by its tokens
            size = len(request) + 8 * len(final.token_ids or ()) + sum(
                len(p) for p in final.fingerprints or ())
        held = self.endpoint_bytes.get(w.endpoint_id, 0)
        if w.bytes + size > MAX_REPLICA_BYTES or held + size > MAX_ENDPOINT_BYTES:
            return False
        w.samples.append(sample)
        w.drawn += drawn
        w.bytes += size
        self.endpoint_bytes[w.endpoint_id] = held + size
        if self.keep is not None:
            self.keep(Kept(w.lease_id, w.job_id, w.endpoint_id, w.provider_id, w.answers,
                           bool(drawn), sample, size))
        return True

    def take(self) -> list[Window]:
        """The windows that kept answers, ended now (a new window begins for each replica)."""
        out = [w for w in self.windows.values() if w.samples]
        self.windows.clear()
        self.endpoint_bytes.clear()
        return out

    def held_bytes(self, endpoint_id: str) -> int:
        return self.endpoint_bytes.get(endpoint_id, 0)

    async def take_kept(self, store) -> list[Window]:
        """The windows that kept answers, ended now, as the store holds them (``take_stored``:
        what this broker kept, and what a broker before a restart or another leader kept),
        once the writes of answers kept so far are done; each window's answer count is the
        larger of the store's and this broker's. ``store`` None: ``take`` (memory only)."""
        here = self.take()
        if store is None:
            return here
        if isinstance(self.keep, StoreWriter):
            await self.keep.flush()
        counted = {w.lease_id: w.answers for w in here}
        stored = await store.write(take_stored)
        for w in stored:
            w.answers = max(w.answers, counted.get(w.lease_id, 0))
        return stored


class StoreWriter:
    """AnswerSamples' ``keep`` in the broker: writes each kept answer to ``store`` (``keep``)
    as it is kept, in a transaction of its own on the store's writer, without holding up the
    answer's stream. Kept answers are few (``answer_check_rate`` of the answers, and a window's
    first of a new provider's replica), so a write each is cheap; an answer not kept is never
    written."""

    def __init__(self, store) -> None:
        self.store = store
        self.writing: set[asyncio.Task] = set()

    def __call__(self, kept: Kept) -> None:
        task = asyncio.get_running_loop().create_task(self.store.write(keep, kept, now_ms()))
        self.writing.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.writing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a sampled answer was not stored (its window goes unchecked if the"
                        " broker restarts before it ends): %r", task.exception())

    async def flush(self) -> None:
        """Wait for the writes begun so far."""
        if self.writing:
            await asyncio.gather(*self.writing, return_exceptions=True)


def keep(db: Database, kept: Kept, now: int) -> bool:
    """Store one kept answer of a replica lease's current window, within the same bounds as
    the router's (which a fresh router, after a restart, counts from nothing): False, and
    nothing written, where the window or the endpoint is full."""
    count, held = db.execute("SELECT count(*), coalesce(sum(bytes), 0) FROM answer_samples"
                             " WHERE lease_id = ?", [kept.lease_id]).fetchone()
    endpoint = db.execute("SELECT coalesce(sum(bytes), 0) FROM answer_samples WHERE"
                          " endpoint_id = ?", [kept.endpoint_id]).fetchone()[0]
    if count >= MAX_PER_WINDOW or held + kept.bytes > MAX_REPLICA_BYTES or \
            endpoint + kept.bytes > MAX_ENDPOINT_BYTES:
        return False
    db.execute("INSERT INTO answer_samples (lease_id, job_id, endpoint_id, provider_id,"
               " answers, drawn, sample, bytes, kept_at_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
               [kept.lease_id, kept.job_id, kept.endpoint_id, kept.provider_id, kept.answers,
                int(kept.drawn), json.dumps(kept.sample, separators=(",", ":")), kept.bytes,
                now])
    return True


def take_stored(db: Database) -> list[Window]:
    """Every window's stored answers, as Windows in the order they were kept, removed from
    the store (a new window begins for each replica)."""
    rows = db.execute("SELECT id, lease_id, job_id, endpoint_id, provider_id, answers, drawn,"
                      " sample, bytes FROM answer_samples ORDER BY id").fetchall()
    if not rows:
        return []
    db.execute("DELETE FROM answer_samples WHERE id <= ?", [rows[-1][0]])
    windows: dict[str, Window] = {}
    for _, lease_id, job_id, endpoint_id, provider_id, answers, drawn, sample, size in rows:
        w = windows.get(lease_id)
        if w is None:
            w = windows[lease_id] = Window(lease_id, job_id, endpoint_id, provider_id)
        w.answers = max(w.answers, answers)
        w.drawn += drawn
        w.samples.append(json.loads(sample))
        w.bytes += size
    return list(windows.values())
