"""gpumarket-broker: run a marketplace broker."""

from __future__ import annotations

import asyncio
import logging
import sys
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
@click.option("--listen", default="127.0.0.1:7070", show_default=True,
              help="gRPC address HOST:PORT (port 0 picks a free port).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory for the database, the broker key and the artifact store.")
@click.option("--http", default="", help="HTTP address HOST:PORT for /healthz, /readyz, "
              "/metrics and /api (port 0 picks a free port); off when not given.")
@click.option("--lease-timeout", type=float, default=15.0, show_default=True,
              help="Seconds without heartbeats after which a provider's leases are lost.")
@click.option("--heartbeat-interval", type=float, default=3.0, show_default=True,
              help="Seconds between provider heartbeats.")
@click.option("--max-attempts", type=int, default=5, show_default=True,
              help="Leases a job may lose before it fails.")
@click.option("--artifact-grace", type=float, default=24 * 3600.0, show_default=True,
              help="Seconds an artifact no job references is kept before it is deleted.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def serve(listen: str, data_dir: Path, http: str, lease_timeout: float,
          heartbeat_interval: float, max_attempts: int, artifact_grace: float,
          log_level: str) -> None:
    """Serve the broker's gRPC API until SIGTERM."""
    _log_setup(log_level)
    if heartbeat_interval <= 0 or lease_timeout <= heartbeat_interval:
        raise click.UsageError("--lease-timeout must be longer than --heartbeat-interval")
    config = BrokerConfig(data_dir=data_dir, listen=listen, http=http,
                          lease_timeout_s=lease_timeout,
                          heartbeat_interval_s=heartbeat_interval, max_attempts=max_attempts,
                          artifact_grace_s=artifact_grace,
                          gc_interval_s=min(60.0, max(1.0, artifact_grace / 2)))
    try:
        asyncio.run(serve_main(config))
    except GpumarketError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:
        click.echo(f"error: cannot start the broker: {exc}", err=True)
        sys.exit(1)


async def serve_main(config: BrokerConfig) -> None:
    from gpumarket.broker.server import serve as run_server

    await run_server(config)


def main() -> None:
    cli(prog_name="gpumarket-broker")
