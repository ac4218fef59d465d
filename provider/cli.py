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
              help="Broker address HOST:PORT (or $GPUMARKET_BROKER, or the config's broker); "
              "TLS, or plaintext://HOST:PORT on loopback; the brokers of one market as "
              "HOST:PORT,HOST:PORT (the next is tried whenever a session breaks).")
@click.option("--broker-key", envvar="GPUMARKET_BROKER_KEY",
              help="The broker's key id to accept (or $GPUMARKET_BROKER_KEY); without it the "
              "key seen first is trusted and remembered in DATA_DIR/known_brokers.")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Directory for the provider key, benchmark cache and job work dirs.")
@click.option("--price", type=float, help="Price per device-hour, in credits (default 1.0): "
              "what standard jobs and endpoint replicas pay.")
@click.option("--interruptible-price", type=float,
              help="Price per device-hour of an interruptible lease, one a job of a higher "
                   "tier may preempt (default: 40% of --price).")
@click.option("--cpu-only", is_flag=True, help="Offer the CPU even where GPUs are present.")
@click.option("--cpu-devices", type=click.IntRange(1, 64),
              help="Offer the CPU as this many devices, each an equal share (default 1).")
@click.option("--slices", "slices_text", metavar="N|SHARES",
              help="Also offer every device as N equal slices, or as slices of these shares "
                   "(comma-separated, e.g. 0.5,0.25,0.25): each a device of its own with its "
                   "share of the card's memory, compute and price.")
@click.option("--models-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Models jobs may name, one directory each (default: DATA_DIR/models).")
@click.option("--max-runtime", type=int, help="Longest a job may run, in seconds (default 1 day).")
@click.option("--kinds", "kind_names",
              help="Job kinds to run, comma-separated (default: every kind but script, which "
                   "runs the client's own Python and must be named).")
@click.option("--no-warm", is_flag=True,
              help="Run no forkservers (each keeps a kind's imports loaded to fork jobs from; "
                   "saves their memory, jobs start a few seconds slower).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def run(config_file: Path | None, broker: str | None, broker_key: str | None,
        data_dir: Path | None, price: float | None, interruptible_price: float | None,
        cpu_only: bool, cpu_devices: int | None, slices_text: str | None,
        models_dir: Path | None, max_runtime: int | None, kind_names: str | None,
        no_warm: bool, log_level: str) -> None:
    """Connect to a broker, advertise this machine, and run leased jobs until SIGTERM
    (SIGTERM drains: jobs checkpoint and move elsewhere; a second SIGTERM stops at once)."""
    from gpumarket.provider import config as provider_config

    _log_setup(log_level)
    try:
        settings = provider_config.load(config_file) if config_file else {}
    except GpumarketError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    for key, value in (("broker", broker), ("broker_key", broker_key), ("data_dir", data_dir),
                       ("price_per_gpu_hour", price), ("max_runtime_s", max_runtime),
                       ("interruptible_price_per_gpu_hour", interruptible_price),
                       ("cpu_devices", cpu_devices), ("models_path", models_dir)):
        if value is not None:
            settings[key] = value
    if kind_names is not None:
        try:
            settings.update(provider_config.kinds_setting(kind_names.split(","), "--kinds"))
        except GpumarketError as exc:
            raise click.BadParameter(exc.message, param_hint="--kinds") from exc
    if slices_text is not None:
        settings["slices"] = _slices_option(slices_text)
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
    if (settings.get("interruptible_price_per_gpu_hour") or 0) < 0:
        raise click.BadParameter("must not be negative", param_hint="--interruptible-price")
    config = provider_config.build(settings)
    if config.interruptible_price > config.price_per_gpu_hour:
        raise click.BadParameter(
            f"{config.interruptible_price:g} is more than the standard price"
            f" {config.price_per_gpu_hour:g}: an interruptible lease may be preempted, so it"
            " costs at most that", param_hint="--interruptible-price")
    # What the daemon writes (its key, journal, cache) is its own, however started; what a
    # job must read is opened to it explicitly (executor.hand_over).
    os.umask(0o077)
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


