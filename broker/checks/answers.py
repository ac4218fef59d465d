"""Checks of an endpoint's answers (docs/verification.md, Endpoint answers): a replica's pay
is settled once a window (the autoscaler's settle pass); a window whose answers were sampled
(broker/serving/answer_samples.py) has that settlement held and a check queued, a job row of
the endpoint kind that another provider runs: it prefills the sampled requests plus the
replica's token ids (``claimed``) and returns the fingerprints it saw (an embed endpoint's:
it embeds the sampled requests' inputs again); the broker compares them with the replica's
(``expect``, evidence no provider reads). The verdict goes the way of
every check (broker/checks/disputes.py): passed, the window's pay is paid on; the replica
found wrong (two of three) loses its pay on the replica and stake, its replica is leased
again elsewhere (replaced), and its second failure bans it. No grpc here; every function runs
inside one write transaction."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from sqlite_utils import Database

from gpumarket.broker.checks import verification
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.money import ledger
from gpumarket.broker.store import blob_holdings
from gpumarket.kinds.endpoint import ANSWERS, settings_of

OWNER = "broker"        # whose the sample blobs are (the broker wrote them)
UNCHECKED_NOTE_MS = 3_600_000   # how often an endpoint's events say a replica went unchecked


@dataclass(frozen=True)
class Blob:
    sha256: str
    data: bytes

    @property
    def ref(self) -> dict:
        return {"name": ANSWERS, "sha256": self.sha256, "size_bytes": len(self.data)}


@dataclass(frozen=True)
class WindowBlobs:
    """A window's sampled answers as the two files a check uses: ``expect`` (the replica's
    token ids and fingerprints: evidence) and ``claimed`` (each request and its token ids:
    what the checker prefills; never the fingerprints)."""

    lease_id: str
    answers: int            # answers the replica gave in the window
    expect: Blob
    claimed: Blob
    warmup: bool = False    # kept only because its provider is new (none drawn at the rate)


def _blob(lines: list[dict]) -> Blob:
    data = b"".join(json.dumps(x, separators=(",", ":")).encode() + b"\n" for x in lines)
    return Blob(hashlib.sha256(data).hexdigest(), data)


def window_blobs(lease_id: str, answers: int, samples: list[dict], drawn: int = 0
                 ) -> WindowBlobs:
    """The files of a window's ``samples`` (answer_samples.Window.samples, ``drawn`` of them
    at the rate)."""
    expect, claimed = [], []
    for i, s in enumerate(samples):
        request = s["request"]
        if "embeddings" in s:
            # an embed endpoint's answer: the checker embeds the request's inputs again and
            # never sees the replica's vectors (they stay the broker's evidence)
            expect.append({"index": i, "embeddings": s["embeddings"]})
            claimed.append({"index": i, "request": request})
            continue
        greedy = isinstance(request, dict) and isinstance(request.get("temperature"),
                                                          (int, float)) \
            and request["temperature"] <= 0
        expect.append({"index": i, "token_ids": s["token_ids"],
                       "fingerprints": s["fingerprints"], "greedy": greedy,
                       **({"tokens_only": True} if s.get("tokens_only") else {})})
        claimed.append({"index": i, "request": request, "token_ids": s["token_ids"] or []})
    return WindowBlobs(lease_id, answers, _blob(expect), _blob(claimed), warmup=not drawn)


def check_window(db: Database, policy: verification.Policy, job: dict, lease: dict,
                 seq: int | None, window: WindowBlobs, now: int) -> str | None:
    """A replica lease's window ended with sampled answers and its pay settled (``seq``,
    None if nothing was paid): hold that pay and queue a check of the answers. Returns the
    check's id, or None (checks off, or no other provider online to run one: the window is
    paid unchecked, and the endpoint's events say so)."""
    if not policy.enabled:
        return None
    top = jobs.job_row(db, job["parent_id"])
    n = window.expect.data.count(b"\n")
    if not policy.can_check(lease["accelerator"]):
        said = f"sampled answers of replica {job['id']} left unchecked"
        # once an hour a replica, not once a window: a market of one provider would write
        # an event a minute for each of its replicas
        if not db.execute("SELECT 1 FROM events WHERE job_id = ? AND type = 'check' AND"
                          " at_ms > ? AND message LIKE ?",
                          [top["id"], now - UNCHECKED_NOTE_MS, f"%{said}%"]).fetchone():
            verification.note(db, top, f"{n} {said} ({lease['provider_id']}'s): no other"
                              " provider of its device class online to replay them", now)
        return None
    for blob in (window.expect, window.claimed):
        blob_holdings.record(db, blob.sha256, len(blob.data), OWNER, now)
    if seq is not None and ledger.posted(db, f"dispute:{seq}") is None:
        ledger.dispute(db, seq, now)
    settings = settings_of(top["spec"])
    scope = {"answers": n, "of_answers": window.answers, "batch_size": 8,
             "dtype": settings.get("dtype", ""), "claimed": window.claimed.ref,
             **({"task": "embed"} if settings.get("task") == "embed" else {})}
    # A window checked only because its provider is new is its warm-up: the provider pays
    # for it when the endpoint ends, as for a job (disputes.charge_warmups); one the rate
    # drew is the client's.
    return verification.queue(db, job, lease["provider_id"], lease["id"], seq, 0, 0, None,
                              {ANSWERS: window.expect.ref}, scope, "check", None, now,
                              lease["provider_id"] if window.warmup else None)


def forget_evidence(db: Database, c: dict) -> None:
    """An answer check ``c`` (a checks row) ended: what it compared is no longer the
    endpoint's evidence (an endpoint lives long, and a window is checked every minute; a
    job's evidence stays until the job ends). A blob another open check of the endpoint
    still compares stays."""
    first = verification.check_row(db, c["first_check"]) if c["first_check"] else None
    shas = {ref["sha256"] for row in (c, first) if row for field in ("expect", "outputs")
            for ref in json.loads(row[field] or "{}").values()}
    for sha in shas:
        if db.execute(f"SELECT 1 FROM checks WHERE top_id = ? AND id != ? AND state IN"
                      f" ({', '.join('?' * len(verification.OPEN))}) AND (expect LIKE ? OR"
                      f" outputs LIKE ?)", [c["top_id"], c["id"], *verification.OPEN,
                                            f"%{sha}%", f"%{sha}%"]).fetchone():
            continue
        db.execute("DELETE FROM artifact_refs WHERE job_id = ? AND sha256 = ? AND role ="
                   " 'evidence'", [c["top_id"], sha])
