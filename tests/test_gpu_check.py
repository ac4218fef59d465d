"""`make gpu-check` (scripts/gpu_check.py) on a machine without an NVIDIA GPU: one line
saying so, exit 0, every check SKIPPED with a reason, nothing written unless asked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ["inventory", "benchmark", "training_resume", "generate", "embed", "endpoint",
          "sandbox", "vllm", "blender"]


@pytest.fixture(autouse=True)
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


def test_without_a_gpu_one_line_and_exit_0():
    before = results_dir()
    r = make()
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and r.stderr == "", r.stdout + r.stderr
    assert lines[0].startswith("gpu-check: no NVIDIA GPU here (")
    assert "every check SKIPPED" in lines[0]
    assert results_dir() == before      # the tree stays clean


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
