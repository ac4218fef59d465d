"""Assemble and run the broker: gRPC services, health, reflection, loops."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import secrets
import signal
import socket

import grpc
from aiohttp import web
from prometheus_client import Gauge
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gpumarket.broker.api.admin import AdminServicer
from gpumarket.broker.api.artifacts import ArtifactsServicer
from gpumarket.broker.api.auth import Authenticator
from gpumarket.broker.api.gateway import ProviderGatewayServicer
from gpumarket.broker.api.http import BrokerHttp
from gpumarket.broker.checks import disputes, task_checks
from gpumarket.broker.checks import verification
from gpumarket.broker.config import BrokerConfig
from gpumarket.broker.jobs import arrays
from gpumarket.broker.jobs import reactions
from gpumarket.broker.market import providers
from gpumarket.broker.market import scheduler
from gpumarket.broker.serving import answer_samples
from gpumarket.broker.serving.autoscaler import Autoscaler
from gpumarket.broker.store.artifact_store import ArtifactStore
from gpumarket.broker.api.listeners import (
    ConnectionGuard, GuardedSite, plan, throttle_accept_errors,
)
from gpumarket.broker.api.marketplace import MarketplaceServicer
from gpumarket.broker.serving.openai_api import OpenAIApi
from gpumarket.broker.serving.relay import Relay, advertised_url
from gpumarket.broker.serving.router import Serving
from gpumarket.broker import state as shared
from gpumarket.broker.state import BrokerState
from gpumarket.broker.store.store import open_store
from gpumarket.proto.tls import tls_material
from gpumarket.proto.wire import PLAINTEXT, SERVER_OPTIONS
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import admin_pb2, artifacts_pb2, gateway_pb2, marketplace_pb2
from gpumarket.proto.v1 import (
    admin_pb2_grpc, artifacts_pb2_grpc, gateway_pb2_grpc, marketplace_pb2_grpc,
)

log = logging.getLogger(__name__)

SESSIONS_END_S = 5.0    # at shutdown, how long the providers' sessions may take to end

SERVICES = (
    gateway_pb2.DESCRIPTOR.services_by_name["ProviderGateway"].full_name,
    marketplace_pb2.DESCRIPTOR.services_by_name["Marketplace"].full_name,
    artifacts_pb2.DESCRIPTOR.services_by_name["Artifacts"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
)


def install_reactions() -> None:
    """What job arrays and spot checks do when a job moves (broker/jobs/reactions.py): set
    once as the broker starts, so the state machine need not import them."""
    reactions.install(reactions.Reactions(
        batch_moved=arrays.follow_batch, batch_tasks=task_checks.lease_tasks,
        array_cancelled=arrays.cancelled, check_leased=verification.lease_scope,
        checkpoint_stored=verification.checkpoint_stored,
        receipt_came=task_checks.receipt_came, open_checks=verification.open_checks,
        work_summary=verification.summary, check_returned=verification.returned,
        check_requeued=verification.requeued, check_failed=disputes.could_not_run,
        job_ended=disputes.drop))


def server_options(cfg: BrokerConfig) -> tuple:
    """The gRPC server's options: the wire's, with the keepalive floor this broker is set to."""
    floor = "grpc.http2.min_ping_interval_without_data_ms"
    return (*(o for o in SERVER_OPTIONS if o[0] != floor),
            (floor, round(cfg.min_ping_interval_s * 1000)))


class BrokerServer:
    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.state: BrokerState | None = None
        self.http: BrokerHttp | None = None
        self.gateway: ProviderGatewayServicer | None = None
        self.api_runner: web.AppRunner | None = None
        self.relay: Relay | None = None

    async def start(self) -> str:
        cfg = self.config
        install_reactions()
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        fds = plan(limit if limit > 0 else 1 << 20, cfg.fd_reserve, api=bool(cfg.api),
                   http=bool(cfg.http))
        throttle_accept_errors(asyncio.get_running_loop())
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        identity = Identity.load_or_create(cfg.key_path)
        store = open_store(cfg.store, cfg.db_path)
        store.open()
        if store.dialect == "sqlite":
            # One broker, one file: no session is open now. (On a shared store the other
            # brokers' sessions are: the leader takes over the leases instead, scheduler.py.)
            await store.write(providers.after_restart)
            kept = await store.write(providers.renew_all_leases, now_ms(),
                                     int(cfg.lease_timeout_s * 1000))
            if kept:
                log.info("%d leases were active at the last stop; waiting for their providers",
                         kept)
        artifacts = ArtifactStore(cfg.data_dir / "artifacts", cfg.max_artifact_bytes)
        self.state = BrokerState(cfg, identity, store, artifacts)
        self.state.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        if self.state.shared:
            shared.share(self.state, cfg.store)
        self.state.revoked = set(await store.read(providers.revoked))
        log.info("open files: limit %d, %d kept for the database and blobs; connections:"
                 " gRPC %d, API %s, HTTP %s (per-peer cap %s)", fds.limit, fds.reserve, fds.grpc,
                 fds.api or "off", fds.http or "off", cfg.max_connections_per_peer or "off")

        server = grpc.aio.server(
            interceptors=[Authenticator(self.state, identity.id, cfg.plaintext)],
            options=(*server_options(cfg), ("grpc.max_allowed_incoming_connections", fds.grpc)))
        self.gateway = ProviderGatewayServicer(self.state)
        gateway_pb2_grpc.add_ProviderGatewayServicer_to_server(self.gateway, server)
        marketplace_pb2_grpc.add_MarketplaceServicer_to_server(
            MarketplaceServicer(self.state), server)
        artifacts_pb2_grpc.add_ArtifactsServicer_to_server(ArtifactsServicer(self.state), server)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(self.state), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        host, _, port = cfg.listen.rpartition(":")
        if cfg.plaintext:
            bound = server.add_insecure_port(cfg.listen)
        else:
            key_pem, cert_pem = await asyncio.to_thread(tls_material, identity, cfg.data_dir)
            bound = server.add_secure_port(
                cfg.listen, grpc.ssl_server_credentials([(key_pem, cert_pem)]))
        if bound == 0:
            raise OSError(f"cannot listen on {cfg.listen}")
        await server.start()
        for name in ("", *SERVICES):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.server = server
        self.address = f"{PLAINTEXT if cfg.plaintext else ''}{host}:{bound}"
        info = {"address": self.address, "pid": os.getpid(), "broker_id": identity.id,
                "tls": not cfg.plaintext, "holder": self.state.holder}
        metrics = self.state.metrics
        state = self.state
        Gauge("gpumarket_broker_leading", "1 while this broker leads (holds the scheduler"
              " role: places jobs, runs the loops; a broker on SQLite always does)",
              registry=metrics.registry).set_function(lambda: int(state.epoch is not None))
        Gauge("gpumarket_broker_leader_epoch", "The scheduler role's epoch while this broker"
              " leads (0 on SQLite), else 0", registry=metrics.registry).set_function(
            lambda: state.epoch or 0)
        serving = self.state.serving = Serving(self.state.sessions, metrics,
                                               cfg.queue_wait_s, cfg.cold_start_s,
                                               cfg.request_timeout_s, cfg.max_held_bytes,
                                               cfg.answer_check_rate)
        metrics.endpoint_held_bytes.set_function(lambda: serving.shares.held)
        if cfg.verify:      # each answer kept for a check is stored as it is kept
            serving.samples.keep = answer_samples.StoreWriter(self.state.store)
        api = OpenAIApi(self.state, serving, cfg.body_timeout_s)
        if cfg.http:
            self.http = BrokerHttp(self.state, lambda: self.server is not None)
            self.http.app.add_routes(api.routes())
            info["http"] = await self.http.start(cfg.http, self._guard("http", fds.http))
            log.info("HTTP (health, metrics) on %s", info["http"])
        if cfg.api:
            # Its caller gone, a request's handler is cancelled (and its held bytes and
            # replica slot freed); a connection idle or without headers is closed.
            self.api_runner = web.AppRunner(api.app(), access_log=None,
                                            handler_cancellation=True,
                                            keepalive_timeout=cfg.idle_timeout_s)
            await self.api_runner.setup()
            host, _, port = cfg.api.rpartition(":")
            site = GuardedSite(self.api_runner, host, int(port), self._guard("api", fds.api))
            await site.start()
            info["api"] = f"{host}:{site.port}"
            log.info("endpoints' API on %s", info["api"])
        if info.get("api") or info.get("http"):
            self.state.api_base = f"http://{info.get('api') or info['http']}"
            if self.state.shared:       # endpoints served on any broker of the store
                api.relay = self.relay = Relay(
                    self.state, serving, advertised_url(cfg.relay_url, info.get("api")
                                                        or info["http"]), metrics.registry)
        tmp = cfg.data_dir / "broker.json.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, cfg.data_dir / "broker.json")
        log.info("broker %s listening on %s (%s)", identity.id, self.address,
                 "plaintext, loopback only" if cfg.plaintext else "TLS")
        return self.address

    def _guard(self, name: str, max_connections: int) -> ConnectionGuard:
        metrics = self.state.metrics
        guard = ConnectionGuard(name, max_connections, self.config.max_connections_per_peer,
                                metrics.connections_refused)
        metrics.connections.labels(listener=name).set_function(lambda: guard.open)
        return guard

    async def stop(self) -> None:
        if self.relay is not None:
            await self.relay.close()
        if self.http is not None:
            await self.http.stop()
        if self.api_runner is not None:
            await self.api_runner.cleanup()
        if self.server is not None:
            server, self.server = self.server, None
            await server.stop(self.config.shutdown_grace_s)
        if self.gateway is not None:
            # A provider's session handler may learn that the server stopped only after
            # server.stop returned: its bookkeeping (gateway.cleanups) must still reach the
            # store before it closes. Bounded: a session that will not end is left.
            loop = asyncio.get_running_loop()
            until = loop.time() + SESSIONS_END_S
            while loop.time() < until and (self.gateway.cleanups
                                           or any(self.state.sessions.local())):
                if self.gateway.cleanups:
                    await asyncio.gather(*self.gateway.cleanups, return_exceptions=True)
                else:
                    await asyncio.sleep(0.01)
        if self.state is not None:
            self.state.store.close()


async def serve(config: BrokerConfig) -> None:
    """Run the broker until SIGTERM or SIGINT."""
    broker = BrokerServer(config)
    await broker.start()
    print(f"gpumarket broker {broker.state.identity.id} listening on {broker.address}",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with asyncio.TaskGroup() as tg:
            # The autoscaler makes and ends replica leases: the leader's, as the loops are.
            tasks = [tg.create_task(scheduler.lead(
                broker.state, also=(lambda st: Autoscaler(st, st.serving).run(),)))]
            if broker.state.shared:
                tasks.append(tg.create_task(broker.state.notices.run()))
                tasks.append(tg.create_task(scheduler.run(broker.state, scheduler.SHARED_LOOPS)))
            if broker.relay is not None:
                tasks.append(tg.create_task(broker.relay.run()))
            await stop.wait()
            log.info("shutting down")
            for task in tasks:
                task.cancel()
    finally:
        await broker.stop()
