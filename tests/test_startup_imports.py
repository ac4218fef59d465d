"""What a program imports it pays for at every start: `gpumarket --help` (and a command that
needs no broker) imports neither torch nor grpc; a provider whose benchmark figures are cached
imports no torch to read them."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT
from tests.test_cli_start import run

HEAVY = ("torch", "transformers", "grpc", "numpy", "bpy")


def test_client_help_imports_neither_torch_nor_grpc(tmp_path):
    for args in (["--help"], ["submit", "--help"], ["keys", "init"]):
        assert run(args, tmp_path, HEAVY)[0] == {"code": 0, "imported": []}, args


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
