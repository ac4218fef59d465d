"""What a `gpumarket` process imports before it does what it was asked: every command's
module is imported (--help lists them all), so their top levels import only click and what
their options need; rich, asyncio, cryptography, grpc and the job kinds come where a command
uses them (bench/cli_start.py measures the start). Plugin kinds are loaded as a command
runs: its errors are the same, and --help needs none."""

from __future__ import annotations

import json
import subprocess
import sys

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


def run(args: list[str], tmp_path, **env: str) -> tuple[dict, str]:
    """The probe's report (exit code, which of LATE it imported) and what it printed on
    stderr before it."""
    env = {"PATH": "/usr/bin:/bin", "GPUMARKET_HOME": str(tmp_path), **env}
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args), json.dumps(LATE)],
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
