"""Render checks with real Blender renders (bpy, Cycles, this CPU): what a check's preview
pass costs, how far honest previews are from the delivered frames, and which doctorings of
one frame it catches (docs/verification.md, Frames). Used by bench/verification.py; run alone
it prints its figures, the last line one JSON object:

    .venv/bin/python bench/render_checks.py [--frames 24]

The job: examples/make_scene.py's turning monkey head (320x240, 16 samples, denoised; a turn
over 48 frames, 7.5 degrees a frame), frames 1..N, rendered by the provider's render runner.
The check: the same runner in check mode (a sample of frames exactly, every frame as a
preview), and the same passes again from a second process pinned to one Cycles thread (the
runner's own functions; the runner has no thread setting), each compared by the broker's own
``kinds.render`` compare. Then each doctoring below replaces one frame of the delivery, in
turn every frame of the job, and the preview pass alone is asked whether it still agrees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RUNNER = "gpumarket.provider.runners.render"
# The doctorings that deliver a frame that was not rendered as asked at all (rather than
# rendered more cheaply): what bench/verification.py's detection_min_render_frame_not_rendered
# is the least over.
NOT_RENDERED = ("blank", "noise", "another_frame", "patch_32px")

ONE_THREAD = """
import json, sys
from pathlib import Path
from gpumarket.provider.runners import render as r
job = json.loads(Path(sys.argv[1]).read_text())
out = Path(sys.argv[2])
scene = r.open_scene(job["scene"])
scene.render.engine = "CYCLES"
scene.render.threads_mode, scene.render.threads = "FIXED", 1
r.use_device(scene, "cpu", False)
for f in job["frames"]:
    r.render_frame(scene, f, out, r.frame_name(f))
r.render_previews(scene, range(job["first"], job["last"] + 1), out,
                  r.png_size(out / r.frame_name(job["frames"][0])))
