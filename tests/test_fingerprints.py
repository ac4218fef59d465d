"""Checks of generated text by activation fingerprints (kinds/fingerprints.py,
docs/verification.md): the generate runner records them while it generates; a check runs the
runner's prefill mode on the provider's tokens, and the generate kind compares. Real runs of
the runner (in this process) on the tests' tiny Llama: honest runs at another batch size,
thread count and dtype pass; another model, a bfloat16-rounded model passed off as float32,
altered tokens and text that is not its tokens' are caught."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from gpumarket.kinds import fingerprints as fp
from gpumarket.kinds import generate
from tests.models import tiny_causal_lm
from tests.test_inference import write_prompts

MAX_TOKENS = 40          # two fingerprints a row: after token 32 and at the last
CHECK_BATCH = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"right": the job's model, "other": another random init, "rounded": the right one's
    weights rounded to bfloat16, stored as float32}, each packed as a model.tar."""
    import torch
    from safetensors.torch import load_file, save_file

    from gpumarket.client.jobfile import pack_directory

    root = tmp_path_factory.mktemp("fingerprint-models")
    right = tiny_causal_lm(root / "right", 0)
    other = tiny_causal_lm(root / "other", 1)
    rounded = tiny_causal_lm(root / "rounded", 0)
    weights = load_file(rounded / "model.safetensors")
    save_file({k: v.to(torch.bfloat16).to(v.dtype) for k, v in weights.items()},
              rounded / "model.safetensors", metadata={"format": "pt"})
    out = {}
    for name, model in (("right", right), ("other", other), ("rounded", rounded)):
        tar = root / f"{name}.tar"
        tar.write_bytes(pack_directory(model))
        out[name] = tar
    out["prompts"] = write_prompts(root / "prompts.jsonl", 8)
    return out


def run_runner(work: Path, models: dict, model: str, threads: int, **fields) -> Path:
    """Run the generate runner in this process on ``work``; returns its outputs folder."""
    import torch

    from gpumarket.provider.runners import generate as runner
    from gpumarket.provider.runners.report import Reporter

    work.mkdir(parents=True)
    params = {"model": "model.tar", "prompts": "prompts.jsonl", "max_tokens": MAX_TOKENS,
              **fields.pop("params", {})}
    (work / "job.json").write_text(json.dumps({
        "job_id": work.name, "attempt": 1, "kind": "generate", "device": "cpu",
        "params": params, "inputs": {"model.tar": str(models[model]),
                                     "prompts.jsonl": str(models["prompts"])}, **fields}))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner.generate(work, Reporter())
    finally:
        torch.set_num_threads(before)
    return work / "outputs"


def provider_run(tmp_path: Path, models: dict, name: str, *, model: str = "right",
                 batch: int, dtype: str, threads: int = 1) -> Path:
    return run_runner(tmp_path / name, models, model, threads,
                      params={"batch_size": batch, "dtype": dtype})


