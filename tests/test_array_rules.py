"""Job arrays without processes: a job file's [array] table (grid, tasks file, every error a
line naming the file and the task), the task parameters every role reads alike, and the
broker's bookkeeping of tasks, batches, retries and the array's state on a real store."""

from __future__ import annotations

import json

import pytest

from gpumarket import kinds
from gpumarket.client import jobfile
from gpumarket.kinds import arrays
from gpumarket.proto.errors import JobFileError

SCRIPT = """
kind = "script"
max_price = 1.0

[script]
code = "main.py"

[array]
{array}
"""


def job_file(tmp_path, array: str):
    (tmp_path / "main.py").write_text("pass\n")
    path = tmp_path / "job.toml"
    path.write_text(SCRIPT.format(array=array))
    return path


def test_a_grid_makes_every_combination_last_fastest(tmp_path):
    job = jobfile.load(job_file(tmp_path, 'grid = { args = [["a"], ["b"]], steps = [1, 2, 3] }'))
    assert job.array_count == 6
    data = next(i.data for i in job.inputs if i.name == "tasks.jsonl")
    lines = [json.loads(x) for x in data.decode().splitlines()]
    assert lines[:3] == [{"args": ["a"], "steps": 1}, {"args": ["a"], "steps": 2},
                         {"args": ["a"], "steps": 3}]


@pytest.mark.parametrize("array, words", [
    ('grid = { args = [["a"]] }\ntasks = "t.jsonl"', "either 'grid' or 'tasks'"),
    ('', "either 'grid' or 'tasks'"),
    ('grid = { nope = [1] }', "task 0: script.nope: not a parameter of this kind"),
    ('grid = { steps = ["x"] }', "task 0: script.steps: must be an integer"),
    ('grid = { code = ["other.py"] }', "task 0: script.code"),
    ('grid = { steps = [1] }\nper_lease = 5000', "array.per_lease"),
    ('grid = { steps = [1] }\nbogus = 1', "unknown field 'array.bogus'"),
    ('tasks = "missing.jsonl"', "cannot read"),
    ('grid = { steps = [1] }\ninputs = ["nope.txt"]', "is not a file"),
])
def test_a_bad_array_table_is_one_line_naming_the_field(tmp_path, array, words):
    with pytest.raises(JobFileError) as exc:
        jobfile.load(job_file(tmp_path, array))
    assert words in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_a_bad_line_of_a_tasks_file_is_named(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"steps": 1}\n[1, 2]\n')
    with pytest.raises(JobFileError, match="task 1: not an object of parameters"):
        jobfile.load(job_file(tmp_path, 'tasks = "t.jsonl"'))
    (tmp_path / "t.jsonl").write_text('{"steps": 1}\n{"model": "x"}\n')
    with pytest.raises(JobFileError, match="not a parameter"):
        jobfile.load(job_file(tmp_path, 'tasks = "t.jsonl"'))


def test_a_task_may_not_change_what_the_array_was_matched_on():
    kind = kinds.get("generate")
    base = {p.name: p.zero() for p in kind.params}
    base.update(model_name="m", prompts="prompts.jsonl")
    with pytest.raises(kinds.ParamError, match="the same for every task"):
        arrays.task_values(kind, base, {"model_name": "bigger"}, {"prompts.jsonl"}, 4)
    got = arrays.task_values(kind, base, {"max_tokens": 3}, {"prompts.jsonl"}, 4)
    assert got["max_tokens"] == 3 and got["model_name"] == "m"


def test_output_names_round_trip_and_refuse_lookalikes():
    assert arrays.output_task(arrays.output_name(42, "a.json")) == (42, "a.json")
    for name in ("task42.a", "taskxxxxxx.a", "task000042.", "other.json"):
        assert arrays.output_task(name) is None
