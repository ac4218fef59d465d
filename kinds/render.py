"""Render: frames of a Blender scene with Cycles (bpy, headless; scene scripts never run),
resumable per frame, split into parts that different providers render at once."""

from __future__ import annotations

import bisect
import contextlib
import math
import re
import secrets
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from gpumarket.kinds.base import Kind, in_time
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

    # A check does two things. It renders a random sample of the frames the lease rendered
    # itself again and compares their pixels: Cycles on the same device class with the same
    # samples and seed gives the same image. A quarter of them (at most MAX_CHECK_FRAMES), so
    # that a provider doctoring even one frame of a lease is caught by a check with p >= 1/4
    # (leases of up to 16,384 frames): within the 20 checks of a new provider's first 20
    # jobs with p >= 0.996. The same share for every check, warm-up or not: a sample sized
    # by the checked provider's rate would tell the checker (who can count the lease's
    # frames) that the provider is new. And it renders EVERY frame of the lease again at a
    # quarter of the resolution each way (PREVIEW_SCALE: about 1/16 of the pixel work), which
    # is compared within a measured tolerance with the delivered frame reduced to the same
    # size: a frame not rendered at all (blank, noise, another frame's image, a large edit)
    # is caught whether the sample holds it or not (docs/verification.md).
    def check_scope(self, values: dict[str, Any], part: int, parts: int,
                    metrics: dict[str, float], done_before: int) -> dict:
        frames = lease_frames(values, part, parts, done_before)
        if not frames:
            return {}
        scope = {"frames": sorted(_draw.sample(frames, check_frames(len(frames))))}
        if preview := preview_frames(values, part, parts, done_before):
            scope["preview"] = [preview[0], preview[-1]]
        return scope

    def evidence(self, names: set[str]) -> set[str]:
        # (a checker's previews too: a tie-break holds them against the first checker's)
        return {n for n in names if FRAME_RE.match(n) or PREVIEW_RE.match(n)}

    def compare(self, expect: dict[str, Path], got: dict[str, Path], scope: dict
                ) -> tuple[bool, str]:
        """The sampled frames pixel for pixel (``compare_sample``; Unfinished when the
        broker's time for them ran out first), then the previews (``compare_previews``)."""
        same, why = compare_sample(expect, got, scope.get("frames", []),
                                   scope.get("compared", ()))
        if not same:
            return False, why
        if not scope.get("preview"):
            return True, why
        same, worst = compare_previews(expect, got, scope["preview"], scope.get("replays"))
        if not same:
            return False, worst
        return True, f"{why}; {worst}"


def lease_frames(values: dict[str, Any], part: int, parts: int, done_before: int) -> range:
    """The frames a lease that started after ``done_before`` frames of its part rendered
    itself: what a check of it covers. Only frames a CheckScope can name (int32): a lease
    naming one past it could not be made, and its placement pass would fail again every time
    (Blender renders none past 1,048,574 anyway: only a provider returning made-up frames
    gets there). The checker's runner computes the same range from the lease's step_from."""
    frames = part_frames(values["frame_start"], values["frame_end"], part, parts)[done_before:]
    return frames[:max(0, bisect.bisect_right(frames, MAX_CHECK_FRAME))]


def preview_frames(values: dict[str, Any], part: int, parts: int, done_before: int
                   ) -> range:
    """The frames a check of such a lease previews: all of them, or none past
    MAX_PREVIEW_FRAMES (the broker's check_scope and the checker's runner both ask here)."""
    frames = lease_frames(values, part, parts, done_before)
    return frames if len(frames) <= MAX_PREVIEW_FRAMES else range(0)


def frame_name(frame: int) -> str:
    return f"frame_{frame:06d}.png"


def preview_name(frame: int) -> str:
    """The file a checker writes a frame's preview to (PREVIEW_SCALE smaller each way)."""
    return f"preview_{frame:06d}.png"


