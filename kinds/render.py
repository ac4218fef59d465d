"""Render: frames of a Blender scene with Cycles (bpy, headless; scene scripts never run),
resumable per frame, split into parts that different providers render at once."""

from __future__ import annotations

import bisect
import math
import re
import secrets
from pathlib import Path
from typing import Any

from gpumarket.kinds.base import Kind
from gpumarket.kinds.schema import UINT32, Param, ParamError
from gpumarket.proto.v1 import types_pb2 as pb

MAX_FRAMES = 1_000_000
MAX_PARTS = 64


def part_frames(first: int, last: int, part: int, parts: int) -> range:
    """The frames of part ``part`` (1-based) of ``parts``: contiguous ranges that cover
    first..last once, the earlier parts one frame longer when they do not divide evenly.
    Part 0 (or one part) is the whole range."""
    if parts <= 1 or part == 0:
        return range(first, last + 1)
    if not 1 <= part <= parts:
        raise ParamError("render.split", f"part {part} of {parts} does not exist")
    count = last - first + 1
    size, extra = divmod(count, parts)
    start = first + (part - 1) * size + min(part - 1, extra)
    return range(start, start + size + (1 if part <= extra else 0))


class Render(Kind):
    def rules(self, values: dict[str, Any]) -> None:
        if values["scene"] and not values["scene"].endswith(".blend"):
            raise ParamError("render.scene", f"{values['scene']!r} is not a .blend file")
        if values["frame_end"] < values["frame_start"]:
            raise ParamError("render.frame_end", "before render.frame_start")
        frames = values["frame_end"] - values["frame_start"] + 1
        if frames > MAX_FRAMES:
            raise ParamError("render", f"at most {MAX_FRAMES:,} frames in one job")
        if values["split"] > min(MAX_PARTS, frames):
            raise ParamError("render.split", f"at most {min(MAX_PARTS, frames)} parts (one"
                                             f" frame each at least, {MAX_PARTS} at most)")

    def parts(self, values: dict[str, Any]) -> int:
        return max(1, values["split"])

    def part_steps(self, values: dict[str, Any], part: int, parts: int) -> range:
        return part_frames(values["frame_start"], values["frame_end"], part, parts)

    def output_problem(self, values: dict[str, Any], names: set[str]) -> str:
        missing = [f for f in range(values["frame_start"], values["frame_end"] + 1)
                   if f"frame_{f:06d}.png" not in names]
        return (f"{len(missing)} frames missing from its receipts (first: {missing[0]})"
                if missing else "")

    # A check renders a random sample of the frames the lease rendered itself again and
    # compares their pixels: Cycles on the same device class with the same samples and seed
    # gives the same image. A quarter of them (at most MAX_CHECK_FRAMES), so that a provider
    # doctoring even one frame of a lease is caught by a check with p >= 1/4 (leases of up to
    # 128 frames), within 20 checked jobs with p >= 0.997 (docs/verification.md).
    def check_scope(self, values: dict[str, Any], part: int, parts: int,
                    metrics: dict[str, float], done_before: int) -> dict:
        frames = self.part_steps(values, part, parts)[done_before:]
        # Only frames a CheckScope can name (int32): a lease naming one past it could not be
        # made, and its placement pass would fail again every time (Blender renders none
        # past 1,048,574 anyway: only a provider returning made-up frames gets there).
        frames = frames[:max(0, bisect.bisect_right(frames, MAX_CHECK_FRAME))]
        if not frames:
            return {}
        return {"frames": sorted(_draw.sample(frames, check_frames(len(frames))))}

    def evidence(self, names: set[str]) -> set[str]:
        return {n for n in names if FRAME_RE.match(n)}

    def compare(self, expect: dict[str, Path], got: dict[str, Path], scope: dict
                ) -> tuple[bool, str]:
        for frame in scope.get("frames", []):
            name = f"frame_{frame:06d}.png"
            if name not in expect:
                return False, f"the provider returned no {name}"
            if name not in got:
                return False, f"the replay returned no {name}"
            try:
                want, have = png_pixels(expect[name]), png_pixels(got[name])
            except ValueError as exc:
                return False, f"{name}: {exc}"
            if want.shape != have.shape:
                return False, f"{name}: {want.shape} pixels against {have.shape}"
            differ = int((want != have).reshape(want.shape[0], want.shape[1], -1)
                         .any(axis=-1).sum())
            if differ:
                return False, f"{name}: {differ} of {want.shape[0] * want.shape[1]} pixels differ"
        frames = scope.get("frames", [])
        return True, (f"frame{'s' if len(frames) > 1 else ''}"
                      f" {', '.join(str(f) for f in frames)}: pixels identical")