"""


def make_scene(path: Path) -> Path:
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_scene.py"), str(path),
                    "--frames", "48"], check=True, capture_output=True, timeout=300)
    return path


def run_runner(work: Path, scene: Path, last: int, samples: int = 0, resolution: int = 0,
               check: dict | None = None) -> tuple[dict[str, Path], dict, float]:
    """The provider's render runner on frames 1..``last`` (or, with ``check``, as a check
    lease runs it): (its PNGs by name, its render-*.json summary, its wall seconds)."""
    work.mkdir(parents=True)
    params = {"scene": "scene.blend", "frame_start": 1, "frame_end": last,
              "samples": samples, "resolution_x": resolution * 4 // 3 if resolution else 0,
              "resolution_y": resolution}
    job = {"job_id": "bench", "attempt": 1, "kind": "render", "device": "cpu",
           "params": params, "inputs": {"scene.blend": str(scene)}, "checkpoint_every": 0,
           "resume_from": None, **(check or {})}
    (work / "job.json").write_text(json.dumps(job))
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", RUNNER, str(work)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
    took = time.perf_counter() - began
    out = work / "outputs"
    summary = json.loads(next(out.glob("render-*.json")).read_text())
    return {p.name: p for p in out.glob("*.png")}, summary, took


def one_thread(work: Path, scene: Path, frames: list[int], first: int, last: int
               ) -> dict[str, Path]:
    """The check's two passes from the runner's own functions, on one Cycles thread."""
    work.mkdir(parents=True)
    (work / "job.json").write_text(json.dumps({"scene": str(scene), "frames": frames,
                                               "first": first, "last": last}))
    subprocess.run([sys.executable, "-c", ONE_THREAD, str(work / "job.json"), str(work)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=3600)
    return {p.name: p for p in work.glob("*.png")}


def doctorings(honest: dict[str, Path], fewer: dict[str, Path], half: dict[str, Path],
               frame: int, last: int, root: Path) -> dict[str, Path]:
    """Each way of delivering frame ``frame`` without rendering it as asked, as a file."""
    from PIL import Image

    from gpumarket.kinds.render import frame_name

    name = frame_name(frame)
    pixels = np.asarray(Image.open(honest[name]).convert("RGBA"))
    h, w = pixels.shape[:2]
    rng = np.random.default_rng(frame)

    def save(tag: str, array: np.ndarray) -> Path:
        path = root / f"{tag}-{name}"
        Image.fromarray(array.astype(np.uint8), "RGBA").save(path)
        return path

    def patch(size: int) -> np.ndarray:
        out = pixels.copy()
        y, x = rng.integers(0, h - size), rng.integers(0, w - size)
        out[y:y + size, x:x + size, :3] = (255, 0, 255)
        return out

    blank = np.zeros_like(pixels)
    blank[..., 3] = 255
    noise = rng.integers(0, 256, pixels.shape)
    noise[..., 3] = 255
    upscaled = np.asarray(Image.open(half[name]).convert("RGBA").resize((w, h),
                                                                          Image.Resampling.BICUBIC))
    return {
        "blank": save("blank", blank),
        "noise": save("noise", noise),
        "another_frame": honest[frame_name((frame - 1 + last // 2) % last + 1)],
        "neighbour_frame": honest[frame_name(frame - 1 if frame > 1 else 2)],
        "patch_32px": save("patch32", patch(32)),
        "patch_8px": save("patch8", patch(8)),
        "fewer_samples": fewer[name],
        "half_resolution_upscaled": save("half", upscaled),
        "shifted_one_pixel": save("shift", np.roll(pixels, 1, axis=1)),
    }


def render_checks(last: int = 24) -> dict:
    from gpumarket.kinds import render

    values = {"frame_start": 1, "frame_end": last}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        scene = make_scene(root / "scene.blend")
        honest, job, job_wall = run_runner(root / "job", scene, last)
        scope = render.KIND.check_scope(values, 0, 0, {}, 0)
        check = {"check_of": "bench-check", "check_frames": scope["frames"],
                 "check_from_row": 0}
        replay, replay_m, replay_wall = run_runner(root / "check", scene, last, check=check)
        single = one_thread(root / "check-1", scene, scope["frames"], 1, last)
        expect = {n: p for n, p in honest.items() if render.FRAME_RE.match(n)}
        verdicts, block = [], []
        for got in (replay, single):
            began = time.perf_counter()
            verdicts.append(render.KIND.compare(expect, got, scope))
            compare_s = time.perf_counter() - began
            for f in range(1, last + 1):
                block.append(render.preview_difference(got[render.preview_name(f)],
                                                        expect[render.frame_name(f)]))
        tiebreak = render.KIND.compare({n: p for n, p in replay.items()}, single,
                                       {**scope, "replays": True})
        # Doctorings that need a render of their own: the frame at a quarter of the
        # samples, and at half the resolution (upscaled).
        fewer, _, _ = run_runner(root / "fewer", scene, last, samples=4)
        half, _, _ = run_runner(root / "half", scene, last, resolution=120)
        caught: dict[str, list[bool]] = {}
        exact_caught: dict[str, list[bool]] = {}
        bad = root / "bad"
        bad.mkdir()
        for f in range(1, last + 1):
            for name, path in doctorings(honest, fewer, half, f, last, bad).items():
                delivered = {**expect, render.frame_name(f): path}
                ok, _ = render.compare_previews(delivered, replay, [f, f])
                caught.setdefault(name, []).append(not ok)
                # (a replay renders any frame as the job did: the sampled ones were
                # bitwise equal, false_positives; so the honest frame stands for it)
                ok, _ = render.KIND.compare(delivered, {render.frame_name(f):
                                                        honest[render.frame_name(f)]},
                                            {"frames": [f]})
                exact_caught.setdefault(name, []).append(not ok)
    # The cost ratio from one process (the check's), its exact frames and its previews
    # rendered one after the other, so that the load beside it weighs on both alike.
    frame_s = replay_m["render_seconds"] / replay_m["frames_rendered"]
    preview_s = replay_m["preview_seconds"] / replay_m["preview_frames"]
    return {
        "render_frames": last,
        "render_job_frame_s": round(sum(job["seconds"].values()) / len(job["seconds"]), 3),
        "render_frame_s": round(frame_s, 3),
        "render_preview_frame_s": round(preview_s, 3),
        "render_preview_cost_ratio": round(preview_s / frame_s, 4),
        "render_check_startup_s": round(replay_wall - replay_m["render_seconds"]
                                        - replay_m["preview_seconds"], 2),
        "render_job_wall_s": round(job_wall, 2),
        "render_compare_s_per_frame": round(compare_s / last, 4),
        "render_honest_checks": len(verdicts),
        "render_false_positives": sum(not ok for ok, _ in verdicts) + (not tiebreak[0]),
        "render_honest_preview_block_max": round(max(block), 2),
        "render_preview_tolerance": render.PREVIEW_TOLERANCE,
        "render_preview_caught": {k: round(sum(v) / len(v), 4) for k, v in caught.items()},
        "render_exact_caught": {k: round(sum(v) / len(v), 4) for k, v in exact_caught.items()},
    }


def detection(rc: dict, trials: int, simulate_jobs, simulate_frames, floor: float) -> dict:
    """bench/verification.py's render figures from ``rc`` (``render_checks``): what a check
    costs over a job of 10, 100 and 1,000 frames (at the floor rate ``floor`` too), and for
    each doctoring of one frame the probability a new provider doing it on every job is
    caught within 20 jobs (verification's simulators, given); ``rc``'s own figures too."""
    from gpumarket.kinds import render

    figures = dict(rc)
    print(f"render checks (real bpy renders, {rc['render_frames']} frames): a preview"
          f" costs {rc['render_preview_cost_ratio']} of a frame"
          f" ({rc['render_preview_frame_s']}s against {rc['render_frame_s']}s); honest"
          f" previews differ by at most {rc['render_honest_preview_block_max']} of 255 in"
          f" a block (tolerance {rc['render_preview_tolerance']}); honest checks judged"
          " wrong:"
          f" {rc['render_false_positives']}; one doctored frame caught by the previews:"
          f" {rc['render_preview_caught']}")
    for frames in (10, 100, 1000):
        # (a check at the floor rate, of a warmed-up provider: k exact frames and n
        # previews over the job's n frames)
        cost = (render.check_frames(frames) + rc["render_preview_cost_ratio"]
                * (frames if frames <= render.MAX_PREVIEW_FRAMES else 0)) / frames
        figures[f"render_check_cost_over_job_{frames}_frames"] = round(cost, 4)
        figures[f"render_check_overhead_{frames}_frames"] = round(
            floor * cost, 4)
        for doctoring, p in rc["render_preview_caught"].items():
            caught = simulate_frames(frames, 1, 20, trials, 4, p)
            figures[f"detection_p_20_jobs_one_frame_of_{frames}_{doctoring}"] = round(
                caught, 4)
        print(f"renders of {frames} frames, one doctored frame in each job: caught within"
              f" 20 jobs with p = " + ", ".join(
                  f"{d} {figures[f'detection_p_20_jobs_one_frame_of_{frames}_{d}']}"
                  for d in rc["render_preview_caught"])
              + f"; a check costs {cost:.3f} of the job (at the floor rate"
              f" {figures[f'render_check_overhead_{frames}_frames']})")
    # The cheat that saves work renders every frame cheaply: each check's exact sample
    # holds such a frame, and a frame of any doctoring differed from its exact replay
    # (render_exact_caught) in this share of the frames tried.
    for doctoring in ("fewer_samples", "half_resolution_upscaled"):
        p = 1 - (1 - rc["render_exact_caught"][doctoring]) ** render.check_frames(1000)
        figures[f"detection_p_20_jobs_every_frame_{doctoring}"] = round(
            simulate_jobs(p, 20, trials, 7), 4)
    not_rendered = {k: v for k, v in figures.items()
                    if k.startswith("detection_p_20_jobs_one_frame_of_")
                    and k.endswith(NOT_RENDERED)}
    figures["detection_min_render_frame_not_rendered"] = min(not_rendered.values())
    return figures


def exact_compare_s(size: tuple[int, int] = (1920, 1080), frames: int = 6) -> float:
    """The broker's time to compare one sampled frame exactly (both PNGs decoded by Pillow,
    every pixel compared: ``compare_sample``), on frames of ``size`` pixels of noise (which
    compresses least, so decodes slowest); seconds a frame, the median of ``frames``."""
    from PIL import Image

    from gpumarket.kinds import render

    rng = np.random.default_rng(0)
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for f in range(1, frames + 1):
            pixels = rng.integers(0, 256, (size[1], size[0], 4), dtype=np.uint8)
            pixels[..., 3] = 255
            files = {}
            for side in ("delivered", "replayed"):
                files[side] = Path(tmp) / f"{side}-{f}.png"
                Image.fromarray(pixels, "RGBA").save(files[side])
            began = time.perf_counter()
            same, _ = render.compare_sample({render.frame_name(f): files["delivered"]},
                                            {render.frame_name(f): files["replayed"]}, [f])
            times.append(time.perf_counter() - began)
            assert same
    return float(np.median(times))


def sample_figures(trials: int, simulate_frames, floor: float) -> dict:
    """bench/verification.py's figures of a check's exact sample alone (no Blender): for
    leases of 10, 100, 1,000 and 10,000 frames, the frames a check renders again, what one
    check of a new provider (a warm-up check: every job) and one at the floor rate cost in
    frames rendered over the lease's own, the probability one doctored frame is caught
    within 20 checked jobs by the sample alone; and how many passes of the broker's verdict
    loop compare a sample of full-HD frames (SAMPLE_COMPARE_S each)."""
    from gpumarket.kinds import render

    figures = {}
    per_frame = exact_compare_s()
    figures["render_exact_compare_s_1080p"] = round(per_frame, 4)
    for frames in (10, 100, 1000, 10_000):
        k = render.check_frames(frames)
        caught = simulate_frames(frames, 1, 20, trials, 4)
        # (a lease too long to preview has the sample alone in a real check too)
        alone = "sample_only" if frames <= render.MAX_PREVIEW_FRAMES else "no_previews"
        passes = max(1, int(np.ceil(k * per_frame / render.SAMPLE_COMPARE_S)))
        figures.update({f"render_sample_frames_{frames}_frames": k,
                        f"render_sample_cost_warmup_{frames}_frames": round(k / frames, 4),
                        f"render_sample_cost_steady_{frames}_frames": round(
                            floor * k / frames, 4),
                        f"render_sample_compare_passes_1080p_{frames}_frames": passes,
                        f"detection_p_20_jobs_one_frame_of_{frames}_{alone}": round(
                            caught, 4)})
        print(f"a lease of {frames} frames: a check renders {k} again ({k / frames:.3f} of"
              f" its frames at a warm-up check, {floor * k / frames:.4f} at the floor rate),"
              f" compared in {passes} pass(es) of the verdict loop at 1920x1080"
              f" ({per_frame:.3f}s a frame); one doctored frame caught within 20 jobs by the"
              f" sample alone with p = {caught:.4f}")
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=24)
    args = ap.parse_args()
    figures = render_checks(args.frames)
    for k, v in figures.items():
        print(f"{k}: {v}")
    print(json.dumps(figures))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
