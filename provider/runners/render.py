"""Render frames of a Blender scene with Cycles, headless, resumable per frame.

    python -m gpumarket.provider.runners.render WORKDIR

Reads WORKDIR/job.json, opens the scene with scripts off (the equivalent of ``blender -Y``:
no auto-run text blocks, no Python drivers), renders the frames of its part of the range
on OptiX, CUDA or the CPU, and writes outputs/frame_NNNNNN.png plus one
outputs/render-FIRST-LAST.json with the device and the seconds of every frame.

A checkpoint is the frames done so far (``frames.tar``) and ``state.json``; a resumed
attempt unpacks them into outputs/ and renders only the missing frames.
"""

from __future__ import annotations

from gpumarket.provider.runners.base import listen_for_drain, read_job

listen_for_drain()

import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from gpumarket.proto.errors import InvalidArgument  # noqa: E402
from gpumarket.kinds.render import (  # noqa: E402
    part_frames, preview_frames, preview_name, preview_size,
)
from gpumarket.provider.runners.base import (  # noqa: E402
    Cadence, JobError, drain_requested, publish_checkpoint, run_main,
)
from gpumarket.provider.runners.report import Reporter  # noqa: E402

if TYPE_CHECKING:
    from gpumarket.kinds.runner_job import RunnerJob

FRAME_RE = re.compile(r"^frame_(\d{6})\.png$")


def frame_name(frame: int) -> str:
    return f"frame_{frame:06d}.png"


def frames_of(job: RunnerJob) -> list[int]:
    p = job.params
    if job.check_frames:     # a check renders only these frames again
        return sorted(set(job.check_frames))
    try:
        return list(part_frames(int(p.get("frame_start", 0)), int(p.get("frame_end", 0)),
                                job.part, job.parts))
    except InvalidArgument as exc:
        raise JobError(str(exc)) from exc


def previews_of(job: RunnerJob) -> range:
    """A check's preview pass: every frame the checked lease rendered itself (its part's
    frames after the ``check_from_row`` it resumed with), or none (not a check of frames, or
    a lease too long to preview: kinds.render decides, as the broker's check_scope does)."""
    if not job.check_frames:
        return range(0)
    p = job.params
    values = {"frame_start": int(p.get("frame_start", 0)), "frame_end": int(p.get("frame_end", 0))}
    try:
        return preview_frames(values, job.part, job.parts, job.check_from_row)
    except InvalidArgument as exc:
        raise JobError(str(exc)) from exc


