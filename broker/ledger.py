"""The ledger: double-entry bookkeeping of every credit that moves on this broker.

Amounts are integers in units: 1 credit = 1,000,000 units (``UNIT``), never floats. A posting
is one event (a credit, a hold, a settlement, ...) whose entries sum to zero; postings and
entries are append-only (SQLite triggers refuse UPDATE and DELETE) and each carries an
idempotency key, so the same event can never post twice. ``ledger_accounts`` caches each
account's balance; ``audit`` checks it against the sum of the entries.

Accounts (see docs/ledger.md):

    deposits            what came in through the operator's door (its negative: all credited)
    client:<key>        a client's available balance
    escrow:<job>        a job's hold (owner: its client); a client's "held" is the sum of these
    provider:<key>      a provider's earnings
    stake:<key>         a provider's stake
    fee                 the market's fee
    disputed:<job>      settlements held while a verification check runs (owner: the provider)

Every function here runs inside the caller's write transaction (Store.write), together with
the job or lease transition that causes it. No grpc here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sqlite_utils import Database

from gpumarket.proto.errors import FailedPrecondition, InsufficientFunds, InvalidArgument
from gpumarket.proto.money import UNIT, fmt, units  # noqa: F401  (part of this module's API)

MS_PER_HOUR = 3_600_000
PPM = 1_000_000                  # fees are in parts per million of a settlement

TYPES = ("deposits", "client", "escrow", "provider", "stake", "fee", "disputed")
# Accounts that may be below zero: deposits always (money from outside); the others only
# where a posting allows it (a broker that does not enforce funds; a reversed settlement).
NEGATIVE_BY_NATURE = frozenset({"deposits"})


def account_type(account: str) -> tuple[str, str]:
    """(type, owner) of an account name; owner of an escrow or disputed account is its job."""
    kind, _, owner = account.partition(":")
    if kind not in TYPES:
        raise ValueError(f"unknown ledger account {account!r}")
    return kind, owner


def client(key_id: str) -> str:
    return f"client:{key_id}"


def escrow(job_id: str) -> str:
    return f"escrow:{job_id}"


def provider(key_id: str) -> str:
    return f"provider:{key_id}"


def stake(key_id: str) -> str:
    return f"stake:{key_id}"


def disputed(job_id: str, provider_id: str) -> str:
    return f"disputed:{job_id}:{provider_id}"


def balance(db: Database, account: str) -> int:
    row = db.execute("SELECT balance FROM ledger_accounts WHERE account = ?", [account]).fetchone()
    return row[0] if row else 0


def posted(db: Database, key: str) -> int | None:
    """The sequence number of the posting with this idempotency key, if it was posted."""
    row = db.execute("SELECT seq FROM ledger_postings WHERE key = ?", [key]).fetchone()
    return row[0] if row else None


def post(db: Database, key: str, type_: str, lines: dict[str, int], now: int, *,
         owners: dict[str, str] | None = None, may_go_negative: frozenset[str] = frozenset(),
         job_id: str = "", lease_id: str = "", provider_id: str = "", step_from: int = 0,
         step_to: int = 0, seconds: float = 0.0, memo: str = "", actor: str = "") -> int | None:
    """Post one balanced event; return its sequence number, or None if a posting with ``key``
    exists already (the event was posted before: nothing moves twice) or nothing moves.

    ``owners``: the owner recorded for accounts whose name does not say it (an escrow's
    client, a disputed account's provider). Raises FailedPrecondition if an account would go
    below zero that may not.
    """
    lines = {a: v for a, v in lines.items() if v != 0}
    if any(not isinstance(v, int) or isinstance(v, bool) for v in lines.values()):
        raise TypeError("ledger amounts are integers (units)")
    if sum(lines.values()) != 0:
        raise ValueError(f"posting {key} does not balance: {lines}")
    if not lines:
        return None
    # Only what an entry takes out can overdraw an account: read those balances, in one query.
    out = [a for a, v in lines.items() if v < 0 and account_type(a)[0] not in NEGATIVE_BY_NATURE
           and a not in may_go_negative]
    if out:
        held = dict(db.execute(f"SELECT account, balance FROM ledger_accounts WHERE account IN"
                               f" ({','.join('?' * len(out))})", out).fetchall())
        for account in out:
            if held.get(account, 0) + lines[account] < 0:
                raise FailedPrecondition(f"{account} would go below zero"
                                         f" ({fmt(held.get(account, 0) + lines[account])}"
                                         f" credits) by {type_} {key}")
    cur = db.execute(
        "INSERT INTO ledger_postings (key, at_ms, type, job_id, lease_id, provider_id,"
        " step_from, step_to, seconds, memo, actor) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT(key) DO NOTHING",
        [key, now, type_, job_id, lease_id, provider_id, step_from, step_to, seconds,
         memo[:500], actor])
    if cur.rowcount == 0:
        return None          # posted before: the idempotency key holds
    seq = cur.lastrowid
    named = {a: account_type(a) for a in lines}
    rows = ", ".join(["(?, ?, ?)"] * len(lines))
    db.conn.execute(f"INSERT INTO ledger_entries (posting_seq, account, amount) VALUES {rows}",
                    [x for a, v in lines.items() for x in (seq, a, v)])
    db.conn.execute(
        f"INSERT INTO ledger_accounts (account, type, owner, balance) VALUES"
        f" {', '.join(['(?, ?, ?, ?)'] * len(lines))}"
        " ON CONFLICT(account) DO UPDATE SET balance = balance + excluded.balance",
        [x for a, v in lines.items()
         for x in (a, named[a][0], (owners or {}).get(a, named[a][1]), v)])
    return seq


# -- funds in ------------------------------------------------------------------------------

def credit(db: Database, key_id: str, amount: int, to: str, memo: str, operator: str,
           order_key: str, now: int) -> tuple[int | None, int]:
    """The operator's door: ``amount`` units from outside into a client's available balance
    (``to="client"``) or a provider's stake (``to="stake"``). Returns (posting, balance after);
    posting None if this order was applied before."""
    if amount <= 0:
        raise InvalidArgument("amount: must be more than 0")
    account = client(key_id) if to == "client" else stake(key_id)
    seq = post(db, f"credit:{order_key}", "credit" if to == "client" else "stake",
               {"deposits": -amount, account: amount}, now, memo=memo or "credit",
               actor=operator, provider_id=key_id if to == "stake" else "")
    return seq, balance(db, account)


# -- a job's money -------------------------------------------------------------------------

def hold(db: Database, job_id: str, client_id: str, amount: int, basis: str, enforce: bool,
         now: int) -> None:
    """Move a new job's hold from its client's available balance into the job's escrow;
    raise InsufficientFunds, naming the amount short, if the client cannot cover it (a broker
    that does not enforce funds lets the balance go below zero: it records usage)."""
    available = balance(db, client(client_id))
    if enforce and available < amount:
        raise InsufficientFunds(
            f"insufficient funds: this job holds {fmt(amount)} credits ({basis}); your"
            f" available balance is {fmt(available)}, {fmt(amount - available)} short"
            " (ask the broker's operator for credit, or set a smaller budget in the job file)")
    post(db, f"hold:{job_id}", "hold", {client(client_id): -amount, escrow(job_id): amount},
         now, owners={escrow(job_id): client_id}, job_id=job_id, memo=basis,
         may_go_negative=frozenset() if enforce else frozenset({client(client_id)}))


def top_up(db: Database, job_id: str, client_id: str, amount: int, enforce: bool,
           now: int) -> None:
    if amount <= 0:
        raise InvalidArgument("amount: must be more than 0")
    available = balance(db, client(client_id))
    if enforce and available < amount:
        raise InsufficientFunds(f"insufficient funds: the top-up is {fmt(amount)} credits; your"
                                f" available balance is {fmt(available)},"
                                f" {fmt(amount - available)} short")
    n = db.execute("SELECT count(*) FROM ledger_postings WHERE job_id = ? AND type = 'topup'",
                   [job_id]).fetchone()[0]
    post(db, f"topup:{job_id}:{n + 1}", "topup",
         {client(client_id): -amount, escrow(job_id): amount}, now,
         owners={escrow(job_id): client_id}, job_id=job_id, memo="top-up by the client",
         may_go_negative=frozenset() if enforce else frozenset({client(client_id)}))


@dataclass(frozen=True)
class Settlement:
    amount: int          # what the segment cost at the lease's price
    paid: int            # what the escrow paid (amount, or what was left of the hold)
    remaining: int       # the hold left after it


def settle(db: Database, job: dict, lease: dict, step_to: int, now: int, *,
           tag: str = "") -> Settlement:
    """Pay a lease's work since its last settlement (or its start) up to progress ``step_to``:
    the lease's price x its devices x the time, from the job's escrow to the provider, less
    the market's fee. Idempotent per (lease, ``tag`` or step: "final" at the receipt, "end"
    when the lease is stopped); a broker that enforces funds never pays more than the hold has
    left. Nothing is paid for time before the provider reported the job started."""
    top = job["parent_id"] or job["id"]
    started = lease["settled_to_ms"] if lease["settled_to_ms"] is not None \
        else lease["started_at_ms"]
    step_from = lease["settled_step"] if lease["settled_step"] is not None else lease["start_step"]
    elapsed = max(0, now - started) if started is not None else 0
    devices = len(json.loads(lease["device_indices"]))
    amount = units(lease["price_per_gpu_hour"]) * devices * elapsed // MS_PER_HOUR
    left = balance(db, escrow(top))
    paid = min(amount, max(left, 0)) if job["enforce_funds"] else amount
    fee = paid * job["fee_ppm"] // PPM
    pid = lease["provider_id"]
    post(db, f"settle:{lease['id']}:{tag or step_to}", "settle",
         {escrow(top): -paid, provider(pid): paid - fee, "fee": fee}, now,
         owners={escrow(top): job["client_id"]},
         may_go_negative=frozenset({escrow(top)}),   # checked above: paid <= what is left
         job_id=job["id"], lease_id=lease["id"], provider_id=pid, step_from=step_from,
         step_to=max(step_to, step_from), seconds=elapsed / 1000,
         memo="" if paid == amount else f"hold exhausted: {fmt(amount - paid)} not covered")
    db.execute("UPDATE leases SET settled_to_ms = ?, settled_step = ? WHERE id = ?",
               [now, max(step_to, step_from), lease["id"]])
    return Settlement(amount, paid, left - paid)


def accrued(lease: dict, now: int) -> int:
    """What a running lease has cost since its last settlement, in units."""
    started = lease["settled_to_ms"] if lease["settled_to_ms"] is not None \
        else lease["started_at_ms"]
    if started is None:
        return 0
    devices = len(json.loads(lease["device_indices"]))
    return units(lease["price_per_gpu_hour"]) * devices * max(0, now - started) // MS_PER_HOUR


def release(db: Database, job_id: str, client_id: str, now: int) -> None:
    """A job ended: what its hold has left goes back to its client's available balance (on a
    broker that does not enforce funds, an overdrawn hold takes the rest from it)."""
    left = balance(db, escrow(job_id))
    post(db, f"release:{job_id}", "release", {escrow(job_id): -left, client(client_id): left},
         now, job_id=job_id, memo="job ended: unspent hold returned",
         may_go_negative=frozenset({escrow(job_id), client(client_id)}))


# -- verification's hooks (docs/ledger.md) -------------------------------------------------

def _settlement(db: Database, seq: int) -> tuple[dict, dict[str, int]]:
    row = db.execute("SELECT * FROM ledger_postings WHERE seq = ? AND type = 'settle'",
                     [seq]).fetchone()
    if row is None:
        raise InvalidArgument(f"no settlement {seq}")
    cols = [d[0] for d in db.execute("SELECT * FROM ledger_postings LIMIT 0").description]
    entries = dict(db.execute("SELECT account, amount FROM ledger_entries WHERE posting_seq = ?",
                              [seq]).fetchall())
    return dict(zip(cols, row)), entries


def dispute(db: Database, seq: int, now: int) -> None:
    """Hold a settlement's pay (provider's and fee) while a check of its segment runs."""
    p, entries = _settlement(db, seq)
    paid, fee = entries.get(provider(p["provider_id"]), 0), entries.get("fee", 0)
    post(db, f"dispute:{seq}", "dispute",
         {provider(p["provider_id"]): -paid, "fee": -fee,
          disputed(p["job_id"], p["provider_id"]): paid + fee},
         now, owners={disputed(p["job_id"], p["provider_id"]): p["provider_id"]},
         job_id=p["job_id"],
         lease_id=p["lease_id"], provider_id=p["provider_id"], step_from=p["step_from"],
         step_to=p["step_to"], memo=f"settlement {seq} disputed",
         may_go_negative=frozenset({provider(p["provider_id"])}))


def resolve(db: Database, seq: int, passed: bool, now: int) -> None:
    """A check ended: a passed one pays the held settlement on; a failed one returns it to the
    job's hold (the client does not pay for the segment; its re-run is paid from there)."""
    if posted(db, f"dispute:{seq}") is None:
        raise FailedPrecondition(f"settlement {seq} is not disputed")
    p, entries = _settlement(db, seq)
    paid, fee = entries.get(provider(p["provider_id"]), 0), entries.get("fee", 0)
    held = disputed(p["job_id"], p["provider_id"])
    top, client_id, ended = db.execute(
        "SELECT t.id, t.client_id, t.state IN (4, 5, 6) FROM jobs j JOIN jobs t"
        " ON t.id = coalesce(j.parent_id, j.id) WHERE j.id = ?", [p["job_id"]]).fetchone()
    # Back into the job's hold while it runs (its re-run is paid from there), else to the client.
    back = client(client_id) if ended else escrow(top)
    lines = ({held: -(paid + fee), provider(p["provider_id"]): paid, "fee": fee} if passed
             else {held: -(paid + fee), back: paid + fee})
    post(db, f"resolve:{seq}", "restore" if passed else "reverse", lines, now,
         job_id=p["job_id"], lease_id=p["lease_id"], provider_id=p["provider_id"],
         step_from=p["step_from"], step_to=p["step_to"],
         memo=f"check of settlement {seq} {'passed' if passed else 'failed: pay returned'}")


