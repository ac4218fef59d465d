"""Render: frames of a Blender scene with Cycles (bpy, headless; scene scripts never run),
resumable per frame, split into parts that different providers render at once."""

from __future__ import annotations

import re
import secrets
import struct
import zlib
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

    # A check renders one frame of the job (or part) again and compares its pixels: Cycles
    # on the same device class with the same samples and seed gives the same image.
    def check_scope(self, values: dict[str, Any], part: int, parts: int,
                    metrics: dict[str, float]) -> dict:
        frames = list(self.part_steps(values, part, parts))
        return {"frames": [frames[secrets.randbelow(len(frames))]]} if frames else {}

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
            except (OSError, ValueError, zlib.error) as exc:
                return False, f"{name} is not a readable PNG ({exc})"
            if want.shape != have.shape:
                return False, f"{name}: {want.shape} pixels against {have.shape}"
            differ = int((want != have).any(axis=-1).sum())
            if differ:
                return False, f"{name}: {differ} of {want.shape[0] * want.shape[1]} pixels differ"
        return True, f"frame {', '.join(str(f) for f in scope.get('frames', []))}: pixels identical"


FRAME_RE = re.compile(r"^frame_\d{6}\.png$")
CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}      # PNG colour type -> channels (no palettes)
MAX_PIXELS = 1 << 28


def png_pixels(path: Path) -> Any:
    """The pixels of a non-interlaced 8- or 16-bit grey/RGB(A) PNG, as (height, width,
    channels); ValueError for anything else."""
    import numpy as np

    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("no PNG signature")
    pos, idat, header = 8, [], None
    while pos + 8 <= len(data):
        length, ctype = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if ctype == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif ctype == b"IDAT":
            idat.append(body)
        elif ctype == b"IEND":
            break
        pos += 12 + length
    if header is None:
        raise ValueError("no IHDR")
    width, height, depth, color, _, _, interlace = header
    if color not in CHANNELS or depth not in (8, 16) or interlace or width * height > MAX_PIXELS:
        raise ValueError(f"unsupported PNG (colour type {color}, depth {depth})")
    bpp = CHANNELS[color] * depth // 8
    stride = width * bpp
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8)
    if raw.size != height * (stride + 1):
        raise ValueError("image data has the wrong size")
    rows = raw.reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.int32)
    prev = np.zeros(stride, dtype=np.int32)
    for y in range(height):
        kind, line = rows[y, 0], rows[y, 1:].astype(np.int32)
        if kind == 0:
            cur = line
        elif kind == 2:
            cur = (line + prev) & 0xFF
        elif kind in (1, 3, 4):
            cur = line.copy()
            for x in range(stride):       # left neighbours depend on this row: sequential
                a = cur[x - bpp] if x >= bpp else 0
                b, c = prev[x], prev[x - bpp] if x >= bpp else 0
                if kind == 1:
                    pred = a
                elif kind == 3:
                    pred = (a + b) // 2
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur[x] = (cur[x] + pred) & 0xFF
        else:
            raise ValueError(f"unknown PNG filter {kind}")
        out[y], prev = cur, cur
    return out.reshape(height, width, bpp)


KIND = Render(
    name="render", number=pb.JOB_KIND_RENDER, proto_field="render",
    runner="gpumarket.provider.runners.render", provider_engine="cycles", verify="frames",
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
