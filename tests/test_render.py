"""Render jobs end to end through the CLI on CPU with Blender's bpy: split across two
providers into one verified result, scene scripts never run, and a provider killed mid-run
whose job resumes elsewhere rendering only the missing frames."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import job_processes, wait_until

pytest.importorskip("bpy", reason="render jobs need Blender's bpy package")
pytestmark = pytest.mark.e2e
# No job here is of a kind that keeps a warm runner (training): providers start without
# one (tests/helpers.py, Marketplace.warm).
WARM_PROVIDERS = False

ROOT = Path(__file__).resolve().parent.parent


def make_scene(path: Path, frames: int, marker: Path) -> Path:
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "make_scene.py"), str(path),
                        "--frames", str(frames), "--marker", str(marker)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return path


def render_job(path: Path, scene: Path, **params) -> Path:
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in params.items())
    path.write_text(f"""
name = "render-{path.stem}"
kind = "render"
max_price = 2.0

[render]
scene = "{scene}"
{lines}
""")
    return path


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    return struct.unpack(">II", data[16:24])


def submit(market, path: Path) -> str:
    r = market.cli("submit", str(path))
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


def test_render_split_across_two_providers_into_one_result(market, tmp_path):
    marker = tmp_path / "a-scene-script-ran"
    scene = make_scene(tmp_path / "scene.blend", 6, marker)
    market.start_provider("p1")
    market.start_provider("p2")
    market.wait_for_offers(2)
    job_id = submit(market, render_job(tmp_path / "job.toml", scene, frame_start=1,
                                       frame_end=6, resolution_x=64, resolution_y=48,
                                       samples=4, split=2))
    job = market.wait_state(job_id, "SUCCEEDED", timeout=300)
    parts = job["parts"]
    assert [p["part"] for p in parts] == [1, 2]
    assert all(p["state"] == "SUCCEEDED" for p in parts)
    assert parts[0]["provider_id"] != parts[1]["provider_id"]   # two providers at once
    assert int(job["progress"]["step"]) == int(job["progress"]["total"]) == 6
    listed = json.loads(market.cli("list", "--json").stdout)
    assert [j["job_id"] for j in listed] == [job_id]            # one job, not three

    out = tmp_path / "out"
    r = market.cli("results", job_id, "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    frames = sorted(p.name for p in out.glob("frame_*.png"))
    assert frames == [f"frame_{f:06d}.png" for f in range(1, 7)]
    assert all(png_size(out / f) == (64, 48) for f in frames)
    assert sorted(p.name for p in out.glob("render-*.json")) == [
        "render-000001-000003.json", "render-000004-000006.json"]
    assert len(summary["parts"]) == 2
    assert {p["provider_id"] for p in summary["parts"]} == {parts[0]["provider_id"],
                                                            parts[1]["provider_id"]}
    m = summary["metrics"]
    assert m["frames"] == 6 and m["frames_rendered"] == 6 and m["gpu"] == 0
    assert m["seconds_per_frame"] > 0 and m["frames_per_hour"] > 0
    part = json.loads((out / "render-000001-000003.json").read_text())
    assert part["device"].startswith("CPU") and len(part["seconds"]) == 3
    assert not marker.exists(), "a script inside the scene ran on a provider"

    events = market.cli("watch", job_id, "--json").stdout
    assert "part 1/2" in events and "part 2/2" in events
    log = market.cli("logs", job_id).stdout
    assert "[part 1] rendering frames 1-3" in log and "[part 2] rendering frames 4-6" in log


def test_render_killed_mid_run_renders_only_missing_frames(market, tmp_path):
    marker = tmp_path / "a-scene-script-ran"
    scene = make_scene(tmp_path / "scene.blend", 12, marker)
    params = dict(frame_start=1, frame_end=12, resolution_x=160, resolution_y=120, samples=32,
                  checkpoint_every=2)
    # Both providers offer before the job starts (one started once the job ran could still
    # be starting when the job ended), and the one that holds it is killed.
    market.start_provider("p1")
    market.start_provider("p2")
    market.wait_for_offers(2)
    job_id = submit(market, render_job(tmp_path / "job.toml", scene, **params))
    held = market.wait_state(job_id, "RUNNING")["provider_id"]
    holder = "p1" if market.provider_id("p1") == held else "p2"
    wait_until(lambda: int(market.job(job_id).get("checkpoint_step", 0)) >= 4,
               "a checkpoint after 4 frames", timeout=240, interval=0.2)
    market.providers[holder].stop(signal.SIGKILL)
    for pid in job_processes(str(market.root / holder / "jobs")):
        os.kill(pid, signal.SIGKILL)
    job = market.wait_state(job_id, "SUCCEEDED", timeout=300)
    assert [a["outcome"] for a in job["attempts"]] == ["lost", "succeeded"]
    out = tmp_path / "out"
    r = market.cli("results", job_id, "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)["metrics"]
    assert m["resumed_frames"] >= 4 and m["frames_rendered"] == 12 - m["resumed_frames"]
    assert sorted(p.name for p in out.glob("frame_*.png")) == [
        f"frame_{f:06d}.png" for f in range(1, 13)]
    assert not marker.exists()

    # The same frames rendered directly, uninterrupted: the same bytes. Every frame the
    # first attempt rendered and the first two of the second (a direct render that stops
    # there renders them as one of all 12 would: frame by frame, in order; the rest of the
    # second attempt's frames came the way its first two did).
    last = min(12, int(m["resumed_frames"]) + 2)
    work = tmp_path / "direct"
    work.mkdir()
    (work / "job.json").write_text(json.dumps({
        "job_id": "direct", "attempt": 1, "kind": "render", "device": "cpu",
        "params": {"scene": "scene.blend", **params, "frame_end": last},
        "inputs": {"scene.blend": str(scene)}, "checkpoint_every": 0, "resume_from": None}))
    r = subprocess.run([sys.executable, "-m", "gpumarket.provider.runners.render", str(work)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (work / "outputs").glob("frame_*.png")) == [
        f"frame_{f:06d}.png" for f in range(1, last + 1)]
    for f in range(1, last + 1):
        name = f"frame_{f:06d}.png"
        assert (out / name).read_bytes() == (work / "outputs" / name).read_bytes(), name


def test_a_render_check_lease_previews_the_frames_its_checked_lease_rendered(tmp_path):
    """Issue 34: the runner of a check lease renders its sampled frames exactly and every
    frame the checked lease rendered itself (those after the frames it resumed with: the
    lease's step_from, here 1) as a preview at kinds.render.preview_size, which the broker's
    compare finds within tolerance of the full frame and a blank frame far from it."""
    from PIL import Image

    from gpumarket.kinds import render

    scene = make_scene(tmp_path / "scene.blend", 4, tmp_path / "marker")
    work = tmp_path / "check"
    work.mkdir()
    (work / "job.json").write_text(json.dumps({
        "job_id": "c0ffee", "attempt": 1, "kind": "render", "device": "cpu",
        "params": {"scene": "scene.blend", "frame_start": 1, "frame_end": 3,
                   "resolution_x": 64, "resolution_y": 48, "samples": 4},
        "inputs": {"scene.blend": str(scene)}, "checkpoint_every": 0, "resume_from": None,
        "check_of": "c0ffee", "check_frames": [2], "check_from_row": 1}))
    r = subprocess.run([sys.executable, "-m", "gpumarket.provider.runners.render", str(work)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = work / "outputs"
    assert sorted(p.name for p in out.glob("*.png")) == [
        "frame_000002.png", "preview_000002.png", "preview_000003.png"]
    assert png_size(out / "preview_000003.png") == render.preview_size(64, 48) == (16, 12)
    assert render.preview_difference(out / "preview_000002.png", out / "frame_000002.png"
                                     ) <= render.PREVIEW_TOLERANCE
    Image.new("RGBA", (64, 48), (0, 0, 0, 255)).save(tmp_path / "blank.png")
    assert render.preview_difference(out / "preview_000002.png", tmp_path / "blank.png"
                                     ) > render.PREVIEW_TOLERANCE
    summary = json.loads(next(out.glob("render-*.json")).read_text())
    assert summary["preview_frames"] == 2 and summary["frames_rendered"] == 1
    assert not (tmp_path / "marker").exists()
