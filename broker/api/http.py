"""The broker's HTTP side (aiohttp): liveness, readiness, Prometheus metrics, the JSON
reads behind the dashboard, and the dashboard itself (plain HTML/CSS/JS, no build step)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpumarket.broker.api.listeners import ConnectionGuard, GuardedSite
from gpumarket.broker.jobs import views
from gpumarket.broker.market import standing
from gpumarket.broker.money import ledger
from gpumarket.broker.serving import endpoints
from gpumarket.broker.serving.router import percentile
from gpumarket.broker.state import BrokerState
from gpumarket.broker.store import blob_holdings
from gpumarket.broker.store.store import ready_probe
from gpumarket.proto.jobspec import ACCELERATOR_NAMES, STATE_NAMES, kind_name, now_ms
from gpumarket.proto.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

DASHBOARD = Path(__file__).parent / "dashboard"
SAMPLE_EVERY_S = 2.0
SAMPLES_KEPT = 1800         # an hour at SAMPLE_EVERY_S


def _db_counts(db) -> tuple[dict[int, int], int, dict[str, int], int, bool]:
    """What a metrics scrape reads, in one read: jobs by state, blob bytes stored, and the
    ledger's cheap check (the whole audit is /api/ledger and `admin audit`)."""
    return (views.state_counts(db), blob_holdings.stored_bytes(db), *ledger.health(db))


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def host_name(header: str) -> str:
    """The name in a Host header, without its port or IPv6 brackets, lower-cased."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class BrokerHttp:
    def __init__(self, state: BrokerState, serving) -> None:
        self.state = state
        self.serving = serving  # () -> bool: is gRPC serving?
        self.hosts = set(LOOPBACK_NAMES) | {h.lower() for h in state.config.http_hosts}
        self.app = web.Application(middlewares=[self.check_host], client_max_size=4 << 20)
        self.app.add_routes([
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/metrics", self.metrics),
            web.get("/api/providers", self.providers),
            web.get("/api/jobs", self.jobs),
            web.get("/api/series", self.series),
            web.get("/api/ledger", self.ledger),
            web.get("/api/endpoints", self.endpoints),
            web.get("/", self.dashboard),
            web.get("/dashboard.js", self.asset),
            web.get("/dashboard.css", self.asset),
        ])
        self.runner: web.AppRunner | None = None
        self.address = ""
        self.samples: deque[dict] = deque(maxlen=SAMPLES_KEPT)
        self._sampler: asyncio.Task | None = None

    @web.middleware
    async def check_host(self, request: web.Request, handler):
        """Answer only requests addressed to this broker by name: a page elsewhere that
        points a name of its own at 127.0.0.1 (DNS rebinding) gets nothing."""
        if host_name(request.headers.get("Host", "")) not in self.hosts:
            return web.json_response(
                {"error": "this broker does not answer to that Host name (http_hosts)"},
                status=421)
        return await handler(request)

    async def start(self, listen: str, guard: ConnectionGuard) -> str:
        """Listen on ``listen`` (HOST:PORT), its connections capped by ``guard``; returns the
        address bound (port 0 picks one)."""
        host, _, port = listen.rpartition(":")
        self.hosts.add(host_name(host or "localhost"))
        cfg = self.state.config
        # A connection without a whole request's headers for idle_timeout (from its start or
        # its last answer) is closed; a handler whose caller went away is cancelled.
        self.runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True,
                                    keepalive_timeout=cfg.idle_timeout_s)
        await self.runner.setup()
        site = GuardedSite(self.runner, host, int(port), guard)
        await site.start()
        self.address = f"{host}:{site.port}"
        self._sampler = asyncio.create_task(self._sample_loop())
        return self.address

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
        if self.runner is not None:
            await self.runner.cleanup()

    async def _sample_loop(self) -> None:
        """Queue depth and GPU utilization over time, for the dashboard's chart."""
        while True:
            try:
                queued = await self.state.store.read(views.count_in_state, pb.JOB_STATE_QUEUED)
                busy = await self.state.busy_devices()
                offers = self.state.sessions.offers()
                self.samples.append({
                    "at_ms": now_ms(), "queued": queued,
                    "gpus": sum(len(o.devices) for o in offers),
                    "gpus_busy": sum(len(busy.get(o.provider_id, ())) for o in offers)})
            except Exception:  # a sample is not worth the loop
                log.warning("dashboard sample failed", exc_info=True)
            await asyncio.sleep(SAMPLE_EVERY_S)

    async def dashboard(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(DASHBOARD / "index.html")

    async def asset(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(DASHBOARD / request.path.lstrip("/"))

    async def series(self, request: web.Request) -> web.Response:
        return web.json_response({"every_s": SAMPLE_EVERY_S, "samples": list(self.samples)})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        problems = []
        try:
            await self.state.store.write(ready_probe)
        except Exception as exc:  # any failure to write means not ready
            log.warning("readiness: database not writable: %s", exc)
            problems.append("database is not writable")
        if not self.serving():
            problems.append("gRPC is not serving")
        if problems:
            return web.json_response({"status": "unavailable", "problems": problems},
                                     status=503)
        return web.json_response({"status": "ready"})

    async def metrics(self, request: web.Request) -> web.Response:
        m = self.state.metrics
        offers = self.state.sessions.offers()
        m.providers_online.set(len(self.state.sessions))
        m.gpus.clear()
        for offer in offers:
            for d in offer.devices:
                m.gpus.labels(model=d.name, accelerator=ACCELERATOR_NAMES[d.accelerator]).inc()
        states, stored, totals, postings, ok = await self.state.store.read(_db_counts)
        for code, name in STATE_NAMES.items():
            m.jobs.labels(state=name).set(states.get(code, 0))
        m.artifact_bytes.set(stored)
        for account, units in totals.items():
            m.ledger.labels(account=account).set(units / ledger.UNIT)
        m.postings.set(postings)
        m.ledger_ok.set(1 if ok else 0)
        return web.Response(body=generate_latest(m.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def ledger(self, request: web.Request) -> web.Response:
        try:
            limit = min(int(request.query.get("limit", "50")), 1000)
        except ValueError:
            return web.json_response({"error": "limit must be a number"}, status=400)
        return web.json_response(await self.state.store.read(ledger.recent_page, limit))

    async def providers(self, request: web.Request) -> web.Response:
        now = now_ms()
        offers = {o.provider_id: o for o in self.state.sessions.offers()}
        busy = await self.state.busy_devices()
        rows = await self.state.store.read(standing.standings, None, now)
        out = []
        for p in rows:
            offer = offers.get(p.provider_id)
            out.append({
                "provider_id": p.provider_id, "online": offer is not None, "banned": p.banned,
                "price_per_gpu_hour": p.price_per_gpu_hour,
                "interruptible_price_per_gpu_hour": p.interruptible_price_per_gpu_hour,
                "devices": [{"name": d.name, "accelerator": ACCELERATOR_NAMES[d.accelerator],
                             "memory_bytes": d.memory_bytes,
                             "matmul_flops": d.benchmark.matmul_flops,
                             "busy": d.index in busy.get(p.provider_id, set())}
                            for d in (offer.devices if offer else ())],
                "reliability": p.reliability, "leases_completed": p.leases_completed,
                "leases_lost": p.leases_lost, "running": p.running, "earned": p.earned,
                "last_seen_ms": p.last_seen_ms,
            })
        return web.json_response({"providers": out})

    async def endpoints(self, request: web.Request) -> web.Response:
        """Serving endpoints: replicas, load, latency and the latest scaling decision."""
        live = await self.state.store.read(endpoints.live)
        serving = self.state.serving
        out = []
        for row in live:
            ep = serving.endpoints.get(row.id) if serving is not None else None
            last = await self.state.store.read(endpoints.events_of, row.id, 1)
            s = row.settings
            out.append({
                "job_id": row.id, "name": row.name, "state": "SERVING",
                "min_replicas": s["min_replicas"], "max_replicas": s["max_replicas"],
                "live": len(row.replicas), "ready": len(ep.ready()) if ep else 0,
                "in_flight": ep.in_flight if ep else 0, "queued": len(ep.waiting) if ep else 0,
                "requests": ep.requests if ep else 0,
                "ttft_p50_ms": percentile(ep.ttft, 0.5) * 1000 if ep else 0.0,
                "tpot_p50_ms": percentile(ep.tpot, 0.5) * 1000 if ep else 0.0,
                "last_event": last[0]["message"] if last else ""})
        return web.json_response({"endpoints": out})

    async def jobs(self, request: web.Request) -> web.Response:
        try:
            limit = min(int(request.query.get("limit", "100")), 1000)
        except ValueError:
            return web.json_response({"error": "limit must be a number"}, status=400)
        found = await self.state.store.read(views.list_jobs, "", [], limit)
        costs = await self.state.store.read(standing.job_costs, [j.job_id for j in found],
                                            now_ms())
        return web.json_response({"jobs": [{
            "job_id": j.job_id, "name": j.name, "kind": kind_name(j.kind),
            "state": STATE_NAMES.get(j.state, "UNSPECIFIED"), "attempt": j.attempt,
            "provider_id": j.provider_id, "step": j.progress.step, "total": j.progress.total,
            "metrics": dict(j.progress.metrics), "error": j.error,
            "created_at_ms": j.created_at_ms, "updated_at_ms": j.updated_at_ms,
            "cost": costs.get(j.job_id, 0.0),
        } for j in found]})



