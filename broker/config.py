"""The broker's settings, built once in main() and passed down."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BrokerConfig:
    data_dir: Path                         # holds broker.db, broker.key, artifacts/
    listen: str = "127.0.0.1:7070"         # gRPC HOST:PORT; port 0 picks a free port
    http: str = ""                         # HTTP HOST:PORT for health and metrics; "" = none
    lease_timeout_s: float = 15.0          # a lease not renewed by heartbeats this long is lost
    heartbeat_interval_s: float = 3.0      # what providers are told to send
    accept_within_s: float = 60.0          # a provider must accept a lease within this
    max_attempts: int = 5                  # leases a job may lose before it fails
    preempt_grace_s: float = 60.0          # a preempted lease has this long to checkpoint
                                           # and stop (then it ends PREEMPTED all the same)
    serving_reserve: int = 0               # devices standard jobs leave free or interruptible,
                                           # for endpoint replicas under a spike (docs/tiers.md)
    artifact_grace_s: float = 24 * 3600    # unreferenced blobs older than this are deleted
    gc_interval_s: float = 60.0            # how often to look for them
    max_artifact_bytes: int = 64 << 30     # largest blob accepted
    schedule_interval_s: float = 1.0       # placement pass at least this often
    shutdown_grace_s: float = 5.0          # in-flight RPCs get this long on SIGTERM
    operators: tuple[str, ...] = ()        # key ids allowed the Admin calls (and broker.key)
    plaintext: bool = False                # no TLS (only when listening on loopback)
    http_public: bool = False              # allow the HTTP side off loopback (no auth there)
    http_hosts: tuple[str, ...] = ()       # Host names it answers besides loopback's and its own
    rate_limit_per_s: float = 50.0         # calls a second per key (bursts of 5x); 0 = off
    max_queued_jobs: int = 100             # QUEUED jobs per client
    max_key_artifact_bytes: int = 256 << 30  # bytes of blobs one key may have uploaded
    billing: bool = True                   # enforce funds (holds); False: only record usage
    market_fee: float = 0.05               # share of each settlement kept as the market's fee
    verify: bool = True                    # spot-check providers' work by replay
    check_wait_s: float = 600.0            # a check no provider took this long is skipped
    ban_after_failed_checks: int = 2       # failed checks that ban a provider; 0 = never
    answer_check_rate: float = 0.02        # share of endpoint answers sampled for a check
    replica_window_s: float = 60.0         # s: a replica is paid, its sample checked, once a window
    trusted_checkers: tuple[str, ...] = () # provider ids that alone may run tie-breaks (the
                                           # operator's referees); () = any provider
    api: str = ""                          # HTTP HOST:PORT of the endpoints' API alone; "" = none
                                           # (it is also on `http`, under /v1)
    public_url: str = ""                   # where clients reach the API (shown by the CLI)
    relay_url: str = ""                    # where the other brokers of a shared store reach
                                           # this one's API (http://HOST:PORT); "" = `api` (or
                                           # `http`), a wildcard host as this machine's name
    queue_wait_s: float = 30.0             # an endpoint request waits this long for a free slot
    cold_start_s: float = 300.0            # ... or this long for a first replica (from zero)
    request_timeout_s: float = 300.0       # a replica silent this long on a request: 504
    max_held_bytes: int = 64 << 20         # request bodies the endpoints' router holds, shared
                                           # fairly between clients (docs/serving.md)
    max_connections_per_peer: int = 256    # connections one address (IPv6: /64) may hold
                                           # open to `api` and to `http`; 0 = no cap
    idle_timeout_s: float = 15.0           # `api`/`http` connection without a whole request's
                                           # headers this long (after connecting or after its
                                           # last answer) is closed
    body_timeout_s: float = 60.0           # a request body must arrive, and a streamed answer's
                                           # piece be taken, within this
    provider_messages_per_s: float = 200.0 # what a provider session may send, sustained
                                           # (bursts of 10 s worth); more ends the session
    fd_reserve: int = 0                    # descriptors kept from the listeners for the
                                           # database and blobs; 0 = an eighth of the limit
    min_ping_interval_s: float = 20.0      # keepalive pings a client may send, at most one
                                           # this often (more: GOAWAY too_many_pings); the
                                           # client's own pings come every 30 s
    store: str = ""                        # where the broker's tables are: "" = SQLite at
                                           # data_dir/broker.db, "sqlite:///PATH", or
                                           # "postgresql://…" (docs/deploy.md)
    leader_ttl_s: float = 5.0              # brokers sharing a PostgreSQL store: the leader's
                                           # lease on the scheduler role, renewed every third
                                           # of it; another broker takes over this long after
                                           # the leader stops renewing

    @property
    def fee_ppm(self) -> int:
        return round(self.market_fee * 1_000_000)

    @property
    def db_path(self) -> Path:
        return self.data_dir / "broker.db"

    @property
    def key_path(self) -> Path:
        return self.data_dir / "broker.key"

    def check(self) -> None:
        """Raise InvalidArgument for settings that cannot work together."""
        from gpumarket.proto.wire import is_loopback
        from gpumarket.proto.errors import InvalidArgument

        host = self.listen.rpartition(":")[0]
        if self.plaintext and not is_loopback(host):
            raise InvalidArgument(f"plaintext is allowed only on a loopback address, not on"
                                  f" {self.listen} (TLS is on by default)")
        if not 0 <= self.market_fee <= 0.5:
            raise InvalidArgument(f"market_fee must be between 0 and 0.5, not {self.market_fee}")
        if not 1 <= self.replica_window_s <= 3600:
            raise InvalidArgument("replica_window_s must be between 1 and 3600, not"
                                  f" {self.replica_window_s}")
        if not 0 <= self.answer_check_rate <= 1:
            raise InvalidArgument("answer_check_rate must be between 0 and 1, not"
                                  f" {self.answer_check_rate}")
        if not self.max_held_bytes >= 1 << 20:
            raise InvalidArgument("max_held_mib must be at least 1")
        if self.provider_messages_per_s <= 0:
            raise InvalidArgument("provider_messages_per_s must be more than 0")
        if self.max_connections_per_peer < 0 or self.fd_reserve < 0:
            raise InvalidArgument("max_connections_per_peer and fd_reserve must not be negative")
        if self.store and not self.store.startswith(
                ("postgresql://", "postgres://", "sqlite:///")):
            raise InvalidArgument(f"store must be postgresql://… or sqlite:///PATH, not"
                                  f" {self.store.split('://')[0]!r}")
        if not 1 <= self.min_ping_interval_s <= 3600:
            raise InvalidArgument(f"min_ping_interval must be between 1 and 3600 seconds, not"
                                  f" {self.min_ping_interval_s}")
        if not 0.3 <= self.leader_ttl_s <= 300:
            raise InvalidArgument("leader_ttl must be between 0.3 and 300 seconds")
        if not (self.idle_timeout_s > 0 and self.body_timeout_s > 0):
            raise InvalidArgument("idle_timeout and body_timeout must be more than 0 seconds")
        http_host = self.http.rpartition(":")[0]
        if self.http and not is_loopback(http_host) and not self.http_public:
            raise InvalidArgument(
                f"the HTTP side (dashboard, /api, /metrics) has no authentication and shows"
                f" every job: serve it on loopback, not {self.http}, or set http_public = true"
                f" (behind an authenticating proxy)")


EXAMPLE = """\
# gpumarket broker config (gpumarket-broker serve --config THIS_FILE)
# Every setting can also be given on the command line, which wins.

