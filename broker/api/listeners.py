"""The broker's listeners against strangers who only connect (docs/security.md, Listeners):
the open-file limit raised and shared between the listeners with a reserve for the rest of
the process, a per-peer and a total connection cap on each HTTP listener (the endpoints' API
and the HTTP side), and accept errors counted into one log line now and then instead of a
traceback each.

The HTTP listeners accept their connections themselves (``GuardedSite``, an aiohttp site):
a connection over a cap is reset before aiohttp or asyncio make anything of it, so it costs
one descriptor for a moment; where the process has no descriptor left, accepting pauses for
a second (asyncio's own server logs a traceback per failed accept there, and re-arms itself
once per failure, which is how an idle flood once wrote a million of them). gRPC's listener
is gRPC core's: its share is ``grpc.max_allowed_incoming_connections``, and its handshake and
idle timeouts are in proto/wire.py."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import resource
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from gpumarket.proto.errors import InvalidArgument

log = logging.getLogger(__name__)

ACCEPT_BATCH = 64           # connections taken per wake-up of a listening socket
ACCEPT_RETRY_S = 1.0        # out of descriptors: accept again after this
BACKLOG = 1024              # connections the kernel keeps waiting for an accept
LOG_EVERY_S = 10.0          # at most one line about refused connections per listener per this
RESERVE_MIN = 256           # descriptors always kept for the database, blobs and the process
LISTENERS_MIN = 64          # fewer left for the listeners than this: refuse to start
# How the descriptors left after the reserve are shared by the listeners that are on: gRPC
# carries every provider's session and every client's calls, the API faces the internet,
# the HTTP side serves operators.
WEIGHTS = {"grpc": 5, "api": 2, "http": 1}
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def raise_open_files() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit; returns (before,
    now). Where the hard limit is unlimited, the soft one goes to the kernel's nr_open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return soft, target
        except (OSError, ValueError):
            log.warning("could not raise the open-file limit from %d to %d", soft, target)
    return soft, soft


@dataclass(frozen=True)
class Descriptors:
    """The open-file limit and each listener's share of it (connections)."""

    limit: int
    reserve: int
    grpc: int
    api: int
    http: int


