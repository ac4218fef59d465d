"""Sampled tokens judged by how they were drawn (kinds/draws.py, docs/verification.md): the
checker's prefill also says where each sampled token sits in the distribution the row's
temperature and top_p give, and the broker fails a row whose tokens an honest sampler would
not draw. In process, on the tests' tiny Llama with its output embedding scaled (a random
init's logits are nearly uniform, a trained model's peaked: PEAK makes them so): honest
sampled rows at several temperatures and top_p pass; a provider that swaps 1-3 tokens for
ones the model found unlikely and fingerprints them with the right model is caught, and so
is another model's sampled text fingerprinted by the right model; the endpoint engines'
(batch, continuous) honest sampled answers pass and a swapped one fails; an old checker's replay
(no figures) leaves the row judged by fingerprints, and the verdict says so."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from gpumarket.kinds import draws, generate
from gpumarket.kinds.endpoint import KIND as ENDPOINT
from tests.models import tiny_causal_lm
from tests.test_fingerprints import ENGINE_PARAMS, answered, judge, rows, run_runner
from tests.test_inference import write_prompts

PEAK = 25.0          # the output embedding's scale: logits' standard deviation ~4, not 0.16
SAMPLINGS = [(0.7, 1.0), (1.0, 0.9), (1.5, 0.95)]
CHECK_BATCH = 4


def peaked(target: Path, seed: int) -> Path:
    from safetensors.torch import load_file, save_file

    out = tiny_causal_lm(target, seed)
    weights = load_file(out / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * PEAK
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from gpumarket.client.jobfile import pack_directory

    root = tmp_path_factory.mktemp("sampled-models")
    out = {"dirs": {}}
    for name, seed in (("right", 0), ("other", 1)):
        out["dirs"][name] = peaked(root / name, seed)
        tar = root / f"{name}.tar"
        tar.write_bytes(pack_directory(out["dirs"][name]))
        out[name] = tar
    out["prompts"] = write_prompts(root / "prompts.jsonl", 8)
    return out


def sampled_run(tmp_path: Path, models: dict, name: str, temperature: float, top_p: float,
                model: str = "right", batch: int = 4, dtype: str = "float32") -> Path:
    return run_runner(tmp_path / name, models, model, 1, params={
        "batch_size": batch, "dtype": dtype, "temperature": temperature, "top_p": top_p,
        "seed": 5})


def check(tmp_path: Path, models: dict, provider_out: Path, temperature: float,
          top_p: float, job_dtype: str = "") -> tuple[bool, str]:
    """An honest float32 checker's prefill of the provider's sampled rows, compared by the
    generate kind as the broker does."""
    import tempfile

    out = run_runner(Path(tempfile.mkdtemp(prefix="check-", dir=tmp_path)) / "work",
                     models, "right", 2, params={"dtype": job_dtype, "temperature":
                                                 temperature, "top_p": top_p},
                     check_of="job", check_batch_size=CHECK_BATCH, check_position=0.0,
                     check_claimed=str(provider_out / "completions.jsonl"))
    scope = {"position": 0.0, "batch_size": CHECK_BATCH, "dtype": job_dtype,
             "greedy": False, "claimed": {"name": "completions.jsonl", "sha256": "0" * 64}}
    expect = {n: provider_out / n for n in ("completions.jsonl", "fingerprints.jsonl")}
    got = {n: out / n for n in ("completions.jsonl", "fingerprints.jsonl", "metrics.json")}
    return generate.KIND.compare(expect, got, scope)


def refingerprinted(tmp_path: Path, models: dict, honest: Path, name: str, change) -> Path:
    """The honest provider's rows with their token ids changed by ``change(prompt ids,
    ids, logits)``, text and fingerprints made again by the right model (a cheat that
    keeps them consistent)."""
    import torch

    from gpumarket.provider.runners.fingerprint import _forward, commit
    from gpumarket.provider.runners.generate import load

    tokenizer, model = load(models["dirs"]["right"], torch.device("cpu"), torch.float32)
    prompts = [json.loads(line)["prompt"] for line in
               models["prompts"].read_text().splitlines()]
    out = tmp_path / name
    out.mkdir()
    done = rows(honest / "completions.jsonl")
    with open(out / "completions.jsonl", "w") as f, \
            open(out / "fingerprints.jsonl", "w") as g:
        for r in done:
            p = tokenizer(prompts[r["index"]])["input_ids"]
            logits, _, _, _ = _forward(model, [(p, r["token_ids"])], "cpu",
                                       len(r["token_ids"]) + 1)
            ids = change(r["token_ids"], logits[0, -len(r["token_ids"]) - 1:-1])
            r = {**r, "token_ids": ids,
                 "completion": tokenizer.decode(ids, skip_special_tokens=True)}
            f.write(json.dumps(r) + "\n")
            g.write(json.dumps({"index": r["index"],
                                "fingerprints": commit(model, [(p, ids)], "cpu")[0]}) + "\n")
    return out


def test_honest_sampled_rows_pass_at_several_temperatures_and_top_p(tmp_path, models):
    for n, (temperature, top_p) in enumerate(SAMPLINGS):
        # bfloat16 on the provider (a GPU's), float32 on the checker, another batch size
        honest = sampled_run(tmp_path, models, f"h{n}", temperature, top_p,
                             batch=(1, 8, 4)[n], dtype=("float32", "bfloat16", "")[n])
        agrees, why = check(tmp_path, models, honest, temperature, top_p)
        assert agrees, why
        assert "drawn as the job's temperature and top_p say" in why, why


def test_a_few_tokens_swapped_for_unlikely_ones_and_refingerprinted_are_caught(
        tmp_path, models):
    rng = random.Random(11)
    for temperature, top_p in ((0.7, 1.0), (1.0, 0.9)):
        honest = sampled_run(tmp_path, models, f"h{temperature}", temperature, top_p)
        for swaps in (1, 2, 3):
            def swap(ids, logits):
                ids = list(ids)
                for j in rng.sample(range(len(ids)), swaps):
                    ids[j] = int(logits[j].argmin())       # the least likely token there
                return ids

            cheat = refingerprinted(tmp_path, models, honest, f"s{temperature}-{swaps}", swap)
            agrees, why = check(tmp_path, models, cheat, temperature, top_p)
            assert not agrees and ("unlikely" in why or "nucleus" in why), why


def test_another_model_s_sampled_rows_fingerprinted_by_the_right_model_are_caught(
        tmp_path, models):
    for temperature, top_p in ((0.7, 1.0), (1.0, 0.9)):
        other = sampled_run(tmp_path, models, f"o{temperature}", temperature, top_p,
                            model="other")
        cheat = refingerprinted(tmp_path, models, other, f"c{temperature}",
                                lambda ids, logits: ids)
        agrees, why = check(tmp_path, models, cheat, temperature, top_p)
        assert not agrees and ("draws" in why or "unlikely" in why or "nucleus" in why), why


def sampled_answers(model_dir: Path, prompts: list[str], temperature: float,
                    top_p: float) -> list[tuple]:
    """Sampled requests answered together by the batch engine: (request, final) each."""
    from gpumarket.kinds.engine_protocol import Complete
    from gpumarket.kinds.runner_job import RunnerJob
    from gpumarket.provider.runners.engine import load_engine

    job = RunnerJob(params=ENGINE_PARAMS, model_dir=str(model_dir))
    return answered(lambda: load_engine(job, model_dir), [
        Complete(prompt=p, max_tokens=40, temperature=temperature, top_p=top_p, seed=i)
        for i, p in enumerate(prompts)])


def test_an_endpoint_s_sampled_answers_are_judged_by_their_draws(tmp_path, models):
    right = models["dirs"]["right"]
    prompts = ["the quick brown fox", "a marketplace for idle gpus", "providers advertise"]
    honest = sampled_answers(right, prompts, 1.0, 0.9)
    verdicts = judge(right, honest)
    assert all(agrees for agrees, _ in verdicts), verdicts
    # one token of each answer swapped for one outside the nucleus, fingerprints made again
    # by the right model: caught by its draw, not its fingerprints
    import torch

    from gpumarket.provider.runners.fingerprint import commit
    from gpumarket.provider.runners.generate import load

    tokenizer, model = load(right, torch.device("cpu"), torch.float32)
    doctored = []
    for request, final in honest:
        ids = list(final.token_ids)
        ids[len(ids) // 2] = (ids[len(ids) // 2] + 101) % len(tokenizer)
        p = tokenizer(request.prompt)["input_ids"]
        doctored.append((request, type(final)(**{**final.__dict__, "token_ids": ids,
                                                 "fingerprints": commit(model, [(p, ids)],
                                                                        "cpu")[0]})))
    verdicts = judge(right, doctored)
    assert not any(agrees for agrees, _ in verdicts), verdicts
    assert any("nucleus" in why or "unlikely" in why for _, why in verdicts), verdicts


def test_an_old_checker_s_replay_leaves_sampled_answers_to_their_fingerprints(tmp_path):
    want = tmp_path / "want.jsonl"
    have = tmp_path / "have.jsonl"
    from gpumarket.kinds import fingerprints as fp

    good = fp.encode(list(range(16)), [float(i + 1) for i in range(16)])
    want.write_text(json.dumps({"index": 0, "fingerprints": [good], "greedy": False,
                                "token_ids": [1, 2]}) + "\n")
    have.write_text(json.dumps({"index": 0, "fingerprints": [good], "token_gap": 3.0}) + "\n")
    agrees, why = ENDPOINT.compare({"answers.jsonl": want}, {"answers.jsonl": have},
                                   {"dtype": ""})
    assert agrees and "judged by fingerprints only" in why, why
    # with figures that say a token is far outside the nucleus, the same answer fails
    have.write_text(json.dumps({"index": 0, "fingerprints": [good], "token_gap": 3.0,
                                "draws": {"tokens": 2, "outside": 4.0, "least": 0.5,
                                          "fisher": 2.0}}) + "\n")
    agrees, why = ENDPOINT.compare({"answers.jsonl": want}, {"answers.jsonl": have},
                                   {"dtype": ""})
    assert not agrees and "nucleus" in why, why


def test_the_draw_figures_judge_by_known_bounds_and_refuse_hostile_ones():
    # chi-square of 2 degrees: P(X >= x) = exp(-x / 2)
    assert math.isclose(draws.chi2_sf_even(10.0, 2), math.exp(-5), rel_tol=1e-12)
    assert math.isclose(draws.chi2_sf_even(4.0, 4), math.exp(-2) * 3, rel_tol=1e-12)

    def every_term(x: float, dof: int) -> float:      # the sum without its window
        logs = [k * math.log(x / 2) - math.lgamma(k + 1) for k in range(dof // 2)]
        top = max(logs)
        return min(1.0, math.exp(-x / 2 + top + math.log(sum(math.exp(v - top)
                                                              for v in logs))))

    for dof in (128, 20_000, 200_000):                # windowed where terms are many
        for x in (dof * 0.5, dof * 0.9, dof, dof * 1.1, dof * 1.5, dof * 3.0):
            assert math.isclose(draws.chi2_sf_even(x, dof), every_term(x, dof),
                                rel_tol=1e-9, abs_tol=1e-300), (x, dof)
    # a hostile checker's largest token count is judged like any other
    most = {"tokens": 1_048_576, "outside": 0.0, "least": 0.5, "fisher": 1e7}
    assert draws.judge(most, "")[0] is False
    assert draws.judge({**most, "fisher": 2 * 1_048_576.0}, "") == (True, "")
    honest = {"tokens": 64, "outside": 0.0, "least": 0.01, "fisher": 128.0}
    assert draws.judge(honest, "") == (True, "")
    assert draws.judge(None, "")[0] is None
    unlikely = {**honest, "least": 1e-13}
    assert draws.judge(unlikely, "")[0] is False
    skewed = {**honest, "fisher": 400.0}
    assert draws.judge(skewed, "")[0] is False
    assert draws.judge({**honest, "outside": 0.2}, "float32")[0] is False
    assert draws.judge({**honest, "outside": 0.2}, "")[0] is True     # bfloat16 rounding
    for bad in ("x", {}, {**honest, "tokens": -1}, {**honest, "least": 2.0},
                {**honest, "fisher": float("nan")}, {**honest, "tokens": 1.5},
                {**honest, "outside": "far"}):
        assert draws.judge(bad, "")[0] is False, bad


def test_the_continuous_engine_s_honest_sampled_answers_pass(models):
    """transformers continuous batching draws with its own per-request processors: the
    checker's nucleus and tail masses must be that sampler's too."""

    import torch

    from gpumarket.kinds.engine_protocol import Complete
    from gpumarket.provider.runners.batching import ContinuousEngine
    from gpumarket.provider.runners.engine import Settings
    from gpumarket.provider.runners.generate import load

    right = models["dirs"]["right"]
    tokenizer, model = load(right, torch.device("cpu"), torch.float32)
    settings = Settings.from_params({**ENGINE_PARAMS, "engine": "continuous"})
    prompts = ["the quick brown fox", "a marketplace for idle gpus", "the lazy dog"]

    answers = answered(lambda: ContinuousEngine(tokenizer, model, settings, 256), [
        Complete(prompt=p, max_tokens=40, temperature=1.0, top_p=0.9, seed=i)
        for i, p in enumerate(prompts)])
    assert all(len(f.token_ids) > 0 for _, f in answers)
    verdicts = judge(right, answers)
    assert all(agrees for agrees, _ in verdicts), verdicts


def test_a_model_s_own_generation_config_does_not_change_what_it_is_checked_against(
        tmp_path, models):
    """A model's generation_config.json may set a repetition penalty, min_p, a minimum
    length...; transformers' ``generate`` applied them, so an honest provider's greedy
    tokens left the replay's top ones and its sampled ones the distribution they are judged
    by. The runners sample as checked (fingerprint.AS_CHECKED): the same model with such a
    config gives the plain model's greedy rows, and its sampled rows pass their check."""
    import shutil

    from gpumarket.client.jobfile import pack_directory

    # The plain tiny Llama (not PEAK's): its greedy rows repeat tokens, which the penalty
    # and the n-gram rule change (with the config obeyed, the rows below differ).
    plain = tiny_causal_lm(tmp_path / "plain-model")
    skewed = tmp_path / "skewed-model"
    shutil.copytree(plain, skewed)
    config = skewed / "generation_config.json"
    said = json.loads(config.read_text()) if config.exists() else {}
    config.write_text(json.dumps({**said, "repetition_penalty": 3.0, "min_p": 0.5,
                                  "no_repeat_ngram_size": 1, "min_new_tokens": 4}))
    local = {"prompts": models["prompts"], "dirs": {"right": plain}}
    for name, folder in (("right", plain), ("skewed", skewed)):
        local[name] = tmp_path / f"{name}.tar"
        local[name].write_bytes(pack_directory(folder))
    greedy = [rows(run_runner(tmp_path / name, local, name, 1,
                              params={"batch_size": 4, "temperature": 0.0})
                   / "completions.jsonl") for name in ("right", "skewed")]
    assert [r["token_ids"] for r in greedy[0]] == [r["token_ids"] for r in greedy[1]]
    temperature, top_p = SAMPLINGS[1]
    sampled = run_runner(tmp_path / "s", local, "skewed", 1, params={
        "batch_size": 4, "temperature": temperature, "top_p": top_p, "seed": 5})
    agrees, why = check(tmp_path, local, sampled, temperature, top_p)
    assert agrees, why