listen = "0.0.0.0:7070"            # gRPC HOST:PORT
http = "127.0.0.1:7071"            # /healthz, /readyz, /metrics, /api; "" = off
data_dir = "/var/lib/gpumarket"    # broker.db, broker.key, artifacts/
store = ""                         # "" = SQLite in data_dir; "postgresql://…" (docs/deploy.md)
leader_ttl = 5.0                   # brokers sharing a PostgreSQL store: seconds before another
                                   # broker takes over from a leader that stopped renewing
lease_timeout = 15.0               # seconds without heartbeats before a lease is lost
heartbeat_interval = 3.0           # seconds between provider heartbeats
max_attempts = 5                   # leases a job may lose before it fails
preempt_grace = 60                 # seconds a preempted interruptible lease has to checkpoint
serving_reserve = 0                # devices standard jobs leave free or interruptible (for replicas)
artifact_grace = 86400.0           # seconds an unreferenced blob is kept
max_artifact_gib = 64              # largest blob accepted, GiB
# Key ids (`gpumarket keys show`) that may run the admin commands (providers, jobs, ban,
# unban, backup, vacuum). The broker's own key (data_dir/broker.key) always may.
operators = []
plaintext = false                  # true: no TLS; allowed only when listen is loopback
http_public = false                # true: allow `http` off loopback (it has no authentication)
http_hosts = []                    # Host header names the HTTP side answers (besides localhost,
                                   # loopback addresses and its own listen address)
