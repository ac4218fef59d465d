"""How much of the broker's memory endpoints' requests may hold, and whose requests give way
when it is full (docs/serving.md, Admission).

A request's body is held from its arrival until the first piece of its answer comes back
(until then it may be sent to another replica), or until it ends. The bytes held over all
endpoints have one budget (``max_held_mib``, 64 MiB), shared max-min fairly: each client (an
endpoint's owner key) that holds bytes or asks for some now gets an equal share of the
budget, and each of its endpoints that holds or asks an equal part of its client's share.
A request is taken if its endpoint stays within its share with it (an endpoint that holds
nothing may always hold one request) and the budget has room. Where the budget has no room,
the newest requests of the endpoints furthest over their shares are evicted (they end in a
429) until it has; if evicting everything held over shares would not make room, the new
request gets the 429 instead and nothing is evicted. So one endpoint alone may use the whole
budget, and as soon as another client wants some, what it holds beyond its share is what
gives way: nobody's waiting requests, cold start included, can hold another client's part.

Plain code, no asyncio: the router (broker/serving/router.py) says how an evicted request ends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class NoRoom(Exception):
    """A request the budget cannot take now; ``over_share``: its endpoint holds its share."""

    def __init__(self, message: str, over_share: bool) -> None:
        super().__init__(message)
        self.message, self.over_share = message, over_share


@dataclass(eq=False)
class Hold:
    """One request's bytes. ``data`` is the body itself (dropped when released); the router
    keeps what it needs to end the request in ``waiter`` and ``pending``."""

    endpoint_id: str
    owner: str
    size: int
    data: bytes | None = None
    held: bool = True
    evicted: bool = False
    waiter: object = None
    pending: object = None


@dataclass
class _Endpoint:
    owner: str
    held: int = 0
    holds: list[Hold] = field(default_factory=list)   # oldest first


class RequestShares:
    def __init__(self, budget: int, on_evict: Callable[[Hold], None]) -> None:
        self.budget = budget
        self.on_evict = on_evict
        self.held = 0
        self.evictions = 0
        self._endpoints: dict[str, _Endpoint] = {}

    def holding(self, endpoint_id: str) -> int:
        e = self._endpoints.get(endpoint_id)
        return e.held if e else 0

    def shares(self, asking: tuple[str, str] | None = None) -> dict[str, float]:
        """Each endpoint's share of the budget (bytes), by endpoint id, over the endpoints that
        hold something and ``asking`` (owner, endpoint id)."""
        by_owner: dict[str, set[str]] = {}
        for endpoint_id, e in self._endpoints.items():
            by_owner.setdefault(e.owner, set()).add(endpoint_id)
        if asking is not None:
            by_owner.setdefault(asking[0], set()).add(asking[1])
        if not by_owner:
            return {}
        per_owner = self.budget / len(by_owner)
        return {endpoint_id: per_owner / len(ids) for ids in by_owner.values()
                for endpoint_id in ids}

    def take(self, endpoint_id: str, owner: str, size: int, data: bytes | None = None) -> Hold:
        """Hold ``size`` bytes for a request to ``endpoint_id`` of ``owner``, evicting others'
        requests over their shares where the budget has no room. Raises NoRoom."""
        shares = self.shares((owner, endpoint_id))
        mine = self.holding(endpoint_id)
        if mine and mine + size > shares[endpoint_id]:
            raise NoRoom(f"its requests hold {mine:,} bytes, its share of the broker's"
                         f" {self.budget:,} for requests now being {shares[endpoint_id]:,.0f}",
                         over_share=True)
        victims: list[Hold] = []
        if self.held + size > self.budget:
            victims = self._victims(shares, self.held + size - self.budget, endpoint_id)
            if victims is None:
                raise NoRoom(f"the broker holds {self.held:,} bytes of requests, its budget"
                             f" is {self.budget:,}, and no other endpoint holds more than its"
                             f" share", over_share=False)
        for victim in victims:
            self.release(victim)
            victim.evicted = True
            self.evictions += 1
            self.on_evict(victim)
        hold = Hold(endpoint_id, owner, size, data)
        e = self._endpoints.setdefault(endpoint_id, _Endpoint(owner))
        e.held += size
        e.holds.append(hold)
        self.held += size
        return hold

    def release(self, hold: Hold) -> None:
        """The request's bytes are no longer held (idempotent)."""
        if not hold.held:
            return
        hold.held = False
        hold.data = None
        self.held -= hold.size
        e = self._endpoints[hold.endpoint_id]
        e.held -= hold.size
        e.holds.remove(hold)
        if not e.holds:
            del self._endpoints[hold.endpoint_id]

    def _victims(self, shares: dict[str, float], need: int,
                 asking: str) -> list[Hold] | None:
        """The holds to evict to free ``need`` bytes: the newest of the endpoint furthest over
        its share, again and again, never the asking endpoint's, never an endpoint's once it
        is within its share; None if that cannot free enough."""
        excess = {endpoint_id: e.held - shares[endpoint_id]
                  for endpoint_id, e in self._endpoints.items()
                  if endpoint_id != asking and e.held > shares[endpoint_id]}
        left = {endpoint_id: list(self._endpoints[endpoint_id].holds) for endpoint_id in excess}
        picked: list[Hold] = []
        freed = 0
        while freed < need:
            over = [(amount, endpoint_id) for endpoint_id, amount in excess.items()
                    if amount > 0 and left[endpoint_id]]
            if not over:
                return None
            endpoint_id = max(over)[1]
            hold = left[endpoint_id].pop()
            picked.append(hold)
            freed += hold.size
            excess[endpoint_id] -= hold.size
        return picked
