"""What spot checks catch and cost (docs/verification.md).

Two parts:

1. Real checks on small real jobs: a tiny Llama is trained with the provider's own training
   runner, checkpointing every few steps; each segment is then replayed from its start
   checkpoint by a second run of the runner (as a check lease runs it: ``stop_at``) and
   compared by the broker's own comparison (kinds.training.compare). Honest segments must all
   agree (false positives), and a copy of each checkpoint with one flipped weight bit (what
   tests/cheating_provider.py uploads) must all disagree (detections). The replay's cost is
   measured against the segment's.

2. The simulator, for rates: a provider's segments pass through the broker's real rate
   function (verification.rate) with its streak and failures, many times over. For a
   provider that doctors a share of its segments: the probability it is caught within its
   first 20 jobs; for an honest one: the checks' compute as a share of its own, at steady
   state (after a long record) and over its first 1,000 jobs, and the part of it its clients
   pay for (the rest is its warm-up); for a renderer that doctors one frame of every job,
   the probability it is caught within 20 jobs, with the real sample of frames a check
   renders again and what its previews of every frame catch, measured with real Blender
   renders (bench/render_checks.py: each doctoring, honest replays, the previews' cost); and how often Sybil checkers holding 30 % of the stake convict an honest
   provider, with and without trusted checkers.

    .venv/bin/python bench/verification.py [--trials N] [--segments-per-job S]

Prints its figures; the last line is one JSON object.
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

from gpumarket.broker.checks import verification
from gpumarket.kinds import training
from gpumarket.provider.checkpoints import pack

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))   # the modules of bench/ it imports
EXAMPLES = ROOT / "examples" / "data"
RUNNER = "gpumarket.provider.runners.training"


# -- 1. real checks -------------------------------------------------------------------------

def run_training(workdir: Path, steps: int, every: int, resume: Path | None = None,
                 stop_at: int = 0) -> float:
    """Run the provider's training runner in ``workdir``; return its wall seconds."""
    workdir.mkdir(parents=True, exist_ok=True)
    job = {"job_id": "bench", "attempt": 1, "kind": "training",
           "params": {"model_config": "config", "base_model": "", "dataset": "data",
                      "steps": steps, "batch_size": 4, "seq_len": 32, "learning_rate": 3e-3,
                      "seed": 7, "warmup_steps": 0, "checkpoint_every": every},
           "inputs": {"config": str(EXAMPLES / "tiny-llama.json"),
                      "data": str(EXAMPLES / "tiny-corpus.jsonl")},
           "checkpoint_every": every, "checkpoint_interval_s": 0, "provider_mtbf_s": 0,
           "device": "cpu", "resume_from": str(resume) if resume else None, "world_size": 1,
           "model_dir": None, "part": 0, "parts": 0}
    if stop_at:
        job["stop_at"] = stop_at
    (workdir / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", RUNNER, str(workdir)], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - began


def flip_weight_bit(tar: Path, out: Path) -> Path:
    data = bytearray(tar.read_bytes())
    size = int(bytes(data[124:136]).rstrip(b"\0 ").decode(), 8)
    data[512 + size - 4] ^= 1
    out.write_bytes(bytes(data))
    return out


def real_checks(steps: int, every: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        original = root / "original"
        train_s = run_training(original, steps, every)
        ckpts = sorted((original / "checkpoints").glob("step-*"))
        tars = {}
        for c in ckpts:
            tars[int(c.name.split("-")[1])] = pack(c, root / f"{c.name}.tar")
        agree = disagree = false_pos = missed = 0
        replay_s, segment_steps = [], []
        bounds = sorted(tars)
        for i, step in enumerate(bounds):
            start = bounds[i - 1] if i else 0
            work = root / f"replay-{step}"
            resume = ckpts[i - 1] if i else None
            replay_s.append(run_training(work, steps, every, resume, stop_at=step))
            segment_steps.append(step - start)
            got = {n: work / "outputs" / n for n in training.CHECKPOINT_FILES}
            ok, _ = training.KIND.compare({"checkpoint.tar": tars[step]}, got, {})
            agree += ok
            false_pos += not ok
            bad = flip_weight_bit(tars[step], root / f"bad-{step}.tar")
            caught, _ = training.KIND.compare({"checkpoint.tar": bad}, got, {})
            disagree += not caught
            missed += caught
        # A replay pays its start-up (imports, model build, checkpoint load) per check.
        per_step = train_s / steps
        overhead = [r / (n * per_step) for r, n in zip(replay_s, segment_steps)]
        startup = [r - n * per_step for r, n in zip(replay_s, segment_steps)]
    return {"real_segments": len(bounds), "real_agree": agree, "real_false_positives": false_pos,
            "real_detected": disagree, "real_missed": missed,
            "real_train_s": round(train_s, 2),
            "real_replay_cost_ratio_median": round(float(np.median(overhead)), 2),
            "real_replay_startup_s": round(float(np.median(startup)), 2)}


SCRIPT = """
import json
import numpy as np
from gpumarket.provider.runners import task
rng = np.random.default_rng(11)
a = rng.standard_normal((384, 384))
for _ in range(6):                      # a little linear algebra: BLAS, threads
    a = np.tanh(a @ a.T / 384.0 + rng.standard_normal((384, 384)) * 0.01)
out = task.output_dir()
np.save(out / "state.npy", a)
(out / "result.json").write_text(json.dumps({"mean": float(a.mean()), "norm":
                                             float(np.linalg.norm(a)), "first": a[0, :8].tolist()}))
(out / "lines.jsonl").write_text("".join(json.dumps({"row": i, "sum": float(a[i].sum())})
                                         + "\\n" for i in range(16)))
task.progress(1, 1)
"""


def run_script(workdir: Path, threads: int) -> tuple[dict[str, Path], float]:
    """Run the provider's script runner on SCRIPT in ``workdir`` with ``threads`` BLAS
    threads; (its output files by name, its wall seconds)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir.parent / "main.py").write_text(SCRIPT)
    job = {"job_id": "bench", "attempt": 1, "kind": "script",
           "params": {"code": "code", "entry": "main.py", "args": [], "steps": 0,
                      "checkpoint_every": 0, "outputs_compare": "exact", "outputs_rtol": 0.0,
                      "outputs_atol": 0.0},
           "inputs": {"code": str(workdir.parent / "main.py")},
           "checkpoint_every": 0, "checkpoint_interval_s": 0, "provider_mtbf_s": 0,
           "device": "cpu", "resume_from": None, "world_size": 1, "model_dir": None,
           "part": 0, "parts": 0}
    (workdir / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads)}
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gpumarket.provider.runners.script", str(workdir)],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    took = time.perf_counter() - began
    return {p.name: p for p in sorted((workdir / "outputs").iterdir())}, took


def _doctored(honest: dict[str, Path], root: Path) -> dict[str, dict[str, Path]]:
    """Each way a cheat could alter a script's delivery, as the files it would upload."""
    def copy(name: str, change: dict[str, bytes | None]) -> dict[str, Path]:
        d = root / name
        d.mkdir()
        out = {}
        for fname, path in {**honest, **{k: None for k in change}}.items():
            data = change.get(fname, path.read_bytes() if path else None)
            if data is not None:
                out[fname] = d / fname
                out[fname].write_bytes(data)
        return out

    state = bytearray(honest["state.npy"].read_bytes())
    state[-1] ^= 1                                        # the lowest bit of one float64
    figures = json.loads(honest["result.json"].read_text())
    figures["norm"] *= 1 + 1e-4                           # one figure off by 1e-4
    return {"one_bit_of_a_binary_file": copy("bit", {"state.npy": bytes(state)}),
            "one_json_number": copy("number", {"result.json": json.dumps(figures).encode()}),
            "made_up_json": copy("made_up", {"result.json": b'{"made_up": true}'}),
            "a_file_dropped": copy("dropped", {"lines.jsonl": None}),
            "a_file_added": copy("added", {"extra.txt": b"x"})}


def script_checks() -> dict:
    """Honest replays of a numpy script (1 and 2 BLAS threads) against an honest run, by
    each rule a job can declare; and every doctored delivery against an honest replay."""
    from gpumarket.kinds import script

    rules = {"exact": {"outputs": "exact"},
             "json": {"outputs": "json", "rtol": 1e-9, "atol": 1e-12}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        honest, run_s = run_script(root / "run" / "w", 1)
        replays = [run_script(root / f"replay{t}" / "w", t)[0] for t in (1, 2)]
        false_pos = {r: sum(not script.KIND.compare(honest, got, scope)[0] for got in replays)
                     for r, scope in rules.items()}
        caught = {}
        for name, files in _doctored(honest, root).items():
            caught[name] = all(not script.KIND.compare(files, got, scope)[0]
                               for got in replays for scope in rules.values())
    return {"script_run_s": round(run_s, 2), "script_honest_replays": len(replays),
            "script_false_positives_exact": false_pos["exact"],
            "script_false_positives_json": false_pos["json"],
            "script_doctorings": len(caught),
            "script_doctorings_caught": sum(caught.values()),
            "script_missed": sorted(n for n, c in caught.items() if not c)}


def fingerprint_checks(rows: int = 16, tokens: int = 128, batch: int = 8) -> dict:
    """Checks of generated text by fingerprints (kinds/fingerprints.py) on the wider random
    Llama of bench/fingerprint_spread.py: the seconds an honest float32 provider takes to
    generate ``rows`` rows of ``tokens`` tokens in batches of ``batch``, and the seconds a
    checker's one prefill of the same rows takes (median of 3 each, one process, model
    loaded: start-up not counted); and the share of a swapped model's and of a
    bfloat16-rounded model's rows (passed off as float32) that one check finds wrong."""
    import fingerprint_spread as fs

    prompts = (fs.PROMPTS * 4)[:rows]
    with tempfile.TemporaryDirectory() as tmp:
        right, other = fs.wide_llama(Path(tmp), 0), fs.wide_llama(Path(tmp), 1)
        tok, model = fs.load(right, "float32")
        fs.generate(tok, model, prompts[:batch], batch, 2, 4)            # warm-up
        gen_s, check_s = [], []
        for _ in range(3):
            claimed, took = fs.generate(tok, model, prompts, batch, 2, tokens)
            gen_s.append(took)
            replay, took = fs.check(model, [(p, g) for p, g, _ in claimed], batch, 2)
            check_s.append(took)
        false_pos = fs.judged(claimed, replay, "float32")[0]
        caught = {}
        for name, cheat_dir, rounded in (("swapped", other, False),
                                         ("lower_precision", right, True)):
            _, cheat = fs.load(cheat_dir, "float32", round_bf16=rounded)
            doctored, _ = fs.generate(tok, cheat, prompts, batch, 2, tokens)
            replay, _ = fs.check(model, [(p, g) for p, g, _ in doctored], batch, 2)
            caught[name] = fs.judged(doctored, replay, "float32")[0] / len(doctored)
    return {"fingerprint_generate_s": round(float(np.median(gen_s)), 3),
            "fingerprint_prefill_s": round(float(np.median(check_s)), 3),
            "fingerprint_prefill_over_generate": round(
                float(np.median(check_s) / np.median(gen_s)), 4),
            "fingerprint_false_positives": false_pos,
            "fingerprint_rows_caught_swapped": caught["swapped"],
            "fingerprint_rows_caught_lower_precision": caught["lower_precision"]}


# -- 2. the simulator -----------------------------------------------------------------------

def simulate(cheat_share: float, jobs: int, per_job: int, trials: int, seed: int,
             ban_after: int) -> dict:
    """``trials`` providers that doctor ``cheat_share`` of their segments, each doing
    ``jobs`` jobs of ``per_job`` segments through the real rate function: the share caught
    (at least one failed check) and banned, and the checks' compute per segment of work."""
    rng = np.random.default_rng(seed)
    rates = np.array([verification.rate(n) for n in range(jobs * per_job + 1)])
    streak = np.zeros(trials, dtype=np.int64)
    fails = np.zeros(trials, dtype=np.int64)
    checks = np.zeros(trials, dtype=np.int64)
    clients = np.zeros(trials, dtype=np.int64)
    for _ in range(jobs * per_job):
        draw = rng.random(trials)
        checked = draw < rates[streak]
        wrong = rng.random(trials) < cheat_share
        caught = checked & wrong
        # A doctored segment that disagrees costs a tie-break too.
        checks += checked + caught
        # The client pays for a check the draw makes below its share (verify "auto": the
        # floor); the provider for its warm-up above it.
        clients += (checked + caught) * (draw < verification.FLOOR)
        fails += caught
        streak = np.where(caught, 0, streak + (checked & ~wrong))
    return {"caught": float((fails > 0).mean()), "banned": float((fails >= ban_after).mean()),
            "check_compute": float(checks.mean() / (jobs * per_job)),
            "client_check_compute": float(clients.mean() / (jobs * per_job))}


def simulate_jobs(p: float, jobs: int, trials: int, seed: int) -> float:
    """``trials`` new providers whose every job is wrong, a check of one catching it with
    probability ``p``, checked at the real rate: the share caught within ``jobs`` jobs."""
    rng = np.random.default_rng(seed)
    rates = np.array([verification.rate(n) for n in range(jobs + 1)])
    streak = np.zeros(trials, dtype=np.int64)
    fails = np.zeros(trials, dtype=np.int64)
    for _ in range(jobs):
        checked = rng.random(trials) < rates[streak]
        caught = checked & (rng.random(trials) < p)
        fails += caught
        streak = np.where(caught, 0, streak + checked)
    return float((fails > 0).mean())


def simulate_frames(frames: int, doctored: int, jobs: int, trials: int, seed: int,
                    preview_catch: float = 0.0) -> float:
    """``trials`` new providers that doctor ``doctored`` of the ``frames`` frames of each of
    their ``jobs`` render jobs (one lease each), checked at the real rate, each check
    rendering the real sample of frames again (kinds/render.py) and, where the lease is
    short enough to preview, every frame as a preview that catches one doctored frame with
    probability ``preview_catch`` (measured with real renders: bench/render_checks.py). The
    sample is drawn independently of which frame is doctored. Returns the share caught
    (``simulate_jobs`` with a check's chance of catching such a job)."""
    from gpumarket.kinds import render

    sampled = render.catch_probability(frames, doctored)
    previewed = preview_catch if frames <= render.MAX_PREVIEW_FRAMES else 0.0
    missed = (1 - sampled) * (1 - previewed) ** doctored
    return simulate_jobs(1 - missed, jobs, trials, seed)


def sybil_framing(share: float, jobs: int, per_job: int, trials: int, seed: int,
                  referees: bool, keys: int = 20, sybil_keys: int = 6) -> dict:
    """An honest provider's first ``jobs`` jobs, checked at the real rate, with each check's
    provider (and each tie-break's) drawn by the broker's real draw (matcher.Book.drawn)
    among ``keys`` eligible checkers, ``sybil_keys`` of them one person's, holding ``share``
    of the stake. A Sybil drawn as checker disagrees; if the tie-break is a Sybil too, they
    return the same made-up bytes and the honest provider is convicted. With ``referees``
    the tie-break runs on a trusted checker (the operator's; honest). Returns the share of
    trials convicted at least once, and of disputes a Sybil started."""
    from datetime import datetime, timezone

    from gpumarket.broker.market.matcher import Book, OfferView, Policy

    honest_stake = (1 - share) / (keys - sybil_keys)
    stakes = [share / sybil_keys] * sybil_keys + [honest_stake] * (keys - sybil_keys)
    book = Book([OfferView(f"k{i}", 1.0, frozenset({1}), (0,), 1, 1 << 34, 0.0, "cpu", 1e11,
                           0.9, 86400.0, Policy(), frozenset(), 0,
                           stake=int(x * 10**9)) for i, x in enumerate(stakes)],
                datetime(2026, 11, 23, 12, 0, tzinfo=timezone.utc))
    everyone = np.ones(keys, dtype=bool)
    rng = np.random.default_rng(seed)
    rates = [verification.rate(n) for n in range(jobs * per_job + 1)]
    convicted = disputes = 0
    for _ in range(trials):
        streak = 0
        eligible = everyone.copy()
        failed = np.zeros(keys, dtype=np.int64)
        for _ in range(jobs * per_job):
            if rng.random() >= rates[streak]:
                continue
            first = book.drawn(eligible, rng.random())
            if first >= sybil_keys:
                streak += 1                     # an honest replay agrees
                continue
            disputes += 1
            if referees:
                # The referee agrees with the provider: the Sybil checker is found wrong, and
                # banned at its BAN_AFTER-th failure.
                failed[first] += 1
                eligible[first] = failed[first] < verification.BAN_AFTER
                streak += 1
                continue
            others = eligible.copy()
            others[first] = False
            if book.drawn(others, rng.random()) < sybil_keys:
                convicted += 1
                break
            streak += 1
    return {"framed": convicted / trials, "disputes_per_trial": disputes / trials}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20_000)
    ap.add_argument("--segments-per-job", type=int, default=5)
    ap.add_argument("--skip-real", action="store_true", help="only the simulator")
    args = ap.parse_args()
    s = args.segments_per_job
    figures: dict = {"segments_per_job": s, "trials": args.trials,
                     "warmup_checks": verification.WARMUP, "floor_rate": verification.FLOOR}
    if not args.skip_real:
        real = real_checks(steps=60, every=10)
        print(f"real checks: {real['real_segments']} training segments replayed from their"
              f" start checkpoints: {real['real_agree']} agree, {real['real_false_positives']}"
              f" false positives; with one weight bit flipped: {real['real_detected']}"
              f" detected, {real['real_missed']} missed; a replay costs"
              f" {real['real_replay_cost_ratio_median']}x its segment's training time"
              " (start-up included)")
        figures.update(real)
    if not args.skip_real:
        fpr = fingerprint_checks()
        figures.update(fpr)
        # A check prefills one batch of a checked job: for a job of one batch (the worst
        # case; more batches only lower it), its cost over the job's is the prefill's over
        # the generation's, paid at the rate a provider with a long record is checked at.
        figures["inference_check_overhead"] = round(
            verification.rate(10**9) * fpr["fingerprint_prefill_over_generate"], 4)
        print(f"generate checked by fingerprints: one prefill of {16} rows x 128 claimed tokens"
              f" took {fpr['fingerprint_prefill_s']}s against {fpr['fingerprint_generate_s']}s"
              f" to generate them ({fpr['fingerprint_prefill_over_generate']}x); at the floor"
              f" rate, {figures['inference_check_overhead']} of the work (a one-batch job);"
              f" honest rows judged wrong: {fpr['fingerprint_false_positives']}; rows caught"
              f" per check: swapped model {fpr['fingerprint_rows_caught_swapped']:.2f},"
              f" bfloat16-rounded passed off as float32"
              f" {fpr['fingerprint_rows_caught_lower_precision']:.2f}")
        for name in ("swapped", "lower_precision"):
            # every job of the cheat is doctored; one check of a job catches it with the
            # share of its checked rows found wrong being > 0 (any row fails the check)
            p = 1.0 if fpr[f"fingerprint_rows_caught_{name}"] > 0 else 0.0
            caught = simulate_jobs(p, 20, args.trials, 5)
            figures[f"detection_p_20_jobs_generate_{name}_model"] = round(caught, 4)
            late = 1 - (1 - verification.rate(10**9) * p) ** 20
            figures[f"detection_p_20_jobs_generate_{name}_model_after_long_record"] = \
                round(late, 4)
            print(f"a generate provider with a {name.replace('_', '-')} model on every job:"
                  f" caught within 20 jobs with p = {caught:.4f} (new), {late:.4f} (one"
                  " turning to it after a long clean record: checked at the floor rate)")
    if not args.skip_real:
        import endpoint_answer_checks

        figures.update(endpoint_answer_checks.figures(endpoint_answer_checks.measure()))
    if not args.skip_real:
        import embed_answer_checks

        em = embed_answer_checks.measure()
        figures.update(em)
        for name in ("random", "cos0.9995_spread", "cos0.9995_one_element"):
            # a new replica's every window is checked (its first answer at least): a cheat
            # answering every request so is caught within 20 windows with:
            p = em[f"endpoint_embed_answers_caught_{name}"]
            figures[f"detection_p_20_jobs_endpoint_embed_{name.replace('.', '')}"] = round(
                1 - (1 - p) ** 20, 4)
        print(f"embed endpoint answers: {em['endpoint_embed_answers']} requests served one"
              f" text at a time in {em['endpoint_embed_serve_s']}s, replayed by a check in"
              f" {em['endpoint_embed_check_s']}s; honest answers judged wrong:"
              f" {em['endpoint_embed_false_positives']}; caught per answer: random"
              f" {em['endpoint_embed_answers_caught_random']}, cosine 0.9995 spread"
              f" {em['endpoint_embed_answers_caught_cos0.9995_spread']}, in one element"
              f" {em['endpoint_embed_answers_caught_cos0.9995_one_element']}")
    if not args.skip_real:
        sc = script_checks()
        figures.update(sc)
        # A cheat that alters any delivered file of every script job it runs: each check of
        # one catches it when every doctoring above was caught (p = 1).
        p = 1.0 if sc["script_doctorings_caught"] == sc["script_doctorings"] else 0.0
        caught = simulate_jobs(p, 20, args.trials, 6)
        figures["detection_p_20_jobs_script_any_output_file"] = round(caught, 4)
        late = 1 - (1 - verification.rate(10**9) * p) ** 20
        figures["detection_p_20_jobs_script_any_output_file_after_long_record"] = round(late, 4)
        print(f"script (outputs_compare): {sc['script_honest_replays']} honest replays (1 and 2"
              f" BLAS threads) judged wrong: exact {sc['script_false_positives_exact']}, json"
              f" {sc['script_false_positives_json']}; doctored deliveries caught by every"
              f" replay under both rules: {sc['script_doctorings_caught']} of"
              f" {sc['script_doctorings']}; a provider altering any output file of every job"
              f" caught within 20 jobs with p = {caught:.4f} (new), {late:.4f} (after a long"
              " record)")
    for share in (0.01, 0.05, 0.10, 0.25, 1.0):
        r = simulate(share, 20, s, args.trials, 1, verification.BAN_AFTER)
        print(f"cheats on {share:>4.0%} of segments: caught within 20 jobs with p ="
              f" {r['caught']:.4f}, banned with p = {r['banned']:.4f}")
        figures[f"detection_p_20_jobs_at_{int(share * 100)}pct"] = round(r["caught"], 4)
        if share == 0.10:
            figures["detection_p_20_jobs"] = round(r["caught"], 4)
            figures["ban_p_20_jobs"] = round(r["banned"], 4)
    if not args.skip_real:
        import render_checks

        figures.update(render_checks.detection(render_checks.render_checks(), args.trials,
                                               simulate_jobs, simulate_frames,
                                               verification.rate(10**9)))
    import array_checks

    from gpumarket.broker.checks import task_checks

    for n, p in array_checks.catch_rates(min(args.trials, 20_000)).items():
        caught = simulate_jobs(p, 20, args.trials, 10)
        figures[f"array_task_catch_p_per_check_{n}_tasks"] = round(p, 4)
        figures[f"detection_p_20_leases_array_task_of_{n}"] = round(caught, 4)
        # What checks cost at steady state: the floor rate times the share a check replays
        # (its start-up on top, as every replay's).
        figures[f"array_check_overhead_steady_{n}_tasks"] = round(
            verification.rate(10**9) * task_checks.sample_size(n) / n, 4)
        if n == 100:    # a cheat doctoring one task of each lease of 100 (the class figure)
            figures["detection_p_20_jobs_array_task"] = round(caught, 4)
        print(f"array leases of {n} tasks, one doctored: one check replays it in {p:.4f}"
              f" of draws; caught within 20 leases with p = {caught:.4f}")
    import render_checks     # the sample alone (what a check of a lease too long to preview has)
    figures.update(render_checks.sample_figures(args.trials, simulate_frames,
                                                verification.rate(10**9)))
    sybil_trials = min(args.trials, 2000)
    for referees in (False, True):
        r = sybil_framing(0.30, 100, s, sybil_trials, 3, referees)
        name = "sybil_framing_p" + ("" if referees else "_without_trusted_checkers")
        figures[name] = round(r["framed"], 4)
        print(f"Sybils with 30% of the checkers' stake frame an honest provider within 100"
              f" jobs with p = {r['framed']:.4f} ({'with' if referees else 'without'} trusted"
              f" checkers; {r['disputes_per_trial']:.1f} disputes they started per provider)")
    honest = simulate(0.0, 1000, s, 2000, 2, verification.BAN_AFTER)
    steady = verification.rate(10**9)
    print(f"honest provider: checks cost {honest['check_compute']:.3f} of its work over its"
          f" first 1,000 jobs; {steady:.3f} at steady state (a long clean record); its clients"
          f" pay for {honest['client_check_compute']:.3f} of it, the provider the rest")
    if "real_replay_startup_s" in figures:
        # A replay also pays its start-up once: negligible against segments of minutes (the
        # Young interval of a provider with an MTBF of hours), not against these tiny ones.
        seg_s = 300.0
        figures["check_overhead_5min_segments_with_startup"] = round(
            steady * (1 + figures["real_replay_startup_s"] / seg_s), 4)
        print(f"with each replay's start-up ({figures['real_replay_startup_s']}s here) on"
              f" 5-minute segments: {figures['check_overhead_5min_segments_with_startup']:.4f}")
    figures.update(check_overhead=round(steady, 4),
                   check_overhead_first_1000_jobs=round(honest["check_compute"], 4),
                   client_check_overhead_first_1000_jobs=round(
                       honest["client_check_compute"], 4),
                   false_positives=figures.get("real_false_positives", 0)
                   + figures.get("fingerprint_false_positives", 0)
                   + figures.get("endpoint_false_positives", 0)
                   + figures.get("endpoint_continuous_false_positives", 0)
                   + figures.get("endpoint_embed_false_positives", 0)
                   + figures.get("script_false_positives_json", 0)
                   + figures.get("script_false_positives_exact", 0)
                   + figures.get("render_false_positives", 0)
                   + int(honest["caught"] > 0))
    # One figure per doctoring class (a new provider doctoring every job of that class;
    # training: 10 % of its segments), and the least of them.
    classes = {k: v for k, v in figures.items() if k.startswith("detection_p_20_jobs")
               and "_at_" not in k and not k.endswith("after_long_record")
               # (the sample alone stands for the render class only where no real render
               # measured what the previews catch)
               and not (k.endswith("sample_only") and not args.skip_real)}
    least = min(classes, key=classes.get)
    figures.update(detection_min=classes[least], detection_min_class=least)
    print(f"least detection within 20 jobs over {len(classes)} classes: {classes[least]}"
          f" ({least})")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
