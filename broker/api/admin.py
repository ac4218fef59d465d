"""Admin: what the broker's operators call (`gpumarket-broker providers|jobs|ban|unban|
backup|vacuum`). Every call carries an AdminOrder signed by an operator key, made for that
one method and dated within ADMIN_ORDER_MAX_AGE_MS."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import tempfile
from pathlib import Path

from gpumarket.broker.api.auth import caller
from gpumarket.broker.api.rpc import streaming, unary
from gpumarket.broker.jobs import views
from gpumarket.broker.market import providers
from gpumarket.broker.market import standing
from gpumarket.broker.money import ledger
from gpumarket.broker.state import BrokerState
from gpumarket.broker.store.store import vacuum
from gpumarket.proto.artifacts import iter_chunks, sha256_file
from gpumarket.proto.envelope import open_envelope
from gpumarket.proto.errors import (BadSignature, FailedPrecondition, InvalidArgument,
                                   PermissionDenied)
from gpumarket.proto.jobspec import MAX_CREDITS, now_ms
from gpumarket.proto.v1 import admin_pb2 as ad
from gpumarket.proto.v1 import admin_pb2_grpc

log = logging.getLogger(__name__)

ADMIN_ORDER_MAX_AGE_MS = 5 * 60 * 1000
KEY_ID_RE = re.compile(r"[a-z2-7]{26}")


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, state: BrokerState) -> None:
        self.state = state

    def _order(self, request: ad.AdminRequest, method: str) -> ad.AdminOrder:
        order, signer = open_envelope(request.order, ad.AdminOrder)
        if order.method != method:
            raise BadSignature(f"admin order is for {order.method or 'nothing'}, not {method}")
        if abs(now_ms() - order.at_ms) > ADMIN_ORDER_MAX_AGE_MS:
            raise BadSignature("admin order is dated more than 5 minutes off (check the clock)")
        if signer not in self.state.operators:
            raise PermissionDenied(f"key {signer} is not an operator of this broker")
        if signer != caller():
            raise PermissionDenied("admin order is signed by another key than the call")
        log.info("admin %s %s by operator %s", method, order.target, signer)
        return order

    def _cut_off(self, provider_id: str, ended: list[tuple[str, int]], reason: str) -> None:
        """After providers.take_leases: tell a connected provider its leases are gone, end its
        session, and let watchers and the scheduler see the change."""
        for job_id, epoch in ended:
            self.state.stop_lease(job_id, epoch, provider_id, reason)
        if self.state.sessions.get(provider_id) is not None:
            self.state.sessions.end(provider_id)
        self.state.events.notify()
        self.state.placement.notify()

    @unary
    async def ListProviders(self, request, context) -> ad.ListProvidersResponse:
        self._order(request, "ListProviders")
        found = await self.state.store.read(standing.standings, None, now_ms())
        return ad.ListProvidersResponse(providers=found)

    @unary
    async def ListAllJobs(self, request, context) -> ad.ListAllJobsResponse:
        order = self._order(request, "ListAllJobs")
        found = await self.state.store.read(views.list_jobs, "", list(order.states),
                                            min(order.limit or 100, 1000))
        return ad.ListAllJobsResponse(jobs=found)

    @unary
    async def Ban(self, request, context) -> ad.BanResponse:
        order = self._order(request, "Ban")
        reason = f"provider banned by the operator: {order.reason[:200] or 'no reason given'}"
        ended = await self.state.store.write(providers.set_banned, order.target, True, reason, now_ms())
        self._cut_off(order.target, ended, reason)
        log.warning("provider %s banned (%s); %d leases taken away", order.target, reason,
                    len(ended))
        return ad.BanResponse(provider_id=order.target, banned=True, leases_lost=len(ended))

    @unary
    async def Revoke(self, request, context) -> ad.RevokeResponse:
        order = self._order(request, "Revoke")
        if order.target in self.state.operators:
            raise PermissionDenied(f"{order.target} is an operator key; remove it from the"
                                   " broker's config instead")
        check_key_id(order.target)
        reason = f"key revoked by the operator: {order.reason[:200] or 'no reason given'}"
        ended = await self.state.store.write(providers.revoke, order.target, reason, now_ms())
        self.state.revoked.add(order.target)
        self._cut_off(order.target, ended, reason)
        log.warning("key %s revoked (%s); %d leases taken away", order.target, reason, len(ended))
        return ad.RevokeResponse(key_id=order.target, revoked=True, leases_lost=len(ended))

    @unary
    async def Unrevoke(self, request, context) -> ad.RevokeResponse:
        order = self._order(request, "Unrevoke")
        await self.state.store.write(providers.unrevoke, order.target)
        self.state.revoked.discard(order.target)
        log.warning("key %s accepted again", order.target)
        return ad.RevokeResponse(key_id=order.target, revoked=False)

    @unary
    async def Unban(self, request, context) -> ad.BanResponse:
        order = self._order(request, "Unban")
        await self.state.store.write(providers.set_banned, order.target, False, "", now_ms())
        log.warning("provider %s unbanned", order.target)
        return ad.BanResponse(provider_id=order.target, banned=False)

    @unary
    async def Credit(self, request, context) -> ad.CreditResponse:
        """The operator's door for money: credit a client (or a provider's stake). The
        posting records the operator's key and memo; one signed order credits once."""
        order = self._order(request, "Credit")
        check_key_id(order.target)
        to = order.account or "client"
        if to not in ("client", "stake"):
            raise InvalidArgument(f"account: {to!r} is not client or stake")
        if not 0 < order.amount <= ledger.units(MAX_CREDITS):
            raise InvalidArgument(f"amount: must be more than 0 and at most {MAX_CREDITS:,}"
                                  " credits")
        if len(order.nonce) != 16:
            raise InvalidArgument("nonce: an order to credit carries 16 random bytes")
        seq, balance = await self.state.store.write(
            ledger.credit, order.target, order.amount, to, order.reason[:500],
            open_envelope(request.order, ad.AdminOrder)[1], order.nonce.hex(), now_ms())
        log.warning("credited %s credits to %s %s (%s)%s", ledger.fmt(order.amount), to,
                    order.target, order.reason[:200], " [duplicate order]" if seq is None else "")
        return ad.CreditResponse(account=f"{to}:{order.target}", balance=balance,
                                 seq=seq or 0, duplicate=seq is None)

    @unary
    async def Audit(self, request, context) -> ad.AuditResponse:
        self._order(request, "Audit")
        problems, count, totals = await self.state.store.read(ledger.audit_report)
        return ad.AuditResponse(ok=not problems, problems=problems, postings=count,
                                totals=totals)

    @streaming
    async def Backup(self, request, context):
        self._order(request, "Backup")
        store = self.state.store
        if store.path is None:
            raise FailedPrecondition("the store is PostgreSQL: back it up with pg_dump or"
                                     " the database's own replication (docs/deploy.md)")
        fd, name = tempfile.mkstemp(prefix=".backup-", suffix=".db", dir=store.path.parent)
        os.close(fd)
        tmp = Path(name)
        try:
            await asyncio.to_thread(store.backup_to, tmp)
            digest, size = await asyncio.to_thread(sha256_file, tmp)
            first = True
            for chunk in iter_chunks(tmp):
                yield ad.BackupChunk(data=chunk, total_bytes=size if first else 0,
                                     sha256=digest if first else "")
                first = False
            log.info("backup of %d bytes sent", size)
        finally:
            tmp.unlink(missing_ok=True)

    @unary
    async def Vacuum(self, request, context) -> ad.VacuumResponse:
        self._order(request, "Vacuum")
        path = self.state.store.path
        if path is None:
            raise FailedPrecondition("the store is PostgreSQL: its autovacuum keeps it compact")
        before = path.stat().st_size
        await self.state.store.write(vacuum, transaction=False)
        return ad.VacuumResponse(bytes_before=before, bytes_after=path.stat().st_size)


def check_key_id(key_id: str) -> None:
    if not KEY_ID_RE.fullmatch(key_id):
        raise InvalidArgument(f"{key_id!r} is not a key id (26 characters a-z, 2-7)")