def restore(job: RunnerJob, out: Path, frames: list[int]) -> set[int]:
    """Unpack the resumed checkpoint's frames into ``out``; return the frames it had.
    Only frame PNGs of this part's range are taken; anything else in the tar is refused."""
    resume = job.resume_from
    if not resume:
        return set()
    wanted = set(frames)
    done = set()
    try:
        with tarfile.open(Path(resume) / "frames.tar", "r:") as tar:
            for member in tar.getmembers():
                m = FRAME_RE.match(member.name)
                if not (m and member.isfile() and int(m.group(1)) in wanted):
                    raise JobError(f"checkpoint: unexpected entry {member.name!r} in frames.tar")
                with tar.extractfile(member) as src, open(out / member.name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                done.add(int(m.group(1)))
    except tarfile.TarError as exc:
        raise JobError(f"checkpoint: frames.tar is unreadable ({exc})") from exc
    return done


def checkpoint(workdir: Path, out: Path, done: set[int], report: Reporter) -> float:
    """Write checkpoints/step-N (N = frames done) atomically; report it; return its seconds."""
    began = time.perf_counter()
    step = len(done)

    def write(tmp: Path) -> None:
        with tarfile.open(tmp / "frames.tar", "w", format=tarfile.PAX_FORMAT) as tar:
            for frame in sorted(done):
                info = tar.gettarinfo(out / frame_name(frame), arcname=frame_name(frame))
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                info.mode = 0o644
                with open(out / frame_name(frame), "rb") as f:
                    tar.addfile(info, f)
        (tmp / "state.json").write_text(json.dumps({"step": step, "frames": sorted(done)}))

    final = publish_checkpoint(workdir / "checkpoints", step, write)
    took = time.perf_counter() - began
    report.checkpoint(step, str(final.relative_to(workdir)), took)
    return took


def open_scene(path: str):
    """Open the .blend with every kind of scene script off."""
    import bpy

    bpy.context.preferences.filepaths.use_scripts_auto_execute = False
    try:
        with quiet():
            bpy.ops.wm.open_mainfile(filepath=path, load_ui=False, use_scripts=False)
    except RuntimeError as exc:
        raise JobError(f"scene: Blender cannot open it ({str(exc).splitlines()[0]})") from exc
    return bpy.context.scene


def use_device(scene, wanted: str, has_cuda: bool) -> tuple[str, bool]:
    """Point Cycles at the job's device; return (what it renders on, whether a GPU)."""
    import bpy

    wanted = wanted or "auto"
    order = {"auto": ["OPTIX", "CUDA"] if has_cuda else [], "cpu": [],
             "cuda": ["CUDA"], "optix": ["OPTIX"]}[wanted]
    prefs = bpy.context.preferences.addons["cycles"].preferences
    for backend in order:
        try:
            prefs.compute_device_type = backend
        except TypeError:
            continue
        with quiet():
            prefs.get_devices()
        gpus = [d for d in prefs.devices if d.type == backend]
        if gpus:
            for d in prefs.devices:
                d.use = d.type == backend
            scene.cycles.device = "GPU"
            return f"{backend}: " + ", ".join(d.name for d in gpus), True
    if wanted in ("cuda", "optix"):
        raise JobError(f"device {wanted}: Blender finds no {wanted.upper()} device on this"
                       " provider")
    scene.cycles.device = "CPU"
    return f"CPU: {os.cpu_count()} threads", False


def strip_text_chunks(path: Path) -> None:
    """Drop a PNG's text chunks: Blender writes the provider's file path and render timings
    there. Without them the same frame is the same bytes on every provider and attempt."""
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise JobError(f"{path.name}: Blender did not write a PNG")
    kept, i = [data[:8]], 8
    while i + 12 <= len(data):
        length = struct.unpack(">I", data[i:i + 4])[0]
        chunk = data[i:i + 12 + length]
        if chunk[4:8] not in (b"tEXt", b"iTXt", b"zTXt"):
            kept.append(chunk)
        i += 12 + length
    path.write_bytes(b"".join(kept))


@contextlib.contextmanager
def quiet():
    """Keep Blender's own per-tile chatter (written by C code to fd 1) out of the job log."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def render_frame(scene, frame: int, out: Path, name: str) -> None:
    """Render ``frame`` of the scene as it is set up now into out/``name`` (through a
    temporary name, its text chunks dropped)."""
    import bpy

    scene.frame_set(frame)
    scene.render.filepath = str(out / ".rendering")
    try:
        with quiet():
            bpy.ops.render.render(write_still=True)
    except RuntimeError as exc:
        raise JobError(f"frame {frame}: Blender failed ({str(exc).splitlines()[0]})") from exc
    strip_text_chunks(out / ".rendering.png")
    os.replace(out / ".rendering.png", out / name)


def render_previews(scene, frames: range, out: Path, frame_size: tuple[int, int]) -> float:
    """A check's cheap pass over every frame of the checked lease: each rendered again at
    kinds.render.preview_size of the job's resolution, with its samples and seed, into
    out/preview_NNNNNN.png; the broker compares each with the delivered frame reduced to the
    same size (docs/verification.md, Frames). ``frame_size``: the size Blender wrote a full
    frame at (a sampled frame's); a preview that Blender's rounding (or a border crop) made
    a pixel off is brought to exactly preview_size of it, since the broker accepts no other.
    Returns its seconds."""
    began = time.perf_counter()
    r = scene.render
    # Blender's own rule for the size it renders at (integer percent of the resolution)
    width = r.resolution_x * r.resolution_percentage // 100
    height = r.resolution_y * r.resolution_percentage // 100
    r.resolution_x, r.resolution_y = preview_size(width, height)
    r.resolution_percentage = 100
    want = preview_size(*frame_size)
    for frame in frames:
        if drain_requested():
            raise JobError("drained during the preview pass (a check renders it again)")
        render_frame(scene, frame, out, preview_name(frame))
        fit(out / preview_name(frame), want)
    took = time.perf_counter() - began
    print(f"previews of frames {frames[0]}-{frames[-1]} at {r.resolution_x}x{r.resolution_y}"
          f" rendered in {took:.2f}s", flush=True)
    return took


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's header."""
    data = path.read_bytes()[:24]
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise JobError(f"{path.name}: Blender did not write a PNG")
    return struct.unpack(">II", data[16:24])


def fit(path: Path, size: tuple[int, int]) -> None:
    """Bring a preview to exactly ``size`` (averaging) where it is not."""
    if png_size(path) == size:
        return
    from PIL import Image

    with Image.open(path) as img:
        small = img.resize(size, Image.Resampling.BOX)
    small.save(path)


def render(workdir: Path, report: Reporter) -> None:
    job = read_job(workdir)
    p = job.params
    frames = frames_of(job)
    out = workdir / "outputs"
    out.mkdir(exist_ok=True)
    done = restore(job, out, frames)
    if done:
        report.send("resumed", step=len(done))
        print(f"resuming: {len(done)} of {len(frames)} frames already rendered", flush=True)
    scene_path = job.inputs.get(p.get("scene", ""))
    if not scene_path:
        raise JobError("scene: no .blend among the job's inputs")
    import bpy

    scene = open_scene(scene_path)
    scene.render.engine = "CYCLES"
    for field in ("resolution_x", "resolution_y"):
        if p.get(field):
            setattr(scene.render, field, int(p[field]))
    if p.get("samples"):
        scene.cycles.samples = int(p["samples"])
    scene.render.image_settings.file_format = "PNG"
    scene.render.use_file_extension = True
    device, on_gpu = use_device(scene, p.get("device", ""), job.device == "cuda")
    print(f"rendering frames {frames[0]}-{frames[-1]} of {Path(scene_path).name} at"
          f" {scene.render.resolution_x}x{scene.render.resolution_y},"
          f" {scene.cycles.samples} samples, Blender {bpy.app.version_string}, {device}",
          flush=True)
    cadence = Cadence.for_job(job)
    seconds: dict[int, float] = {}
    began = time.perf_counter()
    checkpoint_s = 0.0
    for frame in frames:
        if frame in done:
            continue
        if drain_requested():
            checkpoint(workdir, out, done, report)
            report.drained(len(done))
            return
        start = time.perf_counter()
        render_frame(scene, frame, out, frame_name(frame))
        seconds[frame] = time.perf_counter() - start
        done.add(frame)
        mean = sum(seconds.values()) / len(seconds)
        print(f"frame {frame} rendered in {seconds[frame]:.2f}s ({len(done)}/{len(frames)})",
              flush=True)
        report.progress(len(done), len(frames), seconds_per_frame=mean,
                        frames_per_hour=3600 / mean if mean > 0 else 0.0)
        if len(done) < len(frames) and (drain_requested() or cadence.due(len(done))):
            took = checkpoint(workdir, out, done, report)
            checkpoint_s += took
            cadence.written(took)
    elapsed = time.perf_counter() - began
    missing = [f for f in frames if not (out / frame_name(f)).is_file()]
    if missing:
        raise JobError(f"{len(missing)} frames have no image (first: {missing[0]})")
    previews = previews_of(job)
    preview_s = render_previews(scene, previews, out, png_size(out / frame_name(frames[0]))
                                ) if previews else 0.0
    rendered = len(seconds)
    mean = sum(seconds.values()) / rendered if rendered else 0.0
    metrics = {"frames": float(len(frames)), "frames_rendered": float(rendered),
               "resumed_frames": float(len(frames) - rendered),
               "seconds_per_frame": mean,
               "frames_per_hour": rendered * 3600 / elapsed if elapsed > 0 else 0.0,
               "render_seconds": elapsed, "checkpoint_seconds": checkpoint_s,
               "gpu": 1.0 if on_gpu else 0.0}
    if previews:
        metrics.update(preview_frames=float(len(previews)), preview_seconds=preview_s)
    summary = {"frames": [frames[0], frames[-1]], "device": device, "seconds": {
        str(f): round(s, 4) for f, s in sorted(seconds.items())}, **metrics}
    (out / f"render-{frames[0]:06d}-{frames[-1]:06d}.json").write_text(
        json.dumps(summary, indent=2))
    print(f"done: {rendered} frames rendered, {mean:.2f} s/frame,"
          f" {metrics['frames_per_hour']:,.0f} frames/hour on {device}", flush=True)
    report.done(**metrics)


def warm_up() -> None:
    import bpy  # noqa: F401


def main() -> int:
    return run_main("render", render)


if __name__ == "__main__":
    sys.exit(main())