rate_limit = 50                    # calls a second per key (bursts of 5x); 0 = no limit
max_queued_jobs = 100              # QUEUED jobs per client
max_key_artifact_gib = 256         # GiB of artifacts one key may upload
billing = true                     # enforce funds: hold each job's worst-case cost at submission
                                   # (false: a private cluster; the ledger only records usage)
market_fee = 0.05                  # share of each settlement kept as the market's fee
verify = true                      # spot-check providers' work by replay on another provider
check_wait = 600                   # seconds a check waits for a provider before it is skipped
ban_after_failed_checks = 2        # failed checks that ban a provider (0 = never)
answer_check_rate = 0.02           # share of endpoint answers kept and checked (0 to 1)
replica_window_s = 60              # seconds: a replica is paid, and its sampled answers
                                   # checked, once a window
# Provider ids that alone run tie-breaks (docs/verification.md, Who checks): with them, only
# a disagreement one of these referees confirms convicts a provider; [] = any provider.
trusted_checkers = []
# Endpoints (docs/serving.md): their OpenAI-compatible API is under /v1 of `http`, and alone
# (it authenticates every call with an endpoint's key, so it may face the internet) on `api`.
api = ""                           # HOST:PORT; "" = only on `http`
public_url = ""                    # e.g. https://api.example.com (what `endpoint show` prints)
relay_url = ""                     # brokers sharing a PostgreSQL store: where the others reach
                                   # this one's API to relay requests (docs/deploy.md); "" = `api`
queue_wait = 30                    # seconds a request waits for a free replica before a 429
cold_start = 300                   # seconds a request waits for a first replica before a 503
request_timeout = 300              # seconds a replica may stay silent on a request (then 504)
max_held_mib = 64                  # MiB of request bodies held for endpoints, shared fairly
                                   # between clients and their endpoints (docs/serving.md)
# Listeners (docs/security.md): the open-file limit is raised to its hard limit at start and
# shared between gRPC, `api` and `http`, less a reserve for the database and blobs.
max_connections_per_peer = 256     # connections one address (IPv6: its /64) may hold open to
                                   # `api` and `http` each; 0 = no cap (behind a proxy that caps)
idle_timeout = 15                  # seconds an `api`/`http` connection may stay without a whole
                                   # request's headers (after connecting or its last answer)
body_timeout = 60                  # seconds a request body may take to arrive, and a streamed
                                   # answer's piece to be taken by the client
fd_reserve = 0                     # descriptors kept from all listeners; 0 = limit / 8, >= 256
provider_messages_per_s = 200      # messages a provider session may send a second, sustained
                                   # (bursts of 10 s worth); more ends its session
