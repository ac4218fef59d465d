"""What a job array's run did, read from the broker's records (its tasks' rows and its
leases' events, through the client) and the providers' logs: each lane's share, how its two
ends went, and every steal its leases were asked for. bench/throughput.py prints them."""

from __future__ import annotations

import json
import re

from tests.helpers import Marketplace


def events(market: Marketplace, job_id: str) -> list[dict]:
    r = market.cli("watch", job_id, "--json", timeout=3600)
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def first_steal(market: Marketplace, rows: list[dict]) -> dict | None:
    """How an array's first two leases (one a lane) ended, by the broker's records: how far
    apart their last tasks were recorded, and whether the first one's end made the other
    yield (arrays.steal_for_idle_lane, at the first's receipt): how long after the first's
    last task, how many tasks it marked, and how many of those the yielding lease reported
    all the same (it had run them, not reported them yet). Without a yield: what the
    steal rule saw at the first's end, the other's tasks not reported yet at its pace (its
    wall time since it started a task reported, or its tasks' own time, the larger), in
    seconds against the STEAL_MIN_S a steal needs. None for an array of one lease."""
    by: dict[str, list[dict]] = {}
    for t in rows:
        by.setdefault(t["batch"], []).append(t)
    if len(by) < 2:
        return None
    first, other = sorted(sorted(by, key=lambda b: int(b.rsplit("-", 1)[1]))[:2],
                          key=lambda b: max(t["updated_at_ms"] for t in by[b]))
    end = max(t["updated_at_ms"] for t in by[first])
    out = {"apart_s": round((max(t["updated_at_ms"] for t in by[other]) - end) / 1000, 3)}
    seen = events(market, other)
    asked = next((e for e in seen if e["type"] == "yielding"), None)
    if asked is not None:
        at = int(asked["at_ms"])
        marked = marked_of(asked)
        return {**out, "yield_ms": at - end, "marked": marked,
                "ran_anyway": marked - moved(seen, len(by[other]))}
    started = next(int(e["at_ms"]) for e in seen if e["type"] == "started")
    told = [t for t in by[other] if t["updated_at_ms"] <= end]
    pace = max((end - started) / 1000 / max(1, len(told)),
               sum(t.get("seconds") or 0.0 for t in told) / max(1, len(told)))
    left = len(by[other]) - len(told)
    return {**out, "yield_ms": None, "left": left,      # no pace before a task reported
            "estimate_s": round(left * pace, 3) if told else None}


def steals(market: Marketplace, rows: list[dict], declined_before: int) -> dict:
    """Every yield the array's leases were asked for, by the broker's records: how many
    were asked, how many tasks the broker marked (its tasks not reported yet), how many of
    those the lease ran all the same (it had run them and held their results, or ran them
    after a steal it declined; its current task among them) and how many moved to new
    leases (``moved``); and how many steals the providers declined (their logs: what they
    had left was quicker than a steal)."""
    ran: dict[str, int] = {}
    for t in rows:
        ran[t["batch"]] = ran.get(t["batch"], 0) + 1
    out = {"asked": 0, "marked": 0, "ran_anyway": 0, "moved": 0}
    for batch, count in sorted(ran.items()):
        seen = events(market, batch)
        for e in seen:
            if e["type"] != "yielding":
                continue
            marked = marked_of(e)
            gone = moved(seen, count)
            out["asked"] += 1
            out["marked"] += marked
            out["ran_anyway"] += marked - gone
            out["moved"] += gone
    out["declined"] = declines(market) - declined_before
    return out


def marked_of(asked: dict) -> int:
    """The tasks a yield or split asked of a lease marked (its "yielding" event): those it
    had not reported then."""
    found = re.search(r"(\d+) tasks go back|of its (\d+) tasks not reported",
                      asked.get("message", ""))
    return int(found[1] or found[2]) if found else 0


def moved(seen: list[dict], ran: int) -> int:
    """How many of a batch's tasks it did not run (``ran``: its tasks' rows), by the tasks
    it was made with (its submitted event): those a yield moved to new leases (or failed
    and ran again elsewhere: none of this bench's fail). Not by when they were recorded:
    an update taken up as the steal was decided is recorded at a time before the ask."""
    made = next((e for e in seen if e["type"] == "submitted"), {})
    found = re.search(r"(\d+) tasks of array", made.get("message", ""))
    return max(0, int(found[1]) - ran) if found else 0


def declines(market: Marketplace) -> int:
    """Steals the providers declined so far (provider/attempt.py logs each)."""
    return sum(p.text().count("does not yield") for p in market.providers.values())


def ends(watched: dict, rows: list[dict], began_ms: float) -> dict:
    """Where an array's run went at its two ends, in ms on the client's clock (the broker
    and the bench share this machine's): the ``submit --watch`` process's start to the
    broker's submitted event (its imports, key, input upload), submitted to the first lease
    (started), to the first task recorded; and the tail: the last task recorded to the
    array's succeeded event, and to the process's exit (the watch stream seeing it, the
    process ending). A task's time is when the broker took up the update that reports it:
    "succeeded" includes recording that last update (its receipts checked, its outputs
    stored) and the leases' receipts behind it."""
    at = {e["type"]: int(e["at_ms"]) for e in reversed(watched["events"])}  # each's first
    first = min(t["updated_at_ms"] for t in rows)
    last = max(t["updated_at_ms"] for t in rows)
    done = int(watched["events"][-1]["at_ms"])
    return {"submit_ms": at["submitted"] - began_ms, "lease_ms": at["started"] - at["submitted"],
            "first_task_ms": first - at["started"], "succeeded_ms": done - last,
            "exit_ms": watched["exited_ms"] - last}


def lanes(rows: list[dict], began_ms: float) -> list[dict]:
    """Each provider's share of an array, from its tasks' rows: tasks, when its last one
    ended (s after submission), the seconds its tasks ran themselves (the rest of a lane's
    time is the lease's and the provider's, or a core taken by something else) and the tasks
    of its last results update (those recorded at its last task's time: the broker records
    an update's tasks at one time; the array's end waits for that update)."""
    by: dict[str, dict] = {}
    last: dict[str, list[int]] = {}
    for t in rows:
        key = t["provider_id"][:8]
        lane = by.setdefault(key, {"tasks": 0, "end_s": 0.0, "task_s": 0.0})
        lane["tasks"] += 1
        lane["end_s"] = max(lane["end_s"], (t["updated_at_ms"] - began_ms) / 1000)
        lane["task_s"] += t.get("seconds") or 0.0
        last.setdefault(key, []).append(t["updated_at_ms"])
    for key, lane in by.items():
        lane["last_update"] = last[key].count(max(last[key]))
    return [{"provider": k, **{f: round(v, 2) for f, v in lane.items()}}
            for k, lane in sorted(by.items())]