def preview_size(width: int, height: int) -> tuple[int, int]:
    """The pixels of a preview of a frame of ``width`` x ``height``: what a checker renders
    it at, and what the delivered frame is reduced to."""
    return max(1, width // PREVIEW_SCALE), max(1, height // PREVIEW_SCALE)


def compare_sample(expect: dict[str, Path], got: dict[str, Path], frames: list[int],
                   compared: Iterable[int] = ()) -> tuple[bool, str]:
    """Each of the sampled ``frames``, delivered (``expect``) against its replay (``got``):
    every pixel equal. In an order the provider cannot predict, for at most
    SAMPLE_COMPARE_S, skipping the frames an earlier pass ``compared`` (and found equal).
    Returns (agrees, the first frame that differs or what was compared); raises Unfinished
    (its progress: {"compared": the frames found equal so far}) when the time ran out with
    frames left: neither a pass (a doctored frame may be among the rest) nor a disagreement
    (that would hold an honest provider's pay for the broker's slowness). Each call compares
    at least one frame, so a check's comparison ends within as many passes as its sample
    has frames."""
    for frame in in_time(frames, compared, SAMPLE_COMPARE_S, _draw, "compared",
                         "sampled frames compared, pixels identical"):
        name = frame_name(frame)
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
    return True, f"{said_frames(frames)}: pixels identical"


def said_frames(frames: list[int]) -> str:
    """A sample of frames in a line: each one where they are few, else how many and where."""
    if len(frames) <= SAID_FRAMES:
        return f"frame{'s' if len(frames) > 1 else ''} {', '.join(str(f) for f in frames)}"
    return f"{len(frames)} frames drawn from {min(frames)}-{max(frames)}"


def compare_previews(expect: dict[str, Path], got: dict[str, Path], first_last: list[int],
                     replays: bool = False) -> tuple[bool, str]:
    """Every frame ``first_last`` spans, delivered (``expect``: frame_*.png), against the
    checker's preview of it (``got``: preview_*.png) by ``preview_difference``; with
    ``replays`` (a tie-break), two checkers' previews against each other. (agrees, the first
    frame beyond the tolerance or the largest difference seen, and how many frames were
    compared within PREVIEW_COMPARE_S)."""
    first, last = int(first_last[0]), int(first_last[1])
    worst = 0.0
    # In an order the provider cannot predict, for at most PREVIEW_COMPARE_S: a lease of
    # large frames is then compared in part (said in the detail), never timed out into a
    # disagreement that would hold an honest provider's pay.
    order = list(range(first, last + 1))
    _draw.shuffle(order)
    until = time.monotonic() + PREVIEW_COMPARE_S
    for done, frame in enumerate(order):
        if time.monotonic() > until:
            return True, (f"{done} of {len(order)} frames, drawn at random, within their"
                          f" previews' tolerance (largest difference {worst:.1f} of 255 in a"
                          f" block); the rest not compared within {PREVIEW_COMPARE_S:g}s")
        mine = preview_name(frame) if replays else frame_name(frame)
        if mine not in expect:
            return False, f"the {'first replay' if replays else 'provider'} returned no {mine}"
        if preview_name(frame) not in got:
            return False, f"the replay returned no {preview_name(frame)}"
        try:
            block = preview_difference(got[preview_name(frame)], expect[mine],
                                       reduce=not replays)
        except ValueError as exc:
            return False, f"{mine}: {exc}"
        if block > PREVIEW_TOLERANCE:
            return False, (f"{mine}: its preview differs by {block:.1f} of 255 in a"
                           f" {PREVIEW_BLOCK}x{PREVIEW_BLOCK} block (tolerance"
                           f" {PREVIEW_TOLERANCE:g})")
        worst = max(worst, block)
    return True, (f"{last - first + 1} frames within their previews' tolerance (largest"
                  f" difference {worst:.1f} of 255 in a block)")


def preview_difference(preview: Path, frame: Path, reduce: bool = True) -> float:
    """How far a frame is from a preview of it, on a 0-255 scale: the frame is reduced to
    the preview's size by averaging (a box filter), both are split into blocks of
    PREVIEW_BLOCK x PREVIEW_BLOCK preview pixels, and the figure is the largest difference
    of one block's mean in one channel. Averaging is what makes a cheap low-resolution
    render comparable at all: single pixels of two renders differ by their sampling noise,
    denoiser and pixel filter; block means much less. (The whole image's mean is not judged
    on its own: on a 16 x 12 preview of a 4-sample frame it differed by 7.9 honestly, as
    much as a tint would.) Without ``reduce`` (``frame`` is another
    checker's preview) the two are compared at their size. ValueError: not a readable PNG,
    or the preview is not ``preview_size`` of the frame."""
    import numpy as np

    small = _decoded(preview)
    with open_png(frame) as img:
        want = preview_size(*img.size) if reduce else img.size
        if small.size != want:
            raise ValueError(f"a preview of {small.size[0]}x{small.size[1]} pixels for a frame"
                             f" of {img.size[0]}x{img.size[1]} ({want[0]}x{want[1]} expected)")
        reduced = _rgba(img.resize(want, _box()) if img.size != want else img)
    mine = _rgba(small)
    h, w = mine.shape[:2]
    b = min(PREVIEW_BLOCK, h, w)
    # Each block at its best of the nine alignments one preview pixel apart: a frame's edges
    # fall a fraction of a preview pixel apart between the two resolutions (a border crop's
    # corner is rounded at each), which at a hard edge is a large difference that says
    # nothing; any change a cheat could gain by is larger than a pixel's shift.
    padded = np.pad(reduced, ((1, 1), (1, 1), (0, 0)), mode="edge")
    best = None
    for dy in (0, 1, 2):
        for dx in (0, 1, 2):
            diff = mine - padded[dy:dy + h, dx:dx + w]
            blocks = np.abs(diff[:h // b * b, :w // b * b]
                            .reshape(h // b, b, w // b, b, -1).mean(axis=(1, 3))).max(axis=-1)
            best = blocks if best is None else np.minimum(best, blocks)
    return float(best.max())


CHECK_SHARE = 0.25          # of a lease's frames, a check renders again ...
MAX_CHECK_FRAMES = 4096     # ... but no more than this many (a quarter of 16,384): what a
                            # lease's CheckScope lists (about 20 KB) and the check's row
                            # keeps. The broker compares them within SAMPLE_COMPARE_S a pass
                            # and goes on at its next pass (compare_sample)
SAMPLE_COMPARE_S = 120.0    # of the broker's 300 s to compare a check, the exact sample's
                            # share in one pass (the previews have theirs, the rest is margin
                            # for one frame begun late: an 8K frame of noise took 5.2 s to
                            # compare, both PNGs decoded, on this 2-core machine at load 7)
SAID_FRAMES = 8             # a sample named frame by frame in a check's detail, up to this
_draw = secrets.SystemRandom()   # which frames: from a source the provider cannot predict
MAX_CHECK_FRAME = 2**31 - 1      # CheckScope.frames is int32

# The preview pass (docs/verification.md, Frames): each frame of the lease rendered again at
# 1/PREVIEW_SCALE of its width and height with the job's own samples, and compared with the
# delivered frame reduced to that size, block by block. The tolerance is on a 0-255 scale,
# set from honest replays measured by bench/render_checks.py (the largest honest difference
# of a block was 16.6 at 320 x 240 and 16 samples, 12.7 for a border-cropped scene at 8:
# about a third of it; docs/verification.md, Frames).
PREVIEW_SCALE = 4
PREVIEW_BLOCK = 4                  # preview pixels a side (16 x 16 pixels of the frame)
PREVIEW_TOLERANCE = 48.0
MAX_PREVIEW_FRAMES = 1000          # a longer lease is checked by the sample alone: the
                                   # checker renders, and the broker decodes, every frame of
                                   # a preview pass (a job split into parts keeps each part's
                                   # leases shorter)
PREVIEW_COMPARE_S = 120.0          # of the broker's 300 s to compare a check: the previews'
                                   # share (a 1920 x 1080 frame took 0.15 to 0.23 s to
                                   # decode, reduce and compare on this 2-core machine at
                                   # load 6 to 8; SAMPLE_COMPARE_S is the exact sample's)


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
PREVIEW_RE = re.compile(r"^preview_\d{6}\.png$")
MAX_PIXELS = 1 << 26                 # 67 Mpixel (8K x 8K): larger frames are not compared
MAX_PNG_BYTES = 1 << 30


def png_pixels(path: Path) -> Any:
    """The pixels of a PNG as an (height, width, 4) RGBA array (decoded by Pillow, in C);
    ValueError for anything that is not a PNG of at most MAX_PIXELS pixels."""
    import numpy as np

    with open_png(path) as img:
        return np.asarray(img.convert("RGBA") if img.mode in ("RGB", "RGBA", "P", "L", "LA")
                          else img.convert("I;16"))


@contextlib.contextmanager
def open_png(path: Path) -> Iterator[Any]:
    """A PNG opened and decoded by Pillow; ValueError for anything that is not a PNG of at
    most MAX_PIXELS pixels (and of at most MAX_PNG_BYTES)."""
    from PIL import Image

    if Path(path).stat().st_size > MAX_PNG_BYTES:
        raise ValueError("larger than a frame can be")
    try:
        with Image.open(path, formats=["PNG"]) as img:
            width, height = img.size
            if width * height > MAX_PIXELS:
                raise ValueError(f"{width}x{height} pixels is more than a check compares")
            img.load()
            yield img
    except (OSError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ValueError(f"not a readable PNG ({exc})") from exc


def _decoded(path: Path) -> Any:
    with open_png(path) as img:
        return img.copy()


def _rgba(img: Any) -> Any:
    """An image's pixels as float32 RGBA on a 0-255 scale (16-bit grey scaled down)."""
    import numpy as np

    if img.mode in ("I", "I;16", "I;16B", "I;16L"):
        grey = np.asarray(img, dtype=np.float32) / 257.0
        return np.stack([grey, grey, grey, np.full_like(grey, 255.0)], axis=-1)
    return np.asarray(img.convert("RGBA"), dtype=np.float32)


def _box() -> Any:
    from PIL import Image

    return Image.Resampling.BOX


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
