"""The ledger's rows as the broker reads them: each an immutable value made from a row in one
place (``from_row``), read by attribute (``posting.provider_id``), so that a column renamed
or gone fails where the row is read, not in a settlement's dispute or a servicer (as
``jobs/job.Job`` is for a job). Amounts are integers in units (money/ledger.py).

- ``Posting``: one row of ``ledger_postings``, an event whose entries sum to zero, with its
  entries (account -> amount) read from their JSON once;
- ``Line``: one entry on an account of a client or provider, with its posting's columns and
  the account as its owner reads it (``available``, ``held``, ``earned``, ...): what
  ``gpumarket account`` lists.

No imports of the broker here."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Posting:
    """One posting of the ledger (append-only: never changed once made)."""

    seq: int
    key: str                        # its idempotency key: the same event never posts twice
    at_ms: int
    type: str                       # credit, hold, settle, dispute, restore, reverse, ...
    entries: dict[str, int]         # account -> amount (units), summing to zero
    job_id: str
    lease_id: str
    provider_id: str
    step_from: int
    step_to: int
    seconds: float                  # the time a settlement pays for
    memo: str
    actor: str                      # the operator, for a credit

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Posting:
        """The posting of a whole row of ``ledger_postings`` (``SELECT *``); raises KeyError
        if a column is missing."""
        values = {f.name: row[f.name] for f in fields(cls)}
        values["entries"] = json.loads(values["entries"])
        return cls(**values)

    def amount(self, account: str) -> int:
        """What this posting moved on ``account`` (0: it did not touch it)."""
        return self.entries.get(account, 0)


@dataclass(frozen=True)
class Line:
    """One entry on a key's accounts, newest first in ``ledger.lines``."""

    seq: int                        # its posting's
    at_ms: int
    type: str                       # its posting's type
    account: str                    # as its owner reads it: available, held, earned, ...
    amount: int                     # units (negative: out of the account)
    job_id: str
    provider_id: str
    step_from: int
    step_to: int
    seconds: float
    memo: str

    COLUMNS = ("p.seq, p.at_ms, p.type, a.type, e.amount, p.job_id, p.provider_id,"
               " p.step_from, p.step_to, p.seconds, p.memo")

    @classmethod
    def from_row(cls, row: tuple, labels: Mapping[str, str]) -> Line:
        """The line of a row selected with ``COLUMNS``, its account type named by
        ``labels``; raises KeyError for an account type without a label."""
        seq, at_ms, type_, account_type, *rest = row
        return cls(seq, at_ms, type_, labels[account_type], *rest)