def slash(db: Database, provider_id: str, client_id: str, job_id: str, amount: int,
          now: int) -> int:
    """A provider caught returning wrong results loses up to ``amount`` of its stake to the
    client; returns what moved."""
    taken = min(amount, max(0, balance(db, stake(provider_id))))
    post(db, f"slash:{job_id}:{provider_id}", "slash",
         {stake(provider_id): -taken, client(client_id): taken}, now, job_id=job_id,
         provider_id=provider_id, memo="stake lost for a wrong result")
    return taken


# -- reading --------------------------------------------------------------------------------

def job_money(db: Database, job_id: str) -> dict[str, int]:
    """A (top-level) job's hold, charges and what is left, in units."""
    rows = dict(db.execute(
        "SELECT p.type, sum(e.amount) FROM ledger_entries e JOIN ledger_postings p"
        " ON p.seq = e.posting_seq WHERE e.account = ? GROUP BY p.type",
        [escrow(job_id)]).fetchall())
    pattern = _like(job_id)
    to_client = db.execute(
        "SELECT coalesce(sum(e.amount), 0) FROM ledger_entries e JOIN ledger_postings p"
        " ON p.seq = e.posting_seq JOIN ledger_accounts a ON a.account = e.account"
        " WHERE p.type = 'reverse' AND a.type = 'client' AND (p.job_id = ? OR p.job_id LIKE ?"
        " ESCAPE '\\')", [job_id, pattern + "-%"]).fetchone()[0]
    held = db.execute(
        "SELECT coalesce(sum(balance), 0) FROM ledger_accounts WHERE type = 'disputed' AND"
        " (account LIKE ? ESCAPE '\\' OR account LIKE ? ESCAPE '\\')",
        [f"disputed:{pattern}:%", f"disputed:{pattern}-%"]).fetchone()[0]
    return {"hold": rows.get("hold", 0) + rows.get("topup", 0),
            "charged": -rows.get("settle", 0) - rows.get("reverse", 0) - to_client,
            "remaining": balance(db, escrow(job_id)), "disputed": held}


