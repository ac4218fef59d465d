"""ProviderGateway: each provider's one bidirectional session.

Handshake: hello (public key) → challenge (nonce, broker key) → signed proof →
welcome. Then offers, heartbeats and job updates flow up; leases, cancels and
settlements flow down through the session's outbox.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random

import grpc

from gpumarket.broker.api import task_results
from gpumarket.broker.api.auth import caller
from gpumarket.broker.api.rpc import STATUS
from gpumarket.broker.api.sessions import CHUNKS_PER_S, ProviderSession
from gpumarket.broker.checks import verdicts
from gpumarket.broker.jobs import logs
from gpumarket.broker.jobs import preemption
from gpumarket.broker.jobs import endings
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import Job
from gpumarket.broker.market import offers
from gpumarket.broker.market import providers
from gpumarket.broker.serving import endpoints
from gpumarket.broker.state import BrokerState
from gpumarket.broker.store import blob_holdings
from gpumarket.proto.envelope import open_envelope, payload_sha256
from gpumarket.proto.errors import (
    BadSignature, FailedPrecondition, GpumarketError, InvalidArgument, PermissionDenied,
)
from gpumarket.proto.identity import fingerprint
from gpumarket.proto.jobspec import NAME_RE, SHA256_RE, now_ms
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import gateway_pb2_grpc
from gpumarket.proto.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
PROOF_MAX_AGE_MS = 5 * 60 * 1000
DRAW = random.SystemRandom()  # which segments are checked: nothing a provider can predict
MAX_EPOCH = 2**63 - 1       # SQLite's INTEGER
MAX_RUNNING = 1024          # leases one heartbeat may list (a provider runs one per device)
MAX_DEVICES = 256
MAX_ERROR = 2000            # characters of a failure's error kept
TAIL_CHARS = 300            # characters kept of each line of a failed job's log tail


def printable(text: str) -> str:
    """``text`` with control characters (a terminal's escapes among them) replaced."""
    return "".join(c if c.isprintable() else "?" for c in text)


def check_offer(offer: pb.Offer, signer: str) -> None:
    """Raise if a signed offer is not usable as this provider's offer."""
    if offer.provider_id != signer:
        raise BadSignature("offer names another provider than its signer")
    offers.check_slices(offer)      # before the count: a thousand slices say so
    if not 0 < len(offer.devices) <= MAX_DEVICES:
        raise InvalidArgument(f"offer.devices: an offer needs 1 to {MAX_DEVICES} devices")
    if len(offer.kinds) > 32 or len(offer.engines) > 32:
        raise InvalidArgument("offer: at most 32 kinds and 32 engines")
    if len({d.index for d in offer.devices}) != len(offer.devices):
        raise InvalidArgument("offer.devices: device indices repeat")
    if not offer.price_per_gpu_hour >= 0:
        raise InvalidArgument("offer.price_per_gpu_hour: must not be negative")
    if not offer.interruptible_price_per_gpu_hour >= 0:
        raise InvalidArgument("offer.interruptible_price_per_gpu_hour: must not be negative")
    if not offer.kinds:
        raise InvalidArgument("offer.kinds: an offer needs at least one job kind")
    if len(offer.models) > 1024 or any(not NAME_RE.match(m) for m in offer.models):
        raise InvalidArgument("offer.models: at most 1,024 plain names")
    if len(offer.cached) > 256 or any(not SHA256_RE.match(c) for c in offer.cached):
        raise InvalidArgument("offer.cached: at most 256 lowercase hex sha256")


class ProviderGatewayServicer(gateway_pb2_grpc.ProviderGatewayServicer):
    def __init__(self, state: BrokerState) -> None:
        self.state = state
        self.cleanups: set[asyncio.Future] = set()   # sessions being closed

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        try:
            provider_id = await self._handshake(context)
        except GpumarketError as exc:
            log.warning("provider session refused: %s", exc.message)
            self.state.metrics.rejected.labels(reason=exc.reason).inc()
            await context.abort(STATUS.get(exc.code, grpc.StatusCode.INVALID_ARGUMENT),
                                exc.message)
            return
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "handshake took too long")
            return
        session = self.state.sessions.open(provider_id, self.state.config.provider_messages_per_s)
        session.row_id = await self.state.store.write(providers.session_started, provider_id, now_ms())
        log.info("provider %s connected", provider_id)
        cfg = self.state.config
        await context.write(gw.BrokerMessage(welcome=gw.SessionWelcome(
            provider_id=provider_id,
            heartbeat_interval_ms=int(cfg.heartbeat_interval_s * 1000),
            lease_timeout_ms=int(cfg.lease_timeout_s * 1000),
            update_receipts=True,
        )))
        writer = asyncio.create_task(self._write_loop(session, context))
        try:
            while not session.closed:
                try:
                    message = await asyncio.wait_for(context.read(), cfg.lease_timeout_s)
                except TimeoutError:
                    # Heartbeats stopped: end the stream, so a provider that was only frozen
                    # sees it end, reconnects, and learns which of its leases are gone.
                    log.warning("provider %s went silent for %.0fs; ending its session",
                                provider_id, cfg.lease_timeout_s)
                    break
                if message is grpc.aio.EOF:
                    break
                if message.WhichOneof("msg") == "chunk":
                    # Answers to endpoint requests: many a second, each only taken for a
                    # request this provider was sent (broker/serving/router.py).
                    if not session.chunks.allow(""):
                        session.end(f"it sent more than {CHUNKS_PER_S:.0f} inference chunks"
                                    " a second")
                        break
                    if self.state.serving is not None:
                        self.state.serving.chunk(provider_id, message.chunk)
                    continue
                if not session.messages.allow(""):
                    session.end(f"it sent more than"
                                f" {self.state.config.provider_messages_per_s:.0f} messages"
                                " a second")
                    break
                await self._handle(session, message)
            if session.ended_why:
                log.warning("provider %s: session ended: %s", provider_id, session.ended_why)
                self.state.metrics.rejected.labels(reason="session_limit").inc()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"session ended: {session.ended_why}")
        except asyncio.CancelledError:
            pass  # the stream is being torn down (provider gone, or the server stopping)
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("provider %s session failed", provider_id)
        finally:
            writer.cancel()
            # The bookkeeping must happen even when the handler is cancelled again while it
            # waits; BrokerServer.stop waits for these before it closes the store.
            cleanup = asyncio.ensure_future(self._closed(session))
            self.cleanups.add(cleanup)
            cleanup.add_done_callback(self.cleanups.discard)
            try:
                await asyncio.shield(cleanup)
            except asyncio.CancelledError:
                pass

    async def _handshake(self, context: grpc.aio.ServicerContext) -> str:
        first = await asyncio.wait_for(context.read(), HANDSHAKE_TIMEOUT_S)
        if first is grpc.aio.EOF or first.WhichOneof("msg") != "hello":
            raise InvalidArgument("a session must start with hello")
        provider_id = fingerprint(first.hello.public_key)
        if provider_id != caller():
            raise BadSignature("the session's hello names another key than the call's token")
        nonce = os.urandom(32)
        broker_key = self.state.identity.public_key
        await context.write(gw.BrokerMessage(challenge=gw.SessionChallenge(
            nonce=nonce, broker_public_key=broker_key)))
        reply = await asyncio.wait_for(context.read(), HANDSHAKE_TIMEOUT_S)
        if reply is grpc.aio.EOF or reply.WhichOneof("msg") != "proof":
            raise InvalidArgument("expected the signed session proof")
        proof, signer = open_envelope(reply.proof, gw.SessionProof)
        if signer != provider_id or reply.proof.signer_public_key != first.hello.public_key:
            raise BadSignature("session proof is signed by another key than the hello's")
        if proof.nonce != nonce or proof.broker_public_key != broker_key:
            raise BadSignature("session proof does not answer this challenge")
        if abs(now_ms() - proof.at_ms) > PROOF_MAX_AGE_MS:
            raise BadSignature("session proof is dated more than 5 minutes off (check clocks)")
        banned = await self.state.store.write(providers.online, provider_id,
                                              bytes(first.hello.public_key), now_ms(),
                                              first.hello.reconnect_within_ms)
        if banned:
            raise PermissionDenied(f"provider {provider_id} is banned from this broker")
        return provider_id

    async def _write_loop(self, session: ProviderSession, context) -> None:
        while True:
            message = await session.outbox.get()
            if message is None:
                return
            await context.write(message)

    async def _closed(self, session: ProviderSession) -> None:
        current = self.state.sessions.close(session)
        await self.state.store.write(providers.session_ended, session.row_id, now_ms(),
                                     "replaced" if not current else "ended")
        if not current:
            return  # replaced by a newer session of the same provider
        log.info("provider %s disconnected", session.provider_id)
        if self.state.serving is not None:
            self.state.serving.provider_gone(session.provider_id)
        # Only while this session is the provider's latest: one it opened since on another
        # broker of a shared store is that broker's, offer and all.
        if not await self.state.store.write(providers.offline, session.provider_id, now_ms(),
                                            session.row_id or None):
            log.info("provider %s has a newer session (on another broker): its offer stays",
                     session.provider_id)
            return
        self.state.events.notify()
        self.state.placement.notify()

    async def _handle(self, session: ProviderSession, message: gw.ProviderMessage) -> None:
        kind = message.WhichOneof("msg")
        if kind == "offer":
            try:
                offer, signer = open_envelope(message.offer, pb.Offer)
                check_offer(offer, signer)
                if signer != session.provider_id:
                    raise BadSignature("offer is signed by another key than the session's")
            except GpumarketError as exc:
                session.log(log, logging.WARNING, "offer from %s refused: %s",
                            session.provider_id, exc.message)
                return
            await self.state.store.write(providers.store_offer, session.provider_id,
                                         message.offer.SerializeToString(), offer, now_ms())
            session.offer, session.offer_envelope = offer, message.offer
            self.state.placement.notify()
        elif kind == "heartbeat":
            if message.heartbeat.draining and self.state.serving is not None:
                self.state.serving.set_draining(session.provider_id, True)
            if message.heartbeat.draining and session.offer is not None:
                log.info("provider %s is draining; its offer is withdrawn", session.provider_id)
                session.offer = None
                await self.state.store.write(providers.withdraw_offer, session.provider_id)
            if len(message.heartbeat.running) > MAX_RUNNING:
                session.end(f"a heartbeat listed {len(message.heartbeat.running):,} leases,"
                            f" more than {MAX_RUNNING:,}")
                return
            running = [(r.job_id, r.epoch) for r in message.heartbeat.running
                       if r.epoch <= MAX_EPOCH]   # no lease has a larger one
            # Written with the others in the next scheduler pass (broker/state.py, Liveness), which
            # tells the provider to stop any of them that is no longer its.
            self.state.liveness.heard(session.provider_id, running, now_ms())
        elif kind == "job_update":
            await self._job_update(session, message.job_update)
        else:
            session.log(log, logging.WARNING, "provider %s sent an unexpected %s",
                        session.provider_id, kind)

    async def _job_update(self, session: ProviderSession, update: gw.JobUpdate) -> None:
        store, pid, now = self.state.store, session.provider_id, now_ms()
        which = update.WhichOneof("update")
        ended = None        # the job whose lease a receipt ended
        final = which in ("failed", "receipt", "rejected", "released")
        try:
            if update.epoch > MAX_EPOCH:
                raise InvalidArgument(f"epoch {update.epoch} is out of range")
            if which == "started":
                await store.write(jobs.mark_started, update.job_id, update.epoch, pid, now,
                                  update.started.resumed_from_step)
            elif which == "progress":
                await store.write(jobs.record_progress, update.job_id, update.epoch, pid,
                                  update.progress, now)
            elif which == "checkpoint":
                c = update.checkpoint
                stored = await store.write(jobs.record_checkpoint, update.job_id, update.epoch,
                                           pid, c.step, c.artifact, c.write_seconds, now,
                                           verdicts.policy(self.state, pid, DRAW.random()))
                if stored == "paused":
                    # Its hold ran out: the checkpoint just settled is where it resumes.
                    self.state.stop_lease(
                        update.job_id, update.epoch, pid,
                        "paused: the job's hold is spent (its client can top it up)")
            elif which == "released":
                await store.write(preemption.release, update.job_id, update.epoch, pid,
                                  update.released.reason[:500] or "released by provider", now)
            elif which == "failed":
                ran, error, tail = await self._failure(pid, update)
                await store.write(functools.partial(endings.fail, job_ran=ran, log_tail=tail),
                                  update.job_id, update.epoch, pid, error, now)
            elif which == "rejected":
                # Not the job's fault as far as the broker knows: it goes to another provider
                # (and fails once it has used up its attempts).
                await store.write(endings.release, update.job_id, update.epoch, pid,
                                  f"provider refused the lease: {update.rejected.reason[:500]}",
                                  now, "rejected")
            elif which == "receipt":
                ended = await self._receipt(pid, update, now)
            elif which == "ready":
                job = await store.write(endpoints.mark_ready, update.job_id, update.epoch, pid,
                                        update.ready.engine[:200], now)
                if self.state.serving is not None:
                    self.state.serving.ready(pid, update.job_id, update.epoch, job.parent_id,
                                             update.ready)
            elif which == "tasks":
                await task_results.record(self.state, pid, update, now)
            elif which == "log":
                await store.write(logs.append, update.job_id, update.epoch, pid,
                                  list(update.log.lines), now)
                self.state.logs.notify()
                return
            else:
                raise InvalidArgument("job update carries nothing")
        except GpumarketError as exc:
            session.log(log, logging.INFO, "update %s for %s from %s refused: %s", which,
                        update.job_id, pid, exc.message)
            if which == "tasks" and update.tasks.seq:
                session.send(task_results.settled(update, exc.message))
            if final:
                session.send(gw.BrokerMessage(settled=gw.UpdateSettled(
                    job_id=update.job_id, epoch=update.epoch, accepted=False, reason=exc.message)))
            elif isinstance(exc, FailedPrecondition):
                self.state.stop_lease(update.job_id, update.epoch, pid, exc.message)
            self.state.events.notify()
            return
        if final:
            session.send(gw.BrokerMessage(settled=gw.UpdateSettled(
                job_id=update.job_id, epoch=update.epoch, accepted=True)))
            self.state.placement.notify()
            if ended is not None and ended.parent_id and ended.tasks:
                # A lane of its array may be idle now: another lease yields to it at once.
                # (The lease's end is settled already: a steal that fails here is left to
                # the other lease's next report, arrays.record_results.)
                try:
                    await task_results.lane_freed(self.state, ended.parent_id, now)
                except Exception:
                    log.exception("array %s: no steal for its idle lane", ended.parent_id)
        elif which == "tasks" and update.tasks.seq:
            session.send(task_results.settled(update))
        self.state.events.notify()

    async def _failure(self, provider_id: str, update: gw.JobUpdate
                       ) -> tuple[bool, str, tuple[str, ...]]:
        """What a failed update says: (whether the job's own process ran, the error, the last
        lines of its log), from the provider's signed FailureReport, checked (its key, this
        job, epoch and spec; BadSignature otherwise). An update with the error alone says
        that the job ran and failed."""
        failed = update.failed
        if not failed.HasField("report"):
            return True, printable(failed.error[:MAX_ERROR]) or "job failed", ()
        report, signer = open_envelope(failed.report, gw.FailureReport)
        if signer != provider_id or report.provider_id != provider_id:
            raise BadSignature("failure report is not signed by the lease's provider")
        if report.job_id != update.job_id or report.epoch != update.epoch:
            raise BadSignature("failure report names another job or epoch than its update")
        job = await self.state.store.read(jobs.job_row, update.job_id)
        if report.spec_sha256 != payload_sha256(pb.Envelope.FromString(job.spec)):
            raise BadSignature("failure report is for another job spec")
        error = printable(report.error[:MAX_ERROR] or failed.error[:MAX_ERROR]) or "job failed"
        tail = tuple(printable(line)[:TAIL_CHARS] for line in report.log_tail[-endings.TAIL_LINES:])
        return report.job_ran, error, tail

    async def _receipt(self, provider_id: str, update: gw.JobUpdate, now: int) -> Job:
        """Check the receipt and end the lease with it; the job as it was before."""
        store = self.state.store
        try:
            receipt, signer = open_envelope(update.receipt, pb.Receipt)
            if signer != provider_id or receipt.provider_id != provider_id:
                raise BadSignature("receipt is not signed by the lease's provider")
            if receipt.job_id != update.job_id or receipt.epoch != update.epoch:
                raise BadSignature("receipt names another job or epoch than its update")
            job = await store.read(jobs.job_row, update.job_id)
            spec_env = pb.Envelope()
            spec_env.ParseFromString(job.spec)
            if receipt.spec_sha256 != payload_sha256(spec_env):
                raise BadSignature("receipt is for another job spec")
            await store.read(blob_holdings.check_outputs, provider_id, list(receipt.outputs))
        except (BadSignature, FailedPrecondition, InvalidArgument) as exc:
            # A bad receipt ends the lease rather than leaving it running forever: the
            # provider's failure, not the job's (it goes to another provider, unpaid).
            await store.write(functools.partial(endings.fail, job_ran=False), update.job_id,
                              update.epoch, provider_id, f"receipt rejected: {exc.message}", now)
            raise
        await store.write(jobs.succeed, update.job_id, update.epoch, provider_id,
                          update.receipt.SerializeToString(), now,
                          verdicts.policy(self.state, provider_id, DRAW.random()))
        return job
