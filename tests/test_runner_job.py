"""The job.json the daemon writes and every runner reads (kinds/runner_job.py): made from a
checked lease in one place (provider/leases.py runner_config), round-tripped unchanged,
its parameters checked against the kind's schema, and a hostile or broken one refused with
the field named (runners/base.read_job: one line, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpumarket import kinds
from gpumarket.kinds.runner_job import ArrayTask, RunnerJob, RunnerJobError, check_params
from gpumarket.proto.errors import InvalidArgument
from gpumarket.provider.leases import runner_config
from gpumarket.provider.runners import base
from tests.test_provider_parts import (  # noqa: F401 (checksum_kind: its fixture)
    checksum_assignment,
    checksum_kind,
)

# The keys job.json held before it was typed: a plugin's runner reads them by name.
KEYS = {"tasks", "job_id", "attempt", "kind", "params", "inputs", "checkpoint_every",
        "checkpoint_interval_s", "provider_mtbf_s", "device", "resume_from", "world_size",
        "model_dir", "part", "parts"}


def test_the_daemon_s_job_json_round_trips_with_the_keys_runners_read(tmp_path):
    a = checksum_assignment(b"x", rounds=3)
    a.lease.checkpoint_interval_s = 30.0
    job = runner_config(a, {"data.bin": str(tmp_path / "data.bin")}, tmp_path / "resume",
                        cuda=False)
    assert job.kind == "checksum" and job.job_id == "j" and job.attempt == 1
    assert job.params["rounds"] == 3 and job.inputs["data.bin"].endswith("data.bin")
    assert job.resume_from == str(tmp_path / "resume") and job.device == "cpu"
    raw = json.loads(job.to_json())
    assert set(raw) == KEYS and raw["tasks"] is None and raw["world_size"] == 1
    assert RunnerJob.from_json(job.to_json()) == job
    with pytest.raises(TypeError):
        job.params["rounds"] = 4           # read-only, as the dataclass is frozen


def test_a_check_lease_tells_only_what_its_check_needs():
    a = checksum_assignment(b"x")
    a.lease.check.frames.extend([3, 1])
    a.lease.check.step_from = 2          # the lease it checks resumed after 2 frames
    raw = json.loads(runner_config(a, {"data.bin": "/x"}, None, cuda=True).to_json())
    assert set(raw) == KEYS | {"check_of", "check_frames", "check_from_row"}
    assert raw["check_frames"] == [3, 1] and raw["device"] == "cuda"
    assert raw["check_from_row"] == 2
    back = RunnerJob.from_json(json.dumps(raw))
    # a check, named by its own job id: the lease does not say which job it checks
    assert back.check_of == a.lease.job_id != "" and back.check_frames == (3, 1)
    assert back.stop_at == 0


def test_an_array_lease_s_tasks_carry_their_own_parameters(tmp_path):
    a = checksum_assignment(b"x")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"rounds": r}) + "\n" for r in (1, 2, 3)))
    a.spec.array.tasks_input = "tasks.jsonl"
    a.spec.array.count = 3
    a.spec.inputs.add(name="tasks.jsonl")
    a.lease.tasks.extend([0, 2])
    job = runner_config(a, {"data.bin": "/x", "tasks.jsonl": str(tasks)}, None, cuda=False)
    assert [(t.task, t.params["rounds"]) for t in job.tasks] == [(0, 1), (2, 3)]
    back = RunnerJob.from_json(job.to_json())
    assert back == job
    one = back.for_task(back.tasks[1])
    assert one.task == 2 and one.tasks is None and one.params["rounds"] == 3
    assert one.resume_from is None and one.job_id == "j"


def test_a_partial_job_json_takes_the_defaults():
    """Runner tests (and older daemons) write only what a runner needs."""
    job = RunnerJob.from_json(json.dumps({"params": {"a": 1}, "inputs": {},
                                          "resume_from": None, "new_field": 1}))
    assert job.world_size == 1 and job.device == "cpu" and job.tasks is None
    assert job.checkpoint_every == 0 and job.model_dir is None and job.params == {"a": 1}


@pytest.mark.parametrize("raw, field", [
    ("[]", "must be an object"),
    ("{", "not JSON"),
    ({"params": []}, "params"),
    ({"inputs": {"a": 1}}, "inputs"),
    ({"device": "tpu"}, "device"),
    ({"world_size": 0}, "world_size"),
    ({"world_size": True}, "world_size"),
    ({"checkpoint_every": -1}, "checkpoint_every"),
    ({"provider_mtbf_s": "1"}, "provider_mtbf_s"),
    ({"resume_from": 7}, "resume_from"),
    ({"tasks": {"task": 1}}, "tasks"),
    ({"tasks": [{"task": -1, "params": {}}]}, "tasks[].task"),
    ({"tasks": [{"params": {}}]}, "tasks[]"),
    ({"check_frames": ["1"]}, "check_frames"),
])
def test_a_job_json_that_is_no_runner_job_is_refused_naming_the_field(raw, field):
    text = raw if isinstance(raw, str) else json.dumps(raw)
    with pytest.raises(RunnerJobError, match=field.replace("[", r"\[").replace("]", r"\]")):
        RunnerJob.from_json(text)


def test_a_huge_job_json_is_refused_unread(monkeypatch):
    from gpumarket.kinds import runner_job

    monkeypatch.setattr(runner_job, "MAX_BYTES", 100)
    with pytest.raises(RunnerJobError, match="more than"):
        RunnerJob.from_json(json.dumps({"params": {"x": "y" * 200}}))


def test_parameters_are_checked_against_the_kind_s_schema():
    kind = kinds.get("checksum")
    good = {"data": "data.bin", "rounds": 2, "algorithm": "sha256"}
    check_params(kind, good, {"data.bin"})
    for bad, why in (({**good, "rounds": "2"}, "an integer"), ({**good, "rounds": 0}, "rounds"),
                     ({k: v for k, v in good.items() if k != "rounds"}, "missing"),
                     ({**good, "data": "other.bin"}, "names no input")):
        with pytest.raises(kinds.ParamError, match=why):
            check_params(kind, bad, {"data.bin"})


def test_runner_config_refuses_parameters_its_kind_does_not_allow(monkeypatch):
    a = checksum_assignment(b"x")
    kind = kinds.get("checksum")
    monkeypatch.setattr(type(kind), "values_of", lambda self, spec: {"rounds": -1})
    with pytest.raises(InvalidArgument):
        runner_config(a, {"data.bin": "/x"}, None, cuda=False)


def test_a_runner_given_a_broken_job_json_says_so_in_one_line(tmp_path):
    (tmp_path / "job.json").write_text(json.dumps({"params": {}, "device": "tpu"}))
    with pytest.raises(base.JobError, match="job.json: device"):
        base.read_job(tmp_path)
    r = subprocess.run([sys.executable, "-m", "gpumarket.provider.runners.script",
                        str(tmp_path)], capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 1, r
    want = "error: job.json: device: must be one of ['cpu', 'cuda']"
    assert r.stderr.strip().splitlines() == [want], r.stderr


def test_an_array_task_is_typed():
    assert ArrayTask(3, {"a": 1}).params == {"a": 1}
    with pytest.raises(RunnerJobError):
        ArrayTask(True, {})
