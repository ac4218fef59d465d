"""The provider's settings: built once in main() from the TOML config and the command line
(which wins), then passed down."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumarket import kinds
from gpumarket.link.channel import Trust
from gpumarket.proto.errors import InvalidArgument
from gpumarket.proto.policy import Policy, parse_window
from gpumarket.proto.slices import MAX_SLICES, SliceError, check_shares
from gpumarket.provider.job_uids import POOL

EXAMPLE = """\
# gpumarket provider config (gpumarket-provider run --config THIS_FILE)
# Command-line options override what is set here.

# broker = "broker.example.org:7070"   # TLS; plaintext://127.0.0.1:7070 for a loopback test
# broker_key = "…"               # the broker's key id (its operator tells you); without it the
#                                # key seen first is trusted and kept in DATA_DIR/known_brokers
price_per_gpu_hour = 1.20        # credits per device-hour (standard and serving leases)
# interruptible_price_per_gpu_hour = 0.48  # credits per device-hour of an interruptible lease
#                                # (one a higher tier may preempt); default: 40 % of the price
kinds = ["training", "generate", "embed", "render"]  # render needs bpy; "script" (the
#                                # client's own Python, sandboxed) runs only if named here
max_job_hours = 24               # longest job accepted
# cpu_devices = 2                # without GPUs: offer the CPU as 2 devices (equal shares)
# models_dir = "/srv/models"     # models jobs may name, one directory each (default: DIR/models)
allow_remote_code = false        # true: run models' own Python code (trust_remote_code) in jobs
isolate = true                   # jobs as their own uid (as root), without network, with limits
# unisolated_code = false        # true: run jobs' own code even where the host cannot isolate
#                                # it fully (gpumarket-provider doctor says what is missing)
# job_uids = "70000-99999"       # pool of uids jobs run as; each daemon takes 64 of its own
job_disk_gib = 100               # disk quota of each job's work directory
allow_clients = []               # client ids; empty = everyone not denied
deny_clients = []

# Hours of availability, UTC. No [[availability]] table = always available.
# [[availability]]
# days = ["mon", "tue", "wed", "thu", "fri"]
# hours = "18:00-08:00"

# A device's own price, if it differs (by device index):
# [devices.1]
# price_per_hour = 2.50

