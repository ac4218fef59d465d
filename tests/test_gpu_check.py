"""`make gpu-check` (scripts/gpu_check.py) on a machine without an NVIDIA GPU: one line
saying so, exit 0, every check SKIPPED with a reason, nothing written unless asked; and the
check's own logic as units: a failed job or replica ends its check at once with its last
log lines, every check has a deadline, --merge keeps reasons, the table is not markup."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ["inventory", "benchmark", "training_resume", "generate", "embed", "endpoint",
          "sandbox", "slices", "vllm", "blender"]


@pytest.fixture
def no_gpu():
    from gpumarket.provider.inventory import nvidia_devices

    try:
        nvidia_devices()
    except RuntimeError:
        return
    pytest.skip("an NVIDIA GPU is here: make gpu-check would run its checks for real")


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "--no-print-directory", "gpu-check",
                           f"GPU_PY={sys.executable}", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)


def results_dir() -> set[str]:
    path = ROOT / "bench" / "results"
    return {p.name for p in path.iterdir()} if path.is_dir() else set()


@pytest.mark.usefixtures("no_gpu")
def test_without_a_gpu_one_line_and_exit_0():
    before = results_dir()
    r = make()
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and r.stderr == "", r.stdout + r.stderr
    assert lines[0].startswith("gpu-check: no NVIDIA GPU here (")
    assert "every check SKIPPED" in lines[0]
    assert results_dir() == before      # the tree stays clean


@pytest.mark.slow
@pytest.mark.usefixtures("no_gpu")
def test_without_a_gpu_json_lists_every_check_skipped(tmp_path):
    out = tmp_path / "nested" / "gpu.json"
    r = make(f"GPU_CHECK_ARGS=--json {out}")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["gpu"] is None and report["mode"] == "no-gpu" and report["reason"]
    assert [c["name"] for c in report["checks"]] == CHECKS
    for check in report["checks"]:
        assert check["status"] == "SKIPPED"
        assert check["detail"].startswith("no NVIDIA GPU (") and len(check["detail"]) > 20


@pytest.mark.parametrize("args, says", [
    ("--only nosuch", "unknown check 'nosuch'"),
    ("--json /", "is a directory"),
])
def test_bad_input_is_one_line_and_exit_2(args, says):
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", *args.split()], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert len(r.stderr.splitlines()) == 1 and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_mig_mode_as_nvml_reports_it():
    """The offer's MIG mode: NVML's current mode, "" where the GPU has none (NotSupported)
    or the driver lacks the call; pynvml's own error classes, a stand-in for the driver."""
    import types

    import pynvml
    from gpumarket.provider.inventory import _mig_mode

    def nvml(answer) -> types.SimpleNamespace:
        def get(handle):
            if isinstance(answer, type):
                raise answer(0)
            return answer
        return types.SimpleNamespace(
            nvmlDeviceGetMigMode=get, NVML_DEVICE_MIG_ENABLE=pynvml.NVML_DEVICE_MIG_ENABLE,
            NVMLError_NotSupported=pynvml.NVMLError_NotSupported,
            NVMLError_FunctionNotFound=pynvml.NVMLError_FunctionNotFound)

    assert _mig_mode(nvml([1, 1]), None) == "enabled"
    assert _mig_mode(nvml([0, 1]), None) == "disabled"     # pending enable: not yet
    assert _mig_mode(nvml(pynvml.NVMLError_NotSupported), None) == ""
    assert _mig_mode(nvml(pynvml.NVMLError_FunctionNotFound), None) == ""


