"""Who holds which blob: an uploader holds a blob once it has sent every byte of it
(hash-checked), and an upload in progress reserves its declared size against the uploader's
quota from its first header on. A blob's recorded size never changes once stored. Plain
SQL, no grpc."""

from __future__ import annotations

import json

from sqlite_utils import Database

from gpumarket.proto.errors import FailedPrecondition, ResourceExhausted
from gpumarket.proto.jobspec import check_artifact_name, check_sha256


def holds(db, key_id: str, sha256: str) -> bool:
    """Whether ``key_id`` has shown it holds the blob's bytes: it uploaded every byte, or
    the blob is part of one of its own jobs. (Reading a leased job's blob is not holding
    it: a provider that reports a blob as its work must have uploaded it.)"""
    return db.execute(
        "SELECT 1 FROM artifact_owners WHERE sha256 = :sha AND owner_id = :key"
        " UNION ALL SELECT 1 FROM artifact_refs r JOIN jobs j ON j.id = r.job_id"
        "  WHERE r.sha256 = :sha AND j.client_id = :key"
        " LIMIT 1", {"sha": sha256, "key": key_id}).fetchone() is not None


def holds_intact(db, key_id: str, sha256: str, size_bytes: int) -> bool:
    """Whether the blob is stored with that size and ``key_id`` holds it."""
    row = db.execute("SELECT size_bytes FROM artifacts WHERE sha256 = ?", [sha256]).fetchone()
    return row is not None and row[0] == size_bytes and holds(db, key_id, sha256)


def check_outputs(db, provider_id: str, outputs, where: str = "") -> None:
    """Raise unless every output a provider's receipt names (``pb.ArtifactRef``s) is a plain
    name and a blob that provider uploaded intact; ``where`` prefixes the field named. One
    query for all of them (an array's update names hundreds)."""
    for i, out in enumerate(outputs):
        check_artifact_name(out.name, f"{where}receipt.outputs[{i}].name")
        check_sha256(out.sha256, f"{where}receipt.outputs[{i}].sha256")
    held = held_sizes(db, provider_id, [out.sha256 for out in outputs])
    for out in outputs:
        if held.get(out.sha256) != out.size_bytes:
            raise FailedPrecondition(f"{where}output {out.name} was not uploaded intact by"
                                     " this provider")


def held_sizes(db, key_id: str, shas: list[str]) -> dict[str, int]:
    """The stored size of each of these blobs that ``key_id`` holds (``holds``), by sha256."""
    if not shas:
        return {}
    return dict(db.execute(
        "SELECT a.sha256, a.size_bytes FROM artifacts a WHERE a.sha256 IN"
        " (SELECT value FROM json_each(:shas)) AND (EXISTS (SELECT 1 FROM artifact_owners o"
        "  WHERE o.sha256 = a.sha256 AND o.owner_id = :key) OR EXISTS (SELECT 1 FROM"
        "  artifact_refs r JOIN jobs j ON j.id = r.job_id WHERE r.sha256 = a.sha256 AND"
        "  j.client_id = :key))",
        {"shas": json.dumps(sorted(set(shas))), "key": key_id}).fetchall())


def uploaded_bytes(db, key_id: str) -> int:
    """Bytes counted against the key's quota: the blobs it uploaded and the declared sizes
    of its uploads in progress."""
    return db.execute(
        "SELECT (SELECT coalesce(sum(size_bytes), 0) FROM artifact_owners WHERE owner_id = :k)"
        " + (SELECT coalesce(sum(size_bytes), 0) FROM artifact_uploads WHERE uploader_id = :k)",
        {"k": key_id}).fetchone()[0]


def upload_size(db, sha256: str, key_id: str) -> int | None:
    """The size an upload in progress was begun with, if there is one."""
    row = db.execute("SELECT size_bytes FROM artifact_uploads WHERE sha256 = ? AND"
                     " uploader_id = ?", [sha256, key_id]).fetchone()
    return row[0] if row else None


def record(db, sha256: str, size: int, owner: str, now: int) -> None:
    """``owner`` uploaded every byte of the blob (hash-checked): it holds it. A blob's
    recorded size never changes once stored."""
    db.execute("INSERT INTO artifacts (sha256, size_bytes, created_at_ms) VALUES (?, ?, ?)"
               " ON CONFLICT (sha256) DO UPDATE SET created_at_ms = excluded.created_at_ms",
               [sha256, size, now])
    db["artifact_owners"].upsert({"sha256": sha256, "owner_id": owner, "size_bytes": size,
                                  "created_at_ms": now}, pk=("sha256", "owner_id"))
    db.execute("DELETE FROM artifact_uploads WHERE sha256 = ? AND uploader_id = ?",
               [sha256, owner])


