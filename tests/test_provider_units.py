"""The provider's plain code: lease checks, inventory, executor, the training runner."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import BadSignature, Expired, InvalidArgument
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider.inventory import detect
from gpumarket.provider.leases import check_lease
from gpumarket.provider.reports import Log, Progress
from tests.helpers import EXAMPLES, ROOT
from tests.test_executor_events import job_process
from tests.test_protocol import spec as make_spec

BROKER, CLIENT, PROVIDER = Identity.generate(), Identity.generate(), Identity.generate()


def lease_envelope(spec_env=None, *, signer=BROKER, provider=PROVIDER.id, devices=(0,),
                   expires_in=60_000):
    spec_env = spec_env or seal(CLIENT, make_spec())
    lease = pb.Lease(lease_id="j.1", job_id="j", attempt=1, epoch=1, provider_id=provider,
                     client_id=CLIENT.id, device_indices=list(devices), issued_at_ms=now_ms(),
                     expires_at_ms=now_ms() + expires_in, job_spec=spec_env)
    return seal(signer, lease)


def check(env, kinds=(pb.JOB_KIND_TRAINING,)):
    return check_lease(env, broker_public_key=BROKER.public_key, provider_id=PROVIDER.id,
                       device_indices={0, 1}, kinds=set(kinds))


def test_a_good_lease_checks_out():
    a = check(lease_envelope())
    assert a.client_id == CLIENT.id and a.lease.job_id == "j"


def test_leases_that_must_not_run():
    tampered = seal(CLIENT, make_spec())
    payload = bytearray(tampered.payload)
    payload[-3] ^= 0x01
    tampered.payload = bytes(payload)
    expired = make_spec()
    expired.created_at_ms, expired.expires_at_ms = now_ms() - 7200_000, now_ms() - 1000
    cases = [
        (lease_envelope(tampered), BadSignature, "does not verify"),
        (lease_envelope(seal(CLIENT, expired)), Expired, "expired"),
        (lease_envelope(seal(Identity.generate(), make_spec())), BadSignature, "lease's client"),
        (lease_envelope(signer=Identity.generate()), BadSignature, "not signed by the broker"),
        (lease_envelope(provider="someone-else"), BadSignature, "not this one"),
        (lease_envelope(expires_in=-1), Expired, "lease expired"),
        (lease_envelope(devices=(7,)), InvalidArgument, "cannot give"),
    ]
    for env, error, message in cases:
        with pytest.raises(error, match=message):
            check(env)
    with pytest.raises(InvalidArgument, match="does not run training"):
        check(lease_envelope(), kinds=())


def test_without_a_gpu_the_cpu_is_offered_honestly():
    devices, warning = detect()
    if devices[0].accelerator == pb.ACCELERATOR_CUDA:
        pytest.skip("this host has NVIDIA GPUs")
    assert [d.accelerator for d in devices] == [pb.ACCELERATOR_CPU]
    assert devices[0].cpu_cores >= 1 and devices[0].memory_bytes > 0
    assert warning and "offering the CPU" in warning and "\n" not in warning


@pytest.mark.cuda
def test_nvml_sees_the_gpus():
    pytest.importorskip("pynvml")
    from gpumarket.provider.inventory import nvidia_devices

    try:
        devices = nvidia_devices()
    except RuntimeError as exc:
        pytest.skip(f"no NVIDIA GPU: {exc}")
    assert all(d.memory_bytes > 0 and d.compute_capability for d in devices)


def _run_module(tmp_path: Path, source: str, stop_when: str | None = None, grace=1.0):
    """Run ``source`` as a job; stopped once its log says ``stop_when``, if given (not after
    a fixed time: a job's interpreter on a loaded machine can take longer to start)."""
    reports = []

    async def on_report(r):
        reports.append(r)

    async def scenario():
        proc = job_process(tmp_path, source, on_report, grace=grace, max_runtime_s=60)
        task = asyncio.create_task(proc.run())
        if stop_when is not None:
            log = proc.workdir / "job.log"
            deadline = time.monotonic() + 120
            while stop_when not in (log.read_text() if log.exists() else ""):
                assert not task.done() and time.monotonic() < deadline, \
                    f"the job never logged {stop_when!r}"
                await asyncio.sleep(0.02)
            await proc.stop("cancelled")
        return await task, proc.workdir

    outcome, workdir = asyncio.run(scenario())
    return outcome, reports, workdir


def test_executor_reports_a_crash_with_its_last_line(tmp_path):
    outcome, reports, _ = _run_module(tmp_path, """
import json, os
out = open(os.environ["GPUMARKET_REPORT_FILE"], "a")
out.write(json.dumps({"event": "progress", "step": 1, "total": 2}) + "\\n"); out.flush()
raise RuntimeError("the model exploded")
""")
    assert outcome.exit_code == 1 and outcome.done is None
    assert "RuntimeError: the model exploded" in outcome.error
    assert [r for r in reports if not isinstance(r, Log)] == [Progress(step=1, total=2)]
    logged = [line for r in reports if isinstance(r, Log) for line in r.lines]
    assert logged[-1] == "RuntimeError: the model exploded"  # its stderr, shipped as log lines


def test_executor_env_is_clean(tmp_path):
    os.environ["GPUMARKET_SECRET_FOR_TEST"] = "hunter2"
    try:
        outcome, reports, workdir = _run_module(tmp_path, """
import json, os
out = open(os.environ["GPUMARKET_REPORT_FILE"], "a")
print("env", json.dumps(sorted(os.environ)))
out.write(json.dumps({"event": "done", "metrics": {"n": len(os.environ)}}) + "\\n")
""")
    finally:
        del os.environ["GPUMARKET_SECRET_FOR_TEST"]
    assert outcome.exit_code == 0 and outcome.done is not None
    line = next(x for r in reports if isinstance(r, Log) for x in r.lines if x.startswith("env "))
    env = json.loads(line[4:])
    assert "GPUMARKET_SECRET_FOR_TEST" not in env
    assert "CUDA_VISIBLE_DEVICES" in env


def test_executor_kills_a_job_that_ignores_sigterm(tmp_path):
    outcome, _, _ = _run_module(tmp_path, """
import signal, time, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("ready", flush=True)          # SIGTERM is ignored from here on
time.sleep(600)
""", stop_when="ready", grace=0.5)
    assert outcome.killed and outcome.exit_code == -signal.SIGKILL
    assert "cancelled" in outcome.error


def _train(workdir: Path, steps: int, resume: str | None = None) -> None:
    inputs = workdir / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    shutil.copy(EXAMPLES / "data" / "tiny-llama.json", inputs / "model_config.json")
    shutil.copy(EXAMPLES / "data" / "tiny-corpus.jsonl", inputs / "dataset.jsonl")
    job = {"job_id": "t", "params": {"model_config": "model_config.json",
                                     "dataset": "dataset.jsonl", "steps": steps,
                                     "batch_size": 4, "seq_len": 32, "learning_rate": 3e-3,
                                     "seed": "11", "warmup_steps": 2},
           "inputs": {"model_config.json": str(inputs / "model_config.json"),
                      "dataset.jsonl": str(inputs / "dataset.jsonl")},
           "checkpoint_every": 5, "device": "cpu", "resume_from": resume}
    (workdir / "job.json").write_text(json.dumps(job))
    r = subprocess.run([sys.executable, "-m", "gpumarket.provider.runners.training",
                        str(workdir)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_training_resumes_bitwise_from_a_checkpoint(tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _train(whole, 12)
    ckpt = whole / "checkpoints" / "step-00000005"
    assert (ckpt / "COMPLETE").exists()
    _train(resumed, 12, resume=str(ckpt))
    assert (whole / "outputs" / "model.safetensors").read_bytes() == \
        (resumed / "outputs" / "model.safetensors").read_bytes()
    assert (whole / "outputs" / "loss.jsonl").read_text() == \
        (resumed / "outputs" / "loss.jsonl").read_text()


def test_provider_policy_is_enforced_on_leases():
    from gpumarket.proto.errors import PermissionDenied
    from gpumarket.proto.policy import Policy, Window

    env = lease_envelope()

    def with_policy(policy):
        return check_lease(env, broker_public_key=BROKER.public_key, provider_id=PROVIDER.id,
                           device_indices={0}, kinds={pb.JOB_KIND_TRAINING}, policy=policy)

    assert with_policy(Policy()).client_id == CLIENT.id
    with pytest.raises(PermissionDenied, match="does not serve this client"):
        with_policy(Policy(denied_clients=frozenset({CLIENT.id})))
    with pytest.raises(PermissionDenied, match="does not serve this client"):
        with_policy(Policy(allowed_clients=frozenset({"someone-else"})))
    never = Window(frozenset(), 0, 60)
    with pytest.raises(PermissionDenied, match="outside its hours"):
        with_policy(Policy(windows=(never,)))


def test_remote_code_and_local_models_need_the_provider_to_agree():
    from gpumarket.proto.errors import PermissionDenied
    from gpumarket.proto.policy import Policy

    spec = make_spec()
    spec.inputs.add(name="prompts.jsonl", sha256="c" * 64, size_bytes=10)
    spec.kind = pb.JOB_KIND_GENERATE
    spec.generate.CopyFrom(pb.GenerateParams(model_name="minilm", prompts="prompts.jsonl",
                                             trust_remote_code=True))
    env = lease_envelope(seal(CLIENT, spec))

    def lease(policy, models=frozenset({"minilm"})):
        return check_lease(env, broker_public_key=BROKER.public_key, provider_id=PROVIDER.id,
                           device_indices={0}, kinds={pb.JOB_KIND_GENERATE}, policy=policy,
                           models=models)

    with pytest.raises(PermissionDenied, match="does not run a model's own code"):
        lease(Policy())
    with pytest.raises(InvalidArgument, match="holds no model named 'minilm'"):
        lease(Policy(allow_remote_code=True), frozenset())
    assert lease(Policy(allow_remote_code=True)).spec.generate.model_name == "minilm"


def test_provider_config_file(tmp_path):
    from gpumarket.proto.errors import InvalidArgument
    from gpumarket.provider import config

    path = tmp_path / "provider.toml"
    path.write_text(config.EXAMPLE + '''
[[availability]]
days = ["sat", "sun"]
hours = "00:00-24:00"

[devices.0]
price_per_hour = 3.0
''')
    built = config.build({**config.load(path), "broker": "x:1", "data_dir": tmp_path})
    assert built.price_per_gpu_hour == 1.2 and built.device_prices == {0: 3.0}
    assert built.policy.max_job_s == 24 * 3600 and len(built.policy.windows) == 1
    path.write_text("price_per_gpu_hour = 1\nprise = 2\n")
    with pytest.raises(InvalidArgument, match="unknown setting 'prise'"):
        config.load(path)
    path.write_text('[[availability]]\ndays = ["mon"]\nhours = "9-5"\n')
    with pytest.raises(InvalidArgument, match="hours"):
        config.load(path)


def test_benchmark_figures_are_cached_per_device(tmp_path):
    from gpumarket.provider.benchmark import cached_benchmarks
    from gpumarket.provider.inventory import cpu_device

    device = cpu_device()
    first = cached_benchmarks([device], tmp_path / "bench.json")[0]
    assert first.matmul_dtype == "fp32" and first.matmul_flops > 0
    assert set(first.matmul_flops_by_dtype) >= {"fp32", "bf16"}
    assert first.memory_bandwidth_bytes_per_s > 0
    again = cached_benchmarks([device], tmp_path / "bench.json")[0]
    assert again.measured_at_ms == first.measured_at_ms  # from the cache
    from dataclasses import replace

    other = cached_benchmarks([replace(device, driver_version="new")], tmp_path / "bench.json")[0]
    assert other.measured_at_ms >= first.measured_at_ms  # a new driver is measured again


@pytest.mark.cuda
def test_gpu_benchmark_on_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from gpumarket.provider.benchmark import measure
    from gpumarket.provider.inventory import nvidia_devices

    b = measure(nvidia_devices()[0])
    assert b.sm_count > 0 and b.host_to_device_bytes_per_s > 0
    assert b.matmul_flops_by_dtype["bf16"] > b.matmul_flops_by_dtype["fp32"]