def plan(limit: int, reserve: int = 0, api: bool = False, http: bool = False) -> Descriptors:
    """Share ``limit`` descriptors: ``reserve`` (0: an eighth of the limit, at least
    RESERVE_MIN) for the database, blobs and the process, the rest between the listeners that
    are on, by WEIGHTS. Raises InvalidArgument where too few are left for the listeners."""
    reserve = reserve or max(RESERVE_MIN, limit // 8)
    left = limit - reserve
    if left < LISTENERS_MIN:
        raise InvalidArgument(
            f"the open-file limit is {limit} and {reserve} descriptors are kept in reserve"
            f" (fd_reserve): at least {LISTENERS_MIN} must be left for connections; raise the"
            f" limit (ulimit -n, LimitNOFILE=) or lower fd_reserve")
    on = {"grpc": True, "api": api, "http": http}
    total = sum(w for name, w in WEIGHTS.items() if on[name])
    share = {name: left * w // total if on[name] else 0 for name, w in WEIGHTS.items()}
    return Descriptors(limit, reserve, share["grpc"], share["api"], share["http"])


def peer_key(address) -> str:
    """Whose connection this is, for the per-peer cap: an IPv4 address, or an IPv6 address's
    /64 (a single host is commonly given a whole /64)."""
    host = address[0] if isinstance(address, tuple) and address else address
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return str(host)
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class ConnectionGuard:
    """One listener's connections: at most ``max_connections`` open, at most ``per_peer``
    from one peer (0: no per-peer cap). ``refused``: a metrics counter with labels
    (listener, reason), or None."""

    def __init__(self, name: str, max_connections: int, per_peer: int,
                 refused=None) -> None:
        self.name = name
        self.max_connections = max_connections
        self.per_peer = per_peer
        self.open = 0
        self.peers: dict[str, int] = {}
        self._refused_metric = refused
        self._counts = {"per_peer": 0, "full": 0, "out_of_descriptors": 0, "accept_error": 0}
        self._example = ""
        self._last_line = 0.0
        self._flush: asyncio.TimerHandle | None = None

    def admit(self, peer: str) -> bool:
        """Count a new connection from ``peer``, or refuse it (False, counted)."""
        if self.open >= self.max_connections:
            self._note("full", peer)
            return False
        have = self.peers.get(peer, 0)
        if self.per_peer and have >= self.per_peer:
            self._note("per_peer", peer)
            return False
        self.peers[peer] = have + 1
        self.open += 1
        return True

    def release(self, peer: str) -> None:
        self.open -= 1
        left = self.peers[peer] - 1
        if left:
            self.peers[peer] = left
        else:
            del self.peers[peer]

    def accept_failed(self, exc: OSError) -> None:
        self._note("out_of_descriptors" if exc.errno in OUT_OF_DESCRIPTORS
                   else "accept_error", "")

    def _note(self, reason: str, peer: str) -> None:
        self._counts[reason] += 1
        if peer and not self._example:
            self._example = peer
        if self._refused_metric is not None:
            self._refused_metric.labels(listener=self.name, reason=reason).inc()
        now = time.monotonic()
        if now - self._last_line >= LOG_EVERY_S:
            self.flush()
        elif self._flush is None:
            loop = asyncio.get_running_loop()
            self._flush = loop.call_later(self._last_line + LOG_EVERY_S - now, self.flush)

    def flush(self) -> None:
        """Write what was counted since the last line, as one line."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        c = self._counts
        if not any(c.values()):
            return
        self._last_line = time.monotonic()
        parts = []
        if c["per_peer"]:
            parts.append(f"{c['per_peer']} over the per-peer cap of {self.per_peer}")
        if c["full"]:
            parts.append(f"{c['full']} with all {self.max_connections} connections in use")
        if c["out_of_descriptors"]:
            parts.append(f"{c['out_of_descriptors']} accepts failed: the process is out of"
                         " file descriptors (accepting paused a second each time)")
        if c["accept_error"]:
            parts.append(f"{c['accept_error']} accepts failed otherwise")
        example = f" (e.g. from {self._example})" if self._example else ""
        log.warning("%s listener refused connections: %s%s; %d open from %d peers",
                    self.name, "; ".join(parts), example, self.open, len(self.peers))
        self._counts = dict.fromkeys(c, 0)
        self._example = ""


class _Tracked(asyncio.Protocol):
    """aiohttp's protocol for one connection, telling the guard when it closes."""

    __slots__ = ("closed", "inner")

    def __init__(self, inner: asyncio.Protocol, closed) -> None:
        self.inner, self.closed = inner, closed

    def connection_made(self, transport) -> None:
        self.inner.connection_made(transport)

    def connection_lost(self, exc) -> None:
        try:
            self.inner.connection_lost(exc)
        finally:
            self.closed()

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class _Listening:
    """What aiohttp's runner expects of a site's server: ``sockets`` and ``close()``."""

    def __init__(self, site: GuardedSite) -> None:
        self.site = site

    @property
    def sockets(self) -> list[socket.socket]:
        return list(self.site.sockets)

    def close(self) -> None:
        self.site.close()


class GuardedSite(web.BaseSite):
    """An aiohttp TCP site whose connections pass a ConnectionGuard before aiohttp sees them."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 guard: ConnectionGuard) -> None:
        super().__init__(runner, backlog=BACKLOG)
        self.host, self._port, self.guard = host, port, guard
        self.sockets: list[socket.socket] = []
        self._paused: dict[int, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def port(self) -> int:
        return self.sockets[0].getsockname()[1] if self.sockets else self._port

    async def start(self) -> None:
        await super().start()
        self._loop = asyncio.get_running_loop()
        self.sockets = _bind(self.host, self._port, self._backlog)
        for sock in self.sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)
        self._server = _Listening(self)

    def close(self) -> None:
        for sock in self.sockets:
            if self._loop is not None and sock.fileno() >= 0:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        for timer in self._paused.values():
            timer.cancel()
        self._paused.clear()
        self.guard.flush()

    def _accept(self, sock: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, address = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.guard.accept_failed(exc)
                if exc.errno in OUT_OF_DESCRIPTORS:
                    # Linux keeps saying the socket is readable: wait instead of spinning.
                    fd = sock.fileno()
                    self._loop.remove_reader(fd)
                    self._paused[fd] = self._loop.call_later(ACCEPT_RETRY_S, self._resume,
                                                             sock)
                    return
                continue
            peer = peer_key(address)
            if not self.guard.admit(peer):
                _reset(conn)
                continue
            task = self._loop.create_task(self._serve(conn, peer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _resume(self, sock: socket.socket) -> None:
        self._paused.pop(sock.fileno(), None)
        if sock.fileno() >= 0:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    async def _serve(self, conn: socket.socket, peer: str) -> None:
        released = False

        def closed() -> None:
            nonlocal released
            if not released:
                released = True
                self.guard.release(peer)

        server = self._runner.server
        try:
            if server is None:
                raise ConnectionAbortedError("the listener is stopping")
            await self._loop.connect_accepted_socket(lambda: _Tracked(server(), closed),
                                                     sock=conn)
        except (OSError, RuntimeError):
            closed()
            conn.close()


def _reset(conn: socket.socket) -> None:
    """Close a refused connection with a reset: nothing lingers on either side."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    conn.close()


def _bind(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets for every address ``host`` names ("" or 0.0.0.0: all), on one port
    (port 0: the first socket's)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address[0]) in seen:
                continue
            seen.add((family, address[0]))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if sockets[0] is not sock:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def throttle_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Make the loop report asyncio's own "socket.accept() out of system resource" (a server
    of asyncio's that ran out of descriptors) as one line per LOG_EVERY_S with a count, not a
    traceback per failed accept; everything else goes to the handler that was there."""
    previous = loop.get_exception_handler()
    state = {"count": 0, "last": 0.0}

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") != "socket.accept() out of system resource":
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        state["count"] += 1
        now = time.monotonic()
        if now - state["last"] >= LOG_EVERY_S:
            log.warning("%d accepts failed: the process is out of file descriptors (%s)",
                        state["count"], context.get("exception"))
            state["count"], state["last"] = 0, now

    loop.set_exception_handler(handler)