def test_nvidia_smi_lines_as_the_inventory_check_reads_them():
    """What the inventory check compares the offer with (the format of nvidia-smi 580)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_checks import parse_smi

    text = ("GPU-0f3c, NVIDIA H100 80GB HBM3, 81559, 9.0, 580.159.04, Disabled\n"
            "GPU-1a2b, Some GPU, with a comma, 24576, 8.9, 580.159.04, [N/A]\n")
    assert parse_smi(text) == {
        "GPU-0f3c": {"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
                     "compute_capability": "9.0", "driver_version": "580.159.04",
                     "mig_mode": "disabled"},
        "GPU-1a2b": {"name": "Some GPU, with a comma", "memory_mib": 24576,
                     "compute_capability": "8.9", "driver_version": "580.159.04",
                     "mig_mode": ""}}


# -- the check's own logic, as units (no GPU, no marketplace) ------------------------------

def _scripts():
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check
    import gpu_checks_inference
    import gpu_market

    return gpu_check, gpu_market, gpu_checks_inference


class FakeMarket:
    """What the checks ask the broker, answered from dicts: ``gpumarket status JOB --json``
    and ``gpumarket logs JOB``; counts the calls."""

    def __init__(self, jobs: dict[str, dict], logs: dict[str, str], shown: dict | None = None):
        self.jobs, self.logs, self.shown, self.calls = jobs, logs, shown, []

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        self.calls.append(args)
        if args[0] == "status":
            return subprocess.CompletedProcess(args, 0, json.dumps(self.jobs[args[1]]), "")
        if args[0] == "logs":
            return subprocess.CompletedProcess(args, 0, self.logs.get(args[1], ""), "")
        if args[:2] == ("endpoint", "show"):
            return subprocess.CompletedProcess(args, 0, json.dumps(self.shown), "")
        raise AssertionError(f"unexpected call {args}")


CRASH_LOG = "\n".join([f"line {i}" for i in range(30)] + [
    "Traceback (most recent call last):",
    "KeyError: 'getpwuid(): uid not found: 99568'"])


def test_a_failed_job_fails_the_wait_at_once_with_its_last_log_lines():
    """issue 31: training_resume waited for a checkpoint at step >= 500 after its job had
    FAILED, until the 10-minute limit."""
    gpu_check, gpu_market, _ = _scripts()
    import gpu_checks

    market = FakeMarket({"j1": {"job_id": "j1", "state": "FAILED", "error": "exited 1",
                                "checkpoint_step": 0}}, {"j1": CRASH_LOG})
    began = time.monotonic()
    with pytest.raises(gpu_market.CheckError) as caught:
        gpu_market.wait_for(lambda: gpu_checks.checkpoint_at(market, "j1", 500),
                            "a checkpoint", timeout=600, interval=0.3)
    assert time.monotonic() - began < 5
    assert "job j1 FAILED: exited 1" in str(caught.value)
    assert "uid not found: 99568" in str(caught.value)        # the log's last line
    assert caught.value.figures["log_tail"][-1].startswith("KeyError")
    assert len(caught.value.figures["log_tail"]) == gpu_market.LOG_TAIL
    # the same for a job whose attempt failed and that the broker queued again
    market.jobs["j1"] = {"job_id": "j1", "state": "QUEUED", "attempts": [
        {"attempt": 1, "outcome": "failed", "reason": "exit status 1"}]}
    with pytest.raises(gpu_market.CheckError, match="attempt 1 failed: exit status 1"):
        gpu_market.finish(market, "j1", timeout=600)
    # a lost attempt (the check kills a provider on purpose) is no failure
    assert gpu_market.job_failure({"job_id": "j2", "state": "RUNNING", "attempts": [
        {"attempt": 1, "outcome": "lost"}, {"attempt": 2, "outcome": "active"}]}) == ""


def test_a_crash_looping_replica_fails_the_endpoint_check_at_once():
    """issue 31: the endpoint check waited while the broker re-leased crash-looping
    replicas (r1-r6, every 11-14 s)."""
    _, gpu_market, inference = _scripts()
    shown = {"job_id": "e1", "state": "JOB_STATE_RUNNING",
             "replicas": [{"job_id": "e1-r2", "state": "JOB_STATE_LEASED"}],
             "events": [{"type": "serving", "message": "serving"},
                        {"type": "scaled", "message": "replica 1 added: min_replicas"},
                        {"type": "scaled", "message": "replica 2 added: min_replicas"}]}
    assert inference.replica_ids(shown) == ["e1-r1", "e1-r2"]
    market = FakeMarket({"e1-r1": {"job_id": "e1-r1", "state": "FAILED",
                                   "error": "the engine exited 1 before it was ready"},
                         "e1-r2": {"job_id": "e1-r2", "state": "LEASED"}},
                        {"e1-r1": CRASH_LOG}, shown)
    with pytest.raises(gpu_market.CheckError) as caught:
        gpu_market.wait_for(lambda: inference._ready_replica(market, "ep"), "a replica",
                            timeout=600, interval=1.0)
    assert "replica job e1-r1 FAILED" in str(caught.value)
    assert "uid not found" in str(caught.value)
    assert caught.value.figures["failed_job"] == "e1-r1"
    # a replica that is ready ends the wait; the endpoint itself failed does too
    market.shown = {**shown, "replicas": [{"job_id": "e1-r2", "ready": True}]}
    assert inference._ready_replica(market, "ep") == {"job_id": "e1-r2", "ready": True}
    market.shown = {"job_id": "e1", "state": "JOB_STATE_FAILED", "error": "3 replicas in a row"}
    with pytest.raises(gpu_market.CheckError, match="endpoint FAILED: 3 replicas"):
        inference._ready_replica(market, "ep")


def test_every_check_has_a_deadline_and_says_what_it_waited_for(monkeypatch):
    """A check past its deadline ends as FAIL "deadline", naming what it was waiting for
    (it was SKIPPED "interrupted" when a device's time limit cut the run); one that does
    not notice is ended by SIGALRM a little later; the next check runs with its own."""
    gpu_check, gpu_market, _ = _scripts()

    def waits(ctx):
        gpu_market.wait_for(lambda: False, "Godot", timeout=600, interval=0.1)

    def sleeps(ctx):
        time.sleep(60)

    def passes(ctx):
        from gpu_checks import passed
        return passed("fine", seen=gpu_market.DEADLINE.left(100, "x"))

    monkeypatch.setattr(gpu_check, "check_functions",
                        lambda: {"inventory": waits, "benchmark": sleeps, "embed": passes})
    monkeypatch.setattr(gpu_check, "BACKSTOP_S", 0.5)
    records, saved = [], []
    began = time.monotonic()
    gpu_check.run_checks(None, ["inventory", "benchmark", "embed"], records,
                         lambda: saved.append(len(records)), deadline_s=1.0)
    assert time.monotonic() - began < 10
    first, second, third = records
    assert first["status"] == "FAIL" and first["detail"].startswith("deadline"), first
    assert "Godot" in first["detail"] and first["waiting_for"] == "Godot"
    assert second["status"] == "FAIL" and second["detail"].startswith("deadline"), second
    assert third["status"] == "PASS" and 0 < third["seen"] <= 1.0
    assert saved == [1, 2, 3]
    assert gpu_market.DEADLINE.at is None          # no deadline outside a check


def test_merge_keeps_earlier_checks_and_their_skipped_reasons(tmp_path):
    gpu_check, _, _ = _scripts()
    earlier = {"gpu": "H100", "mode": "cuda", "checks": [
        {"name": "inventory", "status": "PASS", "detail": "ok", "seconds": 1.0},
        {"name": "vllm", "status": "SKIPPED", "detail": "vllm is not installed in this Python"},
        {"name": "blender", "status": "SKIPPED", "detail": "not asked for (--only)"},
        {"name": "sandbox", "status": "SKIPPED", "detail": "not run yet (the run was cut short)"},
        {"name": "endpoint", "status": "FAIL", "detail": "deadline"}]}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(earlier))
    kept = gpu_check.earlier_checks(path, "H100", "cuda")
    assert set(kept) == {"inventory", "vllm", "endpoint"}
    assert all(c["earlier_run"] for c in kept.values())
    assert gpu_check.earlier_checks(path, "A100", "cuda") == {}
    now = [{"name": "endpoint", "status": "PASS", "detail": "now"}]
    merged = gpu_check.merged_checks(now, kept, ["endpoint", "sandbox"])
    assert [c["name"] for c in merged] == CHECKS
    by_name = {c["name"]: c for c in merged}
    assert by_name["endpoint"]["detail"] == "now"                 # the new run wins
    assert by_name["vllm"]["detail"] == "vllm is not installed in this Python"
    assert by_name["inventory"]["status"] == "PASS"
    assert by_name["sandbox"]["detail"].startswith("not run yet")  # asked, not ended
    assert by_name["blender"]["detail"].startswith("not asked for")
    path.write_text("[1, 2]")
    assert gpu_check.earlier_checks(path, "H100", "cuda") == {}


def test_the_summary_table_shows_details_as_text_not_markup():
    import io

    gpu_check, _, _ = _scripts()
    out = io.StringIO()
    gpu_check.summary_table([{"name": "vllm", "status": "SKIPPED", "detail":
                              "vllm is not installed (pip install 'gpumarket[vllm]')"},
                             {"name": "endpoint", "status": "FAIL", "detail": "[bold]x[/]"}],
                            "gpu-check [cuda]", file=out)
    text = out.getvalue()
    assert "gpumarket[vllm]" in text and "[bold]x[/]" in text and "[cuda]" in text


def test_deadline_usage_is_one_line():
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--deadline", "1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "--deadline 1: give 10 to 3600 seconds" in r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_a_deadline_inside_a_wait_names_the_wait():
    _, gpu_market, _ = _scripts()
    market = FakeMarket({"j1": {"job_id": "j1", "state": "RUNNING"}}, {})
    gpu_market.DEADLINE.start(0.5)
    try:
        with pytest.raises(gpu_market.CheckError) as caught:
            gpu_market.finish(market, "j1", timeout=600)
    finally:
        gpu_market.DEADLINE.stop()
    assert "while waiting for job j1 to end" in str(caught.value), caught.value


def test_a_failed_checks_jobs_are_cancelled_for_the_next_check(monkeypatch):
    """A check that ran out of time left its training job running on the provider's one
    device, and the next check's job queued behind it past its own deadline."""
    gpu_check, gpu_market, _ = _scripts()

    class Market(FakeMarket):
        def cli(self, *args, timeout=300):
            if args[0] in ("cancel", "submit"):
                self.calls.append(args)
                out = "j9 submitted" if args[0] == "submit" else ""
                return subprocess.CompletedProcess(args, 0, out, "")
            return super().cli(*args, timeout=timeout)

    market = Market({"j9": {"job_id": "j9", "state": "RUNNING"}}, {})

    def submits_and_fails(ctx):
        gpu_market.submit(market, Path("job.toml"))
        raise gpu_market.CheckError("it broke")

    def submits_and_passes(ctx):
        from gpu_checks import passed
        gpu_market.submit(market, Path("job.toml"))
        return passed("fine")

    ctx = type("Ctx", (), {"_market": market})()
    monkeypatch.setattr(gpu_check, "check_functions", lambda: {
        "generate": submits_and_passes, "embed": submits_and_fails})
    records = []
    gpu_check.run_checks(ctx, ["generate", "embed"], records, lambda: None, deadline_s=60)
    assert [r["status"] for r in records] == ["PASS", "FAIL"]
    assert records[1]["cancelled_jobs"] == ["j9"] and "cancelled_jobs" not in records[0]
    assert market.calls.count(("cancel", "j9")) == 1      # the passing check's: left alone