# Every device (the CPU device where there is no GPU) also offered as slices: a number of
# equal slices, or the share of each; a slice is a device of its own with that share of
# its card's memory and compute, and of its price. Its card stays offered whole; the two
# are never leased at once. Per device: `slices = ...` in its [devices.N] table.
# slices = 2                     # or [0.5, 0.25, 0.25]
"""

KEYS = {"broker", "broker_key", "data_dir", "price_per_gpu_hour", "kinds", "max_job_hours",
        "interruptible_price_per_gpu_hour",
        "allow_clients", "deny_clients", "availability", "devices", "cpu_devices", "models_dir",
        "allow_remote_code", "isolate", "job_disk_gib", "unisolated_code", "job_uids",
        "slices"}


# An interruptible lease's price, unless the provider sets one: this share of the standard
# price. It may be preempted (its job resumes elsewhere from its last checkpoint, and the
# work since then is the provider's loss), so it sells for less.
INTERRUPTIBLE_SHARE = 0.4


@dataclass(frozen=True)
class ProviderConfig:
    broker: str                          # broker gRPC address HOST:PORT; the brokers of one
                                         # market as HOST:PORT,HOST:PORT (tried in turn)
    data_dir: Path                       # key, journal, benchmark cache, job work dirs
    broker_key: str = ""                 # the broker key id to accept; "" = trust on first use
    price_per_gpu_hour: float = 1.0      # credits per device-hour (standard and serving)
    # credits per device-hour of an interruptible lease; None = INTERRUPTIBLE_SHARE of the
    # standard price (``interruptible_price``)
    interruptible_price_per_gpu_hour: float | None = None
    max_runtime_s: int = 24 * 3600       # longest a job may run (the policy's cap too)
    cancel_grace_s: float = 10.0         # SIGTERM, then SIGKILL after this
    drain_timeout_s: float = 120.0       # longest a drain waits for jobs to checkpoint and stop
    progress_interval_s: float = 0.25    # at most this often a progress update goes up
    rpc_timeout_s: float = 30.0          # deadline on each unary call to the broker
    backoff_max_s: float = 30.0          # longest wait between session tries (before jitter)
    probe_max_s: float = 2.0             # while the broker is unreachable, see at least this
                                         # often whether it listens again (a TCP connect)
    cpu_only: bool = False               # advertise the CPU even where GPUs are present
    cpu_devices: int = 1                 # offer the CPU as this many devices (equal shares)
    models_path: Path | None = None      # local model directory; default data_dir/models
    isolate: bool = True                 # jobs in a sandbox (see provider/sandbox.py)
    unisolated_code: bool = False        # run jobs' own code even where isolation is partial
    job_uid_pool: tuple[int, int] = POOL  # uids jobs run as (each daemon claims 64)
    job_disk_gib: float = 100.0          # disk quota of each job's work directory
    warm_runners: bool = True            # a forkserver per kind: jobs forked, imports done
    kinds: frozenset[int] = frozenset()  # kinds accepted; empty = every kind it knows
    policy: Policy = field(default_factory=Policy)  # clients and hours served
    device_prices: dict[int, float] = field(default_factory=dict)  # per device index
    # shares of the slices each whole device is also offered as (docs/provider.md, Slices);
    # () = not sliced; ``device_slices`` by device index wins over ``slices``
    slices: tuple[float, ...] = ()
    device_slices: dict[int, tuple[float, ...]] = field(default_factory=dict)

    def slice_shares(self, devices) -> dict[int, tuple[float, ...]]:
        """By whole device (not a MIG instance) of ``devices``: the shares of its slices."""
        out = {}
        for d in devices:
            shares = self.device_slices.get(d.index, self.slices)
            if shares and not getattr(d, "mig_parent_uuid", ""):
                out[d.index] = shares
        return out

    @property
    def interruptible_price(self) -> float:
        """Credits per device-hour of an interruptible lease (what the offer says)."""
        if self.interruptible_price_per_gpu_hour is None:
            return round(self.price_per_gpu_hour * INTERRUPTIBLE_SHARE, 6)
        return self.interruptible_price_per_gpu_hour

    @property
    def key_path(self) -> Path:
        return self.data_dir / "provider.key"

    def trust(self) -> Trust:
        return Trust(pin=self.broker_key, known=self.data_dir / "known_brokers")

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"

    @property
    def cache_dir(self) -> Path:
        return self.data_dir / "cache"

    @property
    def models_dir(self) -> Path:
        return self.models_path or self.data_dir / "models"


def kinds_setting(names: list[str], where: str) -> dict:
    """The ``kinds`` setting from kind names (InvalidArgument naming ``where``)."""
    names = [n.strip() for n in names if n.strip()]
    known = {k.name: k.number for k in kinds.all_kinds()}
    if not names or any(n not in known for n in names):
        raise InvalidArgument(f"{where} must name some of {sorted(known)}")
    return {"kinds": frozenset(known[n] for n in names)}


def _list_of_str(raw: dict, key: str, file: str) -> list[str]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"{file}: {key} must be a list of strings")
    return value


def _uid_pool(value: Any, file: str) -> tuple[int, int]:
    first, _, last = str(value).partition("-")
    if not (first.isdigit() and last.isdigit()) or not \
            1000 <= int(first) < int(last) < 2**31 - 1 or int(last) - int(first) < 63:
        raise InvalidArgument(f"{file}: job_uids must be a range FIRST-LAST of at least 64"
                              " uids between 1000 and 2147483646, like \"70000-99999\"")
    return int(first), int(last)


def load(path: Path) -> dict[str, Any]:
    """Read a provider config file into ProviderConfig keyword arguments."""
    file = str(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise InvalidArgument(f"{file}: no such config file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{file}: not valid TOML ({exc})") from exc
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise InvalidArgument(f"{file}: unknown setting {unknown[0]!r} (known: {', '.join(sorted(KEYS))})")
    out: dict[str, Any] = {}
    if "broker" in raw:
        brokers = raw["broker"]
        if isinstance(brokers, list):    # broker = ["a:7070", "b:7070"]: one market's brokers
            if not brokers or not all(isinstance(b, str) for b in brokers):
                raise InvalidArgument(f"{file}: broker must be HOST:PORT or a list of them")
            brokers = ",".join(brokers)
        out["broker"] = str(brokers)
    if "broker_key" in raw:
        if not isinstance(raw["broker_key"], str):
            raise InvalidArgument(f"{file}: broker_key must be a key id (text)")
        out["broker_key"] = raw["broker_key"]
    if "data_dir" in raw:
        out["data_dir"] = Path(raw["data_dir"]).expanduser()
    if "price_per_gpu_hour" in raw:
        price = raw["price_per_gpu_hour"]
        if not isinstance(price, (int, float)) or price < 0:
            raise InvalidArgument(f"{file}: price_per_gpu_hour must be a number >= 0")
        out["price_per_gpu_hour"] = float(price)
    if "interruptible_price_per_gpu_hour" in raw:
        price = raw["interruptible_price_per_gpu_hour"]
        if not isinstance(price, (int, float)) or isinstance(price, bool) or price < 0:
            raise InvalidArgument(f"{file}: interruptible_price_per_gpu_hour must be a number"
                                  " >= 0")
        out["interruptible_price_per_gpu_hour"] = float(price)
    if "kinds" in raw:
        out.update(kinds_setting(_list_of_str(raw, "kinds", file), f"{file}: kinds"))
    if "models_dir" in raw:
        if not isinstance(raw["models_dir"], str):
            raise InvalidArgument(f"{file}: models_dir must be a path")
        out["models_path"] = Path(raw["models_dir"]).expanduser()
    if "isolate" in raw:
        if not isinstance(raw["isolate"], bool):
            raise InvalidArgument(f"{file}: isolate must be true or false")
        out["isolate"] = raw["isolate"]
    if "unisolated_code" in raw:
        if not isinstance(raw["unisolated_code"], bool):
            raise InvalidArgument(f"{file}: unisolated_code must be true or false")
        out["unisolated_code"] = raw["unisolated_code"]
    if "job_uids" in raw:
        out["job_uid_pool"] = _uid_pool(raw["job_uids"], file)
    if "job_disk_gib" in raw:
        quota = raw["job_disk_gib"]
        if not isinstance(quota, (int, float)) or isinstance(quota, bool) or quota <= 0:
            raise InvalidArgument(f"{file}: job_disk_gib must be a number > 0")
        out["job_disk_gib"] = float(quota)
    if "cpu_devices" in raw:
        count = raw["cpu_devices"]
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 64:
            raise InvalidArgument(f"{file}: cpu_devices must be a whole number from 1 to 64")
        out["cpu_devices"] = count
    if "max_job_hours" in raw:
        hours = raw["max_job_hours"]
        if not isinstance(hours, (int, float)) or hours <= 0:
            raise InvalidArgument(f"{file}: max_job_hours must be a number > 0")
        out["max_runtime_s"] = int(hours * 3600)
    windows = []
    for i, w in enumerate(raw.get("availability", [])):
        if not isinstance(w, dict) or set(w) - {"days", "hours"}:
            raise InvalidArgument(f"{file}: availability[{i}] takes days and hours")
        windows.append(parse_window(w.get("days", ["all"]), w.get("hours", ""),
                                    f"{file}: availability[{i}]"))
    allow_code = raw.get("allow_remote_code", False)
    if not isinstance(allow_code, bool):
        raise InvalidArgument(f"{file}: allow_remote_code must be true or false")
    out["policy_parts"] = {
        "allow_remote_code": allow_code,
        "allowed_clients": frozenset(_list_of_str(raw, "allow_clients", file)),
        "denied_clients": frozenset(_list_of_str(raw, "deny_clients", file)),
        "windows": tuple(windows),
    }
    if "slices" in raw:
        out["slices"] = slices_setting(raw["slices"], f"{file}: slices")
    prices, sliced = {}, {}
    for index, table in raw.get("devices", {}).items():
        if not index.isdigit() or not isinstance(table, dict) or set(table) - {
                "price_per_hour", "slices"} or not table or "price_per_hour" in table and \
                not isinstance(table.get("price_per_hour"), (int, float)):
            raise InvalidArgument(f"{file}: [devices.N] tables take price_per_hour and slices")
        if "price_per_hour" in table:
            prices[int(index)] = float(table["price_per_hour"])
        if "slices" in table:
            sliced[int(index)] = slices_setting(table["slices"], f"{file}: devices.{index}.slices")
    out["device_prices"] = prices
    out["device_slices"] = sliced
    return out


def slices_text(text: str, where: str) -> tuple[float, ...]:
    """The slices setting as typed on a command line: "N" or "SHARE,SHARE,..."."""
    try:
        value = int(text) if text.strip().isdigit() else [float(x) for x in text.split(",")]
    except ValueError:
        raise InvalidArgument(f"{where}: a number of slices, or their shares (0.5,0.25,0.25),"
                              f" not {text!r}") from None
    return slices_setting(value, where)


def slices_setting(value: Any, where: str) -> tuple[float, ...]:
    """``slices = N`` (N equal slices) or a list of shares, checked (proto/slices.py);
    InvalidArgument naming ``where``."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not 2 <= value <= MAX_SLICES:
            raise InvalidArgument(f"{where}: a device is offered as 2 to {MAX_SLICES} slices,"
                                  f" not {value:,}")
        return (1 / value,) * value
    if not isinstance(value, list):
        raise InvalidArgument(f"{where}: a number of slices, or a list of their shares")
    try:
        return check_shares(value, where)
    except SliceError as exc:
        raise InvalidArgument(str(exc)) from None


def build(settings: dict[str, Any]) -> ProviderConfig:
    """A ProviderConfig from merged settings (config file, then command line)."""
    parts = settings.pop("policy_parts", {})
    max_runtime = settings.get("max_runtime_s", 24 * 3600)
    settings["policy"] = Policy(max_job_s=float(max_runtime), **parts)
    return ProviderConfig(**settings)
