"""What a `gpumarket` process imports before it does what it was asked: every command's
module is imported (--help lists them all), so their top levels import only click and what
their options need; rich, asyncio, cryptography, grpc and the job kinds come where a command
uses them (bench/cli_start.py measures the start). Plugin kinds are loaded as a command
runs: its errors are the same, and --help needs none."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

# Each is 5-25 ms of a start here (python -X importtime), none needed to print a help page.
LATE = ("rich", "asyncio", "cryptography", "grpc", "gpumarket.kinds", "importlib.metadata",
        "google.protobuf.json_format")

# click's own main (not the program's, whose quick exit after grpc would skip the report).
PROBE = """
import json, sys
late = json.loads(sys.argv[2])
from gpumarket.client.cli import cli
try:
    cli.main(json.loads(sys.argv[1]), prog_name="gpumarket")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(json.dumps({"code": code, "imported": [m for m in late if m in sys.modules]}),
      file=sys.stderr)
"""


def run(args: list[str], tmp_path, watched: tuple[str, ...] = LATE,
        **env: str) -> tuple[dict, str]:
    """The probe's report (exit code, which of ``watched`` it imported) and what it printed
    on stderr before it."""
    env = {"PATH": "/usr/bin:/bin", "GPUMARKET_HOME": str(tmp_path), **env}
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args), json.dumps(watched)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    *before, report = r.stderr.strip().splitlines()
    return json.loads(report), "\n".join(before)


def test_help_pages_import_none_of_what_commands_use(tmp_path):
    for args in (["--help"], ["submit", "--help"], ["status", "--help"],
                 ["endpoint", "create", "--help"], ["keys", "init", "--help"]):
        assert run(args, tmp_path)[0] == {"code": 0, "imported": []}, args


def test_a_command_imports_the_kinds_only_for_a_plugin_or_a_job_file(tmp_path):
    assert run(["keys", "init"], tmp_path)[0]["code"] == 0
    # No broker listens on port 1: the command fails after its imports, with one line.
    report, stderr = run(["--broker", "plaintext://127.0.0.1:1", "balance"], tmp_path)
    assert report["code"] == 1 and stderr.startswith("error: "), (report, stderr)
    assert "gpumarket.kinds" not in report["imported"]
    assert {"grpc", "asyncio", "importlib.metadata"} <= set(report["imported"])


def test_a_plugin_kind_that_cannot_load_fails_a_command_but_not_its_help(tmp_path):
    bad = {"GPUMARKET_KINDS": "no_such_kind_module"}
    report, stderr = run(["--broker", "plaintext://127.0.0.1:1", "balance"], tmp_path, **bad)
    assert report["code"] == 1, (report, stderr)
    assert stderr.startswith("error: kind module 'no_such_kind_module' cannot be imported")
    assert "grpc" not in report["imported"]         # refused before any broker call
    assert run(["balance", "--help"], tmp_path, **bad)[0]["code"] == 0


@pytest.mark.e2e
def test_a_job_files_inputs_reach_the_spec_in_its_order_small_or_large(market, tmp_path):
    """Small inputs go up together (one UploadBlobs call), one over CHUNK_BYTES on its own
    (a tasks file here, a directory's tar, a file): the signed spec names each by the
    sha256 of its bytes, in the job file's order, and the broker holds them all."""
    from gpumarket.client.jobfile import pack_directory
    from gpumarket.proto.artifacts import CHUNK_BYTES
    from gpumarket.proto.envelope import open_envelope
    from gpumarket.proto.v1 import types_pb2 as pb

    code = tmp_path / "code"
    code.mkdir()
    (code / "main.py").write_text("pass\n")
    (code / "weights.bin").write_bytes(os.urandom(CHUNK_BYTES + 1))      # its tar is large
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"args": ["x" * 4000, str(i)]}) + "\n"
                             for i in range(CHUNK_BYTES // 4000 + 1)))     # large
    extra = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for n, path in enumerate(extra):
        path.write_text(f"input {n}\n")                                    # small
    job = tmp_path / "job.toml"
    job.write_text(f'name = "inputs"\nkind = "script"\nmax_price = 2.0\nbudget = 10\n'
                   f'[script]\ncode = "{code}"\n[array]\ntasks = "{tasks}"\n'
                   f'inputs = ["{extra[0]}", "{extra[1]}"]\n')
    r = market.cli("submit", str(job))
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [f"uploading {code} as code.tar",
                                     f"uploading {extra[0]} as a.txt",
                                     f"uploading {extra[1]} as b.txt",
                                     "uploading its tasks as tasks.jsonl"]

    async def spec_of(broker):
        return open_envelope((await broker.get_job(r.stdout.split()[0])).spec, pb.JobSpec)[0]

    spec = market.ask(spec_of)
    sent = [pack_directory(code), *(p.read_bytes() for p in extra), tasks.read_bytes()]
    assert [(i.name, i.sha256, i.size_bytes) for i in spec.inputs] == [
        (name, hashlib.sha256(data).hexdigest(), len(data))
        for name, data in zip(["code.tar", "a.txt", "b.txt", "tasks.jsonl"], sent)]