def check(tmp_path: Path, models: dict, provider_out: Path, job_dtype: str, *,
          threads: int = 2, position: float = 0.0, outputs: list | None = None
          ) -> tuple[bool, str]:
    """An honest checker's prefill of the provider's tokens (the job's own model and dtype,
    another batch and thread count), compared by the generate kind as the broker does."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = run_runner(Path(tempfile.mkdtemp(prefix="check-", dir=tmp_path)) / "work",
                     models, "right", threads, params={"dtype": job_dtype},
                     check_of="job", check_batch_size=CHECK_BATCH, check_position=position,
                     check_claimed=str(provider_out / "completions.jsonl"))
    scope = {"position": position, "batch_size": CHECK_BATCH, "dtype": job_dtype,
             "greedy": True, "claimed": {"name": "completions.jsonl", "sha256": "0" * 64}}
    expect = {n: provider_out / n for n in ("completions.jsonl", "fingerprints.jsonl")}
    got = {n: out / n for n in ("completions.jsonl", "fingerprints.jsonl", "metrics.json")}
    if outputs is not None:
        outputs.append(got)
    return generate.KIND.compare(expect, got, scope)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_runner_records_compact_fingerprints_with_its_tokens(tmp_path, models):
    out = provider_run(tmp_path, models, "p", batch=4, dtype="float32")
    done = rows(out / "completions.jsonl")
    prints = {r["index"]: r["fingerprints"] for r in rows(out / "fingerprints.jsonl")}
    assert len(done) == 8 and set(prints) == set(range(8))
    for r in done:
        assert len(r["token_ids"]) == r["output_tokens"] > 0
        assert "fingerprints" not in r     # a checker reads this file: never what it is
        assert len(prints[r["index"]]) == len(fp.positions(r["output_tokens"]))
        for text in prints[r["index"]]:
            indices, values = fp.decode(text)
            assert len(indices) == fp.k_for(64) == 16     # hidden 64: a quarter of it
            assert len(text) <= 4 * 4 * 16 // 3 + 4      # 4 bytes an entry, as base64


def test_an_honest_run_at_another_batch_size_thread_count_and_dtype_passes(tmp_path, models):
    # float32 asked, float32 run at batch 1 on one thread, checked by a prefill of 4 rows
    # on two: within the float32 tolerance
    honest = provider_run(tmp_path, models, "f32", batch=1, dtype="float32")
    for position in (0.0, 0.9):
        agrees, why = check(tmp_path / f"at{position}", models, honest, "float32",
                            position=position)
        assert agrees, why
    # "auto" asked: a provider that ran bfloat16 (as a GPU would) at batch 8, checked by a
    # float32 prefill on the CPU
    bf16 = provider_run(tmp_path, models, "bf16", batch=8, dtype="bfloat16", threads=2)
    agrees, why = check(tmp_path, models, bf16, "")
    assert agrees, why


def test_a_swapped_model_is_caught(tmp_path, models):
    out = provider_run(tmp_path, models, "swapped", model="other", batch=4, dtype="float32")
    agrees, why = check(tmp_path, models, out, "")
    assert not agrees and "fingerprint" in why, why


def test_a_bfloat16_rounded_model_passed_off_as_float32_is_caught(tmp_path, models):
    out = provider_run(tmp_path, models, "rounded", model="rounded", batch=4, dtype="float32")
    agrees, why = check(tmp_path, models, out, "float32")
    assert not agrees and "differ" in why, why
    # where the job left the dtype to the provider, bfloat16's precision is honest
    agrees, why = check(tmp_path / "auto", models, out, "")
    assert agrees, why


def test_altered_tokens_and_text_that_is_not_its_tokens_are_caught(tmp_path, models):
    from transformers import AutoTokenizer

    honest = provider_run(tmp_path, models, "honest", batch=4, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(tiny_causal_lm(tmp_path / "tok"))
    done = rows(honest / "completions.jsonl")

    def doctored(name: str, change) -> Path:
        out = tmp_path / name
        out.mkdir()
        (out / "fingerprints.jsonl").write_bytes((honest / "fingerprints.jsonl").read_bytes())
        with open(out / "completions.jsonl", "w") as f:
            for r in done:
                f.write(json.dumps(change(dict(r))) + "\n")
        return out

    def alter_token(r: dict) -> dict:
        ids = list(r["token_ids"])
        ids[len(ids) // 2] = (ids[len(ids) // 2] + 7) % len(tokenizer)
        r["token_ids"] = ids
        r["completion"] = tokenizer.decode(ids, skip_special_tokens=True)
        return r

    replays: list = []
    tokens = doctored("tokens", alter_token)
    agrees, why = check(tmp_path, models, tokens, "", outputs=replays)
    assert not agrees and ("fingerprint" in why or "greedy token" in why), why
    # the tie-break: it disagrees with the provider too, and agrees with the first check
    # (their token gap is the claimed tokens', not theirs), so the provider is found wrong
    agrees, why = check(tmp_path, models, tokens, "", threads=1, outputs=replays)
    assert not agrees, why
    first = {n: replays[0][n] for n in ("completions.jsonl", "fingerprints.jsonl")}
    scope = {"batch_size": CHECK_BATCH, "dtype": "", "greedy": True, "replays": True,
             "claimed": {"name": "completions.jsonl", "sha256": "0" * 64}}
    agrees, why = generate.KIND.compare(first, replays[1], scope)
    assert agrees, why

    def other_text(r: dict) -> dict:
        r["completion"] = "the quick brown fox jumps over the lazy dog"
        return r

    agrees, why = check(tmp_path, models, doctored("text", other_text), "")
    assert not agrees and "not the text of its tokens" in why, why


def test_hostile_fingerprints_disagree_and_never_crash():
    good = fp.encode(list(range(16)), [float(i) for i in range(16)])
    tol = fp.tolerance("")
    assert fp.same_fingerprints([good], [good], tol) == (True, "")
    for bad in (["!!"], [good[:-4]], [123], [fp.encode([1] * 16, [0.0] * 16)],
                [fp.encode([1], [float("nan")])], [good, good], "x", None,
                ["A" * 10_000]):
        agrees, why = fp.same_fingerprints(bad, [good], tol)
        assert not agrees and why
    assert fp.positions(0) == [] and fp.positions(1) == [0]
    assert fp.positions(64) == [31, 63] and fp.positions(70) == [31, 63, 69]


# -- endpoint answers ---------------------------------------------------------------------

ENGINE_PARAMS = {"model": "", "model_name": "tiny", "task": "", "dtype": "", "max_seq_len": 0,
                 "max_concurrency": 8, "engine": "batch", "trust_remote_code": False}


def answered(make_engine, requests: list, stagger: float = 0.0, inside=None) -> list[tuple]:
    """``requests`` (engine_protocol.Complete) through the engine ``make_engine()`` makes,
    all in flight at once on a loop of its own (the i-th after ``stagger`` x i seconds: later
    ones join a running batch): (request, its final message) each, in order. ``inside``
    is called with the engine once every answer has ended, before it closes."""
    import asyncio

    from gpumarket.kinds.engine_protocol import Final

    async def run() -> list[tuple]:
        engine = make_engine()
        out = {}

        async def one(i: int, request) -> None:
            if stagger:
                await asyncio.sleep(stagger * i)
            async for event in engine.complete(f"r{i}", request):
                if isinstance(event, Final):
                    out[i] = (request, event)
        try:
            await asyncio.wait_for(asyncio.gather(*(one(i, r) for i, r in
                                                    enumerate(requests))), 300)
            if inside is not None:
                inside(engine)
        finally:
            await engine.close()
        return [out[i] for i in range(len(requests))]

    return asyncio.run(run())


def serve_answers(model_dir: Path, prompts: list[str], max_tokens: int) -> list[tuple]:
    """Requests answered together by the batch engine (rows joining between decode steps):
    (request, final message) each."""
    from gpumarket.kinds.engine_protocol import Complete
    from gpumarket.kinds.runner_job import RunnerJob
    from gpumarket.provider.runners.engine import load_engine

    job = RunnerJob(params=ENGINE_PARAMS, model_dir=str(model_dir))
    return answered(lambda: load_engine(job, model_dir), [
        Complete(prompt=p, max_tokens=max_tokens + i, temperature=0)
        for i, p in enumerate(prompts)], stagger=0.01)


def judge(model_dir: Path, answers: list[tuple], dtype: str = "") -> list[tuple[bool, str]]:
    """An honest checker's prefill of the answers (answer_check.check_answers)."""
    import torch

    from gpumarket.provider.runners.answer_check import check_answers
    from gpumarket.provider.runners.generate import load

    tokenizer, model = load(model_dir, torch.device("cpu"), torch.float32)
    samples = [{"request": r.to_dict(), "token_ids": f.token_ids,
                "fingerprints": f.fingerprints} for r, f in answers]
    return check_answers(tokenizer, model, torch.device("cpu"), 256, samples, dtype)


