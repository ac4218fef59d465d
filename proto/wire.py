"""What both ends of the wire agree on, as plain values: the address forms, the call-token
metadata, message sizes and keepalives (gRPC options for each side). No grpc import here."""

from __future__ import annotations

import ipaddress

from gpumarket.proto.errors import InvalidArgument

PLAINTEXT = "plaintext://"
TOKEN_METADATA = "gpumarket-token-bin"
TOKEN_LIFETIME_MS = 60_000
MAX_MESSAGE_BYTES = 4 << 20             # gRPC's default, stated: large data moves in chunks

# Keepalives that agree: the client pings an idle connection every 30 s (and gives up on a
# silent peer after 10 s more); the broker accepts pings down to every 20 s, so it never
# answers "too many pings", and pings its side every 60 s to find dead clients.
CLIENT_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
# A broker restart makes every provider reconnect within seconds: 10,000 sessions' calls
# wait at once for the server to take them. Past gRPC's pending-call backlog (1,000, refusing
# at random up to 3,000 and all beyond) core refuses them as RESOURCE_EXHAUSTED before the
# broker sees them, so the backlog is sized for the storm.
MAX_PENDING_CALLS = 20_000
# A connection that has not finished its TLS and HTTP/2 handshake within 30 s (gRPC's default
# is 120 s) is closed, and one without a call for 5 minutes is sent GOAWAY (clients reconnect
# on their next call; a provider's session is a call): what a stranger who only connects
# holds, and for how long. The broker adds grpc.max_allowed_incoming_connections, gRPC's
# share of its file descriptors (broker/listeners.py).
HANDSHAKE_TIMEOUT_MS = 30_000
MAX_CONNECTION_IDLE_MS = 300_000
SERVER_OPTIONS = (
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
    ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
    ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 20_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)


def split_address(address: str) -> tuple[str, int, bool]:
    """``[plaintext://]HOST:PORT`` → (host, port, plaintext); plaintext only to loopback."""
    plaintext = address.startswith(PLAINTEXT)
    rest = address[len(PLAINTEXT):] if plaintext else address
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise InvalidArgument(f"broker address {address!r}: give HOST:PORT")
    if plaintext and not is_loopback(host):
        raise InvalidArgument(f"broker address {address!r}: plaintext is allowed only to a"
                              " loopback address (127.0.0.1, ::1, localhost)")
    return host, int(port), plaintext


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
