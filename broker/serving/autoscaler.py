"""The endpoints' autoscaler (docs/serving.md): once a second it reads the serving endpoints
and their replicas, brings the router (broker/serving/router.py) in step, and decides per endpoint:

- below ``min_replicas`` (a replica failed for good, or was moved): add one per missing;
- a request waits and no replica lives (scale from zero): add one at once;
- load (requests in flight and waiting) over ``target`` x ready replicas for ``scale_window_s``
  and every replica ready: add one, up to ``max_replicas``;
- no request for ``idle_s`` and more replicas than ``min_replicas``: retire one (the least
  useful: one still starting before one serving), then wait ``idle_s`` again;
- a replica on a draining provider: start its replacement; once that serves, retire it (the
  new one is ready before the old one stops taking requests);
- replicas that keep failing before they ever serve, on at least two providers: the endpoint
  fails (endpoints.crash_loop; a provider failing its replicas is avoided for them, then left
  out: endpoints.steer).

Every decision is an event on the endpoint. Replica leases are paid once a window (the
broker's ``replica_window_s``, SETTLE_EVERY_S by default; they have no checkpoints to settle
at), the windows whose answers were sampled held for a check of them (broker/checks/
answers.py), and the tokens they served are written every pass.
The price cap is the matcher's: a replica is only leased within the endpoint's max_price.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gpumarket.broker.checks import answers, verdicts, verification
from gpumarket.broker.jobs import endings
from gpumarket.broker.serving import endpoints
from gpumarket.broker.serving.router import Endpoint, Serving
from gpumarket.broker.serving.rows import LiveReplica
from gpumarket.broker.state import BrokerState
from gpumarket.proto.errors import FailedPrecondition
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

PASS_S = 1.0
SETTLE_EVERY_S = 60.0


@dataclass
class Decision:
    add: int = 0
    add_why: str = ""
    retire: tuple[str, ...] = ()       # replica job ids
    retire_why: str = ""


@dataclass
class Watch:
    """What the autoscaler remembers of an endpoint between passes."""

    over_since: float | None = None
    last_change: float = 0.0
    replacing: dict[str, str] | None = None    # draining replica -> its replacement


def decide(ep: Endpoint, rows: Sequence[LiveReplica], watch: Watch, now: float,
           wanted: bool) -> Decision:
    """What to do for one endpoint now, given its live replicas ``rows`` (pure, but for
    ``watch``)."""
    s = ep.settings
    live = rows     # paused ones (their hold spent) count: a top-up resumes them
    ready = ep.ready()
    draining = [r for r in ready if r.draining]
    serving_ids = {r.job_id for r in ready}
    replacing = watch.replacing if watch.replacing is not None else {}
    watch.replacing = replacing
    live_ids = {r.id for r in live}
    for old, new in list(replacing.items()):
        if old not in live_ids:
            del replacing[old]
        elif new not in live_ids:       # the replacement failed: the next pass starts another
            del replacing[old]
    # A draining replica's replacement serves: the old one goes.
    busy = {r.job_id for r in ready if r.in_flight}
    done = tuple(old for old, new in replacing.items() if new in serving_ids and old not in busy
                 and not any(r.job_id == new and r.draining for r in ready))
    if done:
        watch.last_change = now
        return Decision(retire=done, retire_why="moved off its draining provider: its"
                        " replacement serves")
    unreplaced = [r for r in draining if r.job_id not in replacing]
    if unreplaced:
        watch.last_change = now
        return Decision(add=1, add_why=f"replacing replica {unreplaced[0].job_id} (its provider"
                        " drains)", retire=(unreplaced[0].job_id,), retire_why="")
    steady = [r for r in live if r.id not in replacing]
    if len(steady) < s["min_replicas"]:
        watch.last_change = now
        return Decision(add=s["min_replicas"] - len(steady),
                        add_why=f"below min_replicas {s['min_replicas']}")
    if not live and (wanted or ep.waiting or ep.peer_load):
        watch.last_change = now
        return Decision(add=1, add_why="scale from zero: a request is waiting")
    # Where brokers share a store, the endpoint's load and replicas on the others count too
    # (each serves its own providers' replicas, and relays to them: broker/serving/relay.py).
    load = ep.in_flight + len(ep.waiting) + ep.peer_load
    capacity = s["target"] * max(len(ready) + ep.peer_ready, 1)
    if load > capacity and len(live) < s["max_replicas"]:
        if watch.over_since is None:
            watch.over_since = now
        starting = len(live) > len([r for r in ready if not r.draining]) + ep.peer_ready
        if now - watch.over_since >= s["window_s"] and not starting:
            watch.over_since = None
            watch.last_change = now
            return Decision(add=1, add_why=f"scale out: {load} requests in flight or waiting"
                            f" over {len(ready) + ep.peer_ready} ready replica(s) at target {s['target']} for"
                            f" {s['window_s']} s")
    else:
        watch.over_since = None
    idle = now - max(ep.last_request, ep.peer_last_request, watch.last_change)
    # Not idle while a request waits for a replica (one still starting, say): retiring it
    # then started another for the same request, idle_s later retired again, and so on
    # wherever a replica took longer than idle_s to start (seen at load 25 with idle_s 6).
    # Nor while a draining replica's replacement starts (one slower to start than idle_s was
    # retired as "one still starting", and the draining one was then never moved).
    if len(live) > s["min_replicas"] and idle >= s["idle_s"] and ep.in_flight == 0 \
            and not ep.waiting and not ep.peer_load and not wanted and not replacing:
        # One still starting goes before one serving (here, or on another broker: ready
        # as the database has it); then the newest.
        victim = sorted(live, key=lambda r: (r.id in serving_ids or (
            r.state == pb.JOB_STATE_RUNNING and r.progress_step == 1), r.part))[0]
        watch.last_change = now
        return Decision(retire=(victim.id,), retire_why=f"scale in: idle for"
                        f" {idle:.0f} s (idle_s {s['idle_s']})")
    return Decision()


def _providers_of(db, lease_ids: list[str]) -> list[str]:
    return [r[0] for r in db.execute(
        f"SELECT DISTINCT provider_id FROM leases WHERE id IN ({','.join('?' * len(lease_ids))})",
        lease_ids).fetchall()] if lease_ids else []


class Autoscaler:
    def __init__(self, state: BrokerState, serving: Serving) -> None:
        self.state = state
        self.serving = serving
        self.watches: dict[str, Watch] = {}
        self.last_settle = time.monotonic()

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("autoscaler pass failed; retrying")
            self.serving.kick.clear()
            try:     # a request waiting for a first replica wakes it at once
                await asyncio.wait_for(self.serving.kick.wait(), PASS_S)
            except TimeoutError:
                pass

    async def tick(self) -> None:
        store, serving = self.state.store, self.serving
        live = await store.read(endpoints.live)
        serving.sync(live)
        now = time.monotonic()
        changed = False
        for row in live:
            ep = serving.endpoints[row.id]
            self.state.metrics.endpoint_replicas.labels(endpoint=ep.id).set(len(ep.ready()))
            broken = "" if ep.ready() or ep.peer_ready else await store.read(
                endpoints.crash_loop, ep.id)
            if broken:
                ended = await store.write(endpoints.fail, ep.id, broken, now_ms())
                self._stop(ended, broken)
                changed = True
                continue
            changed |= await self._late(ep, row.replicas)
            watch = self.watches.setdefault(ep.id, Watch(last_change=now))
            d = decide(ep, row.replicas, watch, now, ep.id in serving.want)
            changed |= await self.apply(ep, watch, d)
        for gone in set(self.watches) - {r.id for r in live}:
            del self.watches[gone]
        usage = serving.take_usage()
        if usage:
            await store.write(endpoints.record_usage, usage, now_ms())
        if now - self.last_settle >= getattr(self.state.config, "replica_window_s",
                                             SETTLE_EVERY_S):
            self.last_settle = now
            await self._settle()
        if changed:
            self.state.events.notify()
            self.state.placement.notify()

    async def _settle(self) -> None:
        """Pay the replicas for the window now ending; the windows whose answers were sampled
        have their pay held and a check queued (broker/checks/answers.py)."""
        store, samples = self.state.store, self.serving.samples
        # as stored: a window this broker did not see begin (a restart, a new leader) too
        taken = await samples.take_kept(store)
        if not getattr(self.state.config, "verify", False):
            taken = []          # checks are off: nothing is held or stored
        windows = {w.lease_id: answers.window_blobs(w.lease_id, w.answers, w.samples, w.drawn)
                   for w in taken}
        blobs = [(b.sha256, b.data) for w in windows.values() for b in (w.expect, w.claimed)]
        if blobs:
            artifacts = self.state.artifacts
            staged = await asyncio.to_thread(artifacts.stage_blobs, blobs)
            await asyncio.to_thread(artifacts.publish_blobs, staged)
        policies = {p: verdicts.policy(self.state, p, 0.0)
                    for p in await store.read(_providers_of, list(windows))}
        await store.write(endpoints.settle_running, now_ms(), windows, policies)
        samples.settled = await store.read(verification.past_warm_up)

    async def _late(self, ep: Endpoint, rows: Sequence[LiveReplica]) -> bool:
        """A replica leased more than cold_start ago that never became ready is lost (its
        provider's fault, as a missed heartbeat is): it is leased again elsewhere, and no
        longer counts as one still starting."""
        limit_ms = int(self.state.config.cold_start_s * 1000)
        late = False
        for r in rows:
            if r.state in (pb.JOB_STATE_LEASED, pb.JOB_STATE_RUNNING) and \
                    r.progress_step != 1 and r.issued_at_ms and \
                    now_ms() - r.issued_at_ms > limit_ms and r.id not in ep.replicas:
                why = f"not ready within {self.state.config.cold_start_s:.0f} s of its lease"
                if await self.state.store.write(endings.lose_lease, r.lease_id, why, now_ms()):
                    log.warning("endpoint %s: replica %s %s", ep.name, r.id, why)
                    self.state.stop_lease(r.id, r.epoch, r.provider_id, why)
                    late = True
        return late

    async def apply(self, ep: Endpoint, watch: Watch, d: Decision) -> bool:
        store = self.state.store
        replacing = bool(d.retire and not d.retire_why)
        for _ in range(d.add):
            # A drain's replacement may exceed max_replicas by one while the old one serves.
            limit = ep.settings["max_replicas"] + (1 if replacing or watch.replacing else 0)
            try:
                new = await store.write(endpoints.add_replica, ep.id, now_ms(), d.add_why,
                                        limit)
            except FailedPrecondition as exc:
                log.info("endpoint %s: no replica added: %s", ep.name, exc.message)
                break
            log.info("endpoint %s: %s", ep.name, d.add_why)
            if replacing:      # a replacement for a draining replica
                watch.replacing[d.retire[0]] = new
        if d.retire_why:
            for replica_id in d.retire:
                replica = ep.replicas.get(replica_id)
                if replica is not None:     # first: no request is sent to it meanwhile
                    self.serving.drop(replica, "the replica was retired")
                ended = await store.write(endpoints.retire, replica_id, d.retire_why, now_ms())
                log.info("endpoint %s: replica %s retired: %s", ep.name, replica_id,
                         d.retire_why)
                self._stop([ended] if ended else [], d.retire_why)
        if d.add or d.retire_why:
            self.serving.want.discard(ep.id)
            return True
        return False

    def _stop(self, ended, why: str) -> None:
        for lease in ended:
            self.state.stop_lease(lease.job_id, lease.epoch, lease.provider_id, why)
