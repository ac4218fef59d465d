"""What a program imports it pays for at every start: `gpumarket --help` (and a command that
needs no broker) imports neither torch nor grpc; a provider whose benchmark figures are cached
imports no torch to read them."""

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


CACHED = """
import sys
from pathlib import Path
from gpumarket.provider import benchmark
from gpumarket.provider.inventory import cpu_devices
from gpumarket.proto.v1 import types_pb2 as pb

benchmark.measure = lambda device: pb.Benchmark(matmul_flops=1e9)   # no torch here either
cache = Path(sys.argv[1])
devices = cpu_devices(1)
benchmark.cached_benchmarks(devices, cache)
assert cache.exists() and benchmark.cached_benchmarks(devices, cache)[0].matmul_flops == 1e9
print("torch" in sys.modules)
"""


def test_cached_benchmark_figures_are_read_without_importing_torch(tmp_path):
    r = subprocess.run([sys.executable, "-c", CACHED, str(tmp_path / "benchmark.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False"]