def record_many(db, blobs: list[tuple[str, int]], owner: str, limit: int, now: int) -> None:
    """``owner`` uploaded every byte of each blob (sha256, size), hash-checked, in one call:
    it holds them all, or none if those it did not hold already take it over ``limit``
    bytes (ResourceExhausted)."""
    shas = json.dumps(sorted({sha for sha, _ in blobs}))
    held = {r[0] for r in db.execute(
        "SELECT sha256 FROM artifact_owners WHERE owner_id = ? AND sha256 IN"
        " (SELECT value FROM json_each(?))", [owner, shas])}
    new = dict((sha, size) for sha, size in blobs if sha not in held)
    if new:
        check_quota(uploaded_bytes(db, owner), sum(new.values()), limit)
    rows = list(dict(blobs).items())
    db.conn.executemany(
        "INSERT INTO artifacts (sha256, size_bytes, created_at_ms) VALUES (?, ?, ?)"
        " ON CONFLICT (sha256) DO UPDATE SET created_at_ms = excluded.created_at_ms",
        [(sha, size, now) for sha, size in rows])
    db.conn.executemany(
        "INSERT INTO artifact_owners (sha256, owner_id, size_bytes, created_at_ms)"
        " VALUES (?, ?, ?, ?) ON CONFLICT (sha256, owner_id) DO UPDATE SET"
        " size_bytes = excluded.size_bytes, created_at_ms = excluded.created_at_ms",
        [(sha, owner, size, now) for sha, size in rows])


def stored_sizes(db, shas: list[str]) -> dict[str, int]:
    """The recorded size of each of these blobs that is stored."""
    return dict(db.execute("SELECT sha256, size_bytes FROM artifacts WHERE sha256 IN"
                           " (SELECT value FROM json_each(?))", [json.dumps(shas)]).fetchall())


def reserve(db, sha256: str, key: str, size: int, limit: int, now: int) -> None:
    """Begin (or continue) ``key``'s upload of a blob of ``size`` bytes: the size is fixed
    from the first header on and counts against the key's quota until the upload ends."""
    begun = upload_size(db, sha256, key)
    if begun is not None and begun != size:
        raise FailedPrecondition(f"the upload of {sha256[:12]}… was begun as {begun:,} bytes;"
                                 f" it cannot change to {size:,}")
    if begun is None:
        held = uploaded_bytes(db, key)
        check_quota(held, size, limit)
        db.execute("INSERT INTO artifact_uploads (sha256, uploader_id, size_bytes,"
                   " started_at_ms, updated_at_ms) VALUES (?, ?, ?, ?, ?)",
                   [sha256, key, size, now, now])
    else:
        db.execute("UPDATE artifact_uploads SET updated_at_ms = ? WHERE sha256 = ? AND"
                   " uploader_id = ?", [now, sha256, key])


def check_quota(held: int, size: int, limit: int) -> None:
    if held + size > limit:
        raise ResourceExhausted(
            f"this upload ({size:,} bytes) would take your artifacts to"
            f" {held + size:,} bytes, over this broker's limit of {limit:,} per key",
            reason="quota")


def expired_uploads(db, updated_before_ms: int) -> list[tuple[str, str]]:
    """Drop uploads that made no progress since the cutoff; return their (sha256, key)."""
    rows = db.execute("SELECT sha256, uploader_id FROM artifact_uploads WHERE"
                      " updated_at_ms < ?", [updated_before_ms]).fetchall()
    db.execute("DELETE FROM artifact_uploads WHERE updated_at_ms < ?", [updated_before_ms])
    return [(r[0], r[1]) for r in rows]


def unreferenced_artifacts(db: Database, created_before_ms: int) -> list[str]:
    """Blobs no job references any more (inputs, the latest checkpoint, outputs), older
    than the cutoff so that inputs uploaded for a job not yet submitted survive."""
    return [r[0] for r in db.execute(
        "SELECT sha256 FROM artifacts a WHERE created_at_ms < ? AND NOT EXISTS"
        " (SELECT 1 FROM artifact_refs r WHERE r.sha256 = a.sha256)", [created_before_ms]
    ).fetchall()]


def unrecorded(db, shas: list[str]) -> set[str]:
    """Those of these blobs that have no row: files nothing will ever read or collect."""
    return set(shas) - set(stored_sizes(db, shas))


def forget_artifacts(db: Database, shas: list[str]) -> None:
    for sha in shas:
        db.execute("DELETE FROM artifacts WHERE sha256 = ? AND NOT EXISTS"
                   " (SELECT 1 FROM artifact_refs r WHERE r.sha256 = ?)", [sha, sha])
        db.execute("DELETE FROM artifact_owners WHERE sha256 = ? AND NOT EXISTS"
                   " (SELECT 1 FROM artifacts a WHERE a.sha256 = ?)", [sha, sha])


def refer(db, sha256: str, job_id: str, role: str) -> None:
    """Keep the blob for the job (an input, checkpoint, output, history or evidence of it):
    garbage collection leaves a referenced blob alone."""
    refer_many(db, [sha256], job_id, role)


def refer_many(db, shas, job_id: str, role: str) -> None:
    """``refer`` each of these blobs, in one statement."""
    db.conn.executemany("INSERT INTO artifact_refs (sha256, job_id, role) VALUES (?, ?, ?)"
                        " ON CONFLICT DO NOTHING", [(sha, job_id, role) for sha in shas])


def stored_bytes(db: Database) -> int:
    """Bytes of all blobs the broker stores."""
    return db.execute("SELECT coalesce(sum(size_bytes), 0) FROM artifacts").fetchone()[0]
