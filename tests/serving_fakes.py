"""Fakes for the endpoint tests without a model: provider sessions that answer the broker's
InferenceRequests as a (hostile) provider would, and a router with one endpoint."""


from __future__ import annotations

import asyncio
import json


from gpumarket.broker.metrics import BrokerMetrics
from gpumarket.broker.serving.router import Endpoint, Serving
from gpumarket.broker.serving.rows import LiveEndpoint
from gpumarket.kinds.engine_protocol import Complete
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb

SETTINGS = {"task": "generate", "min_replicas": 1, "max_replicas": 3, "max_concurrency": 4,
            "target": 4, "window_s": 5, "idle_s": 60, "max_tokens": 0, "max_seq_len": 0}
RUNNING = pb.JOB_STATE_RUNNING
REQ = Complete(prompt="hi")      # a request as the broker's API makes one
DONE = {"done": True, "finish_reason": "stop", "prompt_tokens": 3, "output_tokens": 1}


# -- fake providers: sessions that answer InferenceRequests ---------------------------------

def honest(request: dict) -> list[dict]:
    return [{"text": "hi"}, dict(DONE)]


class AnsweringSession:
    """A provider's session as the router sees it: ``send`` takes BrokerMessages; an
    InferenceRequest is answered (soon, on the loop) with what ``answer`` returns for its
    decoded body, sent back as one InferenceChunk; None: silence."""

    def __init__(self, provider_id: str, answer=honest) -> None:
        self.provider_id, self.answer = provider_id, answer
        self.sent: list[gw.BrokerMessage] = []
        self.serving: Serving | None = None

    def send(self, message: gw.BrokerMessage) -> None:
        self.sent.append(message)
        if message.WhichOneof("msg") == "infer" and self.answer is not None:
            request = message.infer
            messages = self.answer(json.loads(request.body))
            if messages is not None:
                data = b"".join(json.dumps(m).encode() + b"\n" for m in messages)
                asyncio.get_running_loop().call_soon(
                    self.serving.chunk, self.provider_id,
                    gw.InferenceChunk(request_id=request.request_id, data=data,
                                      last=any(m.get("done") for m in messages)))

    def requests(self) -> list[gw.InferenceRequest]:
        return [m.infer for m in self.sent if m.WhichOneof("msg") == "infer"]


def router(sessions: dict[str, AnsweringSession], queue_wait_s: float = 0.5,
           cold_start_s: float = 0.5, request_timeout_s: float = 5.0,
           **settings) -> tuple[Serving, Endpoint]:
    serving = Serving(sessions, BrokerMetrics(), queue_wait_s, cold_start_s, request_timeout_s)
    for s in sessions.values():
        s.serving = serving
    serving.sync([live_row(**settings)])
    return serving, serving.endpoints["ep"]


def live_row(**settings) -> LiveEndpoint:
    return LiveEndpoint("ep", "c1", "tiny", {**SETTINGS, **settings})


def ready(serving: Serving, provider: str, job: str, concurrency: int = 4,
          max_seq_len: int = 0) -> None:
    serving.ready(provider, job, 1, "ep", gw.ReplicaReady(
        engine="test", task="generate", max_concurrency=concurrency, max_seq_len=max_seq_len))


async def collect(agen) -> list[dict]:
    return [m async for m in agen]
