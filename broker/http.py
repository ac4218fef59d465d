"""The broker's HTTP side (aiohttp): liveness, readiness, Prometheus metrics, JSON reads."""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpumarket.broker import views
from gpumarket.broker.state import BrokerState
from gpumarket.proto.jobspec import ACCELERATOR_NAMES, STATE_NAMES, kind_name, now_ms

log = logging.getLogger(__name__)


def _db_counts(db) -> tuple[dict[int, int], int]:
    states = dict(db.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall())
    stored = db.execute("SELECT coalesce(sum(size_bytes), 0) FROM artifacts").fetchone()[0]
    return states, stored


def _probe(db) -> None:
    db.execute("CREATE TEMP TABLE IF NOT EXISTS _ready (x)")


class BrokerHttp:
    def __init__(self, state: BrokerState, serving) -> None:
        self.state = state
        self.serving = serving  # () -> bool: is gRPC serving?
        self.app = web.Application()
        self.app.add_routes([
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/metrics", self.metrics),
            web.get("/api/providers", self.providers),
            web.get("/api/jobs", self.jobs),
        ])
        self.runner: web.AppRunner | None = None
        self.address = ""

    async def start(self, listen: str) -> str:
        host, _, port = listen.rpartition(":")
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, int(port))
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # port 0 picks one
        self.address = f"{host}:{bound}"
        return self.address

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        problems = []
        try:
            await self.state.store.write(_probe)
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
        states, stored = await self.state.store.read(_db_counts)
        for code, name in STATE_NAMES.items():
            m.jobs.labels(state=name).set(states.get(code, 0))
        m.artifact_bytes.set(stored)
        return web.Response(body=generate_latest(m.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def providers(self, request: web.Request) -> web.Response:
        from gpumarket.broker import reliability

        out = []
        offers = self.state.sessions.offers()
        busy = await self.state.store.read(views.busy_devices)
        hist = await self.state.store.read(views.histories, [o.provider_id for o in offers],
                                           now_ms())
        for offer in offers:
            h = hist[offer.provider_id]
            out.append({
                "provider_id": offer.provider_id,
                "online": True,
                "price_per_gpu_hour": offer.price_per_gpu_hour,
                "devices": [{"name": d.name, "accelerator": ACCELERATOR_NAMES[d.accelerator],
                             "memory_bytes": d.memory_bytes,
                             "matmul_flops": d.benchmark.matmul_flops,
                             "busy": d.index in busy.get(offer.provider_id, set())}
                            for d in offer.devices],
                "reliability": reliability.score(h),
                "mtbf_s": reliability.mtbf_s(h),
                "leases_completed": h.leases_completed,
                "leases_lost": h.leases_lost,
            })
        return web.json_response({"providers": out})

    async def jobs(self, request: web.Request) -> web.Response:
        try:
            limit = min(int(request.query.get("limit", "100")), 1000)
        except ValueError:
            return web.json_response({"error": "limit must be a number"}, status=400)
        found = await self.state.store.read(views.list_jobs, "", [], limit)
        return web.json_response({"jobs": [{
            "job_id": j.job_id, "name": j.name, "kind": kind_name(j.kind),
            "state": STATE_NAMES.get(j.state, "UNSPECIFIED"), "attempt": j.attempt,
            "provider_id": j.provider_id, "step": j.progress.step, "total": j.progress.total,
            "metrics": dict(j.progress.metrics), "error": j.error,
            "created_at_ms": j.created_at_ms, "updated_at_ms": j.updated_at_ms,
        } for j in found]})



