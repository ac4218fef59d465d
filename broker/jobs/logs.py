"""Job logs: the lines a job writes to stdout and stderr, shipped by its provider, kept by the
broker for as long as the job, and streamed to its client (``gpumarket logs ID --follow``)."""

from __future__ import annotations

from sqlite_utils import Database

from gpumarket.broker.jobs.job import add_to_job
from gpumarket.broker.jobs.transitions import current
from gpumarket.proto.jobspec import LOG_LINE_CHARS, LOG_LINES_PER_UPDATE
from gpumarket.proto.v1 import types_pb2 as pb

MAX_LINES_PER_JOB = 50_000


def append(db: Database, job_id: str, epoch: int, provider_id: str, lines: list[str],
           now: int) -> int:
    """Keep the lines from the lease holder of the current epoch; return how many were kept.
    Past MAX_LINES_PER_JOB one last line says the log was cut."""
    job, _ = current(db, job_id, epoch, provider_id)
    room = MAX_LINES_PER_JOB - job.log_lines
    if room <= 0:
        return 0
    lines = [line[:LOG_LINE_CHARS] for line in lines[:LOG_LINES_PER_UPDATE]]
    if len(lines) >= room:
        lines = lines[:room - 1] + [f"[gpumarket: log cut at {MAX_LINES_PER_JOB} lines]"]
    db["job_logs"].insert_all(
        {"job_id": job_id, "attempt": job.attempt, "at_ms": now, "text": text}
        for text in lines)
    add_to_job(db, job_id, None, log_lines=len(lines))
    return len(lines)


def lines_after(db: Database, job_id: str, seq: int, limit: int = 1000) -> list[pb.LogLine]:
    """The job's lines after ``seq``; for a split job, its parts' lines, each marked with
    its part."""
    rows = db.execute(
        "SELECT l.seq, l.at_ms, l.attempt, l.text, j.part FROM job_logs l"
        " JOIN jobs j ON j.id = l.job_id"
        " WHERE l.job_id IN (SELECT ? UNION ALL SELECT id FROM jobs WHERE parent_id = ?)"
        " AND l.seq > ? ORDER BY l.seq LIMIT ?", [job_id, job_id, seq, limit]).fetchall()
    return [pb.LogLine(seq=r[0], at_ms=r[1], attempt=r[2],
                       text=f"[part {r[4]}] {r[3]}" if r[4] else r[3]) for r in rows]
