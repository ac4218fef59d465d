"""What relaying an endpoint request to the broker that holds its replica costs
(broker/serving/relay.py): two brokers' OpenAI-compatible APIs in one process, on 127.0.0.1,
the replica a provider session that answers at once (tests/serving_fakes.py), so that what is
timed is the brokers' work, not a model's. The same requests, whole and streamed, are sent
to the replica's broker (direct) and to the other one (relayed), alternating; prints the
latency percentiles of each and, last, one JSON object.

    .venv/bin/python bench/relay.py [--requests 400] [--pieces 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpumarket.broker.serving.relay import Peer  # noqa: E402
from tests.serving_fakes import AnsweringSession, ready  # noqa: E402
from tests.test_serving_relay import broker, close, started  # noqa: E402
from tests.test_serving_hostile_api import KEY, chat  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] * 1000


async def main(requests: int, pieces: int) -> dict:
    answer = [{"text": "zq"} for _ in range(pieces)] + [
        {"done": True, "finish_reason": "length", "prompt_tokens": 3, "output_tokens": pieces}]
    session = AnsweringSession("p1", lambda r: answer)
    a = await started(broker("a", {"p1": session}))
    ready(a.api.serving, "p1", "r1", concurrency=64)
    b = await started(broker("b", {}))
    b.relay.peers = [Peer("a", a.url, {"ep": 1})]
    times: dict[str, list[float]] = {k: [] for k in
                                     ("direct", "relayed", "direct_stream", "relayed_stream")}
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        for i in range(requests):
            for name, client in (("direct", a.client), ("relayed", b.client)):
                for stream in (False, True):
                    body = json.dumps(chat(stream=stream, max_tokens=pieces))
                    began = time.perf_counter()
                    response = await client.post("/v1/chat/completions", data=body,
                                                 headers=headers)
                    text = await response.text()
                    took = time.perf_counter() - began
                    if response.status != 200 or text.count("zq") != pieces:
                        raise SystemExit(f"{name}: {response.status} {text[:300]}")
                    times[name + ("_stream" if stream else "")].append(took)
    finally:
        await close(a, b)
    out = {}
    for name, values in times.items():
        out[f"{name}_p50_ms"] = round(pct(values, 0.5), 3)
        out[f"{name}_p99_ms"] = round(pct(values, 0.99), 3)
        print(f"{name:15s} p50 {pct(values, 0.5):7.2f} ms  p99 {pct(values, 0.99):7.2f} ms"
              f"  ({len(values)} requests)")
    out["relay_added_p50_ms"] = round(out["relayed_p50_ms"] - out["direct_p50_ms"], 3)
    out["relay_added_stream_p50_ms"] = round(
        out["relayed_stream_p50_ms"] - out["direct_stream_p50_ms"], 3)
    out["requests"], out["pieces"] = requests, pieces
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="of each of the four sorts")
    parser.add_argument("--pieces", type=int, default=16, help="tokens an answer streams")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.requests, args.pieces))))
