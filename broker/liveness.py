"""Heartbeats noted in memory and written together: a provider's last heartbeat and the
leases it said it runs are kept here and written in one transaction per scheduler pass
(``providers.heartbeats``), not one transaction per heartbeat. At 10,000 providers on 5 s
heartbeats that is 2,000 writes a second fewer in front of the one writer, where signed
calls' nonces, handshakes and job updates wait.

None of it needs to survive the broker: after a restart every provider is offline until it
reconnects, and every active lease waits for its provider from the restart as long as that
provider said it takes to reconnect, plus a margin, and at least a lease timeout
(``providers.renew_all_leases``). The expiry of leases reads the database only after what
was noted here is written (``scheduler.expire``)."""

from __future__ import annotations


class Liveness:
    def __init__(self) -> None:
        self.seen: dict[str, int] = {}                          # provider -> when, ms
        self.running: dict[str, list[tuple[str, int]]] = {}     # provider -> (job, epoch)

    def heard(self, provider_id: str, running: list[tuple[str, int]], now: int) -> None:
        """A heartbeat: the provider is alive at ``now`` and runs ``running``."""
        self.seen[provider_id] = now
        self.running[provider_id] = running

    def take(self) -> tuple[dict[str, int], dict[str, list[tuple[str, int]]]]:
        """What was heard since the last take, to write."""
        taken = self.seen, self.running
        self.seen, self.running = {}, {}
        return taken

    def put_back(self, seen: dict[str, int], running: dict[str, list[tuple[str, int]]]) -> None:
        """A take whose write failed: heard again, unless a newer heartbeat came meanwhile."""
        for provider_id, when in seen.items():
            if provider_id not in self.seen:
                self.heard(provider_id, running.get(provider_id, []), when)
