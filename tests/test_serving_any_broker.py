"""An endpoint served on any broker of a shared PostgreSQL store (docs/deploy.md), with real
processes: two brokers, the replica's provider connected to the one that does not lead; the
official ``openai`` package pointed at the other broker (the leader, which holds no replica)
gets the same answers, streamed or not, as pointed at the replica's broker; every request is
counted once, by the broker whose replica answered. Then the replica's broker is killed: the
client of the survivor gets the same answers from the replica, moved there."""

from __future__ import annotations

import json
import signal

import openai
import pytest

from tests.helpers import Marketplace, wait_until
from tests.models import tiny_causal_lm
from tests.test_ha_failover import LEASE_ARGS, leadership, start_second_broker
from tests.test_serving import client, endpoint_file, new_key, ready_replicas

pytestmark = pytest.mark.e2e
WARM_PROVIDERS = False
ASK = {"messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 8,
       "temperature": 0}


def chat(api: openai.OpenAI) -> tuple[str, str]:
    whole = api.chat.completions.create(model="tiny", **ASK).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model="tiny", stream=True, **ASK) if c.choices)
    return whole, streamed


def test_a_broker_without_the_replica_relays_to_the_one_with_it(tmp_path, pg_cluster):
    url = pg_cluster.database()
    market = Marketplace(tmp_path)
    market.warm = False
    b = None
    try:
        market.start_broker(*LEASE_ARGS, "--store", url, "--http", "127.0.0.1:0")
        a = json.loads((tmp_path / "broker" / "broker.json").read_text())
        wait_until(lambda: (leadership(url) or ("",))[0] == a["holder"], "broker a to lead")
        b, b_info = start_second_broker(market, url, "--http", "127.0.0.1:0")
        # The provider connects to b (a only if b goes); the CLI asks b.
        leader = a["address"]
        market.address = f"{b_info['address']},{leader}"
        market.start_provider("p1", 1.0)
        market.address = b_info["address"]
        market.wait_for_offers(1)
        model = tiny_causal_lm(tmp_path / "tiny")
        r = market.cli("endpoint", "create", endpoint_file(
            tmp_path / "ep.toml", "tiny", model=str(model), max_seq_len=96, max_tokens=32,
            max_concurrency=2))
        assert r.returncode == 0, r.stderr
        ready_replicas(market, "tiny", 1)
        market.address = leader     # the leader, which holds no replica, says it is ready too
        ready_replicas(market, "tiny", 1, timeout=30)
        market.address = b_info["address"]
        key, _ = new_key(market, "tiny")

        at_replica = chat(client(f"http://{b_info['http']}/v1", key))
        at_leader = chat(client(f"http://{a['http']}/v1", key))
        assert at_replica[0] and at_replica == at_leader, (at_replica, at_leader)
        assert at_leader[0] == at_leader[1]
        with pytest.raises(openai.AuthenticationError):     # the key is checked where it came
            client(f"http://{a['http']}/v1", "gm-not-a-key").chat.completions.create(
                model="tiny", **ASK)
        # Four answers, each counted once, by broker b (it does not lead: its own pass
        # writes its replicas' usage).
        wait_until(lambda: int(market.endpoint("tiny")["load"].get("requests", 0)) >= 4,
                   "the usage of four requests", 30, 0.5)
        load = market.endpoint("tiny")["load"]
        assert int(load["requests"]) == 4 and int(load.get("errors", 0)) == 0, load
        assert "relay to" not in market.broker.text(), market.broker.text()[-2000:]

        # b dies: the provider moves to a, its replica keeps its lease and serves there; a
        # client of a gets its answer (a relay tried on b meanwhile is skipped).
        b.stop(signal.SIGKILL)
        market.address = leader
        assert chat(client(f"http://{a['http']}/v1", key)) == at_leader
        wait_until(lambda: int(market.endpoint("tiny")["load"].get("requests", 0)) >= 6,
                   "the usage of six requests", 30, 0.5)
        assert int(market.endpoint("tiny")["load"]["requests"]) == 6
    finally:
        if b is not None:
            b.stop()
        # Its replica has nowhere to move: a drain would wait 20 s for nothing (the job
        # processes it leaves are ended by close()).
        for p in market.providers.values():
            p.stop(signal.SIGKILL)
        market.close()
