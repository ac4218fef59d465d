"""What a job writes that the daemon reads (provider/reports.py): each report typed and in
range, or dropped with a warning that a job cannot turn into a flood; fuzzed, nothing a job
writes raises; and an attempt whose daemon side fails still ends its job."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumarket import kinds
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import reports
from gpumarket.provider.attempt import Attempt
from gpumarket.provider.reports import (
    Checkpoint, Done, Drained, EngineAnswer, EngineReady, Log, Progress, ReportReader,
    TaskEnded,
)

WORKDIR = Path("/srv/jobs/j.1")


def parse(obj) -> reports.Report | None:
    return reports.parse_line(json.dumps(obj).encode(), WORKDIR)


def dropped(obj) -> str:
    with pytest.raises(reports.Malformed) as info:
        parse(obj)
    return str(info.value)


def test_good_reports_are_typed():
    assert parse({"event": "progress", "step": 3, "total": 10, "metrics": {"loss": 0.5}}) \
        == Progress(3, 10, {"loss": 0.5})
    assert parse({"event": "progress"}) == Progress(0, 0, {})
    assert parse({"event": "checkpoint", "step": 2, "path": "checkpoints/step-00000002",
                  "write_seconds": 0.25}) == Checkpoint(2, "checkpoints/step-00000002", 0.25)
    assert parse({"event": "checkpoint", "step": 2, "path": str(WORKDIR / "ck/step-2")}) \
        == Checkpoint(2, "ck/step-2", 0.0)
    assert parse({"event": "task", "task": 7, "ok": False, "error": "x" * 5000,
                  "seconds": 1}) == TaskEnded(7, False, "x" * 1000, 1.0)
    assert parse({"event": "done", "metrics": {"n": 2, "bad": "x", "inf": None}}) \
        == Done({"n": 2.0})
    assert parse({"event": "drained", "step": 4}) == Drained(4)
    assert parse({"event": "log", "lines": ["a", "b" * 10_000]}) == Log(("a", "b" * 4096))
    assert parse({"event": "resumed", "step": 3}) is None          # not the daemon's business


def test_what_once_failed_the_daemon_is_dropped():
    assert "step" in dropped({"event": "progress", "step": "abc", "total": 10})
    assert "step" in dropped({"event": "progress", "step": -5, "total": 10})
    assert "total" in dropped({"event": "progress", "step": 1, "total": 2**64})
    assert "step" in dropped({"event": "progress", "step": True})
    assert "step" in dropped({"event": "progress", "step": 1.5})
    assert "step" in dropped({"event": "checkpoint", "path": "ck"})
    assert "write_seconds" in dropped({"event": "checkpoint", "step": 1, "path": "ck",
                                       "write_seconds": "soon"})
    for path in ("/etc/passwd", "../other/ck", "ck/../../x", "", ".", "a\0b", 7,
                 "/".join(["d"] * 17), "x" * 2000):
        assert "path" in dropped({"event": "checkpoint", "step": 1, "path": path}), path
    assert "task" in dropped({"event": "task", "task": -1, "ok": True})
    assert "task" in dropped({"event": "task", "task": 2**32, "ok": True})
    assert "ok" in dropped({"event": "task", "task": 1, "ok": "yes"})
    assert "error" in dropped({"event": "task", "task": 1, "ok": False, "error": ["x"]})
    assert "seconds" in dropped({"event": "task", "task": 1, "ok": True, "seconds": -1})
    assert "lines" in dropped({"event": "log", "lines": "one"})
    assert "lines" in dropped({"event": "log", "lines": [1]})
    assert "event" in dropped({"event": "nonsense"})
    assert "object" in dropped([1, 2])
    for line in (b"{", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000,
                 b'{"event": "progress", "step": 1' + b"0" * 5000 + b"}",
                 b'{"event": "progress", "step": 1e999}', b"x" * (reports.MAX_LINE + 1)):
        with pytest.raises(reports.Malformed):
            reports.parse_line(line, WORKDIR)


def test_metrics_are_finite_named_and_few():
    metrics = {"nan": math.nan, "inf": math.inf, "": 1, "x" * 200: 1, "ok": 1,
               "flag": True, **{f"m{i}": i for i in range(200)}}
    got = reports.metrics_of(metrics)
    assert "ok" in got and len(got) == reports.MAX_METRICS
    assert not {"nan", "inf", "", "x" * 200, "flag"} & set(got)
    assert all(math.isfinite(v) for v in got.values())
    assert reports.metrics_of(["not", "a", "dict"]) == {}


def test_a_flood_of_bad_lines_is_one_warning(caplog):
    reader = ReportReader(WORKDIR)
    data = b"\n".join([b'{"event": "progress", "step": "abc"}'] * 10_000
                      + [json.dumps({"event": "progress", "step": 1, "total": 2}).encode()])
    with caplog.at_level(logging.WARNING, logger="gpumarket.provider.reports"):
        assert reader.lines(data) == [Progress(1, 2, {})]
    assert reader.dropped == 10_000
    [line] = [r.getMessage() for r in caplog.records]
    assert "1 report lines dropped" in line and "step is not an integer" in line


def test_engine_lines():
    ready = b'{"event": "ready", "engine": "e", "task": "generate", "max_concurrency": 8,' \
            b' "max_seq_len": -1}'
    assert reports.engine_line(ready) == EngineReady("e", "generate", 8, 0)
    assert reports.engine_line(b'{"id": "r1", "done": 1}') == EngineAnswer("r1", True)
    for line in (b'{"id": 5}', b"[]", b"nope"):
        with pytest.raises(reports.Malformed):
            reports.engine_line(line)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4), max_leaves=20)
EVENTS = st.sampled_from(["progress", "checkpoint", "task", "log", "done", "drained",
                          "resumed", "other"])
FIELDS = st.sampled_from(["step", "total", "metrics", "path", "write_seconds", "task", "ok",
                          "error", "seconds", "lines"])
REPORTS = st.builds(lambda event, fields: {"event": event, **fields}, EVENTS,
                    st.dictionaries(FIELDS, JSON | st.integers(-2**70, 2**70), max_size=6))


def as_messages(report) -> None:
    """What the daemon makes of a report: protobuf messages (which refuse out-of-range
    numbers by raising)."""
    if isinstance(report, Progress):
        pb.Progress(step=report.step, total=report.total, metrics=report.metrics)
    elif isinstance(report, Checkpoint):
        gw.CheckpointReport(step=report.step, write_seconds=report.write_seconds)
    elif isinstance(report, TaskEnded):
        gw.TaskResult(task=report.task, ok=report.ok, error=report.error,
                      seconds=report.seconds)
    elif isinstance(report, (Done, Log, Drained)):
        pb.Receipt(metrics=report.metrics) if isinstance(report, Done) else None


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(REPORTS)
def test_no_report_a_job_can_write_raises_or_breaks_a_message(raw):
    reader = ReportReader(WORKDIR)
    line = json.dumps(raw).encode()
    [*got] = reader.lines(line)
    assert len(got) + reader.dropped <= 1
    for report in got:
        as_messages(report)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000))
def test_no_bytes_a_job_can_write_raise(data):
    reader = ReportReader(WORKDIR)
    for report in reader.lines(data):
        as_messages(report)
    try:
        reports.engine_line(data)
    except reports.Malformed:
        pass


# -- the attempt, which takes them -----------------------------------------------------------

def test_every_report_the_reader_lets_through_is_taken_by_an_attempt(tmp_path):
    from tests.test_provider_parts import FakeHost

    host = FakeHost(tmp_path, {})
    job = Attempt(script_assignment(b"pass"), tmp_path / "jobs" / "j.1", host)
    job.workdir.mkdir(parents=True)

    @settings(max_examples=200, deadline=None)
    @given(REPORTS)
    def feed(raw):
        report = ReportReader(job.workdir).line(json.dumps(raw).encode())
        if report is not None:
            asyncio.run(job.on_report(report))

    feed()


def script_assignment(code: bytes):
    from gpumarket.proto.envelope import payload_sha256, seal
    from gpumarket.proto.jobspec import now_ms
    from gpumarket.provider.leases import Assignment
    from tests.test_provider_parts import CLIENT, PROVIDER

    spec = pb.JobSpec(max_price_per_gpu_hour=1.0, nonce=os.urandom(16),
                      resources=pb.Resources(gpus=1), created_at_ms=now_ms(),
                      expires_at_ms=now_ms() + 3600_000,
                      inputs=[pb.ArtifactRef(name="code.tar",
                                             sha256=hashlib.sha256(code).hexdigest(),
                                             size_bytes=len(code))])
    kinds.get("script").write(spec, {"code": "code.tar", "entry": "main.py"})
    spec_env = seal(CLIENT, spec)
    lease = pb.Lease(lease_id="j.1", job_id="j", attempt=1, epoch=1, provider_id=PROVIDER.id,
                     client_id=CLIENT.id, device_indices=[0], job_spec=spec_env)
    return Assignment(lease, spec, CLIENT.id, payload_sha256(spec_env))


def test_an_attempt_whose_daemon_side_fails_after_the_start_ends_its_job(tmp_path):
    """The job started, then the daemon's own code failed (here: recording its pid): the
    attempt fails, and its job's processes are gone before the device is told free."""
    from tests.test_provider_parts import FakeHost

    code = b"import time\ntime.sleep(120)\n"
    host = FakeHost(tmp_path, {hashlib.sha256(code).hexdigest(): code})
    pids = []

    async def started(attempt, pid):
        pids.append(pid)
        raise RuntimeError("the journal is gone")

    host.started = started
    job = Attempt(script_assignment(code), tmp_path / "jobs" / "j.1", host)
    job.workdir.mkdir(parents=True)
    asyncio.run(job.run())
    assert host.final.job_update.WhichOneof("update") == "failed"
    assert "provider error" in host.final.job_update.failed.error
    [pid] = pids
    deadline = time.monotonic() + 30
    while running(pid):
        assert time.monotonic() < deadline, "the job outlived its attempt"
        time.sleep(0.05)


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
