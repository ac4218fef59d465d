"""The slices check of scripts/gpu_check.py (issue 35): the first GPU offered as two slices
(provider/inventory.sliced, shares 0.5 and 0.5) and one real job process on each at once,
started by the provider's executor with the environment a lease on that slice gets
(executor.job_env + slice_env) and held to its share by the runners' start
(runners/base.apply_share). Each job sees the card, allocates 60 % of its share, waits until
the other has too (both on the card at once), then asks for as much again — past its share:
that allocation must fail with an out-of-memory error in that job, and each job's first
allocation must still hold its values after the other's failed. Whether an MPS daemon holds
the slices' compute shares is reported, not required.

On the CPU rehearsal: the CPU as two slices, each job's threads pinned to its own cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from gpu_checks import Outcome, failed, passed, say, skipped
from gpu_market import CheckError

PROBE = r'''
import json, os, sys, time
from pathlib import Path
from gpumarket.provider.runners.base import apply_share

notes = apply_share()
import torch

work, peer = Path(sys.argv[1]), Path(os.environ["SLICE_PEER"])
seen = {"notes": notes, "cores": sorted(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "mps_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "")}


def wait(name):
    end = time.monotonic() + 300
    while not (peer / name).exists():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


if torch.cuda.is_available():
    share = float(os.environ["GPUMARKET_MEMORY_FRACTION"])
    free, total = torch.cuda.mem_get_info()
    seen.update(device_count=torch.cuda.device_count(), total_bytes=total, share=share,
                device_uuid=str(torch.cuda.get_device_properties(0).uuid))
    block = int(total * share * 0.6) // 4
    first = torch.full((block,), 7.0, device="cuda")
    torch.cuda.synchronize()
    seen["allocated_bytes"] = block * 4
    (work / "allocated").write_text("1")
    seen["both_at_once"] = wait("allocated")
    try:
        second = torch.full((block,), 3.0, device="cuda")
        torch.cuda.synchronize()
        seen["past_share"] = "allocated"
    except torch.OutOfMemoryError as exc:
        seen["past_share"] = "out of memory: " + str(exc).splitlines()[0][:160]
    (work / "tried").write_text("1")
    wait("tried")
    seen["values_ok"] = bool((first == 7.0).all().item())
else:
    (work / "allocated").write_text("1")
    seen["both_at_once"] = wait("allocated")
print("seen " + json.dumps(seen), flush=True)
with open(os.environ["GPUMARKET_REPORT_FILE"], "a") as out:
    out.write(json.dumps({"event": "done", "metrics": {}}) + "\n")
'''


async def _run_two(devices, root: Path) -> list[dict]:
    """The probe on each of ``devices`` at once; what each saw."""
    from gpumarket.provider.executor import JobProcess, job_env, slice_env

    pkg = root / "pkgs"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "slice_probe.py").write_text(PROBE)
    works = [root / f"slice{d.index}" for d in devices]
    procs = []
    for d, work, peer in zip(devices, works, reversed(works)):
        work.mkdir(parents=True, exist_ok=True)
        env = {**job_env(work, d.visible_id if d.is_cuda else "",
                         None if d.is_cuda else d.cpu_cores),
               **slice_env([d]), "SLICE_PEER": str(peer),
               "PYTHONPATH": os.pathsep.join([str(pkg), *sys.path])}

        async def on_report(r):
            pass

        procs.append(JobProcess("slice_probe", work, env, on_report, max_runtime_s=600,
                                grace_s=5.0))
    outcomes = await asyncio.gather(*(p.run() for p in procs))
    seen = []
    for d, work, outcome in zip(devices, works, outcomes):
        log = (work / "job.log").read_text(errors="replace")
        line = next((x for x in log.splitlines() if x.startswith("seen ")), None)
        if not outcome.succeeded or line is None:
            raise CheckError(f"the job on slice {d.index} ended without its figures:"
                             f" {outcome.error or log.strip().splitlines()[-1:]}")
        seen.append(json.loads(line[5:]))
    return seen


def slices(ctx) -> Outcome:
    from gpumarket.provider.inventory import cpu_device, mps_running, sliced

    if ctx.cuda:
        card = ctx.devices[0]
        if card.mig_parent_uuid:
            return skipped("the first device is a MIG instance: MIG instances are not sliced")
    else:
        card = cpu_device()
        if len(card.cores) < 2:
            return skipped("the CPU rehearsal needs two cores for two slices")
    whole, *parts = sliced([card], {card.index: (0.5, 0.5)})
    say(f"two jobs on two slices of {whole.name} ({whole.uuid})")
    seen = asyncio.run(_run_two(parts, ctx.root / "slices"))
    problems = []
    if not all(s["both_at_once"] for s in seen):
        problems.append("the two jobs did not run at once")
    if ctx.cuda:
        mps = mps_running()
        for d, s in zip(parts, seen):
            if s.get("device_count") != 1 or s["cuda_visible_devices"] != whole.uuid:
                problems.append(f"slice {d.index}'s job sees {s.get('device_count')} devices"
                                f" ({s['cuda_visible_devices']!r}), not its card")
            if not str(s.get("past_share", "")).startswith("out of memory"):
                problems.append(f"slice {d.index}'s job allocated past its share"
                                f" ({s.get('past_share')})")
            if not s.get("values_ok"):
                problems.append(f"slice {d.index}'s first allocation lost its values")
        gib = seen[0]["allocated_bytes"] / 2**30
        text = (f"two jobs at once on two 0.5 slices of {whole.name}: each allocated"
                f" {gib:.1f} GiB (60 % of its share) and failed past its share in its own"
                f" process ({seen[0].get('past_share', '')[:60]}); values intact;"
                f" compute share {'held by MPS' if mps else 'not held (no MPS daemon)'}")
        figures = {"seen_in_jobs": seen, "mps": mps}
    else:
        for d, s in zip(parts, seen):
            if s["cores"] != list(d.cores) or s["threads"] != len(d.cores):
                problems.append(f"slice {d.index}'s job runs on cores {s['cores']} with"
                                f" {s['threads']} threads, not its {list(d.cores)}")
        text = (f"CPU rehearsal: two jobs at once on two slices, on cores"
                f" {seen[0]['cores']} and {seen[1]['cores']}")
        figures = {"seen_in_jobs": seen}
    if problems:
        return failed("; ".join(problems) + " | " + text, **figures)
    return passed(text, **figures)