ANSWER_PROMPTS = ["the quick brown fox", "a marketplace for idle gpus", "providers advertise",
                  "checkpoints let a job resume", "the lazy dog"]


def test_an_endpoint_engine_commits_to_its_answers_and_an_honest_one_passes(tmp_path):
    from gpumarket.kinds.engine_protocol import decode_answer

    model = tiny_causal_lm(tmp_path / "tiny")
    answers = serve_answers(model, ANSWER_PROMPTS, 33)
    for request, final in answers:
        assert final.error is None, final
        assert len(final.token_ids) == final.output_tokens
        assert len(final.fingerprints) == len(fp.positions(final.output_tokens))
        # what crosses the daemon and the broker keeps them (and refuses ones that do not fit)
        line = json.dumps(final.to_dict()).encode()
        assert decode_answer(line).fingerprints == final.fingerprints
        bad = json.loads(line)
        bad["token_ids"] = bad["token_ids"][:-1]
        assert decode_answer(json.dumps(bad).encode()).fingerprints is None
    verdicts = judge(model, answers)
    assert all(agrees for agrees, _ in verdicts), verdicts


def test_an_endpoint_replica_answering_with_another_model_is_caught(tmp_path):
    right = tiny_causal_lm(tmp_path / "right", 0)
    other = tiny_causal_lm(tmp_path / "other", 1)
    answers = serve_answers(other, ANSWER_PROMPTS, 33)
    verdicts = judge(right, answers)
    assert not any(agrees for agrees, _ in verdicts), verdicts
    # random tokens, committed to by the right model's fingerprints, are caught by the gap
    import random

    honest = serve_answers(right, ANSWER_PROMPTS[:2], 20)
    rng = random.Random(3)
    doctored = [(r, type(f)(**{**f.__dict__, "token_ids": [rng.randrange(300) for _ in
                                                         f.token_ids]}))
                for r, f in honest]
    refit = judge(right, doctored)
    assert not any(agrees for agrees, _ in refit), refit