min_ping_interval = 20             # seconds: clients may send a keepalive ping at most this
                                   # often (ours ping every 30 s; faster ones are sent GOAWAY)
"""

# config key -> (BrokerConfig field, type, scale)
KEYS = {
    "listen": ("listen", str, None), "http": ("http", str, None),
    "data_dir": ("data_dir", Path, None),
    "store": ("store", str, None),
    "leader_ttl": ("leader_ttl_s", float, None),
    "lease_timeout": ("lease_timeout_s", float, None),
    "heartbeat_interval": ("heartbeat_interval_s", float, None),
    "max_attempts": ("max_attempts", int, None),
    "preempt_grace": ("preempt_grace_s", float, None),
    "serving_reserve": ("serving_reserve", int, None),
    "artifact_grace": ("artifact_grace_s", float, None),
    "max_artifact_gib": ("max_artifact_bytes", int, 2**30),
    "operators": ("operators", tuple, None),
    "plaintext": ("plaintext", bool, None),
    "http_public": ("http_public", bool, None),
    "http_hosts": ("http_hosts", tuple, None),
    "rate_limit": ("rate_limit_per_s", float, None),
    "max_queued_jobs": ("max_queued_jobs", int, None),
    "max_key_artifact_gib": ("max_key_artifact_bytes", int, 2**30),
    "billing": ("billing", bool, None),
    "market_fee": ("market_fee", float, None),
    "verify": ("verify", bool, None),
    "check_wait": ("check_wait_s", float, None),
    "ban_after_failed_checks": ("ban_after_failed_checks", int, None),
    "answer_check_rate": ("answer_check_rate", float, None),
    "replica_window_s": ("replica_window_s", float, None),
    "trusted_checkers": ("trusted_checkers", tuple, None),
    "api": ("api", str, None), "public_url": ("public_url", str, None),
    "relay_url": ("relay_url", str, None),
    "queue_wait": ("queue_wait_s", float, None), "cold_start": ("cold_start_s", float, None),
    "request_timeout": ("request_timeout_s", float, None),
    "max_held_mib": ("max_held_bytes", int, 2**20),
    "max_connections_per_peer": ("max_connections_per_peer", int, None),
    "idle_timeout": ("idle_timeout_s", float, None),
    "body_timeout": ("body_timeout_s", float, None),
    "fd_reserve": ("fd_reserve", int, None),
    "min_ping_interval": ("min_ping_interval_s", float, None),
    "provider_messages_per_s": ("provider_messages_per_s", float, None),
}


def load(path: Path) -> dict:
    """Read a broker config file into BrokerConfig keyword arguments."""
    import tomllib

    from gpumarket.proto.errors import InvalidArgument

    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise InvalidArgument(f"{path}: no such config file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{path}: not valid TOML ({exc})") from exc
    out = {}
    for key, value in raw.items():
        if key not in KEYS:
            raise InvalidArgument(f"{path}: unknown setting {key!r} (known: {', '.join(KEYS)})")
        field_name, typ, scale = KEYS[key]
        if typ is tuple:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise InvalidArgument(f"{path}: {key} must be a list of strings")
            out[field_name] = tuple(value)
            continue
        if typ is bool:
            if not isinstance(value, bool):
                raise InvalidArgument(f"{path}: {key} must be true or false")
            out[field_name] = value
            continue
        ok = isinstance(value, str) if typ in (str, Path) else (
            isinstance(value, (int, float)) and not isinstance(value, bool)
            and (typ is float or scale or float(value).is_integer()))
        if not ok:
            raise InvalidArgument(f"{path}: {key} must be {'text' if typ in (str, Path) else 'a number'}")
        if scale:               # a size in GiB may be fractional; the field is in bytes
            out[field_name] = typ(value * scale)
            continue
        out[field_name] = typ(value) if typ is not Path else Path(value).expanduser()
    return out