def _slices_option(text: str) -> tuple[float, ...]:
    """--slices N or --slices SHARE,SHARE,... as the config's slices setting."""
    from gpumarket.provider import config as provider_config

    try:
        return provider_config.slices_text(text, "--slices")
    except GpumarketError as exc:
        raise click.BadParameter(exc.message, param_hint="--slices") from exc


async def _run(config: ProviderConfig) -> None:
    from gpumarket.provider.benchmark import cached_benchmarks
    from gpumarket.provider.daemon import ProviderDaemon
    from gpumarket.provider.inventory import config_slices, detect, device_line, device_row

    config.data_dir.mkdir(parents=True, exist_ok=True)
    identity = Identity.load_or_create(config.key_path)
    devices, warning = await asyncio.to_thread(detect, config.cpu_only, config.cpu_devices)
    if warning:
        log.warning("%s", warning)
    benchmarks = await asyncio.to_thread(cached_benchmarks, devices,
                                         config.data_dir / "benchmark.json")
    for d in devices:
        b = benchmarks[d.index]
        log.info("device %d: %s (%s, %s), %.1f GFLOP/s %s, %.1f GB/s", d.index, d.name,
                 ACCELERATOR_NAMES[d.accelerator], _gib(d.memory_bytes), b.matmul_flops / 1e9,
                 b.matmul_dtype, b.memory_bandwidth_bytes_per_s / 1e9)
    # Slices are not measured: the broker reads a slice's speed as its share of its card's.
    devices = config_slices(devices, config)
    for d in devices:
        if d.is_slice:
            log.info("device %s", device_line(device_row(d)))
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
@click.option("--cpu-devices", type=click.IntRange(1, 64),
              help="The CPU as this many devices, as `run --cpu-devices` offers it.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path),
              help="TOML config whose slices (and cpu_devices) to apply, as `run` does.")
@click.option("--slices", "slices_text", metavar="N|SHARES",
              help="Show every device also as N equal slices, or slices of these shares.")
def devices(as_json: bool, cpu_only: bool, cpu_devices: int | None, config_file: Path | None,
            slices_text: str | None) -> None:
    """List the devices this machine would offer: GPUs (MIG instances as devices of their
    own), or the CPU; and the slices the config or --slices cuts them into."""
    from gpumarket.provider import config as provider_config
    from gpumarket.provider.inventory import config_slices, detect, device_line, device_row

    slices = _slices_option(slices_text) if slices_text is not None else None
    try:
        settings = provider_config.load(config_file) if config_file else {}
        config = ProviderConfig(broker="", data_dir=Path("."),
                                slices=slices or settings.get("slices", ()),
                                device_slices=settings.get("device_slices", {}))
        found, warning = detect(cpu_only, cpu_devices or settings.get("cpu_devices", 1))
        if warning:
            click.echo(f"warning: {warning}", err=True)
        found = config_slices(found, config)
    except GpumarketError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    rows = [device_row(d) for d in found]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        click.echo(device_line(r))


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


@cli.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Where the key, config, benchmark cache and job work dirs will live.")
@click.option("--broker", envvar="GPUMARKET_BROKER", default="",
              help="Broker address HOST:PORT to put in the config (and to check it answers).")
@click.option("--broker-key", envvar="GPUMARKET_BROKER_KEY", default="",
              help="The broker's key id to accept (or $GPUMARKET_BROKER_KEY); without it the "
              "key seen first is trusted and remembered in DATA_DIR/known_brokers.")
