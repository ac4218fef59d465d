"""gpumarket-provider: rent out this machine's GPUs (or its CPU) on a gpumarket broker."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import click

from gpumarket.proto.errors import GpumarketError
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import ACCELERATOR_NAMES
from gpumarket.provider.config import ProviderConfig

log = logging.getLogger("gpumarket.provider")


def _log_setup(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """gpumarket provider: detect and benchmark this machine's devices, offer them to a
    broker, and run the jobs it leases."""


@cli.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path),
              help="TOML config: price, accepted kinds, clients, hours (see `config --example`).")
@click.option("--broker", envvar="GPUMARKET_BROKER",
              help="Broker address HOST:PORT (or $GPUMARKET_BROKER, or the config's broker).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Directory for the provider key, benchmark cache and job work dirs.")
@click.option("--price", type=float, help="Price per device-hour, in credits (default 1.0).")
@click.option("--cpu-only", is_flag=True, help="Offer the CPU even where GPUs are present.")
@click.option("--max-runtime", type=int, help="Longest a job may run, in seconds (default 1 day).")
@click.option("--no-warm", is_flag=True,
              help="Do not keep an idle runner with its imports done (saves its memory; jobs "
                   "start a few seconds slower).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def run(config_file: Path | None, broker: str | None, data_dir: Path | None,
        price: float | None, cpu_only: bool, max_runtime: int | None, no_warm: bool,
        log_level: str) -> None:
    """Connect to a broker, advertise this machine, and run leased jobs until SIGTERM
    (SIGTERM drains: jobs checkpoint and move elsewhere; a second SIGTERM stops at once)."""
    from gpumarket.provider import config as provider_config

    _log_setup(log_level)
    try:
        settings = provider_config.load(config_file) if config_file else {}
    except GpumarketError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    for key, value in (("broker", broker), ("data_dir", data_dir),
                       ("price_per_gpu_hour", price), ("max_runtime_s", max_runtime)):
        if value is not None:
            settings[key] = value
    if cpu_only:
        settings["cpu_only"] = True
    if no_warm:
        settings["warm_runners"] = False
    if not settings.get("broker"):
        raise click.UsageError("give --broker (or $GPUMARKET_BROKER, or broker in --config)")
    if not settings.get("data_dir"):
        raise click.UsageError("give --data-dir (or data_dir in --config)")
    if settings.get("price_per_gpu_hour", 0) < 0:
        raise click.BadParameter("must not be negative", param_hint="--price")
    config = provider_config.build(settings)
    try:
        asyncio.run(_run(config))
    except GpumarketError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


@cli.command("config")
@click.option("--example", is_flag=True, required=True, help="Print a commented example.")
def config_cmd(example: bool) -> None:
    """Print a commented example provider config (for run --config)."""
    from gpumarket.provider.config import EXAMPLE

    click.echo(EXAMPLE, nl=False)


async def _run(config: ProviderConfig) -> None:
    from gpumarket.provider.benchmark import cached_benchmarks
    from gpumarket.provider.daemon import ProviderDaemon
    from gpumarket.provider.inventory import detect

    config.data_dir.mkdir(parents=True, exist_ok=True)
    identity = Identity.load_or_create(config.key_path)
    devices, warning = await asyncio.to_thread(detect, config.cpu_only)
    if warning:
        log.warning("%s", warning)
    benchmarks = await asyncio.to_thread(cached_benchmarks, devices,
                                         config.data_dir / "benchmark.json")
    for d in devices:
        b = benchmarks[d.index]
        log.info("device %d: %s (%s, %s), %.1f GFLOP/s %s, %.1f GB/s", d.index, d.name,
                 ACCELERATOR_NAMES[d.accelerator], _gib(d.memory_bytes), b.matmul_flops / 1e9,
                 b.matmul_dtype, b.memory_bandwidth_bytes_per_s / 1e9)
    daemon = ProviderDaemon(config, identity, devices, benchmarks)
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        # The first SIGTERM/SIGINT drains; a second one stops at once.
        if daemon.draining:
            daemon.stop()
        else:
            daemon.request_drain()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    pid_file = config.data_dir / "provider.pid"
    pid_file.write_text(str(os.getpid()))
    print(f"gpumarket provider {identity.id} serving broker {config.broker}", flush=True)
    try:
        await daemon.run()
    finally:
        pid_file.unlink(missing_ok=True)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--cpu-only", is_flag=True, help="Show only the CPU device.")
def devices(as_json: bool, cpu_only: bool) -> None:
    """List the devices this machine would offer."""
    from gpumarket.provider.inventory import detect

    found, warning = detect(cpu_only)
    if warning:
        click.echo(f"warning: {warning}", err=True)
    rows = [{"index": d.index, "name": d.name, "uuid": d.uuid,
             "accelerator": ACCELERATOR_NAMES[d.accelerator], "memory_bytes": d.memory_bytes,
             "compute_capability": d.compute_capability, "driver_version": d.driver_version,
             "cuda_version": d.cuda_version, "cpu_cores": d.cpu_cores} for d in found]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        extra = (f"cc {r['compute_capability']}, driver {r['driver_version']}, CUDA "
                 f"{r['cuda_version']}" if r["accelerator"] == "cuda"
                 else f"{r['cpu_cores']} cores")
        click.echo(f"{r['index']}  {r['accelerator']:4}  {r['name']}  "
                   f"{_gib(r['memory_bytes'])}  {extra}  {r['uuid']}")


@cli.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Cache the figures here (as `run` does); without it, always measure.")
@click.option("--refresh", is_flag=True, help="Measure again even if cached.")
@click.option("--cpu-only", is_flag=True, help="Benchmark only the CPU device.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def bench(data_dir: Path | None, refresh: bool, cpu_only: bool, as_json: bool) -> None:
    """Measure each device's matmul throughput and memory bandwidth."""
    import tempfile

    from gpumarket.provider.benchmark import cached_benchmarks
    from gpumarket.provider.inventory import detect

    found, warning = detect(cpu_only)
    if warning:
        click.echo(f"warning: {warning}", err=True)
    with tempfile.TemporaryDirectory() as tmp:
        cache = (data_dir or Path(tmp)) / "benchmark.json"
        figures = cached_benchmarks(found, cache, refresh=refresh)
    from google.protobuf.json_format import MessageToDict

    rows = [{"index": d.index, "name": d.name,
             **MessageToDict(figures[d.index], preserving_proto_field_name=True)}
            for d in found]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for d in found:
        b = figures[d.index]
        dtypes = ", ".join(f"{k} {v / 1e12:.3g}" for k, v in
                           sorted(b.matmul_flops_by_dtype.items()))
        click.echo(f"{d.index}  {d.name}")
        click.echo(f"   matmul TFLOP/s: {dtypes}")
        click.echo(f"   memory bandwidth {b.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s"
                   + (f", host-to-device {b.host_to_device_bytes_per_s / 1e9:.1f} GB/s"
                      if b.host_to_device_bytes_per_s else "")
                   + (f", {b.sm_count} SMs" if b.sm_count else "")
                   + (f", {b.interconnect}" if b.interconnect else ""))


def _running(pid: int) -> bool:
    """True while ``pid`` exists and has not exited (a zombie counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@cli.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The data directory of the running provider.")
@click.option("--timeout", type=float, default=180.0, show_default=True,
              help="Seconds to wait for the daemon to finish draining.")
def drain(data_dir: Path, timeout: float) -> None:
    """Drain a running provider: checkpoint every job now, upload, give the leases back so
    the jobs resume elsewhere at once, then exit (the same as sending it SIGTERM)."""
    pid_file = data_dir / "provider.pid"
    try:
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        click.echo(f"error: no running provider with data dir {data_dir}", err=True)
        sys.exit(1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _running(pid):
            click.echo(f"provider {pid} drained and stopped")
            return
        time.sleep(0.2)
    click.echo(f"error: provider {pid} is still draining after {timeout:.0f}s", err=True)
    sys.exit(1)


def main() -> None:
    cli(prog_name="gpumarket-provider")
