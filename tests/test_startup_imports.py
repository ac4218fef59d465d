"""What a program imports it pays for at every start: `gpumarket --help` (and a command that
needs no broker) imports neither torch nor grpc."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT

HEAVY = ("torch", "transformers", "grpc", "numpy", "bpy")

PROBE = """
import json, sys
heavy = json.loads(sys.argv[2])
sys.argv = ["gpumarket", *json.loads(sys.argv[1])]
from gpumarket.client.cli import main
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(json.dumps({"code": code, "heavy": [m for m in heavy if m in sys.modules]}),
      file=sys.stderr)
"""


def imported(args: list[str], tmp_path) -> dict:
    env = {"PATH": "/usr/bin:/bin", "GPUMARKET_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args), json.dumps(HEAVY)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return json.loads(r.stderr.strip().splitlines()[-1])


def test_client_help_imports_neither_torch_nor_grpc(tmp_path):
    for args in (["--help"], ["submit", "--help"], ["keys", "init"]):
        assert imported(args, tmp_path) == {"code": 0, "heavy": []}, args