CHECK_SHARE = 0.25          # of a lease's frames, a check renders again ...
MAX_CHECK_FRAMES = 32       # ... but no more than this many: a check's cost, and its compare
                            # within the broker's 300 s (an 8K frame of noise took 5.2 s to
                            # compare, both PNGs decoded, on this 2-core machine at load 7)
_draw = secrets.SystemRandom()   # which frames: from a source the provider cannot predict
MAX_CHECK_FRAME = 2**31 - 1      # CheckScope.frames is int32


def check_frames(frames: int) -> int:
    """How many of a lease's ``frames`` a check renders again."""
    return min(frames, MAX_CHECK_FRAMES, max(1, math.ceil(frames * CHECK_SHARE)))


def catch_probability(frames: int, doctored: int) -> float:
    """The probability that one check of a lease of ``frames`` frames, ``doctored`` of them
    wrong, renders at least one of those again: 1 - C(n - d, k) / C(n, k)."""
    if frames <= 0 or doctored <= 0:
        return 0.0
    k = check_frames(frames)
    return 1 - math.comb(frames - min(doctored, frames), k) / math.comb(frames, k)


FRAME_RE = re.compile(r"^frame_\d{6}\.png$")
MAX_PIXELS = 1 << 26                 # 67 Mpixel (8K x 8K): larger frames are not compared
MAX_PNG_BYTES = 1 << 30


def png_pixels(path: Path) -> Any:
    """The pixels of a PNG as an (height, width, 4) RGBA array (decoded by Pillow, in C);
    ValueError for anything that is not a PNG of at most MAX_PIXELS pixels."""
    import numpy as np
    from PIL import Image

    if Path(path).stat().st_size > MAX_PNG_BYTES:
        raise ValueError("larger than a frame can be")
    try:
        with Image.open(path, formats=["PNG"]) as img:
            width, height = img.size
            if width * height > MAX_PIXELS:
                raise ValueError(f"{width}x{height} pixels is more than a check compares")
            img.load()
            return np.asarray(img.convert("RGBA" if img.mode in ("RGB", "RGBA", "P", "L", "LA")
                                          else "I;16"))
    except (OSError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ValueError(f"not a readable PNG ({exc})") from exc


KIND = Render(
    name="render", number=pb.JOB_KIND_RENDER, proto_field="render",
    runner="gpumarket.provider.runners.render", provider_engine="cycles", verify="frames",
    checkpoints=True,
    params=(
        Param("scene", "file", required=True, input_name="scene.blend", suffix=".blend",
              doc="a .blend file"),
        Param("frame_start", "int", required=True, max=UINT32),
        Param("frame_end", "int", required=True, max=UINT32),
        Param("resolution_x", "int", max=16_384, doc="0 = the scene's own"),
        Param("resolution_y", "int", max=16_384, doc="0 = the scene's own"),
        Param("samples", "int", max=1_000_000, doc="Cycles samples a pixel; 0 = the scene's"),
        Param("device", "str", choices=("", "auto", "cpu", "cuda", "optix")),
        Param("output_format", "str", choices=("", "PNG")),
        Param("split", "int", max=UINT32,
              doc="parts rendered by different providers at once; 0 or 1 = one part"),
        Param("engine", "str", choices=("", "cycles")),
        Param("checkpoint_every", "int", max=UINT32,
              doc="frames between checkpoints; 0 = the broker decides"),
    ),
)