def _like(text: str) -> str:
    """``text`` as a literal in a LIKE pattern (ESCAPE '\\')."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


ACCOUNT_LABELS = {"client": "available", "escrow": "held", "provider": "earned",
                  "stake": "stake", "disputed": "disputed"}


def lines(db: Database, key_id: str, job_id: str = "", limit: int = 100,
          before_seq: int = 0) -> list[dict]:
    """Entries on ``key_id``'s accounts (as a client: available and its jobs' holds; as a
    provider: earned, stake, its disputed pay), newest first; ``job_id``: of that job (and
    its parts) only."""
    where = ["(a.account IN (?, ?, ?) OR a.owner = ?)", "a.type != 'deposits'"]
    args: list = [client(key_id), provider(key_id), stake(key_id), key_id]
    if job_id:
        where.append("(p.job_id = ? OR p.job_id LIKE ? ESCAPE '\\')")
        args += [job_id, _like(job_id) + "-%"]
    if before_seq:
        where.append("p.seq < ?")
        args.append(before_seq)
    cur = db.execute(
        "SELECT p.seq, p.at_ms, p.type, a.type, e.amount, p.job_id, p.provider_id, p.step_from,"
        " p.step_to, p.seconds, p.memo FROM ledger_entries e"
        " JOIN ledger_postings p ON p.seq = e.posting_seq"
        " JOIN ledger_accounts a ON a.account = e.account"
        f" WHERE {' AND '.join(where)} ORDER BY p.seq DESC, a.type LIMIT ?", [*args, limit])
    names = ("seq", "at_ms", "type", "account", "amount", "job_id", "provider_id", "step_from",
             "step_to", "seconds", "memo")
    out = [dict(zip(names, r)) for r in cur.fetchall()]
    for line in out:
        line["account"] = ACCOUNT_LABELS[line["account"]]
    return out


def summary(db: Database, key_id: str) -> dict[str, int]:
    """What ``key_id`` has on this broker, in units."""
    spent = -db.execute(
        "SELECT coalesce(sum(e.amount), 0) FROM ledger_accounts a"
        " JOIN ledger_entries e ON e.account = a.account"
        " JOIN ledger_postings p ON p.seq = e.posting_seq"
        " WHERE ((a.type = 'escrow' AND p.type IN ('settle', 'reverse'))"
        " OR (a.type = 'client' AND p.type = 'reverse')) AND a.owner = ?",
        [key_id]).fetchone()[0]
    held = sum(r[0] for r in db.execute(
        "SELECT balance FROM ledger_accounts WHERE type = 'escrow' AND owner = ?", [key_id]))
    credited = db.execute(
        "SELECT coalesce(sum(e.amount), 0) FROM ledger_entries e JOIN ledger_postings p"
        " ON p.seq = e.posting_seq WHERE e.account = ? AND p.type = 'credit'",
        [client(key_id)]).fetchone()[0]
    return {"available": balance(db, client(key_id)), "held": held, "credited": credited,
            "spent": spent, "earned": balance(db, provider(key_id)),
            "stake": balance(db, stake(key_id))}


def totals(db: Database) -> dict[str, int]:
    """Sum of balances per account type."""
    found = dict(db.execute("SELECT type, sum(balance) FROM ledger_accounts GROUP BY type"
                            ).fetchall())
    return {t: found.get(t, 0) for t in TYPES}


def audit(db: Database) -> list[str]:
    """What is wrong with the ledger (nothing, if empty): a posting that does not sum to zero,
    a cached balance that differs from its entries, an account below zero that may not be."""
    problems = [f"posting {seq} sums to {total}, not 0" for seq, total in db.execute(
        "SELECT posting_seq, sum(amount) FROM ledger_entries GROUP BY posting_seq"
        " HAVING sum(amount) != 0").fetchall()]
    problems += [f"{account}: cached balance {cached} but its entries sum to {total}"
                 for account, cached, total in db.execute(
                     "SELECT a.account, a.balance, coalesce(sum(e.amount), 0) FROM"
                     " ledger_accounts a LEFT JOIN ledger_entries e ON e.account = a.account"
                     " GROUP BY a.account HAVING a.balance != coalesce(sum(e.amount), 0)"
                 ).fetchall()]
    problems += [f"{account} has no cached balance" for (account,) in db.execute(
        "SELECT DISTINCT account FROM ledger_entries WHERE account NOT IN"
        " (SELECT account FROM ledger_accounts)").fetchall()]
    problems += [f"{account} is below zero ({fmt(b)})" for account, b in db.execute(
        "SELECT account, balance FROM ledger_accounts WHERE balance < 0"
        " AND type IN ('fee', 'stake', 'disputed')").fetchall()]
    problems += [f"{account} is below zero ({fmt(b)}) though its job enforces funds"
                 for account, b in db.execute(
                     "SELECT a.account, a.balance FROM ledger_accounts a JOIN jobs j ON"
                     " a.account = 'escrow:' || j.id WHERE a.balance < 0 AND j.enforce_funds"
                 ).fetchall()]
    if totals(db)["deposits"] > 0:
        problems.append("deposits are above zero: more left than came in")
    return problems
