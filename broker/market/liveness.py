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


UNCONFIRMED_FOR_MS = 3_600_000     # a provider that never says again is forgotten after this


class Liveness:
    def __init__(self) -> None:
        self.seen: dict[str, int] = {}                          # provider -> when, ms
        self.running: dict[str, list[tuple[str, int]]] = {}     # provider -> (job, epoch)
        # Leases the broker ended itself (lost to missed heartbeats, run past their
        # max_runtime) that their provider may still run: their devices are not leased
        # again until a heartbeat of that provider no longer lists them (only such leases:
        # what a heartbeat lists that is not the provider's costs the broker nothing here).
        # provider -> {(job, epoch): since, ms}
        self.unconfirmed: dict[str, dict[tuple[str, int], int]] = {}

    def heard(self, provider_id: str, running: list[tuple[str, int]], now: int) -> None:
        """A heartbeat: the provider is alive at ``now`` and runs ``running``."""
        self.seen[provider_id] = now
        self.running[provider_id] = running
        if (ended := self.unconfirmed.get(provider_id)) is not None:
            listed = set(running)
            for pair in [p for p in ended if p not in listed]:
                del ended[pair]
            if not ended:
                del self.unconfirmed[provider_id]

    def ended(self, provider_id: str, job_id: str, epoch: int, now: int) -> None:
        """The broker ended this lease without its provider saying it stopped."""
        self.unconfirmed.setdefault(provider_id, {})[(job_id, epoch)] = now

    def still_running(self, now: int) -> dict[str, list[tuple[str, int]]]:
        """The ended leases their providers may still run, by provider."""
        for provider_id in list(self.unconfirmed):
            ended = self.unconfirmed[provider_id]
            for pair in [p for p, since in ended.items() if now - since > UNCONFIRMED_FOR_MS]:
                del ended[pair]
            if not ended:
                del self.unconfirmed[provider_id]
        return {p: list(ended) for p, ended in self.unconfirmed.items()}

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
