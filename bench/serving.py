"""Serving benchmark (docs/serving.md): what the marketplace adds to an endpoint's latency and
takes from its throughput, and how fast it scales.

1. Open-loop load: requests arrive as a Poisson process at each rate in --rates (streamed
   chat completions of --tokens tokens) for --duration seconds, against
   (a) the same engine served directly in this process (provider/runners/engine.py), and
   (b) an endpoint of one replica through a local broker and provider, called with the
       official ``openai`` package (AsyncOpenAI).
   Per rate and side: throughput (output tokens/s over the window), TTFT and TPOT p50/p99,
   errors; and the ratios market/direct.
2. Scale-up: an endpoint with max_replicas 2 under a step of load: the time from the step
   to a second replica serving.
3. Scale from zero: an endpoint with min_replicas 0 whose model the provider already holds
   in its cache: the time from the first request to its first token.
4. Joining (issue 32): 16 streams, in process, the first one alone and the other 15
   arriving --join-gap-ms apart while it decodes, max_concurrency 16, on the CPU batch engine
   as it is (step-wise: requests join between decode steps), as it was (one ``generate``
   call at a time, ``BatchEngine(stepwise=False)``) and on continuous batching: TTFT p50
   and p99 of the 16 (to their first text piece, and to their first token as the engine
   measured it), tokens/s, and this process's CPU milliseconds per token.

    .venv/bin/python bench/serving.py [--rates 2,4,8] [--duration 20] [--tokens 32]
    .venv/bin/python bench/serving.py --join-only [--join-rounds 3]

The model is the tiny 2-layer Llama of tests/models.py on the CPU. Prints its figures; the
last line is one JSON object with throughput_ratio and ttft_p50_added_ms (at the highest
rate), scale_up_s, scale_from_zero_s and ``join`` (case 4; with --join-only, only it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpumarket.kinds.engine_protocol import Complete, Final, Message  # noqa: E402
from gpumarket.kinds.runner_job import RunnerJob  # noqa: E402
from tests.helpers import LEASE_ARGS, Marketplace, wait_until  # noqa: E402
from tests.models import tiny_causal_lm  # noqa: E402
from percentiles import p50_p99_ms  # noqa: E402

PROMPTS = ["the quick brown fox", "a marketplace for idle gpus", "providers advertise devices",
           "checkpoints let a job resume", "the broker matches each job"]


def summary(samples: list[dict], window_s: float) -> dict:
    ok = [s for s in samples if not s.get("error")]
    tokens = sum(s["tokens"] for s in ok)
    return {"requests": len(samples), "errors": len(samples) - len(ok),
            "tokens_per_s": tokens / window_s,
            **p50_p99_ms([s["ttft"] for s in ok], "ttft"),
            **p50_p99_ms([s["tpot"] for s in ok if s["tokens"] > 1], "tpot")}


async def open_loop(send, rate: float, duration: float, seed: int) -> tuple[list[dict], float]:
    """Start ``send(i)`` at Poisson arrivals of ``rate``/s for ``duration`` s; wait for all.
    Returns the samples and the window (first arrival to last answer)."""
    rng = random.Random(seed)
    tasks, began = [], time.perf_counter()
    at = 0.0
    i = 0
    while True:
        at += rng.expovariate(rate)
        if at > duration:
            break
        delay = began + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(i)))
        i += 1
    samples = await asyncio.gather(*tasks)
    return samples, time.perf_counter() - began


def timing(start: float, pieces: list[float], tokens: int) -> dict:
    end = time.perf_counter()
    first = pieces[0] if pieces else end
    return {"ttft": first - start, "tokens": tokens,
            "tpot": (end - first) / (tokens - 1) if tokens > 1 else 0.0}


async def direct_side(model: Path, rates: list[float], duration: float, tokens: int,
                      concurrency: int) -> dict:
    from gpumarket.provider.runners.engine import load_engine

    job = RunnerJob(params={"model_name": model.name, "max_concurrency": concurrency,
                            "max_seq_len": 256}, model_dir=str(model))
    engine = load_engine(job, model)

    async def send(i: int) -> dict:
        start, pieces, final = time.perf_counter(), [], Final()
        request = Complete(max_tokens=tokens, temperature=0, messages=(
            Message("user", PROMPTS[i % len(PROMPTS)]),))
        async for event in engine.complete(f"d{i}", request):
            if isinstance(event, Final):
                final = event
            else:
                pieces.append(time.perf_counter())
        if final.error is not None:
            return {"error": final.error, "ttft": 0, "tpot": 0, "tokens": 0}
        return timing(start, pieces, final.output_tokens)

    await send(-1)      # warm-up
    out = {}
    for rate in rates:
        samples, window = await open_loop(send, rate, duration, seed=int(rate * 1000))
        out[rate] = summary(samples, window)
    await engine.close()
    return out


async def market_side(base: str, key: str, model_name: str, rates: list[float],
                      duration: float, tokens: int) -> dict:
    import openai

    api = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=300)

    async def send(i: int) -> dict:
        start, pieces, usage = time.perf_counter(), [], None
        try:
            stream = await api.chat.completions.create(
                model=model_name, max_tokens=tokens, temperature=0, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(time.perf_counter())
        except openai.APIError as exc:
            return {"error": str(exc), "ttft": 0, "tpot": 0, "tokens": 0}
        return timing(start, pieces, usage.completion_tokens if usage else len(pieces))

    await send(-1)
    out = {}
    for rate in rates:
        samples, window = await open_loop(send, rate, duration, seed=int(rate * 1000))
        out[rate] = summary(samples, window)
    await api.close()
    return out


JOIN_ENGINES = ("step-wise", "generate calls", "continuous")


async def join_case(model: Path, engine_name: str, streams: int, tokens: int,
                    gap_s: float) -> dict:
    """Case 4 on one engine: one stream of ``tokens`` tokens, then ``streams`` - 1 more
    arriving ``gap_s`` apart once its first token is out; their TTFTs and the tokens/s."""
    from gpumarket.provider.runners.batching import BatchEngine
    from gpumarket.provider.runners.engine import Settings, load_engine

    params = {"model_name": model.name, "max_concurrency": streams, "max_seq_len": 256,
              "engine": "continuous" if engine_name == "continuous" else "batch"}
    engine = load_engine(RunnerJob(params=params, model_dir=str(model)), model)
    if engine_name == "generate calls":
        loaded = engine
        engine = BatchEngine(loaded.tokenizer, loaded.model, Settings.from_params(params),
                             loaded.max_seq_len, stepwise=False)
        await loaded.close()
    first_token = asyncio.Event()

    async def one(i: int) -> dict:
        start, pieces, final = time.perf_counter(), [], Final()
        request = Complete(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=tokens, temperature=0)
        async for event in engine.complete(f"j{i}", request):
            if isinstance(event, Final):
                final = event
            elif event.text:
                pieces.append(time.perf_counter())
                if i == 0:
                    first_token.set()       # the later ones come while it decodes
        if final.error is not None:
            return {"error": final.error, "ttft": 0, "tpot": 0, "tokens": 0}
        return {**timing(start, pieces, final.output_tokens), "engine_ttft": final.ttft_s}

    async def later(i: int) -> dict:
        await first_token.wait()
        await asyncio.sleep(gap_s * i)
        return await one(i)

    await one(-1)       # warm-up
    began, cpu = time.perf_counter(), time.process_time()
    samples = await asyncio.gather(one(0), *(later(i) for i in range(1, streams)))
    window, cpu = time.perf_counter() - began, time.process_time() - cpu
    await engine.close()
    out = summary(samples, window)
    # the engine's own: to its first token (the first text piece may wait for a whole
    # character: the tiny model's random bytes often are not one)
    out.update(p50_p99_ms([s["engine_ttft"] for s in samples], "engine_ttft"))
    # CPU time of this process (the engine's thread and the loop) per token: on a host
    # shared with other work a steadier measure of the engine's cost than tokens/s
    out["cpu_ms_per_token"] = cpu * 1000 / max(1, sum(s["tokens"] for s in samples))
    out["engine"] = engine.description
    return out


def join_cases(model: Path, rounds: int, streams: int, tokens: int, gap_s: float) -> dict:
    """Case 4 on each of JOIN_ENGINES, ``rounds`` times in turn; each engine's round with
    the median TTFT p99."""
    runs: dict[str, list[dict]] = {name: [] for name in JOIN_ENGINES}
    for _ in range(rounds):
        for name in JOIN_ENGINES:
            runs[name].append(asyncio.run(join_case(model, name, streams, tokens, gap_s)))
    out = {}
    for name, results in runs.items():
        mid = sorted(results, key=lambda r: r["ttft_p99_ms"])[len(results) // 2]
        out[name] = {k: round(v, 2) if isinstance(v, float) else v for k, v in mid.items()}
        print(f"join, {name}: TTFT p50 {mid['ttft_p50_ms']:.0f} ms, p99"
              f" {mid['ttft_p99_ms']:.0f} ms (to the first token: p50"
              f" {mid['engine_ttft_p50_ms']:.0f}, p99 {mid['engine_ttft_p99_ms']:.0f} ms),"
              f" {mid['tokens_per_s']:.0f} tokens/s,"
              f" {mid['cpu_ms_per_token']:.2f} CPU ms a token (median of {rounds} rounds by"
              f" p99; {mid['engine']})", flush=True)
    return out


def models_dir(root: Path) -> Path:
    """The tiny 2-layer Llama (tests/models.py) under ``root``/models/tiny-llama, the whole
    tree readable by the jobs' own uids (a provider's --models-dir); returns its directory."""
    model = tiny_causal_lm(root / "models" / "tiny-llama")
    root.chmod(0o755)
    for path in (root / "models", model, *model.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return model


def endpoint_file(path: Path, name: str, **params) -> str:
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in params.items())
    path.write_text(f'kind = "endpoint"\nname = "{name}"\nmax_price = 5.0\n\n[endpoint]\n'
                    f'{lines}\n')
    return str(path)


def show(market: Marketplace, name: str) -> dict:
    r = market.cli("endpoint", "show", name, "--json", "--events", "500")
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout)


def ready_count(market: Marketplace, name: str) -> int:
    return sum(1 for r in show(market, name).get("replicas", []) if r.get("ready"))


def key_for(market: Marketplace, name: str) -> str:
    r = market.cli("endpoint", "key", name, "--json")
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout)["key"]


def create(market: Marketplace, path: Path, name: str, **params) -> None:
    r = market.cli("endpoint", "create", endpoint_file(path, name, **params))
    if r.returncode != 0:
        raise SystemExit(r.stderr)


async def step_load(base: str, key: str, name: str, until, tokens: int, concurrent: int) -> None:
    """Keep ``concurrent`` requests in flight until ``until()`` is true."""
    import openai

    api = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=300)

    async def worker() -> None:
        while not await asyncio.to_thread(until):
            await api.chat.completions.create(model=name, max_tokens=tokens, temperature=0,
                                              messages=[{"role": "user", "content": "x"}])
    await asyncio.gather(*(worker() for _ in range(concurrent)))
    await api.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="2,4,8", help="requests/s, comma-separated")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per rate")
    parser.add_argument("--tokens", type=int, default=32, help="max_tokens per request")
    parser.add_argument("--concurrency", type=int, default=8, help="max_concurrency")
    parser.add_argument("--join-only", action="store_true",
                        help="run only case 4 (requests joining a running batch)")
    parser.add_argument("--join-rounds", type=int, default=3, help="rounds of case 4")
    parser.add_argument("--join-tokens", type=int, default=64,
                        help="max_tokens of each stream in case 4")
    parser.add_argument("--join-gap-ms", type=float, default=20.0,
                        help="between the later arrivals of case 4")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = models_dir(root)
        print(f"case 4: 16 streams of {args.join_tokens} tokens, the later 15"
              f" {args.join_gap_ms:g} ms apart, max_concurrency 16", flush=True)
        join = join_cases(model, args.join_rounds, 16, args.join_tokens,
                          args.join_gap_ms / 1000)
        if args.join_only:
            print(json.dumps({"join": join}))
            return
        print(f"model: 2-layer Llama (tests/models.py); {args.tokens} tokens per request,"
              f" max_concurrency {args.concurrency}, {args.duration:.0f} s per rate", flush=True)
        direct = asyncio.run(direct_side(model, rates, args.duration, args.tokens,
                                         args.concurrency))
        (root / "market").mkdir()
        market = Marketplace(root / "market")
        try:
            market.start_broker(*LEASE_ARGS, "--http", "127.0.0.1:0")
            info = json.loads((market.root / "broker" / "broker.json").read_text())
            base = f"http://{info['http']}/v1"
            assert market.cli("keys", "init").returncode == 0
            market.start_provider("p1", 1.0, "--models-dir", str(root / "models"))
            market.start_provider("p2", 1.0, "--models-dir", str(root / "models"))
            market.wait_for_offers(2)
            create(market, root / "a.toml", "bench", model_name="tiny-llama",
                   max_concurrency=args.concurrency, max_seq_len=256, min_replicas=1,
                   max_replicas=1)
            wait_until(lambda: ready_count(market, "bench") == 1, "a replica", 300, 0.5)
            key = key_for(market, "bench")
            through = asyncio.run(market_side(base, key, "bench", rates, args.duration,
                                              args.tokens))
            results = {}
            for rate in rates:
                d, m = direct[rate], through[rate]
                ratio = m["tokens_per_s"] / d["tokens_per_s"] if d["tokens_per_s"] else 0.0
                added = m["ttft_p50_ms"] - d["ttft_p50_ms"]
                print(f"rate {rate:g}/s  direct: {d['tokens_per_s']:.1f} tok/s, TTFT p50"
                      f" {d['ttft_p50_ms']:.1f} p99 {d['ttft_p99_ms']:.1f} ms, TPOT p50"
                      f" {d['tpot_p50_ms']:.2f} p99 {d['tpot_p99_ms']:.2f} ms,"
                      f" {d['errors']} errors", flush=True)
                print(f"           market: {m['tokens_per_s']:.1f} tok/s, TTFT p50"
                      f" {m['ttft_p50_ms']:.1f} p99 {m['ttft_p99_ms']:.1f} ms, TPOT p50"
                      f" {m['tpot_p50_ms']:.2f} p99 {m['tpot_p99_ms']:.2f} ms,"
                      f" {m['errors']} errors;  throughput ratio {ratio:.3f}, TTFT p50 added"
                      f" {added:+.1f} ms", flush=True)
                results[rate] = {"direct": d, "market": m, "throughput_ratio": ratio,
                                 "ttft_p50_added_ms": added}
            assert market.cli("endpoint", "delete", "bench").returncode == 0

            # 2. A step of load on an endpoint that may grow to two replicas.
            create(market, root / "b.toml", "step", model_name="tiny-llama",
                   max_concurrency=2, target=2, scale_window_s=2, max_seq_len=256,
                   min_replicas=1, max_replicas=2)
            wait_until(lambda: ready_count(market, "step") == 1, "a replica", 300, 0.5)
            key = key_for(market, "step")
            stepped = time.perf_counter()
            asyncio.run(step_load(base, key, "step", lambda: ready_count(market, "step") >= 2,
                                  64, 8))
            scale_up_s = time.perf_counter() - stepped
            print(f"scale-up: a step to 8 requests in flight (target 2 per replica, window 2"
                  f" s) had a second replica serving after {scale_up_s:.1f} s", flush=True)
            assert market.cli("endpoint", "delete", "step").returncode == 0

            # 3. From zero, the model already in the providers' model directories.
            create(market, root / "c.toml", "cold", model_name="tiny-llama", min_replicas=0,
                   max_replicas=1, max_seq_len=256)
            key = key_for(market, "cold")
            import openai

            api = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=300)
            began = time.perf_counter()
            first = None
            for chunk in api.chat.completions.create(
                    model="cold", max_tokens=4, stream=True,
                    messages=[{"role": "user", "content": "hello"}]):
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
            scale_from_zero_s = (first or time.perf_counter()) - began
            print(f"scale from zero: first token {scale_from_zero_s:.1f} s after the first"
                  f" request (model held by the provider)", flush=True)
        finally:
            market.close()
    top = results[max(rates)]
    print(json.dumps({"throughput_ratio": round(top["throughput_ratio"], 4),
                      "ttft_p50_added_ms": round(top["ttft_p50_added_ms"], 2),
                      "scale_up_s": round(scale_up_s, 2),
                      "scale_from_zero_s": round(scale_from_zero_s, 2), "join": join,
                      "rates": {str(r): {"throughput_ratio": round(v["throughput_ratio"], 4),
                                         "ttft_p50_added_ms": round(v["ttft_p50_added_ms"], 2),
                                         "direct": v["direct"], "market": v["market"]}
                                for r, v in results.items()}}))


if __name__ == "__main__":
    main()
