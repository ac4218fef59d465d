"""gpumarket-broker: run a marketplace broker."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

import click

from gpumarket.broker.config import BrokerConfig
from gpumarket.proto.errors import GpumarketError


def _log_setup(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """gpumarket broker: keeps providers, jobs, leases and artifacts, and matches jobs to
    providers."""


@cli.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path),
              help="TOML config (see `gpumarket-broker config --example`); options below win.")
@click.option("--listen", help="gRPC address HOST:PORT (port 0 picks a free port) "
              "[default: 127.0.0.1:7070].")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Directory for the database, the broker key and the artifact store.")
@click.option("--http", help="HTTP address HOST:PORT for /healthz, /readyz, /metrics and /api "
              "(port 0 picks a free port); off when not given.")
@click.option("--lease-timeout", type=float,
              help="Seconds without heartbeats after which a provider's leases are lost "
              "[default: 15].")
@click.option("--heartbeat-interval", type=float,
              help="Seconds between provider heartbeats [default: 3].")
@click.option("--max-attempts", type=int, help="Leases a job may lose before it fails "
              "[default: 5].")
@click.option("--artifact-grace", type=float,
              help="Seconds an artifact no job references is kept before it is deleted "
              "[default: 86400].")
@click.option("--operator", "operators", multiple=True,
              help="Key id allowed the admin commands (repeatable; the broker's own key "
              "always is).")
@click.option("--plaintext", is_flag=True, default=None,
              help="Serve without TLS (allowed only on a loopback address; TLS is the "
              "default).")
@click.option("--rate-limit", type=float,
              help="Calls a second allowed per key, bursts of 5x; 0 = no limit [default: 50].")
@click.option("--max-queued-jobs", type=int, help="QUEUED jobs allowed per client "
              "[default: 100].")
@click.option("--billing/--no-billing", default=None,
              help="Enforce funds: hold each job's worst-case cost from its client's balance "
              "at submission [default: on]; --no-billing only records usage (a private "
              "cluster).")
@click.option("--market-fee", type=float,
              help="Share of each settlement kept as the market's fee, 0 to 0.5 "
              "[default: 0.05].")
@click.option("--verify/--no-verify", default=None,
              help="Spot-check providers' work by replaying part of it on another provider "
              "[default: on]; see docs/verification.md.")
@click.option("--check-wait", type=float,
              help="Seconds a check waits for a provider to replay it before it is skipped "
              "[default: 600].")
@click.option("--trusted-checker", "trusted_checkers", multiple=True,
              help="Provider id that alone may run tie-breaks of spot checks (repeatable; "
              "the operator's referees) [default: any provider].")
@click.option("--api", help="HTTP address HOST:PORT of the endpoints' OpenAI-compatible API"
              " alone (it is also under /v1 of --http) [default: none].")
@click.option("--cold-start", type=float,
              help="Seconds an endpoint request waits for a first replica before a 503 "
              "[default: 300].")
@click.option("--queue-wait", type=float,
              help="Seconds an endpoint request waits for a free replica before a 429 "
              "[default: 30].")
@click.option("--max-held-mib", type=float,
              help="MiB of endpoint requests' bodies the broker holds, shared fairly between "
              "clients and their endpoints [default: 64].")
@click.option("--max-connections-per-peer", type=int,
              help="Connections one address (IPv6: its /64) may hold open to --api and to "
              "--http each; 0 = no cap [default: 256].")
@click.option("--idle-timeout", type=float,
              help="Seconds an --api/--http connection may stay without a whole request's "
              "headers, after connecting or after its last answer [default: 15].")
@click.option("--fd-reserve", type=int,
              help="File descriptors kept from all listeners for the database and blobs; "
              "0 = an eighth of the open-file limit, at least 256 [default: 0].")
@click.option("--provider-messages-per-s", type=float,
              help="Messages a provider session may send a second, sustained (bursts of 10 s "
              "worth); more ends its session [default: 200].")
@click.option("--store", help="Where the broker keeps its tables: postgresql://USER@HOST/DB "
              "(a libpq URL; docs/deploy.md) or sqlite:///PATH [default: SQLite, "
              "DATA_DIR/broker.db].")
@click.option("--leader-ttl", type=float,
              help="Brokers sharing a PostgreSQL store: seconds the leader's hold on the "
              "scheduler role lasts unrenewed (renewed every third of it); another broker "
              "takes over this long after the leader stops [default: 5].")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def serve(config_file: Path | None, listen: str | None, data_dir: Path | None,
          http: str | None, lease_timeout: float | None, heartbeat_interval: float | None,
          max_attempts: int | None, artifact_grace: float | None, operators: tuple[str, ...],
          plaintext: bool | None, rate_limit: float | None, max_queued_jobs: int | None,
          billing: bool | None, market_fee: float | None, verify: bool | None,
          check_wait: float | None, trusted_checkers: tuple[str, ...], api: str | None,
          cold_start: float | None,
          queue_wait: float | None, max_held_mib: float | None,
          max_connections_per_peer: int | None, idle_timeout: float | None,
          fd_reserve: int | None, provider_messages_per_s: float | None,
          store: str | None, leader_ttl: float | None, log_level: str) -> None:
    """Serve the broker's gRPC API (and HTTP side) until SIGTERM."""
    from gpumarket.broker import config as broker_config
    from gpumarket.broker.api.listeners import raise_open_files

    _log_setup(log_level)
    try:
        settings = broker_config.load(config_file) if config_file else {}
    except GpumarketError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    for key, value in (("listen", listen), ("data_dir", data_dir), ("http", http),
                       ("lease_timeout_s", lease_timeout),
                       ("heartbeat_interval_s", heartbeat_interval),
                       ("max_attempts", max_attempts), ("artifact_grace_s", artifact_grace),
                       ("operators", operators or None), ("plaintext", plaintext),
                       ("rate_limit_per_s", rate_limit), ("max_queued_jobs", max_queued_jobs),
                       ("billing", billing), ("market_fee", market_fee),
                       ("verify", verify), ("check_wait_s", check_wait),
                       ("trusted_checkers", trusted_checkers or None), ("api", api),
                       ("cold_start_s", cold_start), ("queue_wait_s", queue_wait),
                       ("max_held_bytes", None if max_held_mib is None
                        else int(max_held_mib * 2**20)),
                       ("max_connections_per_peer", max_connections_per_peer),
                       ("idle_timeout_s", idle_timeout), ("fd_reserve", fd_reserve),
                       ("provider_messages_per_s", provider_messages_per_s),
                       ("store", store), ("leader_ttl_s", leader_ttl)):
        if value is not None:
            settings[key] = value
    if "data_dir" not in settings:
        raise click.UsageError("give --data-dir (or data_dir in --config)")
    config = BrokerConfig(**settings)
    try:
        config.check()
    except GpumarketError as exc:
        raise click.UsageError(str(exc)) from exc
    if config.heartbeat_interval_s <= 0 or config.lease_timeout_s <= config.heartbeat_interval_s:
        raise click.UsageError("the lease timeout must be longer than the heartbeat interval")
    config = replace(config, gc_interval_s=min(60.0, max(1.0, config.artifact_grace_s / 2)))
    # What the broker writes (its database, artifacts, keys) is its own, however started.
    os.umask(0o077)
    # The broker keeps many objects for long (each session's state, its stream's tasks) and
    # makes many short-lived ones per message: with CPython's default thresholds (700, 10,
    # 10), at 10,000 providers a full collection ran every few seconds, pausing the event
    # loop 0.7 s each time and finding nothing (bench/scale.py: signed calls' p99 was
    # 634-748 ms, 13 ms with these). What the start made is left out of collections; the
    # young generation is collected every 50,000 allocations, the older ones less often.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    # Descriptors are what a flood of idle connections takes: as many as the host allows,
    # shared between the listeners with a reserve (broker/api/listeners.py).
    raise_open_files()
    try:
        asyncio.run(serve_main(config))
    except GpumarketError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:
        click.echo(f"error: cannot start the broker: {exc}", err=True)
        sys.exit(1)


@cli.command("config")
@click.option("--example", is_flag=True, required=True, help="Print a commented example.")
def config_cmd(example: bool) -> None:
    """Print a commented example broker config (for serve --config)."""
    from gpumarket.broker.config import EXAMPLE

    click.echo(EXAMPLE, nl=False)


async def serve_main(config: BrokerConfig) -> None:
    from gpumarket.broker.server import serve as run_server

    await run_server(config)


def _add_admin_commands() -> None:
    from gpumarket.broker.admin_cli import COMMANDS

    for command in COMMANDS:
        cli.add_command(command)


_add_admin_commands()


def main() -> None:
    from gpumarket import kinds

    try:
        kinds.load_plugins(os.environ.get("GPUMARKET_KINDS", ""))
    except GpumarketError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    cli(prog_name="gpumarket-broker")
