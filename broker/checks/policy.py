"""What the caller of a transition knows about spot checks that its transaction cannot
(docs/verification.md): a plain value, so that the state machine (jobs/transitions) can
carry it to the checks without importing them."""

from __future__ import annotations

from dataclasses import dataclass

BAN_AFTER = 2         # failed checks (since its last ban was lifted) that ban a provider


@dataclass(frozen=True)
class Policy:
    """What the caller knows that the transaction cannot: whether checks are on, the device
    classes (Accelerator) of the other providers online (a check runs on the same class as the
    work it checks), and a uniform draw in [0, 1) (from a source the providers cannot
    predict) that decides whether this segment is checked."""

    enabled: bool = False
    others_online: frozenset[int] = frozenset()
    draw: float = 1.0
    ban_after: int = BAN_AFTER

    def can_check(self, accelerator: int) -> bool:
        """Whether a provider that could replay work done on this device class is online
        (a lease of no recorded class: any other provider)."""
        return accelerator in self.others_online or (not accelerator and bool(
            self.others_online))


OFF = Policy()
