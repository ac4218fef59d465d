"""The `gpumarket` process ends at once after a command that talked to a broker (grpc
imported; client/console.py ``leave``), with the same output and exit code as an ordinary
exit: nothing it printed is lost in a pipe."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT

PROBE = """
import atexit, json, sys
if sys.argv[2] == "grpc":
    import grpc  # noqa: F401  (as a command that talked to a broker has)
atexit.register(lambda: print("finalized", file=sys.stderr))
sys.argv = ["gpumarket", *json.loads(sys.argv[1])]
from gpumarket.client.cli import main
main()
"""


def run(args: list[str], grpc: bool, tmp_path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "GPUMARKET_HOME": str(tmp_path)}
    return subprocess.run([sys.executable, "-c", PROBE, json.dumps(args),
                           "grpc" if grpc else "-"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_command_that_imported_grpc_ends_at_once_with_all_its_output(tmp_path):
    for args, code in ((["submit", "--help"], 0), (["no-such-command"], 2)):
        ordinary, fast = run(args, False, tmp_path), run(args, True, tmp_path)
        assert ordinary.returncode == fast.returncode == code, (args, ordinary, fast)
        assert "finalized" in ordinary.stderr       # the interpreter's exit ran ...
        assert "finalized" not in fast.stderr       # ... and here did not
        assert fast.stdout == ordinary.stdout, args
        assert fast.stdout or code, args            # --help printed its page
        assert fast.stderr == ordinary.stderr.replace("finalized\n", ""), args
