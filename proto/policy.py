"""A provider's policy: which clients it serves, for how long, and when. Shared by the
broker (which matches on it) and the provider (which enforces it again)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

from gpumarket.proto.errors import InvalidArgument
from gpumarket.proto.v1 import types_pb2 as pb

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
HOURS_RE = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")


@dataclass(frozen=True)
class Window:
    """Hours of availability, in UTC: on ``days`` (0 = Monday) from start to end minute."""

    days: frozenset[int]
    start_minute: int
    end_minute: int

    def contains(self, t: datetime) -> bool:
        minute = t.hour * 60 + t.minute
        if self.start_minute <= self.end_minute:
            return t.weekday() in self.days and self.start_minute <= minute < self.end_minute
        # wraps past midnight: the part after midnight belongs to the previous day's window
        if minute >= self.start_minute:
            return t.weekday() in self.days
        return minute < self.end_minute and (t.weekday() - 1) % 7 in self.days


@dataclass(frozen=True)
class Policy:
    allowed_clients: frozenset[str] = frozenset()   # empty = everyone not denied
    denied_clients: frozenset[str] = frozenset()
    max_job_s: float = 0.0                          # 0 = no cap
    allow_remote_code: bool = False                 # jobs may run their model's own code
    windows: tuple[Window, ...] = ()                # empty = always

    def accepts(self, client_id: str) -> bool:
        if client_id in self.denied_clients:
            return False
        return not self.allowed_clients or client_id in self.allowed_clients

    def available(self, t: datetime | None = None) -> bool:
        t = t or datetime.now(timezone.utc)
        return not self.windows or any(w.contains(t) for w in self.windows)

    def message(self) -> pb.Policy:
        return pb.Policy(
            allowed_clients=sorted(self.allowed_clients),
            denied_clients=sorted(self.denied_clients),
            max_job_seconds=int(self.max_job_s),
            allow_remote_code=self.allow_remote_code,
            windows=[pb.AvailabilityWindow(days=sorted(w.days), start_minute=w.start_minute,
                                           end_minute=w.end_minute) for w in self.windows],
        )

    @classmethod
    def from_message(cls, p: pb.Policy) -> "Policy":
        return cls(
            allowed_clients=frozenset(p.allowed_clients),
            denied_clients=frozenset(p.denied_clients),
            max_job_s=float(p.max_job_seconds),
            allow_remote_code=p.allow_remote_code,
            windows=tuple(Window(frozenset(w.days), w.start_minute, w.end_minute)
                          for w in p.windows),
        )


def parse_window(days: list[str], hours: str, where: str) -> Window:
    """``days`` like ["mon", "tue"] (or ["all"]), ``hours`` like "18:00-08:00" (UTC)."""
    if days == ["all"]:
        idx = frozenset(range(7))
    else:
        try:
            idx = frozenset(DAYS.index(d.lower()[:3]) for d in days)
        except (ValueError, AttributeError) as exc:
            raise InvalidArgument(f"{where}.days: use names from {', '.join(DAYS)} or 'all'") \
                from exc
    m = HOURS_RE.match(hours) if isinstance(hours, str) else None
    if not m:
        raise InvalidArgument(f"{where}.hours: must look like \"18:00-08:00\", got {hours!r}")
    h1, m1, h2, m2 = map(int, m.groups())
    if h1 > 24 or h2 > 24 or m1 > 59 or m2 > 59:
        raise InvalidArgument(f"{where}.hours: {hours!r} is not a time range")
    return Window(idx, h1 * 60 + m1, h2 * 60 + m2)
