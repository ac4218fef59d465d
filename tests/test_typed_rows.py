"""Serving's and the ledger's rows read as typed values made in one place
(broker/serving/rows.py, broker/money/rows.py), as a job is (broker/jobs/job.py): a column
missing fails where the row is read, and every reader uses attributes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.market import providers, standing
from gpumarket.broker.market.standing import Provider
from gpumarket.broker.money import ledger
from gpumarket.broker.money.rows import Posting
from gpumarket.broker.serving.rows import EndpointKey, LiveEndpoint, LiveReplica
from gpumarket.proto.v1 import types_pb2 as pb
from tests.test_ledger import World, artifact, running

ROOT = Path(__file__).resolve().parent.parent

# The modules that read serving's rows and the ledger's postings, and the names they give
# them: none of those names is read by key (``r["state"]``) there.
ROW_READERS = {
    "broker/serving/endpoints.py": {"r", "row", "key", "replica"},
    "broker/serving/router.py": {"r", "row"},
    "broker/serving/autoscaler.py": {"r", "row", "rows", "live", "victim"},
    "broker/api/http.py": {"row", "live"},
    "broker/api/marketplace.py": {"r", "info", "usage", "k", "key", "line"},
    "broker/money/ledger.py": {"posting", "line"},
    "bench/tiers_demand.py": {"r", "rows"},
    "broker/market/standing.py": {"row", "provider", "p", "found"},
}


def _read_by_key(source: str, names: set[str]) -> list[tuple[int, str]]:
    """Where ``source`` reads one of ``names`` by a string key: ``row["state"]``, or an
    element of it, ``rows[0]["id"]``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)):
            continue
        held = node.value.value if isinstance(node.value, ast.Subscript) else node.value
        if isinstance(held, ast.Name) and held.id in names:
            found.append((node.lineno, f"{ast.unparse(node.value)}[{node.slice.value!r}]"))
    return found


def test_serving_rows_and_ledger_postings_are_read_by_attribute():
    found = [f"{rel}:{line}: {what}" for rel, names in ROW_READERS.items()
             for line, what in _read_by_key((ROOT / rel).read_text(), names)]
    assert not found, "rows read by key:\n" + "\n".join(found)


def test_the_source_check_finds_a_row_and_a_row_of_a_list_read_by_key():
    found = _read_by_key('x = row["state"]\ny = rows[0]["id"]\nz = row.state\n'
                         's = settings["max_replicas"]\n', {"row", "rows"})
    assert found == [(1, "row['state']"), (2, "rows[0]['id']")]


REPLICA_ROW = {"id": "ep-r1", "part": 1, "state": pb.JOB_STATE_RUNNING, "epoch": 2,
               "provider_id": "p1", "progress_step": 1, "attempt": 2, "lease_id": "ep-r1.2",
               "issued_at_ms": 5, "accelerator": None}


def test_a_live_replica_is_made_from_its_whole_row_and_is_read_by_attribute_only():
    replica = LiveReplica.from_row(REPLICA_ROW)
    assert (replica.id, replica.epoch, replica.provider_id) == ("ep-r1", 2, "p1")
    assert {name: getattr(replica, name) for name in REPLICA_ROW} == REPLICA_ROW
    with pytest.raises(KeyError, match="lease_id"):
        LiveReplica.from_row({k: v for k, v in REPLICA_ROW.items() if k != "lease_id"})
    endpoint = LiveEndpoint("ep", "c1", "tiny", {"max_replicas": 2}, 0, (replica,))
    # no reader by key is left: a row["column"] would be a TypeError, not a silent read
    for row in (replica, endpoint):
        with pytest.raises(TypeError):
            row["id"]


def test_a_key_never_revoked_reads_as_revoked_at_zero():
    assert EndpointKey.from_row({"key_id": "k1", "created_at_ms": 3, "revoked_at_ms": None}) \
        == EndpointKey("k1", 3, 0)


def test_a_posting_reads_its_entries_once_and_needs_every_column():
    row = {"seq": 7, "key": "settle:l.1:10", "at_ms": 1, "type": "settle",
           "entries": '{"escrow:j": -100, "fee": 5, "provider:pa": 95}', "job_id": "j",
           "lease_id": "l.1", "provider_id": "pa", "step_from": 0, "step_to": 10,
           "seconds": 360.0, "memo": "", "actor": ""}
    posting = Posting.from_row(row)
    assert posting.amount("provider:pa") == 95 and posting.amount("client:ca") == 0
    with pytest.raises(KeyError, match="actor"):
        Posting.from_row({k: v for k, v in row.items() if k != "actor"})


def test_a_settlement_taken_back_after_its_check_passed_names_the_work_it_undoes(
        store_location):
    w = World(store_location)
    running(w)
    ref = w.write(artifact, "pa", 10, 0)
    w.write(jobs.record_checkpoint, "j", 1, "pa", 10, ref, 0.1, 360_000)
    seq = w.db.execute("SELECT seq FROM ledger_postings WHERE type = 'settle'").fetchone()[0]
    assert w.write(ledger.settled_to, seq) == 95_000       # 6 min at 1.0/h, less the 5 % fee
    w.write(ledger.dispute, seq, 400_000)
    w.write(ledger.resolve, seq, True, 500_000)
    assert ledger.balance(w.db, ledger.provider("pa")) == 95_000
    w.write(ledger.claw_back, seq, 600_000)
    w.write(ledger.claw_back, seq, 700_000)                # once only
    assert ledger.balance(w.db, ledger.provider("pa")) == 0
    assert ledger.balance(w.db, ledger.escrow("j")) == 500_000     # back in the job's hold
    lease_id = w.db.execute("SELECT id FROM leases WHERE job_id = 'j'").fetchone()[0]
    about = w.db.execute(
        "SELECT type, job_id, lease_id, provider_id, step_from, step_to FROM ledger_postings"
        " WHERE key IN (?, ?, ?) ORDER BY seq",
        [f"dispute:{seq}", f"resolve:{seq}", f"clawback:{seq}"]).fetchall()
    assert [tuple(r) for r in about] == [
        (t, "j", lease_id, "pa", 0, 10) for t in ("dispute", "restore", "reverse")]
    assert ledger.audit(w.db) == []


def test_a_provider_row_is_read_whole_into_a_provider_and_its_standing_from_that(
        store_location):
    w = World(store_location)
    w.write(providers.online, "pa", b"key-a", 1_000, 30_000)
    w.write(providers.online, "pb", b"key-b", 2_000)
    w.db.execute("UPDATE providers SET banned = 1, online = 0 WHERE id = 'pb'")
    assert standing.providers(w.db, None) == [       # the latest seen first
        Provider("pb", 2_000, 2_000, online=False, banned=True),
        Provider("pa", 1_000, 1_000, online=True, banned=False, reconnect_within_ms=30_000)]
    assert standing.providers(w.db, ["pa"])[0].online is True
    [a] = standing.standings(w.db, ["pa"], 5_000)
    assert (a.provider_id, a.online, a.banned, a.first_seen_ms) == ("pa", True, False, 1_000)
    with pytest.raises(KeyError, match="banned"):
        Provider.from_row({"id": "pc", "first_seen_ms": 0, "last_seen_ms": 0, "online": 1,
                           "reconnect_within_ms": 0})
