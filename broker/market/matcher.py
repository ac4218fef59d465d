"""Matching jobs to offers. Plain code: no grpc, no database.

Hard constraints first: job kind, provider policy (client allow/deny lists), hours of
availability, maximum job duration, price, device count, accelerator, compute capability,
GPU model allow-list, memory per device, minimum reliability, a deadline the offer cannot meet,
and free devices. Then the feasible offers are ranked by the job's objective, using the
expected time and cost to finish (see reliability.expected_time_s):

    runtime   = work (FLOPs) / (effective FLOP/s per device x devices)
    expected  = runtime x (1 + C/tau) + runtime/MTBF x (tau/2 + restart),  tau = Young interval
    cost      = price x devices x expected / 3600

``cheapest`` minimises cost, ``fastest`` expected time, ``reliable`` maximises the reliability
score, and ``deadline`` is the cheapest offer expected to finish in time. Offers within 0.1 % of
the best are equivalent; among them the least loaded provider wins, so work spreads out.
A provider that already holds the job's model archive in its cache (a warm cache) wins over
the best offer unless that one is more than ``WARM_MARGIN`` better.

A job pays its tier's price (``OfferView.price``): an interruptible job the offer's
interruptible price, a standard job or an endpoint's replica its standard price;
``max_price_per_gpu_hour`` is compared with that price. Which interruptible leases a higher
tier may take over is the scheduler's (broker/market/preemption.py).

A provider that offers slices (proto/slices.py) is several ``OfferView``s — its whole
devices, and its slices of each share — that know each other's devices (``cards``): a card
with a slice leased is busy, and the slices of a card leased whole; a slice view takes jobs
of one device only, and among equivalent offers a slice goes first.

``Book`` does this for many offers with numpy; ``exclusion`` and ``expected`` are the plain
reference the property tests hold the book to.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np

from gpumarket.broker.market import reliability
from gpumarket.broker.market.reliability import PRIOR_UPTIME_S
from gpumarket.proto.policy import Policy, Window  # noqa: F401  (part of this module's API)
from gpumarket.proto.slices import blocked
from gpumarket.proto.v1 import types_pb2 as pb

OBJECTIVES = ("cheapest", "fastest", "reliable", "deadline")
NOMINAL_WORK_FLOPS = 1e15       # ranking work when a job's size is unknown
EQUIVALENT = 1e-3               # offers this close to the best are interchangeable
WARM_MARGIN = 0.10              # a warm cache is worth this much of the objective
ANY = pb.ACCELERATOR_UNSPECIFIED

# The order in which exclusions are counted: what can never change first, "busy" last.
CONSTRAINTS = ("kind", "policy", "hours", "duration", "price", "gpus", "accelerator",
               "compute_capability", "gpu_model", "memory", "reliability", "stake", "deadline",
               "independent", "busy")
REASON_TEXT = {
    "kind": "do not run this job kind as asked (engine, local model, remote code)",
    "policy": "do not accept this client",
    "hours": "are outside their hours of availability",
    "duration": "cap job duration below this job's",
    "price": "ask more than max_price_per_gpu_hour",
    "gpus": "have fewer devices than asked",
    "accelerator": "have no device of the asked accelerator",
    "compute_capability": "have a lower compute capability than asked",
    "gpu_model": "have no GPU model on the job's allow-list",
    "memory": "have too little memory per device",
    "reliability": "are less reliable than asked",
    "stake": "have staked less than min_provider_stake",
    "deadline": "are not expected to finish before the deadline",
    "independent": "may not run it (the provider a check replays or found wrong on it, or"
                   " one that kept failing it)",
    "busy": "are busy with other jobs",
}


@dataclass(frozen=True)
class OfferView:
    """What the matcher needs to know of one live offer (devices taken as alike: the
    smallest memory and compute capability stand for all of them)."""

    provider_id: str
    price_per_gpu_hour: float
    kinds: frozenset[int]
    device_indices: tuple[int, ...]
    accelerator: int
    device_memory_bytes: int
    compute_capability: float = 0.0
    gpu_name: str = ""
    flops: float = 1e11                  # effective FLOP/s per device for this kind of work
    reliability: float = 0.2
    mtbf_s: float = PRIOR_UPTIME_S
    policy: Policy = field(default_factory=Policy)
    busy: frozenset[int] = frozenset()
    load: int = 0                        # active leases
    engines: frozenset[str] = frozenset()   # inference engines it runs
    models: frozenset[str] = frozenset()    # models in its local model directory
    cached: frozenset[str] = frozenset()    # sha256 of artifacts in its cache
    claimed_flops: float = 0.0           # the benchmark's FLOP/s per device (calibration's base)
    stake: int = 0                       # units its provider has staked (ledger)
    interruptible_price_per_gpu_hour: float | None = None   # None: the standard price
    # Slices (proto/slices.py): (index, card or None) of every device of the provider's
    # offer, this view's and its other views' (() = none is a slice); ``busy`` holds the
    # devices leased on any of them. A view of slices runs jobs of one device only.
    cards: tuple[tuple[int, int | None], ...] = ()
    slices: bool = False

    def price(self, tier: str = "standard") -> float:
        """Credits per device-hour a lease of ``tier`` pays on this offer."""
        if tier == "interruptible" and self.interruptible_price_per_gpu_hour is not None:
            return min(self.interruptible_price_per_gpu_hour, self.price_per_gpu_hour)
        return self.price_per_gpu_hour

    @property
    def free(self) -> tuple[int, ...]:
        if not self.busy:       # most offers, each pass: nothing to take out
            return self.device_indices
        taken = blocked(self.cards, self.busy) if self.cards else self.busy
        return tuple(i for i in self.device_indices if i not in taken)


@dataclass(frozen=True)
class JobNeeds:
    job_id: str
    kind: int
    gpus: int
    min_memory_bytes: int
    accelerator: int                     # ANY = any
    max_price_per_gpu_hour: float
    client_id: str = ""
    min_compute_capability: float = 0.0
    gpu_models: frozenset[str] = frozenset()   # substrings of GPU names; empty = any
    min_reliability: float = 0.0
    work_flops: float = 0.0              # 0 = unknown
    objective: str = "cheapest"
    deadline_s: float = 0.0
    max_runtime_s: float = 0.0
    checkpoint_cost_s: float = 0.0
    avoid: frozenset[str] = frozenset()  # providers that lost this job: last resort
    engine: str = ""                     # inference engine required; "" = any
    model_name: str = ""                 # a model the provider must hold; "" = none
    warm_sha256: str = ""                # the job's model archive: holders are preferred
    remote_code: bool = False            # runs its model's own code: needs a willing provider
    min_stake: int = 0                   # units its provider must have staked
    exclude: frozenset[str] = frozenset()  # providers that must not run it (verification)
    draw: float | None = None            # a spot check: its provider is drawn, this uniform
                                         # in [0, 1) picking among those that fit (``drawn``)
    tier: str = "standard"               # "standard", "interruptible", "serving": its price
    too_slow: frozenset[int] = frozenset()  # the Book's offers (views) a deadline rules out:
                                         # calibrated, they would not finish it in time
                                         # (deadlines.too_slow; counted as "deadline")


@dataclass(frozen=True)
class Estimate:
    provider_id: str
    price_per_gpu_hour: float
    runtime_s: float
    expected_s: float
    expected_cost: float
    p_uninterrupted: float
    reliability: float
    offer_index: int = -1            # the Book's offer (view) it is for; -1: not a Book's


@dataclass(frozen=True)
class Placement:
    provider_id: str
    device_indices: tuple[int, ...]
    price_per_gpu_hour: float
    estimate: Estimate
    offer_index: int = -1            # the Book's offer (view) it was placed on


def _work(job: JobNeeds) -> float:
    return job.work_flops if job.work_flops > 0 else NOMINAL_WORK_FLOPS


def expected(job: JobNeeds, offer: OfferView) -> Estimate:
    """Expected runtime, time and cost of ``job`` on ``offer`` (the reference formula)."""
    runtime = _work(job) / (offer.flops * job.gpus)
    t = reliability.expected_time_s(runtime, offer.mtbf_s, job.checkpoint_cost_s)
    price = offer.price(job.tier)
    return Estimate(offer.provider_id, price, runtime, t, price * job.gpus * t / 3600,
                    reliability.p_uninterrupted(t, offer.mtbf_s), offer.reliability)


def _model_ok(job: JobNeeds, name: str) -> bool:
    return not job.gpu_models or any(m.lower() in name.lower() for m in job.gpu_models)


def exclusion(job: JobNeeds, offer: OfferView, now: datetime | None = None) -> str | None:
    """The first hard constraint ``offer`` fails for ``job``, or None if the job fits."""
    now = now or datetime.now(timezone.utc)
    if job.kind not in offer.kinds or (job.engine and job.engine not in offer.engines) or (
            job.model_name and job.model_name not in offer.models) or (
            job.remote_code and not offer.policy.allow_remote_code):
        return "kind"
    if not offer.policy.accepts(job.client_id):
        return "policy"
    if not offer.policy.available(now):
        return "hours"
    est = expected(job, offer)
    wanted = job.max_runtime_s or (est.runtime_s if job.work_flops > 0 else 0.0)
    if offer.policy.max_job_s and wanted > offer.policy.max_job_s:
        return "duration"
    if offer.price(job.tier) > job.max_price_per_gpu_hour:
        return "price"
    if len(offer.device_indices) < job.gpus or offer.slices and job.gpus > 1:
        return "gpus"
    if job.accelerator != ANY and offer.accelerator != job.accelerator:
        return "accelerator"
    if offer.compute_capability < job.min_compute_capability:
        return "compute_capability"
    if not _model_ok(job, offer.gpu_name):
        return "gpu_model"
    if offer.device_memory_bytes < job.min_memory_bytes:
        return "memory"
    if offer.reliability < job.min_reliability:
        return "reliability"
    if offer.stake < job.min_stake:
        return "stake"
    if job.objective == "deadline" and job.deadline_s and est.expected_s > job.deadline_s:
        return "deadline"
    if offer.provider_id in job.exclude:
        return "independent"
    if len(offer.free) < job.gpus:
        return "busy"
    return None


def objective_key(job: JobNeeds, est: Estimate) -> tuple[float, float]:
    """(primary, secondary): lower is better."""
    if job.objective == "fastest":
        return est.expected_s, est.expected_cost
    if job.objective == "reliable":
        return -est.reliability, est.expected_cost
    return est.expected_cost, est.expected_s


def explain(excluded: Counter, total: int) -> str:
    """One line saying why no offer was chosen."""
    if total == 0:
        return "waiting: no provider is online"
    parts = [f"{n} {REASON_TEXT[r]}" for r, n in sorted(
        excluded.items(), key=lambda kv: (-kv[1], CONSTRAINTS.index(kv[0])))]
    return f"waiting: of {total} offers, " + "; ".join(parts)


# The Book's columns of one value a view: (attribute, dtype, value); the rest are made in
# ``Book.__init__``. A kept Book (market/kept_book.py) patches a changed row from this table.
COLUMNS = (
    ("is_slice", bool, lambda x: x.slices),
    ("price", float, lambda x: x.price_per_gpu_hour),
    ("interruptible_price", float, lambda x: x.price("interruptible")),
    ("count", np.int64, lambda x: len(x.device_indices)),
    ("load", np.int64, lambda x: x.load),
    ("accel", np.int64, lambda x: x.accelerator),
    ("memory", np.int64, lambda x: x.device_memory_bytes),
    ("cc", float, lambda x: x.compute_capability),
    ("flops", float, lambda x: max(x.flops, 1.0)),
    ("rel", float, lambda x: x.reliability),
    ("stake", np.int64, lambda x: x.stake),
    ("mtbf", float, lambda x: max(x.mtbf_s, 1.0)),
    ("max_job", float, lambda x: x.policy.max_job_s),
    ("restricted", bool, lambda x: bool(x.policy.allowed_clients or x.policy.denied_clients)),
)


class Book:
    """Live offers as columns, for placing many jobs quickly.

    The static part of a job's feasibility (everything but free devices and the deadline)
    is cached per job shape, and so are the per-offer speed/reliability factors per
    checkpoint cost: a placement is then a few vector operations over the offers.
    """

    def __init__(self, offers: Iterable[OfferView], now: datetime | None = None) -> None:
        self.offers = list(offers)
        self.now = now or datetime.now(timezone.utc)
        o = self.offers
        # A provider's offer may be several views (its whole devices, its slices: offers.
        # offer_views): ``index`` is its first, ``views`` all of them.
        self.views: dict[str, list[int]] = {}
        for i, x in enumerate(o):
            self.views.setdefault(x.provider_id, []).append(i)
        self.index = {p: ix[0] for p, ix in self.views.items()}
        for name, dtype, value in COLUMNS:
            setattr(self, name, np.array([value(x) for x in o], dtype=dtype))
        # What each sliced provider has leased, across its views (``take``, ``release``).
        self.leased = {x.provider_id: set(x.busy) for x in o if x.cards}
        self.free_devices = [list(x.free) for x in o]
        self.free = np.array([len(x) for x in self.free_devices], dtype=np.int64)
        self.available = np.array([x.policy.available(self.now) for x in o], dtype=bool)
        kinds = sorted({k for x in o for k in x.kinds})
        self._kind_bit = {k: 1 << i for i, k in enumerate(kinds)}
        self.kinds = np.array([sum(self._kind_bit[k] for k in x.kinds) for x in o],
                              dtype=np.int64)
        self._restricted_idx = np.flatnonzero(self.restricted)
        self._capped_idx = np.flatnonzero(self.max_job > 0)
        self._all_true = np.ones(len(o), dtype=bool)
        self._static: dict[tuple, list[np.ndarray]] = {}
        self._clients: dict[str, np.ndarray] = {}
        self._factors: dict[float, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.offers)

    def prices(self, tier: str) -> np.ndarray:
        """Each offer's price for a lease of ``tier``."""
        return self.interruptible_price if tier == "interruptible" else self.price

    def _time_factor(self, cost_s: float) -> np.ndarray:
        """expected time = work / (flops x gpus) x factor (per offer, per checkpoint cost)."""
        c = round(cost_s if cost_s > 0 else reliability.DEFAULT_CHECKPOINT_COST_S, 3)
        f = self._factors.get(c)
        if f is None:
            tau = np.clip(np.sqrt(2 * c * self.mtbf), reliability.MIN_INTERVAL_S,
                          reliability.MAX_INTERVAL_S)
            f = (1 + c / tau) + (tau / 2 + reliability.RESTART_S) / self.mtbf
            self._factors[c] = f
        return f

    def _shape_masks(self, job: JobNeeds) -> list[np.ndarray]:
        """Masks that depend only on the job's shape (cached: jobs repeat shapes)."""
        key = (job.kind, job.engine, job.model_name, job.remote_code,
               job.max_price_per_gpu_hour, job.tier == "interruptible", job.gpus,
               job.accelerator,
               job.min_compute_capability, job.gpu_models, job.min_memory_bytes,
               job.min_reliability, job.min_stake)
        hit = self._static.get(key)
        if hit is not None:
            return hit
        n = len(self.offers)
        kind = (self.kinds & self._kind_bit.get(job.kind, 0)) != 0
        if job.engine:
            kind &= np.array([job.engine in x.engines for x in self.offers], dtype=bool)
        if job.model_name:
            kind &= np.array([job.model_name in x.models for x in self.offers], dtype=bool)
        if job.remote_code:
            kind &= np.array([x.policy.allow_remote_code for x in self.offers], dtype=bool)
        accel = (self.accel == job.accelerator) if job.accelerator != ANY else np.ones(n, bool)
        if job.gpu_models:
            model = np.array([_model_ok(job, x.gpu_name) for x in self.offers], dtype=bool)
        else:
            model = np.ones(n, dtype=bool)
        masks = [kind, self.prices(job.tier) <= job.max_price_per_gpu_hour,
                 (self.count >= job.gpus) & (~self.is_slice | (job.gpus <= 1)), accel,
                 self.cc >= job.min_compute_capability, model,
                 self.memory >= job.min_memory_bytes, self.rel >= job.min_reliability,
                 self.stake >= job.min_stake]
        masks.append(np.logical_and.reduce(masks) if n else np.zeros(0, dtype=bool))
        self._static[key] = masks
        return masks

    def _client_mask(self, client_id: str) -> np.ndarray:
        """Allow/deny lists: evaluated only on the few offers that have them."""
        mask = self._clients.get(client_id)
        if mask is None:
            mask = np.ones(len(self.offers), dtype=bool)
            for i in self._restricted_idx:
                mask[i] = self.offers[i].policy.accepts(client_id)
            self._clients[client_id] = mask
        return mask

    def _duration_mask(self, job: JobNeeds) -> np.ndarray:
        """Providers' caps on job duration: evaluated only on offers that have one."""
        idx = self._capped_idx
        if not len(idx) or not (job.max_runtime_s or job.work_flops > 0):
            return self._all_true  # no cap applies to a job of unknown length
        runtime = _work(job) / (self.flops[idx] * job.gpus)
        wanted = job.max_runtime_s if job.max_runtime_s else runtime
        mask = self._all_true.copy()
        mask[idx] = wanted <= self.max_job[idx]
        return mask

    def _static_masks(self, job: JobNeeds) -> tuple[np.ndarray, list[np.ndarray]]:
        """Everything but free devices and the deadline: (combined, masks in CONSTRAINTS
        order)."""
        shape = self._shape_masks(job)
        client, duration = self._client_mask(job.client_id), self._duration_mask(job)
        combined = shape[-1] & client & self.available & duration
        return combined, [shape[0], client, self.available, duration, *shape[1:-1]]

    def _keys(self, job: JobNeeds, factor: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = _work(job) / (self.flops * job.gpus) * factor
        cost = self.prices(job.tier) * job.gpus * t / 3600
        if job.objective == "fastest":
            return t, cost
        if job.objective == "reliable":
            return -self.rel, cost
        return cost, t

    def _excluded(self, job: JobNeeds) -> np.ndarray:
        mask = self._all_true.copy()
        for pid in job.exclude:
            for i in self.views.get(pid, ()):
                mask[i] = False
        return mask

    def _feasible(self, job: JobNeeds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        static, _ = self._static_masks(job)
        factor = self._time_factor(job.checkpoint_cost_s)
        mask = static & (self.free >= job.gpus)
        if job.exclude:
            mask &= self._excluded(job)
        if job.objective == "deadline" and job.deadline_s:
            t = _work(job) / (self.flops * job.gpus) * factor
            mask &= t <= job.deadline_s
        if job.too_slow:
            mask &= self._in_time(job)
        return mask, factor, static

    def _in_time(self, job: JobNeeds) -> np.ndarray:
        mask = self._all_true.copy()
        for i in job.too_slow:
            if 0 <= i < len(mask):
                mask[i] = False
        return mask

    def lanes(self, job: JobNeeds) -> int:
        """How many leases of ``job``'s shape the offers that fit it could run at once, their
        devices busy or not (an array is spread over that many: broker/jobs/arrays.py)."""
        static, _ = self._static_masks(job)
        if not self.leased:         # no provider offers slices: one view each
            return int((self.count[static] // max(1, job.gpus)).sum())
        lanes: dict[str, int] = {}
        for i in np.flatnonzero(static):
            # a card runs a whole job or its slices' jobs: the provider's most of either
            pid = self.offers[i].provider_id
            lanes[pid] = max(lanes.get(pid, 0), int(self.count[i]) // max(1, job.gpus))
        return sum(lanes.values())

    def fitting(self, job: JobNeeds) -> set[str]:
        """The providers whose offers could run ``job`` if enough of their devices were
        free (every constraint but free devices and the deadline)."""
        return {self.offers[i].provider_id for i in self.fitting_views(job)}

    def fitting_views(self, job: JobNeeds) -> list[int]:
        """The offers (views: a provider's whole devices, its slices) that could run ``job``
        if enough of their devices were free."""
        static, _ = self._static_masks(job)
        mask = static & (self.count >= max(1, job.gpus))
        if job.exclude:
            mask &= self._excluded(job)
        return [int(i) for i in np.flatnonzero(mask)]

    def leased_on(self, i: int) -> set[int]:
        """The devices of offer ``i``'s provider leased now (those of every view of a
        provider offering slices; of this view otherwise)."""
        pid = self.offers[i].provider_id
        if pid in self.leased:
            return set(self.leased[pid])
        return set(self.offers[i].device_indices) - set(self.free_devices[i])

    def exclusions(self, job: JobNeeds) -> Counter:
        """How many offers each constraint excludes (first failing constraint counted)."""
        _, masks = self._static_masks(job)
        factor = self._time_factor(job.checkpoint_cost_s)
        t = _work(job) / (self.flops * job.gpus) * factor
        deadline = (t <= job.deadline_s) if job.objective == "deadline" and job.deadline_s \
            else np.ones(len(self.offers), dtype=bool)
        if job.too_slow:
            deadline = deadline & self._in_time(job)
        remaining = np.ones(len(self.offers), dtype=bool)
        out: Counter = Counter()
        for name, m in zip(CONSTRAINTS, [*masks, deadline, self._excluded(job),
                                         self.free >= job.gpus]):
            failed = remaining & ~m
            if failed.any():
                out[name] = int(failed.sum())
            remaining &= m
        return out

    def best(self, job: JobNeeds) -> int | None:
        """Index of the offer the job should go to, or None."""
        mask, factor, _ = self._feasible(job)
        if not mask.any():
            return None
        if job.avoid:
            preferred = mask.copy()
            for pid in job.avoid:
                for i in self.views.get(pid, ()):
                    preferred[i] = False
            if preferred.any():
                mask = preferred
        if job.draw is not None:
            return self.drawn(mask, job.draw)
        primary, secondary = self._keys(job, factor)
        if job.warm_sha256:
            warm = mask & np.array([job.warm_sha256 in x.cached for x in self.offers],
                                   dtype=bool)
            if warm.any():
                best_any = primary[mask].min()
                if primary[warm].min() <= best_any + abs(best_any) * WARM_MARGIN:
                    mask = warm
        keyed = np.where(mask, primary, np.inf)
        i = int(np.argmin(keyed))
        best = keyed[i]
        margin = abs(best) * EQUIVALENT
        ties = np.flatnonzero(keyed <= best + margin)
        if len(ties) > 1:
            # equivalent offers: a slice first (it leaves whole devices to the jobs that
            # need one), then least loaded, then the secondary key
            order = np.lexsort((secondary[ties], self.load[ties], ~self.is_slice[ties]))
            i = int(ties[order[0]])
        return i

    def drawn(self, mask: np.ndarray, draw: float) -> int:
        """A checker, drawn among the offers in ``mask`` with a chance in proportion to what
        its provider has at stake and its record — (stake + 1 unit) × its reliability (at
        least 0.05) — never to its price: a provider cannot buy its way onto the checks of
        the work of others by underbidding, and keys with a share of the stake at risk are
        drawn about that share of the time (docs/verification.md, Who checks)."""
        idx = np.flatnonzero(mask)
        weight = (self.stake[idx] + 1).astype(np.float64) * np.maximum(self.rel[idx], 0.05)
        cumulative = np.cumsum(weight)
        pick = int(np.searchsorted(cumulative, draw * cumulative[-1], side="right"))
        return int(idx[min(pick, len(idx) - 1)])

    def estimate(self, job: JobNeeds, i: int) -> Estimate:
        o = self.offers[i]
        factor = self._time_factor(job.checkpoint_cost_s)[i]
        runtime = _work(job) / (self.flops[i] * job.gpus)
        t = runtime * factor
        price = float(self.prices(job.tier)[i])
        return Estimate(o.provider_id, price, runtime, t, price * job.gpus * t / 3600,
                        math.exp(-t / self.mtbf[i]), o.reliability, i)

    def view_of(self, provider_id: str, devices: Iterable[int]) -> int | None:
        """The provider's offer (view) that holds ``devices`` (a lease's): its slices' view
        for a lease of a slice; None if the provider offers none of them now."""
        devices = set(devices)
        for i in self.views.get(provider_id, ()):
            if devices & set(self.offers[i].device_indices):
                return i
        return None

    def place(self, job: JobNeeds) -> tuple[Placement | None, Counter]:
        """Choose an offer and its devices, and take them; or say why nothing fits."""
        i = self.best(job)
        if i is None:
            return None, self.exclusions(job)
        devices = tuple(sorted(self.free_devices[i][: job.gpus]))
        est = self.estimate(job, i)
        self.take(i, devices)
        return Placement(self.offers[i].provider_id, devices,
                         float(self.prices(job.tier)[i]), est, i), Counter()

    def take(self, i: int, devices: tuple[int, ...]) -> None:
        pid = self.offers[i].provider_id
        if pid in self.leased:
            self.leased[pid] |= set(devices)
            self._refresh(pid, +1)
            return
        self.free_devices[i] = [d for d in self.free_devices[i] if d not in devices]
        self.free[i] = len(self.free_devices[i])
        self.load[i] += 1

    def release(self, i: int, devices: tuple[int, ...]) -> None:
        """A placement ended: its devices are free again."""
        pid = self.offers[i].provider_id
        if pid in self.leased:
            self.leased[pid] -= set(devices)
            self._refresh(pid, -1)
            return
        self.free_devices[i] = sorted({*self.free_devices[i], *devices})
        self.free[i] = len(self.free_devices[i])
        self.load[i] -= 1

    def _refresh(self, pid: str, load: int) -> None:
        """A sliced provider's devices changed hands: every view's free devices again (a
        card with a slice leased is not free, nor the slices of a card leased whole), and
        one lease more or less on each."""
        views = self.views[pid]
        taken = blocked(self.offers[views[0]].cards, self.leased[pid])
        for j in views:
            self.free_devices[j] = [d for d in self.offers[j].device_indices if d not in taken]
            self.free[j] = len(self.free_devices[j])
            self.load[j] += load

    def candidates(self, job: JobNeeds, n: int = 5) -> tuple[list[Estimate], Counter]:
        """The best ``n`` feasible offers in objective order (free devices or not), and the
        exclusions of the rest."""
        static, _ = self._static_masks(job)
        factor = self._time_factor(job.checkpoint_cost_s)
        mask = static.copy()
        if job.objective == "deadline" and job.deadline_s:
            mask &= _work(job) / (self.flops * job.gpus) * factor <= job.deadline_s
        excluded = self.exclusions(job)
        excluded.pop("busy", None)
        idx = np.flatnonzero(mask)
        if not len(idx):
            return [], excluded
        primary, secondary = self._keys(job, factor)
        order = idx[np.lexsort((self.load[idx], secondary[idx], primary[idx]))][:n]
        return [self.estimate(job, int(i)) for i in order], excluded