@click.option("--price", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Price per device-hour, in credits.")
@click.option("--cpu-only", is_flag=True, help="Offer the CPU even where GPUs are present.")
@click.option("--force", is_flag=True, help="Overwrite an existing provider.toml.")
def init(data_dir: Path, broker: str, broker_key: str, price: float, cpu_only: bool,
         force: bool) -> None:
    """Set this machine up as a provider: create its key, write a commented config with the
    devices found (DATA_DIR/provider.toml), self-test and benchmark each device, and print
    the provider's fingerprint."""
    from gpumarket.provider.benchmark import cached_benchmarks
    from gpumarket.provider.inventory import detect
    from gpumarket.provider.onboarding import config_text, self_test

    config_path = data_dir / "provider.toml"
    if config_path.exists() and not force:
        click.echo(f"error: {config_path} exists (give --force to overwrite it)", err=True)
        sys.exit(1)
    data_dir.mkdir(parents=True, exist_ok=True)
    identity = Identity.load_or_create(data_dir / "provider.key")
    found, warning = detect(cpu_only)
    if warning:
        click.echo(f"warning: {warning}", err=True)
    config_path.write_text(config_text(found, broker, str(data_dir.resolve()), price))
    failed = 0
    figures = cached_benchmarks(found, data_dir / "benchmark.json", refresh=True)
    for d in found:
        test = self_test(d)
        b = figures[d.index]
        verdict = "ok" if test.ok else f"FAILED: {test.problem}"
        failed += not test.ok
        click.echo(f"device {d.index}: {d.name} ({ACCELERATOR_NAMES[d.accelerator]},"
                   f" {_gib(d.memory_bytes)}): self-test {verdict}; allocated"
                   f" {_gib(test.allocated_bytes)}, matmul error {test.matmul_max_error:.1e},"
                   f" {b.matmul_flops / 1e12:.3g} TFLOP/s {b.matmul_dtype},"
                   f" {b.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s")
    if broker:
        try:
            asyncio.run(_broker_standing(broker, broker_key, identity, data_dir))
            click.echo(f"broker {broker} answers")
        except GpumarketError as exc:
            if exc.code == "NOT_FOUND":
                click.echo(f"broker {broker} answers (this provider has not connected yet)")
            else:
                click.echo(f"warning: {exc}", err=True)
    click.echo(f"config written to {config_path}")
    click.echo(f"provider fingerprint: {identity.id}")
    click.echo(f"start it with: gpumarket-provider run --config {config_path}")
    if failed:
        click.echo(f"error: {failed} device(s) failed the self-test", err=True)
        sys.exit(1)


async def _broker_standing(broker: str, pin: str, identity, data_dir: Path):
    from gpumarket.link.channel import Trust
    from gpumarket.link.client import BrokerClient

    trust = Trust(pin=pin, known=data_dir / "known_brokers")
    async with BrokerClient(broker, identity, timeout_s=10, trust=trust) as client:
        return await client.get_provider(identity.id)


CLOCK_SKEW_WARN_MS = 60_000


def _key_and_broker(data_dir: Path, broker: str, broker_key: str
                    ) -> tuple[Identity, str, str]:
    """The provider's key, and the broker to ask (the options', else its provider.toml's);
    one line on stderr and exit 1 if there is no key or the config is unusable."""
    key = data_dir / "provider.key"
    if not key.exists():
        click.echo(f"error: no provider key in {data_dir}; run `gpumarket-provider init`",
                   err=True)
        sys.exit(1)
    try:
        identity = Identity.load(key)
        if (data_dir / "provider.toml").exists():
            from gpumarket.provider import config as provider_config

            settings = provider_config.load(data_dir / "provider.toml")
            broker = broker or settings.get("broker", "")
            broker_key = broker_key or settings.get("broker_key", "")
    except GpumarketError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    return identity, broker, broker_key


@cli.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The provider's data directory.")
@click.option("--broker", envvar="GPUMARKET_BROKER", default="",
              help="Broker to ask (default: the config's, or $GPUMARKET_BROKER).")
@click.option("--broker-key", envvar="GPUMARKET_BROKER_KEY", default="",
              help="The broker's key id to accept (or $GPUMARKET_BROKER_KEY).")
@click.option("--job", "job_id", default="", help="Only the settlements of this job.")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (amounts in units).")
def earnings(data_dir: Path, broker: str, broker_key: str, job_id: str, limit: int,
             as_json: bool) -> None:
    """What the broker's ledger has paid this provider: each settled segment of a job's
    progress (steps, device-seconds, amount after the market's fee), newest first."""
    from google.protobuf.json_format import MessageToDict

    from gpumarket.link.channel import Trust
    from gpumarket.link.client import BrokerClient
    from gpumarket.proto.money import fmt

    identity, broker, broker_key = _key_and_broker(data_dir, broker, broker_key)
    if not broker:
        raise click.UsageError("give --broker (or broker in provider.toml)")

    async def ask():
        trust = Trust(pin=broker_key, known=data_dir / "known_brokers")
        async with BrokerClient(broker, identity, timeout_s=10, trust=trust) as client:
            return await client.account(job_id=job_id, limit=limit)

    try:
        acct = asyncio.run(ask())
    except GpumarketError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps({"provider_id": acct.key_id, "earned": acct.earned,
                               "stake": acct.stake, "lines": [
                                   MessageToDict(x, preserving_proto_field_name=True)
                                   for x in acct.lines]}, indent=2))
        return
    click.echo(f"provider {acct.key_id}: earned {fmt(acct.earned)} credits, stake"
               f" {fmt(acct.stake)}")
    for x in acct.lines:
        steps = f" steps {x.step_from}→{x.step_to}, {x.seconds:.1f} s" if x.type == "settle" else ""
        click.echo(f"  {x.seq:>6} {x.type:8} {x.account:8} {fmt(x.amount):>14}  job"
                   f" {x.job_id or '-'}{steps}{'  ' + x.memo if x.memo else ''}")


