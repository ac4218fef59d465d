"""The ledger: double-entry bookkeeping of every credit that moves on this broker.

Amounts are integers in units: 1 credit = 1,000,000 units (``UNIT``), never floats. A posting
is one event (a credit, a hold, a settlement, ...) whose entries sum to zero; postings and
entries are append-only (SQLite triggers refuse UPDATE and DELETE) and each carries an
idempotency key, so the same event can never post twice. Each entry carries its account's
running balance (``ledger_entries`` is clustered by account, so a balance is one index seek);
``audit`` checks every running balance against the sum of the entries before it.

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

from gpumarket.broker.jobs.job import Job, update_job
from gpumarket.broker.money.rows import Line, Posting
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
    """The account's balance: the running balance of its latest entry (the sum of its
    entries, as the audit checks)."""
    row = _latest(db, account)
    return row[0] if row else 0


# An account's balance (its one parameter: the account), as a statement of its own or a
# caller's subquery (``hold``'s ``read``).
BALANCE = ("SELECT balance FROM ledger_entries WHERE account = ?"
           " ORDER BY posting_seq DESC LIMIT 1")


def _latest(db: Database, account: str) -> tuple[int] | None:
    return db.conn.execute(BALANCE, [account]).fetchone()


LATEST = ("SELECT a.account, a.type, a.owner, e.balance FROM ledger_accounts a"
          " JOIN ledger_entries e ON e.account = a.account AND e.posting_seq ="
          " (SELECT max(posting_seq) FROM ledger_entries WHERE account = a.account)")


def _prefix(account_prefix: str) -> tuple[str, str]:
    """Bounds of the accounts that start with ``account_prefix``, for a range scan."""
    return account_prefix, account_prefix[:-1] + chr(ord(account_prefix[-1]) + 1)


def posted(db: Database, key: str) -> int | None:
    """The sequence number of the posting with this idempotency key, if it was posted."""
    row = db.execute("SELECT seq FROM ledger_postings WHERE key = ?", [key]).fetchone()
    return row[0] if row else None


def post(db: Database, key: str, type_: str, lines: dict[str, int], now: int, *,
         owners: dict[str, str] | None = None, may_go_negative: frozenset[str] = frozenset(),
         job_id: str = "", lease_id: str = "", provider_id: str = "", step_from: int = 0,
         step_to: int = 0, seconds: float = 0.0, memo: str = "", actor: str = "",
         known: dict[str, int | None] | None = None, new_key: bool = False) -> int | None:
    """Post one balanced event; return its sequence number, or None if a posting with ``key``
    exists already (the event was posted before: nothing moves twice) or nothing moves.

    ``owners``: the owner recorded for accounts whose name does not say it (an escrow's
    client, a disputed account's provider). Raises FailedPrecondition if an account would go
    below zero that may not.

    ``known``: balances the caller read in this transaction, nothing of those accounts
    written since (one read fewer each); None for an account it found without an entry yet
    (recorded in ``ledger_accounts`` as any such account). ``new_key``: the caller knows no
    posting has ``key`` (a new job's hold: its job row did not exist in this transaction,
    and rows of ``jobs`` are never deleted): the posting's sequence number is not read back
    — its entries take it by key in their own statement, so that on PostgreSQL the posting
    costs no round trip — and None is returned; a posting with ``key`` after all fails the
    write (the key is unique), it is never added to.
    """
    lines = {a: v for a, v in lines.items() if v != 0}
    if any(not isinstance(v, int) or isinstance(v, bool) for v in lines.values()):
        raise TypeError("ledger amounts are integers (units)")
    if sum(lines.values()) != 0:
        raise ValueError(f"posting {key} does not balance: {lines}")
    if not lines:
        return None
    latest = {a: (None if known[a] is None else (known[a],)) if known and a in known
              else _latest(db, a) for a in lines}
    after = {a: (latest[a][0] if latest[a] else 0) + v for a, v in lines.items()}
    for account, amount in lines.items():   # only what an entry takes out can overdraw
        if after[account] < 0 and amount < 0 and account not in may_go_negative \
                and account_type(account)[0] not in NEGATIVE_BY_NATURE:
            raise FailedPrecondition(f"{account} would go below zero"
                                     f" ({fmt(after[account])} credits) by {type_} {key}")
    cur = db.conn.execute(
        "INSERT INTO ledger_postings (key, at_ms, type, entries, job_id, lease_id, provider_id,"
        " step_from, step_to, seconds, memo, actor) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        + ("" if new_key else " ON CONFLICT(key) DO NOTHING RETURNING seq"),
        [key, now, type_, json.dumps(lines, sort_keys=True), job_id, lease_id, provider_id,
         step_from, step_to, seconds, memo[:500], actor])
    if new_key:
        seq, value = None, "(?, (SELECT seq FROM ledger_postings WHERE key = ?), ?, ?)"
        values = [x for a, v in lines.items() for x in (a, key, v, after[a])]
    else:
        row = cur.fetchone()
        if row is None:
            return None          # posted before: the idempotency key holds
        seq, value = row[0], "(?, ?, ?, ?)"
        values = [x for a, v in lines.items() for x in (a, seq, v, after[a])]
    db.conn.execute(f"INSERT INTO ledger_entries (account, posting_seq, amount, balance) VALUES"
                    f" {', '.join([value] * len(lines))}", values)
    new = [a for a in lines if latest[a] is None]   # accounts without entries yet
    if new:
        named = {a: account_type(a) for a in new}
        db.conn.execute(
            f"INSERT INTO ledger_accounts (account, type, owner) VALUES"
            f" {', '.join(['(?, ?, ?)'] * len(new))} ON CONFLICT DO NOTHING",
            [x for a in new for x in (a, named[a][0], (owners or {}).get(a, named[a][1]))])
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
         now: int, read: tuple[int | None] | None = None) -> None:
    """Move a new job's hold from its client's available balance into the job's escrow;
    raise InsufficientFunds, naming the amount short, if the client cannot cover it (a broker
    that does not enforce funds lets the balance go below zero: it records usage).

    ``read``: (the client's balance, None where its account has no entry yet) as read in
    this transaction with ``BALANCE`` in a statement of the caller's, nothing of that
    account written since, by a caller that found in the same transaction that the job did
    not exist (jobs/transitions.submit, with its replay checks): its escrow then has no entry
    and no posting has its hold's key, so the hold reads nothing and waits for no answer
    (``post``'s ``known`` and ``new_key``: on PostgreSQL two round trips a submission fewer).
    None: the balance is read here, and the posting checks its key."""
    account = client(client_id)
    if read is None:
        latest = _latest(db, account)
    else:
        latest = None if read[0] is None else (read[0],)
    new = read is not None      # the caller found the job new (see above)
    available = latest[0] if latest else 0
    if enforce and available < amount:
        raise InsufficientFunds(
            f"insufficient funds: this job holds {fmt(amount)} credits ({basis}); your"
            f" available balance is {fmt(available)}, {fmt(amount - available)} short"
            " (ask the broker's operator for credit, or set a smaller budget in the job file)")
    # The balance just read is the one the posting runs from (one read a submission fewer:
    # a round trip on PostgreSQL); an account with no entry yet is known as None, so that
    # ``post`` records it.
    known: dict[str, int | None] = {account: latest[0] if latest else None}
    if new:
        known[escrow(job_id)] = None
    post(db, f"hold:{job_id}", "hold", {account: -amount, escrow(job_id): amount},
         now, owners={escrow(job_id): client_id}, job_id=job_id, memo=basis,
         may_go_negative=frozenset() if enforce else frozenset({account}),
         known=known, new_key=new)


def top_up(db: Database, job_id: str, client_id: str, amount: int, enforce: bool,
           now: int, nonce: str = "") -> None:
    if amount <= 0:
        raise InvalidArgument("amount: must be more than 0")
    available = balance(db, client(client_id))
    if enforce and available < amount:
        raise InsufficientFunds(f"insufficient funds: the top-up is {fmt(amount)} credits; your"
                                f" available balance is {fmt(available)},"
                                f" {fmt(amount - available)} short")
    if nonce:       # the client's: a retried call moves nothing twice
        key = f"topup:{job_id}:{nonce}"
    else:
        n = db.execute("SELECT count(*) FROM ledger_postings WHERE job_id = ? AND"
                       " type = 'topup'", [job_id]).fetchone()[0]
        key = f"topup:{job_id}:{n + 1}"
    post(db, key, "topup",
         {client(client_id): -amount, escrow(job_id): amount}, now,
         owners={escrow(job_id): client_id}, job_id=job_id, memo="top-up by the client",
         may_go_negative=frozenset() if enforce else frozenset({client(client_id)}))


@dataclass(frozen=True)
class Settlement:
    amount: int          # what the segment cost at the lease's price
    paid: int            # what the escrow paid (amount, or what was left of the hold)
    remaining: int       # the hold left after it


def settle(db: Database, job: Job, lease: dict, step_to: int, now: int, *,
           tag: str = "") -> Settlement:
    """Pay a lease's work since its last settlement (or its start) up to progress ``step_to``
    (the cursor is on the job's row: ``settled_to_ms``, ``settled_step``):
    the lease's price x its devices x the time, from the job's escrow to the provider, less
    the market's fee. Idempotent per (lease, ``tag`` or step: "final" at the receipt, "end"
    when the lease is stopped); a broker that enforces funds never pays more than the hold has
    left. Nothing is paid for time before the provider reported the job started."""
    top = job.pays_from or job.top_id
    started, step_from = job.settled_to_ms, job.settled_step
    amount = accrued(job, lease, now)
    # The time this amount pays for exactly: what is left of a unit carries to the next one.
    rate = units(lease["price_per_gpu_hour"]) * len(json.loads(lease["device_indices"]))
    elapsed = 0 if started is None else (
        max(0, now - started) if rate <= 0 else amount * MS_PER_HOUR // rate)
    left = balance(db, escrow(top))
    paid = min(amount, max(left, 0)) if job.enforce_funds else amount
    fee = paid * job.fee_ppm // PPM
    pid = lease["provider_id"]
    if paid == 0:    # nothing moves (not started, or under a unit): the next settlement covers it
        return Settlement(amount, 0, left)
    post(db, f"settle:{lease['id']}:{tag or step_to}", "settle",
         {escrow(top): -paid, provider(pid): paid - fee, "fee": fee}, now,
         owners={escrow(top): job.client_id},
         may_go_negative=frozenset({escrow(top)}),   # checked above: paid <= what is left
         known={escrow(top): left} if left else None,
         job_id=job.id, lease_id=lease["id"], provider_id=pid, step_from=step_from,
         step_to=max(step_to, step_from), seconds=elapsed / 1000,
         memo="" if paid == amount else f"hold exhausted: {fmt(amount - paid)} not covered")
    update_job(db, job.id, None, settled_to_ms=started + elapsed,
               settled_step=max(step_to, step_from))
    return Settlement(amount, paid, left - paid)


def accrued(job: Job, lease: dict, now: int) -> int:
    """What the job's running lease has cost since its last settlement (or its start), in
    units."""
    return cost_since(lease, job.settled_to_ms, now)


def cost_since(lease: dict, since_ms: int | None, now: int) -> int:
    """What ``lease`` (its price and devices) costs from ``since_ms`` to ``now``, in units
    (0 from None: not started)."""
    if since_ms is None:
        return 0
    devices = len(json.loads(lease["device_indices"]))
    return units(lease["price_per_gpu_hour"]) * devices * max(0, now - since_ms) // MS_PER_HOUR


def release(db: Database, job_id: str, client_id: str, now: int) -> None:
    """A job ended: what its hold has left goes back to its client's available balance (on a
    broker that does not enforce funds, an overdrawn hold takes the rest from it)."""
    left = balance(db, escrow(job_id))
    post(db, f"release:{job_id}", "release", {escrow(job_id): -left, client(client_id): left},
         now, job_id=job_id, memo="job ended: unspent hold returned",
         may_go_negative=frozenset({escrow(job_id), client(client_id)}))


# -- verification's hooks (docs/ledger.md) -------------------------------------------------

def _settlement(db: Database, seq: int) -> Posting:
    """The settlement posted as ``seq``; raises InvalidArgument if there is none."""
    cur = db.execute("SELECT * FROM ledger_postings WHERE seq = ? AND type = 'settle'", [seq])
    row = cur.fetchone()
    if row is None:
        raise InvalidArgument(f"no settlement {seq}")
    return Posting.from_row(dict(zip([d[0] for d in cur.description], row)))


def _payer(db: Database, job_id: str) -> tuple[str, str, bool]:
    """(the job whose hold pays for ``job_id``'s leases, its client, whether it has ended)."""
    return db.execute(
        "SELECT t.id, t.client_id, t.state IN (4, 5, 6) FROM jobs j JOIN jobs t"
        " ON t.id = coalesce(j.pays_from, j.parent_id, j.id) WHERE j.id = ?",
        [job_id]).fetchone()


def settled_to(db: Database, seq: int) -> int:
    """What a settlement paid its provider (after the fee), in units."""
    posting = _settlement(db, seq)
    return posting.amount(provider(posting.provider_id))


def dispute(db: Database, seq: int, now: int) -> None:
    """Hold a settlement's pay (provider's and fee) while a check of its segment runs."""
    posting = _settlement(db, seq)
    earner = provider(posting.provider_id)
    paid, fee = posting.amount(earner), posting.amount("fee")
    held = disputed(posting.job_id, posting.provider_id)
    post(db, f"dispute:{seq}", "dispute", {earner: -paid, "fee": -fee, held: paid + fee},
         now, owners={held: posting.provider_id}, **_about(posting),
         memo=f"settlement {seq} disputed", may_go_negative=frozenset({earner}))


def _about(posting: Posting) -> dict:
    """What a posting that undoes or moves on a settlement says it is about: the
    settlement's job, lease, provider and steps."""
    return {"job_id": posting.job_id, "lease_id": posting.lease_id,
            "provider_id": posting.provider_id, "step_from": posting.step_from,
            "step_to": posting.step_to}


def resolve(db: Database, seq: int, passed: bool, now: int, why: str = "") -> None:
    """A check ended: a passed one pays the held settlement on; a failed one returns it to the
    job's hold (the client does not pay for the segment; its re-run is paid from there), as
    does one left unresolved (``why`` says so in the memo)."""
    if posted(db, f"dispute:{seq}") is None:
        raise FailedPrecondition(f"settlement {seq} is not disputed")
    posting = _settlement(db, seq)
    paid, fee = posting.amount(provider(posting.provider_id)), posting.amount("fee")
    held = disputed(posting.job_id, posting.provider_id)
    top, client_id, ended = _payer(db, posting.job_id)
    # Back into the job's hold (its re-run is paid from there); if the job has ended, on to
    # its client, as its release would have.
    lines = ({held: -(paid + fee), provider(posting.provider_id): paid, "fee": fee} if passed
             else {held: -(paid + fee), escrow(top): paid + fee})
    post(db, f"resolve:{seq}", "restore" if passed else "reverse", lines, now,
         **_about(posting),
         memo=f"check of settlement {seq} "
              f"{why or ('passed' if passed else 'failed: pay returned')}")
    if not passed and ended:
        post(db, f"refund:{seq}", "release", {escrow(top): -(paid + fee),
                                              client(client_id): paid + fee}, now,
             job_id=top, memo=f"settlement {seq} reversed after the job ended")


def claw_back(db: Database, seq: int, now: int) -> None:
    """Take back a settlement a check had let be paid (its provider was found wrong on the
    job later): into the job's hold, or to its client if the job has ended. The provider's
    earned balance may go below zero."""
    if posted(db, f"resolve:{seq}") is None or posted(db, f"clawback:{seq}") is not None:
        return
    reversed_ = db.execute("SELECT type FROM ledger_postings WHERE key = ?",
                           [f"resolve:{seq}"]).fetchone()[0] == "reverse"
    if reversed_:
        return
    posting = _settlement(db, seq)
    earner = provider(posting.provider_id)
    paid, fee = posting.amount(earner), posting.amount("fee")
    top, client_id, ended = _payer(db, posting.job_id)
    to = client(client_id) if ended else escrow(top)
    post(db, f"clawback:{seq}", "reverse", {earner: -paid, "fee": -fee, to: paid + fee}, now,
         **_about(posting),
         memo=f"settlement {seq} taken back: its provider was found wrong on the job",
         may_go_negative=frozenset({earner}))


def slash(db: Database, provider_id: str, client_id: str, job_id: str, amount: int,
          now: int) -> int:
    """A provider caught returning wrong results loses up to ``amount`` of its stake to the
    client; returns what moved."""
    taken = min(amount, max(0, balance(db, stake(provider_id))))
    post(db, f"slash:{job_id}:{provider_id}", "slash",
         {stake(provider_id): -taken, client(client_id): taken}, now, job_id=job_id,
         provider_id=provider_id, memo="stake lost for a wrong result")
    return taken


def check_cost(db: Database, check_id: str, top: str) -> int:
    """What job ``top``'s hold paid for the replays of check ``check_id`` (its job row's
    settlements), less those reversed or taken back since, in units."""
    cost = 0
    for seq, entries in db.execute("SELECT seq, entries FROM ledger_postings WHERE type ="
                                   " 'settle' AND job_id = ?", [check_id]).fetchall():
        undone = db.execute("SELECT 1 FROM ledger_postings WHERE (key = ? AND type = 'reverse')"
                            " OR key = ?", [f"resolve:{seq}", f"clawback:{seq}"]).fetchone()
        if undone is None:
            cost -= json.loads(entries).get(escrow(top), 0)
    return cost


def charge_check(db: Database, check_id: str, provider_id: str, top: str, client_id: str,
                 now: int) -> int:
    """A warm-up check of ``provider_id``'s work (docs/verification.md): what job ``top``'s
    hold paid for its replays goes back into the hold from the provider's earnings, as far as
    they go (never below zero: no checker is paid with money nobody put in). Once per check;
    returns what moved."""
    taken = min(check_cost(db, check_id, top), max(0, balance(db, provider(provider_id))))
    if taken <= 0:
        return 0
    post(db, f"warmup:{check_id}", "warmup", {provider(provider_id): -taken, escrow(top): taken},
         now, owners={escrow(top): client_id}, job_id=top, provider_id=provider_id,
         memo=f"warm-up check {check_id} of this provider's work: paid by the provider")
    return taken


# -- reading --------------------------------------------------------------------------------

def job_money(db: Database, job_id: str) -> dict[str, int]:
    """A (top-level) job's hold, charges and what is left, in units."""
    rows = dict(db.execute(
        "SELECT p.type, sum(e.amount) FROM ledger_entries e JOIN ledger_postings p"
        " ON p.seq = e.posting_seq WHERE e.account = ? GROUP BY p.type",
        [escrow(job_id)]).fetchall())
    held = sum(balance(db, a) for sep in (":", "-") for (a,) in db.conn.execute(
        "SELECT account FROM ledger_accounts WHERE account >= ? AND account < ?",
        _prefix(f"disputed:{job_id}{sep}")))
    return {"hold": rows.get("hold", 0) + rows.get("topup", 0),
            "charged": -sum(rows.get(t, 0) for t in ("settle", "reverse", "warmup")),
            "remaining": balance(db, escrow(job_id)), "disputed": held}


def _like(text: str) -> str:
    """``text`` as a literal in a LIKE pattern (ESCAPE '\\')."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


ACCOUNT_LABELS = {"client": "available", "escrow": "held", "provider": "earned",
                  "stake": "stake", "disputed": "disputed"}


def lines(db: Database, key_id: str, job_id: str = "", limit: int = 100,
          before_seq: int = 0) -> list[Line]:
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
        f"SELECT {Line.COLUMNS} FROM ledger_entries e"
        " JOIN ledger_postings p ON p.seq = e.posting_seq"
        " JOIN ledger_accounts a ON a.account = e.account"
        f" WHERE {' AND '.join(where)} ORDER BY p.seq DESC, a.type LIMIT ?", [*args, limit])
    return [Line.from_row(r, ACCOUNT_LABELS) for r in cur.fetchall()]


def summary(db: Database, key_id: str) -> dict[str, int]:
    """What ``key_id`` has on this broker, in units."""
    spent = -db.execute(
        "SELECT coalesce(sum(e.amount), 0) FROM ledger_accounts a"
        " JOIN ledger_entries e ON e.account = a.account"
        " JOIN ledger_postings p ON p.seq = e.posting_seq"
        " WHERE a.type = 'escrow' AND p.type IN ('settle', 'reverse', 'warmup')"
        " AND a.owner = ?",
        [key_id]).fetchone()[0]
    held = db.execute(f"SELECT coalesce(sum(balance), 0) FROM ({LATEST} WHERE a.owner = ?"
                      " AND a.type = 'escrow') AS latest", [key_id]).fetchone()[0]
    credited = db.execute(
        "SELECT coalesce(sum(e.amount), 0) FROM ledger_entries e JOIN ledger_postings p"
        " ON p.seq = e.posting_seq WHERE e.account = ? AND p.type = 'credit'",
        [client(key_id)]).fetchone()[0]
    return {"available": balance(db, client(key_id)), "held": held, "credited": credited,
            "spent": spent, "earned": balance(db, provider(key_id)),
            "stake": balance(db, stake(key_id))}


def health(db: Database) -> tuple[dict[str, int], int, bool]:
    """(totals by account type, postings, whether they balance): the cheap check a metrics
    scrape makes (the whole check is ``audit``)."""
    sums = totals(db)
    postings = db.execute("SELECT count(*) FROM ledger_postings").fetchone()[0]
    entries = db.execute("SELECT coalesce(sum(amount), 0) FROM ledger_entries").fetchone()[0]
    return sums, postings, sum(sums.values()) == 0 == entries


def audit_report(db: Database) -> tuple[list[str], int, dict[str, int]]:
    """(the audit's problems, postings, totals): what `admin audit` answers."""
    return audit(db), health(db)[1], totals(db)


def recent_page(db: Database, limit: int) -> dict:
    """The operator's view of the ledger, in credits: totals, the audit, the latest
    ``limit`` postings whole."""
    cur = db.execute("SELECT * FROM ledger_postings ORDER BY seq DESC LIMIT ?", [limit])
    cols = [d[0] for d in cur.description]
    postings = []
    for row in cur.fetchall():
        p = Posting.from_row(dict(zip(cols, row)))
        postings.append({"seq": p.seq, "at_ms": p.at_ms, "type": p.type, "job_id": p.job_id,
                         "provider_id": p.provider_id, "step_from": p.step_from,
                         "step_to": p.step_to, "seconds": p.seconds, "memo": p.memo,
                         "actor": p.actor,
                         "entries": {a: v / UNIT for a, v in p.entries.items()}})
    return {"totals": {k: v / UNIT for k, v in totals(db).items()},
            "problems": audit(db), "postings": postings}


def totals(db: Database) -> dict[str, int]:
    """Sum of balances per account type."""
    found = dict(db.execute(f"SELECT type, sum(balance) FROM ({LATEST}) AS latest GROUP BY type"
                            ).fetchall())
    return {t: found.get(t, 0) for t in TYPES}


def audit(db: Database) -> list[str]:
    """What is wrong with the ledger (nothing, if empty): a posting that does not sum to zero
    or whose entries differ from its record, an entry on an unregistered account, an account
    below zero that may not be."""
    problems = [f"posting {seq} sums to {total}, not 0" for seq, total in db.execute(
        "SELECT posting_seq, sum(amount) FROM ledger_entries GROUP BY posting_seq"
        " HAVING sum(amount) != 0").fetchall()]
    entries: dict[int, dict[str, int]] = {}
    running, last = 0, None
    for account, seq, amount, after in db.execute(
            "SELECT account, posting_seq, amount, balance FROM ledger_entries"
            " ORDER BY account, posting_seq"):
        entries.setdefault(seq, {})[account] = amount
        running = (running if account == last else 0) + amount
        last = account
        if after != running:
            problems.append(f"{account}: running balance {after} at posting {seq}, but its"
                            f" entries sum to {running}")
            running = after
    problems += [f"posting {seq}: its entries differ from its record"
                 for seq, recorded in db.execute("SELECT seq, entries FROM ledger_postings")
                 if json.loads(recorded) != entries.pop(seq, {})]
    problems += [f"entries of posting {seq} without a posting" for seq in entries]
    problems += [f"{account} is not a registered account" for (account,) in db.execute(
        "SELECT DISTINCT account FROM ledger_entries WHERE account NOT IN"
        " (SELECT account FROM ledger_accounts)").fetchall()]
    balances = db.execute(f"SELECT account, type, balance FROM ({LATEST}) AS latest"
                          " WHERE balance < 0"
                          ).fetchall()
    enforced = {r[0] for r in db.execute("SELECT id FROM jobs WHERE enforce_funds != 0")}
    for account, kind, b in balances:
        if kind in ("fee", "stake", "disputed"):
            problems.append(f"{account} is below zero ({fmt(b)})")
        elif kind == "escrow" and account_type(account)[1] in enforced:
            problems.append(f"{account} is below zero ({fmt(b)}) though its job enforces funds")
    if totals(db)["deposits"] > 0:
        problems.append("deposits are above zero: more left than came in")
    return problems
