"""Who is calling: every call but health, reflection and offer search carries a CallToken
signed by the caller's key (gpumarket.link.channel makes them). The interceptor checks it
before the handler runs and makes the caller's key id available as ``caller()``.

A token is good for one call of one method with one request body, at this broker, within
its minute; its nonce is stored until it expires (in SQLite, so a restart does not reopen
the window). Revoked keys and callers over the request rate are refused here too. Every
refusal is logged with its reason and counted in gpumarket_rejected_requests_total.
"""

from __future__ import annotations

import contextvars
import hashlib
import inspect
import logging

import grpc
from google.protobuf.message import DecodeError

from gpumarket.broker.api.rpc import STATUS
from gpumarket.broker.store import call_nonces
from gpumarket.proto.wire import TOKEN_METADATA
from gpumarket.proto.envelope import open_envelope
from gpumarket.proto.ratelimit import RateLimiter
from gpumarket.proto.errors import (
    BadSignature, Expired, GpumarketError, PermissionDenied, Replay, ResourceExhausted,
)
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

CLOCK_SKEW_MS = 30_000
MAX_TOKEN_LIFETIME_MS = 5 * 60_000
PUBLIC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
PUBLIC_METHODS = frozenset({"/gpumarket.v1.Marketplace/SearchOffers"})
ARTIFACTS = "/gpumarket.v1.Artifacts/"

_caller: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="")


def caller() -> str:
    """The key id that signed the current call's token ("" for a public call)."""
    return _caller.get()


class Authenticator(grpc.aio.ServerInterceptor):
    def __init__(self, state, broker_id: str, plaintext: bool) -> None:
        self.state = state
        self.broker_id = broker_id
        self.plaintext = plaintext
        cfg = state.config
        self.limiter = RateLimiter(cfg.rate_limit_per_s, cfg.rate_limit_per_s * 5)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(PUBLIC_PREFIXES):
            return handler
        if method in PUBLIC_METHODS:
            return _wrap(handler, self._anonymous)
        token = next((v for k, v in details.invocation_metadata or () if k == TOKEN_METADATA),
                     None)
        return _wrap(handler, lambda digest, context: self._check(method, token, digest,
                                                                   context))

    async def _check(self, method: str, raw: bytes | None, digest: bytes | None,
                     context: grpc.aio.ServicerContext) -> None:
        try:
            key_id = await self.verify(method, raw, digest)
        except GpumarketError as exc:
            reason = exc.reason
            log.warning("refused %s from %s: %s (%s)", method, context.peer(), exc.message, reason)
            self.state.metrics.rejected.labels(reason=reason).inc()
            await context.abort(STATUS.get(exc.code, grpc.StatusCode.UNAUTHENTICATED), exc.message)
        # Each call runs in its own task (its own context): set, never reset.
        _caller.set(key_id)

    async def _anonymous(self, digest, context: grpc.aio.ServicerContext) -> None:
        """A public call needs no token; it is rate-limited by the caller's host instead."""
        peer = context.peer()                    # "ipv4:127.0.0.1:51234", "ipv6:[::1]:51234"
        host = peer.partition(":")[2].rpartition(":")[0] or peer
        if not self.limiter.allow(f"host {host}"):
            self.state.metrics.rejected.labels(reason="rate_limited").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"more than {self.state.config.rate_limit_per_s:g} calls a"
                                f" second from {host}; slow down")

    async def verify(self, method: str, raw: bytes | None, digest: bytes | None) -> str:
        """Return the key id that signed ``raw`` for this call, or raise why not."""
        if not raw:
            raise BadSignature(f"{method} needs a call token signed by your key"
                               " (use a gpumarket client)", reason="unauthenticated")
        envelope = pb.Envelope()
        try:
            envelope.ParseFromString(raw)
        except DecodeError as exc:
            raise BadSignature("call token does not parse", reason="bad_signature") from exc
        try:
            token, key_id = open_envelope(envelope, pb.CallToken)
        except BadSignature as exc:
            raise BadSignature(f"call token: {exc.message}", reason="bad_signature") from exc
        if key_id in self.state.revoked:
            raise PermissionDenied(f"key {key_id} is revoked on this broker", reason="revoked")
        if token.method != method:
            raise BadSignature(f"call token is for {token.method or 'nothing'}, not {method}",
                               reason="wrong_call")
        if token.audience != self.broker_id and not (self.plaintext and not token.audience):
            raise BadSignature(f"call token is for broker {token.audience or '(none)'}, not"
                               f" this one ({self.broker_id})", reason="wrong_call")
        if digest is not None and token.request_sha256 != digest:
            raise BadSignature("call token was signed for another request than the one sent",
                               reason="wrong_call")
        now = now_ms()
        if token.expires_at_ms - token.issued_at_ms > MAX_TOKEN_LIFETIME_MS:
            raise BadSignature("call token lives longer than 5 minutes", reason="bad_signature")
        if now < token.issued_at_ms - CLOCK_SKEW_MS:
            raise Expired("call token is not valid yet (issued in the future: check your clock)",
                          reason="not_yet_valid")
        if now > token.expires_at_ms + CLOCK_SKEW_MS:
            raise Expired("call token has expired (check your clock)", reason="expired")
        if len(token.nonce) != 16:
            raise BadSignature("call token nonce must be 16 bytes", reason="bad_signature")
        if not self._allow(key_id, method):
            raise ResourceExhausted(f"more than {self.state.config.rate_limit_per_s:g} calls a"
                                    f" second from key {key_id}{self._per_device(key_id, method)}"
                                    "; slow down", reason="rate_limited")
        fresh = await self.state.store.write(
            call_nonces.use, key_id, token.nonce.hex(), token.expires_at_ms + CLOCK_SKEW_MS)
        if not fresh:
            raise Replay("call token was used before (replayed call)", reason="replay")
        return key_id


    def _devices(self, key_id: str, method: str) -> int:
        """The devices a connected provider offers, for its artifact calls (0: not such a
        call, or not a provider's)."""
        if not method.startswith(ARTIFACTS):
            return 0
        session = self.state.sessions.get(key_id)
        offer = session.offer if session is not None else None
        return len(offer.devices) if offer is not None else 0

    def _allow(self, key_id: str, method: str) -> bool:
        """Whether the key may make this call now. A connected provider's artifact calls
        (its jobs' outputs and checkpoints, its inputs) have a budget of their own for each
        device it offers, that is for each lease it may hold at once: a provider running
        many leases is not held to one client's call rate, nor do its uploads use up the
        calls of its session."""
        devices = self._devices(key_id, method)
        if devices:
            return self.limiter.allow(f"artifacts {key_id}", 1 / devices)
        return self.limiter.allow(key_id)

    def _per_device(self, key_id: str, method: str) -> str:
        devices = self._devices(key_id, method)
        return f" for each of its {devices} devices" if devices else ""