@cli.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The provider's data directory.")
@click.option("--broker", envvar="GPUMARKET_BROKER", default="",
              help="Broker to ask (default: the config's, or $GPUMARKET_BROKER).")
@click.option("--broker-key", envvar="GPUMARKET_BROKER_KEY", default="",
              help="The broker's key id to accept (or $GPUMARKET_BROKER_KEY); without it the "
              "key seen first is trusted and remembered in DATA_DIR/known_brokers.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(data_dir: Path, broker: str, broker_key: str, as_json: bool) -> None:
    """This provider's devices, the jobs it runs now, and what the broker reports of it
    (online, reliability, completed and lost leases, earnings so far)."""
    from google.protobuf.json_format import MessageToDict

    from gpumarket.proto.jobspec import now_ms
    from gpumarket.provider.benchmark import cached_benchmarks
    from gpumarket.provider.inventory import detect
    from gpumarket.provider.journal import Journal

    identity, broker, broker_key = _key_and_broker(data_dir, broker, broker_key)
    found, warning = detect()
    if warning:
        click.echo(f"warning: {warning}", err=True)
    figures = cached_benchmarks(found, data_dir / "benchmark.json")
    journal = Journal(data_dir / "journal.db")
    running = [{"job_id": e.job_id, "epoch": e.epoch, "pid": e.pid,
                "process": "running" if e.pid and _running(e.pid) else "not running",
                "reported": e.final is not None} for e in journal.entries()]
    journal.close()
    pid_file = data_dir / "provider.pid"
    daemon = int(pid_file.read_text()) if pid_file.exists() else 0
    report = {"provider_id": identity.id,
              "daemon": "running" if daemon and _running(daemon) else "stopped",
              "devices": [{"index": d.index, "name": d.name,
                           "accelerator": ACCELERATOR_NAMES[d.accelerator],
                           "memory_bytes": d.memory_bytes,
                           "matmul_flops": figures[d.index].matmul_flops} for d in found],
              "jobs": running, "broker": broker}
    problem = ""
    if broker:
        try:
            resp = asyncio.run(_broker_standing(broker, broker_key, identity, data_dir))
            report["standing"] = MessageToDict(resp.provider, preserving_proto_field_name=True)
            report["clock_skew_ms"] = now_ms() - resp.broker_time_ms
        except GpumarketError as exc:
            problem = str(exc) if exc.code != "NOT_FOUND" else ""
            report["standing"] = None
            report["broker_error"] = problem
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _print_status(report)
    if problem:
        click.echo(f"error: {problem}", err=True)
        sys.exit(1)


def _print_status(r: dict) -> None:
    click.echo(f"provider {r['provider_id']} (daemon {r['daemon']})")
    for d in r["devices"]:
        click.echo(f"  device {d['index']}: {d['name']} ({d['accelerator']},"
                   f" {_gib(d['memory_bytes'])}), {d['matmul_flops'] / 1e12:.3g} TFLOP/s")
    click.echo(f"  jobs here: {len(r['jobs'])}")
    for j in r["jobs"]:
        click.echo(f"    {j['job_id']} epoch {j['epoch']}: {j['process']}"
                   + (", result waiting for the broker" if j["reported"] else ""))
    standing = r.get("standing")
    if not r["broker"]:
        click.echo("  broker: none configured (give --broker)")
    elif r.get("broker_error"):
        click.echo(f"  broker {r['broker']}: unreachable")
    elif standing is None:
        click.echo(f"  broker {r['broker']}: has not seen this provider yet")
    else:
        state = ("banned" if standing.get("banned") else
                 "online" if standing.get("online") else "offline")
        click.echo(f"  broker {r['broker']}: {state}, reliability"
                   f" {standing.get('reliability', 0):.2f}, leases completed"
                   f" {standing.get('leases_completed', 0)}, lost {standing.get('leases_lost', 0)},"
                   f" running {standing.get('running', 0)}, earned {standing.get('earned', 0):.4f}")
        click.echo(f"  spot checks: {standing.get('check_rate', 1.0):.0%} of its work checked"
                   f" now; passed {standing.get('checks_passed', 0)} since the last failure,"
                   f" failed {standing.get('checks_failed', 0)} (docs/verification.md)")
        skew = r.get("clock_skew_ms", 0)
        if abs(skew) > CLOCK_SKEW_WARN_MS:
            click.echo(f"warning: this machine's clock is {abs(skew) / 1000:.0f}s"
                       f" {'ahead of' if skew > 0 else 'behind'} the broker's; signatures dated"
                       " more than 300s off are refused (sync it: timedatectl set-ntp true)",
                       err=True)


@cli.command()
@click.option("--data-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The provider's data directory.")
@click.option("--models-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Its model directory, if not DATA_DIR/models.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def doctor(data_dir: Path, models_dir: Path | None, as_json: bool) -> None:
    """Say which job isolation this host gives (each protection tried for real, the job uid
    by running what a job's runner imports, as that uid), how each limit on a job's memory,
    processes and CPU holds (cgroup v2, cgroup v1, an rlimit, or not at all, and why), what
    a missing one turns off, and whether the data directory keeps the provider's key to
    itself. Exit 1 if it does not."""
    from rich.console import Console
    from rich.table import Table

    from gpumarket.provider import sandbox

    jobs = data_dir / "jobs"
    reach = jobs if jobs.is_dir() else data_dir
    checks = sandbox.probe(str(reach) if reach.is_dir() else None)
    missing = sandbox.missing_for_code(checks)
    checks["jobs_own_code"] = {
        "available": not missing,
        "detail": "jobs that run code of their own (script jobs, a model's remote code) are"
        " isolated fully"
        if not missing else f"refused (no {', '.join(missing)}), unless the provider config"
        " says unisolated_code = true"}
    checks["clean_environment"] = {"available": True, "detail": "jobs get PATH, LANG, TZ, a"
                                   " user name, and their own HOME, TMPDIR and caches; never"
                                   " the daemon's variables"}
    checks["own_gpus_only"] = {"available": True, "detail": "CUDA_VISIBLE_DEVICES names only"
                               " the leased GPUs"}
    checks["disk_quota"] = {"available": True, "detail": "work directory measured every 2 s"
                            " (job_disk_gib), no single file larger (RLIMIT_FSIZE)"}
    key = data_dir / "provider.key"
    key_ok = key.exists() and key.stat().st_mode & 0o077 == 0
    checks["key_private"] = {"available": key_ok, "detail": f"{key} is mode 0600" if key_ok
                             else f"{key} is missing or readable by others"}
    models = models_dir or data_dir / "models"
    if models.is_dir():
        readable = models.stat().st_mode & 0o005 == 0o005
        checks["models_readable"] = {"available": readable, "detail": f"{models} is"
                                     f" {'' if readable else 'not '}readable by job uids"}
    if as_json:
        click.echo(json.dumps(checks, indent=2))
    else:
        table = Table("isolation", "here", "how")
        for name, c in checks.items():
            table.add_row(name.replace("_", " "), "yes" if c["available"] else "NO",
                          str(c["detail"]))
        Console().print(table)
    if not key_ok:
        sys.exit(1)


def main() -> None:
    from gpumarket import kinds

    try:
        kinds.load_plugins(os.environ.get("GPUMARKET_KINDS", ""))
    except GpumarketError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    cli(prog_name="gpumarket-provider")
