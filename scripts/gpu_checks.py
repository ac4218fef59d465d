"""The checks of scripts/gpu_check.py, one function each: ``check(ctx) -> Outcome``. A check
raises (CheckError or anything else) to FAIL with a one-line reason; its figures are only
what it measured.

Each runs on CUDA (``ctx.cuda``) or, for the rehearsal, on the CPU device with a tiny
model: the same code, other sizes.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpu_market import (
    ROOT,
    CheckError,
    failed_job,
    finish,
    job,
    job_failure,
    job_file,
    job_log,
    kill_machine,
    last_line,
    offer_of,
    results,
    start_provider,
    submit,
    wait_for,
)


@dataclass
class Outcome:
    status: str                     # PASS, FAIL or SKIPPED
    detail: str                     # one line
    figures: dict = field(default_factory=dict)


def passed(detail: str, **figures) -> Outcome:
    return Outcome("PASS", detail, figures)


def failed(detail: str, **figures) -> Outcome:
    return Outcome("FAIL", detail, figures)


def skipped(detail: str) -> Outcome:
    return Outcome("SKIPPED", detail)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def say(text: str) -> None:
    print(f"   .. {text}", file=sys.stderr, flush=True)


# -- NVML inventory -------------------------------------------------------------------------

SMI_FIELDS = ("uuid", "name", "memory.total", "compute_cap", "driver_version",
              "mig.mode.current")


def nvidia_smi() -> dict[str, dict]:
    """What nvidia-smi reports of each GPU, by UUID."""
    r = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}",
                        "--format=csv,noheader,nounits"], capture_output=True, text=True,
                       timeout=60, check=False)
    if r.returncode != 0:
        raise CheckError(f"nvidia-smi exited {r.returncode}: {last_line(r.stdout + r.stderr)}")
    return parse_smi(r.stdout)


def parse_smi(text: str) -> dict[str, dict]:
    """nvidia-smi's CSV (SMI_FIELDS, no header, no units) by UUID; "[N/A]" and the like kept
    as text (they compare unequal to what the offer says, and the check says so)."""
    out = {}
    for line in text.strip().splitlines():
        uuid, rest = line.split(",", 1)           # a UUID has no comma; a name might
        name, mib, cc, driver, mig = [v.strip() for v in rest.rsplit(",", 4)]
        out[uuid.strip()] = {
            "name": name, "memory_mib": int(mib) if mib.isdigit() else mib,
            "compute_capability": cc, "driver_version": driver,
            "mig_mode": mig.lower() if mig.lower() in ("enabled", "disabled") else ""}
    return out


def inventory(ctx) -> Outcome:
    offer = offer_of(ctx.market(), ctx.provider)
    devices = offer.get("devices", [])
    if not devices:
        raise CheckError("the offer lists no device")
    if not ctx.cuda:
        from gpumarket.provider.inventory import cpu_device

        want = cpu_device()
        d = devices[0]
        got = {"name": d.get("name"), "memory_bytes": int(d.get("memory_bytes", 0)),
               "cpu_cores": int(d.get("cpu_cores", 0))}
        expect = {"name": want.name, "memory_bytes": want.memory_bytes,
                  "cpu_cores": want.cpu_cores}
        diffs = [f"{k}: offer {got[k]!r}, host {expect[k]!r}" for k in got if got[k] != expect[k]]
        figures = {"devices": [got]}
        return (failed("; ".join(diffs), **figures) if diffs else
                passed(f"CPU rehearsal: {got['name']}, {got['cpu_cores']} cores,"
                       f" {got['memory_bytes'] / 2**30:.1f} GiB as advertised", **figures))
    smi = nvidia_smi()
    rows, diffs = [], []
    for d in devices:
        row = {"uuid": d.get("uuid", ""), "name": d.get("name", ""),
               "memory_bytes": int(d.get("memory_bytes", 0)),
               "compute_capability": d.get("compute_capability", ""),
               "driver_version": d.get("driver_version", ""),
               "cuda_version": d.get("cuda_version", ""), "mig_mode": d.get("mig_mode", "")}
        rows.append(row)
        seen = smi.get(row["uuid"])
        if seen is None:
            diffs.append(f"{row['uuid']}: not listed by nvidia-smi")
            continue
        pairs = [("name", row["name"], seen["name"]),
                 ("memory MiB", row["memory_bytes"] >> 20, seen["memory_mib"]),
                 ("compute capability", row["compute_capability"], seen["compute_capability"]),
                 ("driver", row["driver_version"], seen["driver_version"]),
                 ("MIG mode", row["mig_mode"], seen["mig_mode"])]
        diffs += [f"{what}: offer {a!r}, nvidia-smi {b!r}" for what, a, b in pairs if a != b]
    missing = set(smi) - {r["uuid"] for r in rows}
    diffs += [f"{u}: listed by nvidia-smi, not offered" for u in sorted(missing)]
    first = rows[0]
    text = (f"{len(rows)} x {first['name']}, {first['memory_bytes'] >> 20} MiB, cc"
            f" {first['compute_capability']}, driver {first['driver_version']}, CUDA"
            f" {first['cuda_version']}, MIG {first['mig_mode'] or 'not supported'}")
    if diffs:
        return failed("; ".join(diffs)[:400], devices=rows)
    return passed(text + ": offer = nvidia-smi", devices=rows)


# -- the benchmark ---------------------------------------------------------------------------

def _direct_figures(cuda: bool, dtypes: set[str]) -> dict[str, float]:
    """Matmul FLOP/s per dtype and device copy bandwidth, measured here with plain torch
    (CUDA events on a GPU, after a warm-up of a second; the best of 3 timings of 10)."""
    import torch

    out: dict[str, float] = {}
    if cuda:
        dev = torch.device("cuda", 0)

        def timed(fn) -> float:
            began = time.perf_counter()
            while time.perf_counter() - began < 1.0:     # clocks up
                fn()
                torch.cuda.synchronize(dev)
            best = float("inf")
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                for _ in range(10):
                    fn()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1000 / 10)
            return best

        n = 8192
        plain = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
                 "bf16": torch.bfloat16}
        for name, dtype in plain.items():
            if name not in dtypes:
                continue
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            a = torch.randn(n, n, device=dev).to(dtype)
            b = torch.randn(n, n, device=dev).to(dtype)
            out[name] = 2 * n**3 / timed(lambda a=a, b=b: torch.mm(a, b))
            a = b = None
        torch.backends.cuda.matmul.allow_tf32 = False
        if "fp8" in dtypes:
            a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
            b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()
            one = torch.tensor(1.0, device=dev)
            out["fp8"] = 2 * n**3 / timed(lambda: torch._scaled_mm(
                a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
            a = b = None
        nbytes = 1 << 30
    else:
        dev = torch.device("cpu")

        def timed(fn) -> float:
            fn()
            best = float("inf")
            for _ in range(3):
                began = time.perf_counter()
                for _ in range(5):
                    fn()
                best = min(best, (time.perf_counter() - began) / 5)
            return best

        for name, dtype, n in (("fp32", torch.float32, 1024), ("bf16", torch.bfloat16, 512)):
            if name in dtypes:
                a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
                out[name] = 2 * n**3 / timed(lambda a=a, b=b: torch.mm(a, b))
        nbytes = 1 << 27
    src = torch.ones(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    out["memory_bandwidth"] = 2 * nbytes / timed(lambda: dst.copy_(src))
    src = dst = None
    if cuda:
        torch.cuda.empty_cache()
    return out


def benchmark(ctx) -> Outcome:
    offer = offer_of(ctx.market(), ctx.provider)
    bench = offer["devices"][0].get("benchmark") or {}
    offered = {k: float(v) for k, v in (bench.get("matmul_flops_by_dtype") or {}).items()}
    if not offered:
        raise CheckError("the offer carries no matmul figures")
    offered["memory_bandwidth"] = float(bench.get("memory_bandwidth_bytes_per_s", 0))
    say("measuring matmul and copy with plain torch")
    direct = _direct_figures(ctx.cuda, set(offered))
    ratios = {k: ratio(offered[k], direct[k]) for k in offered if k in direct}
    # The provider measures with a few repeats; within a factor of 1.5 of a longer direct
    # measurement on a GPU is honest advertising. The rehearsal's CPU is shared with other
    # work (the same matmul took 0.3 ms or 8 ms in two processes a minute apart on the
    # 2-core host it was written on): its ratios are reported, not judged.
    band = 1.5
    off = {k: r for k, r in ratios.items() if r is None or not 1 / band <= r <= band} \
        if ctx.cuda else {}
    figures = {"offered": offered, "direct": direct, "ratio_offered_to_direct": ratios,
               "host_to_device_bytes_per_s": float(bench.get("host_to_device_bytes_per_s", 0)),
               "sm_count": int(bench.get("sm_count", 0)),
               "interconnect": bench.get("interconnect", "")}
    text = ", ".join(f"{k} {offered[k] / (1e9 if k == 'memory_bandwidth' else 1e12):.3g}"
                     f"{' GB/s' if k == 'memory_bandwidth' else ''} (x{ratios[k]})"
                     for k in sorted(ratios))
    if off:
        return failed(f"offered/direct outside 1/{band:g}..{band:g}: {off}; {text}", **figures)
    return passed(f"{'' if ctx.cuda else 'CPU rehearsal, not judged: '}offered"
                  f" (offered/direct): {text}", **figures)


# -- training, killed once and resumed ----------------------------------------------------

TRAIN_CUDA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 512,
              "intermediate_size": 1376, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 8, "max_position_embeddings": 512,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


def checkpoint_at(market, job_id: str, step: int) -> dict | None:
    """The job once its latest checkpoint is at ``step`` or later, or once it ended; None
    before. CheckError, with its last log lines, as soon as it failed (job_failure)."""
    found = job(market, job_id)
    if why := job_failure(found):
        raise failed_job(market, job_id, why)
    if found["state"] == "SUCCEEDED" or int(found.get("checkpoint_step", 0)) >= step:
        return found
    return None


def _compare_weights(a: Path, b: Path) -> dict:
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    if set(x) != set(y):
        raise CheckError("the two runs' weights have different tensors")
    worst, worst_rel = 0.0, 0.0
    for name in x:
        d = (x[name].double() - y[name].double()).abs()
        worst = max(worst, float(d.max()))
        worst_rel = max(worst_rel, float((d / y[name].double().abs().clamp(min=1e-12)).max()))
    return {"max_abs_diff": worst, "max_rel_diff": worst_rel}


def training_resume(ctx) -> Outcome:
    market = ctx.market()
    if ctx.cuda:
        # ~13M parameters: a checkpoint (weights and AdamW state) is ~150 MB to write and
        # upload, so one every 250 steps
        config, steps, every, batch, seq = TRAIN_CUDA, 2000, 250, 16, 128
    else:
        config, steps, every, batch, seq = (json.loads((ROOT / "examples" / "data" /
                                                        "tiny-llama.json").read_text()),
                                            600, 50, 4, 32)
    work = ctx.root / "training"
    work.mkdir()
    (work / "model.json").write_text(json.dumps(config))
    params = {"model_config": str(work / "model.json"),
              "dataset": str(ROOT / "examples" / "data" / "tiny-corpus.jsonl"),
              "steps": steps, "batch_size": batch, "seq_len": seq, "learning_rate": 3e-4,
              "warmup_steps": 20, "seed": 7, "checkpoint_every": every}
    accel = "cuda" if ctx.cuda else "cpu"
    first = ctx.provider
    job_id = submit(market, job_file(work / "interrupted.toml", "training", params,
                                     accelerator=accel))
    kill_at = 2 * every      # resumed from a checkpoint that is not the first
    say(f"training {job_id}: killing {first} once a checkpoint at step >= {kill_at} is in")
    seen = wait_for(lambda: checkpoint_at(market, job_id, kill_at),
                    f"job {job_id}'s checkpoint at step >= {kill_at}", timeout=600, interval=0.3)
    if seen["state"] != "RUNNING":
        raise CheckError(f"job {job_id} was {seen['state']} before the kill: too few steps")
    killed_after = int(seen.get("checkpoint_step", 0))
    kill_machine(market, first)
    second = ctx.next_provider()
    ctx.provider = second     # the provider of the checks after this one, pass or fail
    start_provider(market, second, not ctx.cuda, ctx.models_dir)
    say(f"{first} killed after checkpoint {killed_after}; {second} started to resume it")
    ended = finish(market, job_id, timeout=900)
    outcomes = [a.get("outcome") for a in ended.get("attempts", [])]
    if "lost" not in outcomes:
        raise CheckError(f"the kill did not lose the lease (attempts: {outcomes})")
    say("the same job again, never interrupted")
    clean_id = submit(market, job_file(work / "clean.toml", "training", params,
                                       accelerator=accel))
    finish(market, clean_id, timeout=900)
    a = results(market, job_id, work / "out-interrupted")
    b = results(market, clean_id, work / "out-clean")
    metrics = json.loads((b / "metrics.json").read_text())
    resumed = int(json.loads((a / "metrics.json").read_text()).get("resumed_from_step", -1))
    bitwise = (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    losses_equal = (a / "loss.jsonl").read_text() == (b / "loss.jsonl").read_text()
    warnings = sum("deterministic" in line.lower() and "warn" in line.lower()
                   for line in job_log(market, job_id).splitlines())
    figures = {"steps": steps, "checkpoint_every": every, "killed_after_checkpoint": killed_after,
               "resumed_from_step": resumed, "attempts": outcomes, "bitwise_equal": bitwise,
               "loss_curve_equal": losses_equal,
               "nondeterminism_warnings_in_log": warnings,
               "tokens_per_s": metrics.get("tokens_per_s"),
               "step_seconds": metrics.get("step_seconds"),
               "parameters": ctx.parameter_count(config)}
    where = "CUDA" if ctx.cuda else "CPU rehearsal"
    if bitwise and losses_equal:
        return passed(f"{where}: killed (SIGKILL) after checkpoint {killed_after}, resumed from"
                      f" step {resumed} on {second}: weights and loss curve bitwise equal to"
                      " an uninterrupted run", **figures)
    diff = _compare_weights(a / "model.safetensors", b / "model.safetensors")
    figures.update(diff)
    tolerance = 10.0 ** math.ceil(math.log10(max(diff["max_abs_diff"], 1e-30)))
    figures["atol_that_holds"] = tolerance
    return failed(f"{where}: resumed run differs from the uninterrupted one: max |diff|"
                  f" {diff['max_abs_diff']:.3g} (allclose holds at atol {tolerance:g}), loss"
                  f" curve {'equal' if losses_equal else 'differs'},"
                  f" {warnings} nondeterminism warnings in the job log", **figures)


# -- the sandbox on a GPU machine -----------------------------------------------------------

# What the sandboxed child reports of itself: a `script` job (runs the client's own code in
# the provider's full sandbox) is the vehicle.
SANDBOX_PROBE = '''
import json, os, resource
from gpumarket.provider.runners import task

seen = {"uid": os.getuid(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0]}
raw = open("/proc/self/cgroup").read()
seen["proc_self_cgroup"] = raw.split()
groups = dict(line.split(":", 2)[1:] for line in raw.split())
seen["cgroup"] = groups.get("memory") or groups.get("")
# v2, v1's memory controller; the mount may start below the path /proc shows (a container)
for base, path, name in (("/sys/fs/cgroup", groups.get(""), "memory.max"),
                         ("/sys/fs/cgroup/memory", groups.get("memory"),
                          "memory.limit_in_bytes")):
    parts = [p for p in (path or "").split("/") if p]
    found = [f for f in ("/".join([base, *parts[i:], name]) for i in range(len(parts)))
             if os.path.exists(f)]
    if parts and found:
        seen["cgroup_memory_max"] = open(found[0]).read().strip()
        break
import torch
seen["torch_cuda_available"] = torch.cuda.is_available()
if seen["torch_cuda_available"]:
    torch.cuda.init()
    seen["torch_device_count"] = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    seen["device_name"], seen["device_uuid"] = props.name, str(props.uuid)
    x = torch.ones(256 << 20, device="cuda")           # 1 GiB
    seen["allocated_bytes"] = x.numel() * 4
    seen["sum_ok"] = float(x.sum()) == float(256 << 20)
    torch.cuda.synchronize()
else:
    seen["torch_device_count"] = 0
    x = torch.ones(64 << 20)                           # 256 MiB on the CPU
    seen["allocated_bytes"] = x.numel() * 4
    seen["sum_ok"] = float(x.sum()) == float(64 << 20)
try:
    import pynvml
    pynvml.nvmlInit()
    seen["nvml_count"] = pynvml.nvmlDeviceGetCount()
    pynvml.nvmlShutdown()
except Exception as exc:
    seen["nvml_error"] = f"{type(exc).__name__}: {exc}"[:200]
(task.output_dir() / "sandbox.json").write_text(json.dumps(seen))
'''


def sandbox(ctx) -> Outcome:
    offer = ctx.offer()
    if "JOB_KIND_SCRIPT" not in offer.get("kinds", []):
        isolation = next((ln.split("job isolation:", 1)[1].strip() for ln in
                          ctx.provider_log().splitlines() if "job isolation:" in ln),
                         "see gpumarket-provider doctor")
        raise CheckError("the provider does not run script jobs: this host does not isolate"
                         f" a job fully ({isolation})"[:400])
    work = ctx.root / "sandbox"
    work.mkdir()
    (work / "probe.py").write_text(SANDBOX_PROBE)
    job_id = submit(ctx.market(), job_file(work / "sandbox.toml", "script",
                                           {"code": str(work / "probe.py"), "entry": "probe.py"},
                                           accelerator="cuda" if ctx.cuda else "cpu"))
    finish(ctx.market(), job_id, timeout=600)
    seen = json.loads((results(ctx.market(), job_id, work / "out") / "sandbox.json").read_text())
    problems = []
    if not seen.get("sum_ok"):
        problems.append("the allocation inside the sandbox did not hold its values")
    if ctx.cuda:
        uuids = [d.get("uuid", "") for d in offer.get("devices", [])]
        visible = seen.get("cuda_visible_devices") or ""
        if visible not in uuids:
            problems.append(f"CUDA_VISIBLE_DEVICES {visible!r} is not one leased GPU")
        if seen.get("torch_device_count") != 1:
            problems.append(f"torch sees {seen.get('torch_device_count')} GPUs, not the lease's 1")
        if visible.removeprefix("GPU-") != seen.get("device_uuid", ""):
            problems.append(f"torch's GPU {seen.get('device_uuid')} is not the leased {visible}")
    else:
        if seen.get("cuda_visible_devices") != "" or seen.get("torch_device_count"):
            problems.append("a CPU lease's job sees a GPU")
    own_uid = seen.get("uid") != 0
    limit = seen.get("cgroup_memory_max", "not readable by the job")
    where = "GPU" if ctx.cuda else "CPU rehearsal"
    text = (f"{where}: the job ({'own uid ' + str(seen.get('uid')) if own_uid else 'uid 0'},"
            f" cgroup memory.max {limit}, RLIMIT_AS {seen.get('rlimit_as')}) sees"
            f" CUDA_VISIBLE_DEVICES={seen.get('cuda_visible_devices')!r}, torch"
            f" {seen.get('torch_device_count')} device(s), NVML"
            f" {seen.get('nvml_count', seen.get('nvml_error'))};"
            f" {seen.get('allocated_bytes', 0) >> 20} MiB allocated"
            f"{' on the GPU after torch.cuda.init()' if ctx.cuda else ''}")
    figures = {"seen_in_job": seen}
    if problems:
        return failed("; ".join(problems) + " | " + text, **figures)
    return passed(text, **figures)


# -- Blender ---------------------------------------------------------------------------------

def blender(ctx) -> Outcome:
    if importlib.util.find_spec("bpy") is None:
        return skipped("bpy (Blender) is not installed in this Python (pip install"
                       " 'gpumarket[render]')")
    if "cycles" not in ctx.offer().get("engines", []):
        raise CheckError("bpy imports here but the provider does not offer cycles")
    work = ctx.root / "render"
    work.mkdir()
    params = {"scene": str(ROOT / "examples" / "scene.blend"), "frame_start": 1,
              "frame_end": 2, "resolution_x": 64, "resolution_y": 48, "samples": 8,
              "device": "auto"}
    job_id = submit(ctx.market(), job_file(work / "render.toml", "render", params,
                                           accelerator="cuda" if ctx.cuda else "cpu"))
    finish(ctx.market(), job_id, timeout=600)
    out = results(ctx.market(), job_id, work / "out")
    frames = sorted(p.name for p in out.glob("frame_*.png"))
    part = next(out.glob("render-*.json"), None)
    info = json.loads(part.read_text()) if part else {}
    figures = {"frames": len(frames), "device": info.get("device", ""),
               "seconds_per_frame": info.get("seconds") or info.get("seconds_per_frame")}
    if len(frames) != 2:
        return failed(f"{len(frames)} frames rendered, not 2", **figures)
    if ctx.cuda and str(info.get("device", "")).upper() not in ("CUDA", "OPTIX"):
        return failed(f"rendered on {info.get('device')!r}, not on the GPU", **figures)
    return passed(f"2 frames rendered with Cycles on {info.get('device', '?')}", **figures)
