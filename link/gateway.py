"""The provider's side of ProviderGateway.Session as an object: the handshake (hello,
challenge, signed proof, welcome), then messages both ways, and why the stream ended."""

from __future__ import annotations

import asyncio

import grpc

from gpumarket.link.errors import error_of
from gpumarket.proto import __version__
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import Unavailable, from_code
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import gateway_pb2_grpc


class GatewaySession:
    """``session = await GatewaySession.open(channel, identity, address)``, then
    ``send``/``receive`` until ``receive`` returns None (the broker ended it) or raises."""

    def __init__(self, call, address: str, welcome: gw.SessionWelcome,
                 broker_public_key: bytes) -> None:
        self.call = call
        self.address = address
        self.welcome = welcome
        self.broker_public_key = broker_public_key

    @classmethod
    async def open(cls, channel: grpc.aio.Channel, identity: Identity, address: str,
                   reconnect_within_ms: int = 0) -> "GatewaySession":
        """Open a session and prove this provider's key, telling the broker how long this
        provider takes to come back after an outage (``reconnect_within_ms``); raise
        Unavailable (or the broker's refusal) if the handshake does not complete."""
        call = gateway_pb2_grpc.ProviderGatewayStub(channel).Session()
        session = cls(call, address, gw.SessionWelcome(), b"")
        try:
            await session.send(gw.ProviderMessage(hello=gw.ProviderHello(
                public_key=identity.public_key, software_version=__version__,
                reconnect_within_ms=reconnect_within_ms)))
            challenge = await session.receive()
            if challenge is None or challenge.WhichOneof("msg") != "challenge":
                raise Unavailable("broker closed the session during the handshake")
            key = challenge.challenge.broker_public_key
            await session.send(gw.ProviderMessage(proof=seal(identity, gw.SessionProof(
                nonce=challenge.challenge.nonce, broker_public_key=key, at_ms=now_ms()))))
            welcome = await session.receive()
            if welcome is None or welcome.WhichOneof("msg") != "welcome":
                raise Unavailable("broker did not welcome this provider")
        except BaseException:
            call.cancel()
            raise
        session.welcome, session.broker_public_key = welcome.welcome, key
        return session

    async def send(self, message: gw.ProviderMessage) -> None:
        try:
            await self.call.write(message)
        except asyncio.InvalidStateError:
            raise await self._ended() from None
        except grpc.aio.AioRpcError as exc:
            raise error_of(exc, self.address) from exc

    async def receive(self) -> gw.BrokerMessage | None:
        """The broker's next message; None when it ended the session cleanly."""
        try:
            message = await self.call.read()
        except asyncio.InvalidStateError:
            raise await self._ended() from None
        except grpc.aio.AioRpcError as exc:
            raise error_of(exc, self.address) from exc
        return None if message is grpc.aio.EOF else message

    async def _ended(self):
        # A stream with interceptors refuses reads and writes once it has ended: say why.
        code, details = await self.call.code(), await self.call.details()
        return from_code(code.name, details or "the broker ended the session")

    def close(self) -> None:
        self.call.cancel()
