"""A sample of each endpoint's answers, kept for a check of them (docs/verification.md,
Endpoint answers): the request as its replica's engine got it, the token ids the replica says
it generated and the fingerprints it committed to in its final message. In memory; the
autoscaler takes what a replica's window gathered when it settles the replica's pay
(broker/checks/answers.py turns it into a check). No grpc here.

Which answers: each with probability ``rate`` (the broker's ``answer_check_rate``), drawn
from the system's random source when the request arrives, before any replica is chosen, and
never told to the replica (every answer of a fingerprinting engine must carry its
fingerprints, so a replica cannot tell which are kept). A replica of a provider still in its
warm-up (its check rate 1, broker/checks/verification.py) also has the first answer of each
window kept, so every window of a new provider's replica is checked. A stranger's prompts are
hostile in size: a replica's window keeps at most MAX_PER_WINDOW answers and
MAX_REPLICA_BYTES, an endpoint's replicas MAX_ENDPOINT_BYTES together; an answer that does not
fit is not kept (a later, smaller one may be)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

MAX_PER_WINDOW = 64               # answers kept per replica per window (answer_check.MAX_SAMPLES)
MAX_REPLICA_BYTES = 2 << 20       # request + token ids + fingerprints kept per replica per window
MAX_ENDPOINT_BYTES = 8 << 20      # ... and over all of an endpoint's replicas
DEFAULT_RATE = 0.02


@dataclass
class Window:
    """What one replica lease's current window kept."""

    lease_id: str
    job_id: str
    endpoint_id: str
    provider_id: str
    answers: int = 0                              # answers it gave in the window
    drawn: int = 0                                # of the kept, those the rate drew
    samples: list[dict] = field(default_factory=list)
    bytes: int = 0


class AnswerSamples:
    def __init__(self, rate: float = DEFAULT_RATE, draw=None) -> None:
        self.rate = rate
        self.draw = draw or random.SystemRandom().random
        self.windows: dict[str, Window] = {}      # by replica lease id
        self.endpoint_bytes: dict[str, int] = {}
        # Providers past their warm-up (set by the autoscaler from their check records): only
        # their replicas go without the first-answer minimum. Unknown = new.
        self.settled: frozenset[str] = frozenset()

    def wants(self, endpoint_id: str, replicas) -> bool | None:
        """At a request's arrival: True if it is drawn at the rate; None if it is not but a
        replica of the endpoint (``replicas``: router Replicas) that checks its answers has
        no sample yet this window (kept only if that replica answers it); False otherwise."""
        if self.rate > 0 and self.draw() < self.rate:
            return True
        for r in replicas:
            if r.fingerprinted and r.provider_id not in self.settled:
                w = self.windows.get(r.lease_id)
                if w is None or not w.samples:
                    return None
        return False

    def offer(self, replica, request: bytes | None, final, drawn: bool) -> bool:
        """A completion ``final`` (engine_protocol.Final) answered ``request`` (its bytes as
        the engine got them; None where ``wants`` said no: only counted) on ``replica``:
        keep it if ``drawn``, or as the window's first of a replica in its warm-up. Returns
        whether it was kept."""
        if not replica.fingerprinted:
            return False
        w = self.windows.get(replica.lease_id)
        if w is None:
            w = self.windows[replica.lease_id] = Window(
                replica.lease_id, replica.job_id, replica.endpoint_id, replica.provider_id)
        w.answers += 1
        first = not w.samples and replica.provider_id not in self.settled
        if request is None or not (drawn or first) or len(w.samples) >= MAX_PER_WINDOW:
            return False
        try:
            as_dict = json.loads(request)
        except ValueError:
            return False
        # None where the replica sent none: judged a failed check (it was asked for them)
        sample = {"request": as_dict, "token_ids": final.token_ids,
                  "fingerprints": final.fingerprints}
        size = len(request) + 8 * len(final.token_ids or ()) + sum(
            len(p) for p in final.fingerprints or ())
        held = self.endpoint_bytes.get(w.endpoint_id, 0)
        if w.bytes + size > MAX_REPLICA_BYTES or held + size > MAX_ENDPOINT_BYTES:
            return False
        w.samples.append(sample)
        w.drawn += drawn
        w.bytes += size
        self.endpoint_bytes[w.endpoint_id] = held + size
        return True

    def take(self) -> list[Window]:
        """The windows that kept answers, ended now (a new window begins for each replica)."""
        out = [w for w in self.windows.values() if w.samples]
        self.windows.clear()
        self.endpoint_bytes.clear()
        return out

    def held_bytes(self, endpoint_id: str) -> int:
        return self.endpoint_bytes.get(endpoint_id, 0)