def _wrap(handler: grpc.RpcMethodHandler, check) -> grpc.RpcMethodHandler:
    """The same handler, with ``check`` run first (given the request's sha256 where the
    call has one request), and the caller set while the handler runs."""
    deserialize = handler.request_deserializer or (lambda raw: raw)

    def hashed(raw: bytes):
        try:
            return hashlib.sha256(raw).digest(), deserialize(raw)
        except DecodeError:
            return None, None   # answered INVALID_ARGUMENT below, not grpc's UNKNOWN

    async def parsed(request, context):
        digest, message = request
        if digest is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request does not parse")
        await check(digest, context)
        return message

    if handler.unary_unary:
        async def unary_unary(request, context):
            return await handler.unary_unary(await parsed(request, context), context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, request_deserializer=hashed,
            response_serializer=handler.response_serializer)
    if handler.unary_stream:
        async def unary_stream(request, context):
            async for item in handler.unary_stream(await parsed(request, context), context):
                yield item

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, request_deserializer=hashed,
            response_serializer=handler.response_serializer)
    if handler.stream_unary:
        async def stream_unary(request_iterator, context):
            await check(None, context)
            return await handler.stream_unary(request_iterator, context)

        return grpc.stream_unary_rpc_method_handler(
            stream_unary, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
    inner = handler.stream_stream
    if inspect.isasyncgenfunction(inner):
        async def stream_stream(request_iterator, context):
            await check(None, context)
            async for item in inner(request_iterator, context):
                yield item
    else:
        async def stream_stream(request_iterator, context):
            await check(None, context)
            return await inner(request_iterator, context)

    return grpc.stream_stream_rpc_method_handler(
        stream_stream, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer)
