"""The broker's Prometheus metrics (prometheus-client), on their own registry.

Counters and histograms are updated where things happen; gauges that mirror the database or
the live sessions are refreshed just before each scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpumarket.proto.jobspec import STATE_NAMES

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
WAIT_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)


class BrokerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.providers_online = Gauge("gpumarket_providers_online",
                                      "Providers with an open session", registry=r)
        self.gpus = Gauge("gpumarket_gpus", "Devices offered by online providers",
                          ["model", "accelerator"], registry=r)
        self.jobs = Gauge("gpumarket_jobs", "Jobs by state", ["state"], registry=r)
        self.queue_wait = Histogram("gpumarket_queue_wait_seconds",
                                    "Time a job waited in QUEUED before each lease",
                                    buckets=WAIT_BUCKETS, registry=r)
        self.time_to_lease = Histogram("gpumarket_time_to_first_lease_seconds",
                                       "Time from submission to a job's first lease",
                                       buckets=WAIT_BUCKETS, registry=r)
        self.placements = Counter("gpumarket_placements", "Leases granted", registry=r)
        self.lease_expiries = Counter("gpumarket_lease_expiries",
                                      "Leases lost to missed heartbeats", registry=r)
        self.checks = Counter("gpumarket_checks",
                              "Spot checks decided, by verdict (agree, disagree, skipped)",
                              ["verdict"], registry=r)
        self.resumes = Counter("gpumarket_resumes",
                               "Leases granted to resume a job from a checkpoint", registry=r)
        self.rejected = Counter(
            "gpumarket_rejected_requests",
            "Requests refused, by reason: unauthenticated, bad_signature, wrong_call, expired,"
            " not_yet_valid, replay, revoked, unauthorized, rate_limited, quota, or the status"
            " code in lower case", ["reason"], registry=r)
        self.artifact_bytes = Gauge("gpumarket_artifact_bytes",
                                    "Bytes held in the artifact store", registry=r)
        self.ledger = Gauge(
            "gpumarket_ledger_balance_credits",
            "Sum of the ledger's balances by account type: client (available), escrow (held"
            " for jobs), provider (earned), stake, fee, disputed; deposits is minus all"
            " credited, so the types sum to zero", ["account"], registry=r)
        self.postings = Gauge("gpumarket_ledger_postings", "Postings in the ledger",
                              registry=r)
        self.ledger_ok = Gauge("gpumarket_ledger_balanced",
                               "1 if the ledger's entries and its accounts' latest running"
                               " balances each sum to zero (the full audit:"
                               " gpumarket-broker admin audit)",
                               registry=r)
        self.endpoint_ttft = Histogram(
            "gpumarket_endpoint_ttft_seconds", "Time to first token of endpoint requests, from"
            " their arrival at the broker", ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.endpoint_tpot = Histogram(
            "gpumarket_endpoint_tpot_seconds", "Time per output token of endpoint requests"
            " (between their first and last pieces)", ["endpoint"], buckets=LATENCY_BUCKETS,
            registry=r)
        self.endpoint_tokens = Counter("gpumarket_endpoint_tokens",
                                       "Tokens endpoints served, by type (prompt, output)",
                                       ["endpoint", "type"], registry=r)
        self.endpoint_requests = Counter("gpumarket_endpoint_requests",
                                         "Endpoint API requests by HTTP status code",
                                         ["endpoint", "code"], registry=r)
        self.endpoint_replicas = Gauge("gpumarket_endpoint_replicas",
                                       "Ready replicas per serving endpoint", ["endpoint"],
                                       registry=r)
        self.endpoint_held_bytes = Gauge(
            "gpumarket_endpoint_held_bytes", "Bytes of endpoint requests' bodies the broker"
            " holds (waiting for a replica, or sent and not answered yet)", registry=r)
        self.connections = Gauge("gpumarket_connections",
                                 "Open connections to an HTTP listener (api, http)",
                                 ["listener"], registry=r)
        self.connections_refused = Counter(
            "gpumarket_connections_refused", "Connections an HTTP listener reset or failed to"
            " accept, by reason: per_peer, full, out_of_descriptors, accept_error",
            ["listener", "reason"], registry=r)
        for state in STATE_NAMES.values():
            self.jobs.labels(state=state)
