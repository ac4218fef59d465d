"""bench/tiers.py's figures: the issue's targets and the counts beside them, read from the
broker's store and ledger once the week is over, and ``colocated_ttft_p99_ratio`` from its
real-process run (bench/colocated.py)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from gpumarket.broker.money import ledger
from gpumarket.broker.serving import endpoints
from gpumarket.proto.v1 import types_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent


class Figures:
    """The figures of a finished run (a mixin of tiers.Sim: its jobs, providers, spikes and
    the work its leases lost)."""

    async def figures(self) -> dict:
        for run in getattr(self, "gone", []):
            self.note_lost(run, self.lost_churn)
        return await self.state.store.read(self._figures)

    def _figures(self, db) -> dict:
        price = {p.id: p.price for p in self.providers}
        # Interruptible jobs' money, from the ledger's settle postings: what they paid, and
        # what the same device-time would have cost at their providers' standard prices.
        inter = {j.id for j in self.jobs.values() if j.tier == "interruptible"}
        paid = on_demand = 0.0
        for job_id, provider_id, lease_id, seconds, entries in db.execute(
                "SELECT job_id, provider_id, lease_id, seconds, entries FROM ledger_postings"
                " WHERE type = 'settle'"):
            if job_id not in inter:
                continue
            charged = -json.loads(entries)[ledger.escrow(job_id)]
            devices = len(json.loads(db.execute("SELECT device_indices FROM leases WHERE id = ?",
                                                [lease_id]).fetchone()[0]))
            paid += charged
            on_demand += ledger.units(price[provider_id]) * devices * seconds / 3600
        # Each job's settled segments chain from 0 to its end, each step paid once.
        chained = double_paid = 0
        for job_id in inter:
            steps = [(r[0], r[1]) for r in db.execute(
                "SELECT step_from, step_to FROM ledger_postings WHERE type = 'settle'"
                " AND job_id = ? ORDER BY seq", [job_id])]
            covered = 0
            for a, b in steps:
                if a < covered and b > a:
                    double_paid += 1
                covered = max(covered, b)
            chained += covered == self.jobs[job_id].steps
        rows = {r[0]: r for r in db.execute(
            "SELECT id, state, updated_at_ms, created_at_ms FROM jobs WHERE kind = ?",
            [pb.JOB_KIND_TRAINING])}
        ended = {r[0]: r[1] for r in db.execute(
            "SELECT job_id, max(at_ms) FROM events WHERE type = 'succeeded' GROUP BY job_id")}
        with_deadline = [j for j in self.jobs.values() if j.deadline_s]
        met = [j for j in with_deadline if j.id in ended
               and ended[j.id] <= j.created_ms + j.deadline_s * 1000]
        succeeded = sum(1 for r in rows.values() if r[1] == pb.JOB_STATE_SUCCEEDED)
        for j in [j for j in with_deadline if j not in met][:3]:     # what happened to them
            print(f"missed its deadline: {j.id}, {j.gpus} GPUs, deadline {j.deadline_s} s,"
                  f" {j.steps} steps", file=sys.stderr)
            for at, type_, message in db.execute(
                    "SELECT at_ms, type, message FROM events WHERE job_id = ? AND type NOT IN"
                    " ('progress', 'checkpoint') ORDER BY seq", [j.id]):
                print(f"  +{(at - j.created_ms) / 1000:8.0f} s {type_}: {message[:150]}",
                      file=sys.stderr)
        # Replica waits: each time a replica is queued (added, or requeued after a lost
        # lease) until its next lease, from the job events.
        waits, spike_waits, long_waits = [], [], []
        queued_at: dict[str, int] = {}
        for job_id, at, type_ in db.execute(
                "SELECT e.job_id, e.at_ms, e.type FROM events e JOIN jobs j ON j.id = e.job_id"
                " WHERE j.kind = ? AND j.parent_id IS NOT NULL ORDER BY e.seq",
                [endpoints.KIND]):
            if type_ in ("submitted", "requeued"):
                queued_at[job_id] = at
            elif type_ == "leased" and job_id in queued_at:
                since = queued_at.pop(job_id)
                wait = (at - since) / 1000
                waits.append(wait)
                if any(a <= since <= b for a, b in self.spikes):
                    spike_waits.append(wait)
                    if wait > self.args.cold_start + 5:
                        long_waits.append((wait, job_id, since, at))
        for wait, job_id, since, at in sorted(long_waits, reverse=True)[:3]:
            print(f"replica {job_id} waited {wait:.0f} s; meanwhile:", file=sys.stderr)
            for j, when, type_, message in db.execute(
                    "SELECT job_id, at_ms, type, message FROM events WHERE at_ms BETWEEN ? AND ?"
                    " AND (job_id = ? OR type IN ('preempting', 'requeued', 'leased'))"
                    " ORDER BY seq LIMIT 12", [since, at, job_id]):
                print(f"  +{(when - since) / 1000:6.0f} s {j} {type_}: {message[:110]}",
                      file=sys.stderr)
        lease_states = dict(db.execute("SELECT state, count(*) FROM leases GROUP BY state"))
        # How busy the market was over the simulated days: device-hours leased per tier
        # (as submitted) over device-hours online.
        gpus = {p.id: p.gpus for p in self.providers}
        online = sum((min(end or self.end_ms, self.end_ms) - start) * gpus[pid]
                     for pid, start, end in db.execute(
                         "SELECT provider_id, started_ms, ended_ms FROM provider_sessions"
                         " WHERE started_ms < ?", [self.end_ms]))
        leased: dict[str, float] = {}
        for job_id, devices, start, end in db.execute(
                "SELECT job_id, device_indices, issued_at_ms, ended_at_ms FROM leases"
                " WHERE issued_at_ms < ?", [self.end_ms]):
            tier = self.jobs[job_id].tier if job_id in self.jobs else "serving"
            leased[tier] = leased.get(tier, 0.0) + len(json.loads(devices)) * (
                min(end or self.end_ms, self.end_ms) - start)
        promotions = db.execute("SELECT count(*) FROM events WHERE type = 'promoted'"
                                ).fetchone()[0]
        undone = undone_preemptions(db, {j.id: j.tier for j in self.jobs.values()})
        problems = ledger.audit(db)
        return {
            "interruptible_cost_ratio": round(on_demand / paid, 3) if paid else None,
            "deadlines_met": round(len(met) / len(with_deadline), 4) if with_deadline else None,
            "lost_intervals_per_preemption": round(
                sum(self.lost_preempted) / len(self.lost_preempted), 4)
            if self.lost_preempted else 0.0,
            "serving_wait_p99_s": round(pct(spike_waits, 0.99), 1),
            "cold_start_s": self.args.cold_start,
            "jobs": len(rows), "jobs_succeeded": succeeded,
            "standard_jobs": sum(1 for j in self.jobs.values() if j.tier == "standard"),
            "interruptible_jobs": len(inter), "with_deadline": len(with_deadline),
            "preemptions": lease_states.get("preempted", 0), "promotions": promotions,
            **undone,
            "leases_lost": lease_states.get("lost", 0),
            "lost_intervals_per_lost_lease": round(
                sum(self.lost_churn) / len(self.lost_churn), 4) if self.lost_churn else 0.0,
            "lost_intervals_max_preemption": round(max(self.lost_preempted, default=0.0), 3),
            "late_preemption_checkpoints": self.late_checkpoints,
            "interruptible_paid_to_end": chained, "steps_paid_twice": double_paid,
            "replica_leases": len(waits), "serving_wait_p50_s": round(pct(spike_waits, 0.5), 1),
            "serving_wait_max_s": round(max(spike_waits, default=0.0), 1),
            "serving_wait_p99_all_s": round(pct(waits, 0.99), 1),
            "spikes": len(self.spikes), "passes": self.passes,
            **{f"busy_share_{tier}": round(leased.get(tier, 0.0) / online, 3)
               for tier in ("standard", "interruptible", "serving")},
            "updates_refused": self.refused,
            "ledger_audit_ok": not problems, "ledger_problems": problems[:5],
        }


UNDONE_WITHIN_MS = 15 * 60_000     # a preempted device back with an interruptible job this soon


def undone_preemptions(db, tiers: dict[str, str]) -> dict:
    """Preemptions undone soon after (churn): a preempted lease whose devices the next lease
    on them (issued within UNDONE_WITHIN_MS of its end) gave to an interruptible job again,
    not to the job it yielded for nor another of a higher tier: its checkpoint, restart and
    lost interval bought nothing. ``preemptions_undone``, and of those
    ``preemptions_undone_same_job`` (the preempted job itself placed back on its devices)
    and ``preemptions_undone_for_serving`` (it had yielded to a replica)."""
    leases: dict[str, list[tuple]] = {}
    for lease_id, job_id, provider_id, devices, issued, ended, state, preempt_for in \
            db.execute("SELECT id, job_id, provider_id, device_indices, issued_at_ms,"
                       " ended_at_ms, state, preempt_for FROM leases ORDER BY issued_at_ms"):
        leases.setdefault(provider_id, []).append(
            (lease_id, job_id, set(json.loads(devices)), issued, ended, state, preempt_for))
    first_leased = {}       # job -> (provider, issued) of each of its leases
    for rows in leases.values():
        for r in rows:
            first_leased.setdefault(r[1], []).append((r[3], r[0]))
    undone = same = for_serving = elsewhere = 0
    for rows in leases.values():
        for i, (_, job_id, devices, _, ended, state, preempt_for) in enumerate(rows):
            if state != "preempted" or ended is None:
                continue
            after = next((r for r in rows[i + 1:] if r[3] >= ended and r[2] & devices), None)
            if after is None or after[3] - ended > UNDONE_WITHIN_MS \
                    or after[1] == preempt_for or tiers.get(after[1]) != "interruptible":
                continue
            undone += 1
            same += after[1] == job_id
            # The job it yielded to leased on another provider's devices before these freed.
            elsewhere += any(issued <= ended for issued, _ in first_leased.get(preempt_for, ())
                             if issued >= rows[i][3])
            for_serving += tiers.get(preempt_for, "serving") == "serving"
    return {"preemptions_undone": undone, "preemptions_undone_same_job": same,
            "preemptions_undone_for_serving": for_serving,
            "preemptions_undone_yielded_to_leased_first": elsewhere}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered \
        else 0.0


def colocated() -> dict:
    """``colocated_ttft_p99_ratio`` from its real-process run (bench/colocated.py: an
    endpoint replica on one slice of this host's CPU, its TTFT p99 alone and while a training
    job runs on the other slice), with the figures beside it and the host's load."""
    import subprocess

    done = subprocess.run([sys.executable, str(ROOT / "bench" / "colocated.py")],
                          capture_output=True, text=True, timeout=1800, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        print(f"colocated run failed: {(done.stderr or done.stdout).strip()[-500:]}",
              file=sys.stderr)
        return {"colocated_ttft_p99_ratio": None}
    figures = json.loads(lines[-1])
    return {"colocated_ttft_p99_ratio": figures["colocated_ttft_p99_ratio"],
            "colocated": {k: v for k, v in figures.items()
                          if k != "colocated_ttft_p99_ratio"}}
