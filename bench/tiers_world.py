"""bench/tiers.py's simulated world: its clock, and the jobs, leases (runs) and providers it
simulates, with the figures they are drawn from (bench/tiers.py's docstring: every
assumption)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from gpumarket.proto import jobspec
from gpumarket.proto.identity import Identity

HOUR_MS = 3_600_000
GB = 1e9
# name, GiB, dense bf16 TFLOP/s, standard price per GPU-hour, share of providers
GPUS = [("NVIDIA H100 80GB HBM3", 80, 990, 2.4, 0.2), ("NVIDIA A100-SXM4-80GB", 80, 312, 1.5, 0.2),
        ("NVIDIA L40S", 48, 362, 0.9, 0.2), ("NVIDIA GeForce RTX 4090", 24, 165, 0.4, 0.25),
        ("NVIDIA GeForce RTX 3090", 24, 71, 0.22, 0.15)]
REF_TFLOPS = 312           # a job's size is given in hours on an A100
TRUE_SLOPE = 2.5           # wall compute = 2.5 x work / benchmark FLOP/s (40 % of the matmul peak)
WRITE_BPS = 1.5 * GB       # checkpoint write to local disk
PASS_EVERY_MS = 60_000     # placement passes while jobs wait (the real loop: every 1 s)
SETTLE_EVERY_MS = 300_000  # replicas paid for their time (settle_running)
MAX_PRICE = 5.0


class Clock:
    """The simulated clock every broker module reads (their ``now_ms``)."""

    def __init__(self, start_ms: int) -> None:
        self.ms = start_ms

    def now_ms(self) -> int:
        return self.ms


def use_clock(clock: Clock) -> None:
    """Point every loaded gpumarket module's ``now_ms`` at the simulated clock."""
    real = jobspec.now_ms
    for name, module in list(sys.modules.items()):
        if name.startswith("gpumarket") and getattr(module, "now_ms", None) is real:
            module.now_ms = clock.now_ms


@dataclass
class SimJob:
    id: str
    client: str
    tier: str                      # as submitted: standard, interruptible, serving
    gpus: int
    steps: int
    ref_step_s: float              # seconds a step takes on the reference device
    ckpt_bytes: float
    start_s: float                 # a lease's start-up before its first step
    deadline_s: int = 0
    honours: bool = True           # checkpoints when asked to yield
    created_ms: int = 0
    endpoint: str = ""             # a replica's endpoint


@dataclass
class Run:
    """One lease of a job on a simulated provider."""

    job: SimJob
    epoch: int
    devices: tuple[int, ...]
    interval_s: float
    step_s: float
    start_step: int
    leased_ms: int
    alive: bool = True
    started: bool = False
    step_at: int = 0               # steps done when compute (re)started at compute_ms
    compute_ms: int = 0
    computing: bool = False
    committed: int = 0             # the newest checkpoint the broker recorded for this lease
    settled_ms: int = 0            # when that checkpoint was recorded
    preempted_ms: int = 0
    stop_step: int = -1

    def step_now(self, now: int) -> int:
        if not self.computing:
            return self.step_at
        return min(self.job.steps, self.step_at + int((now - self.compute_ms) / 1000
                                                       / self.step_s))


@dataclass
class SimProvider:
    identity: Identity
    name: str
    gpus: int
    tflops: float
    price: float
    share: float                   # interruptible price / price
    upload_bps: float
    speed: float                   # its own efficiency (x the class's)
    flaky: bool
    online: bool = False
    runs: dict[tuple[str, int], Run] = field(default_factory=dict)
    session: object = None

    @property
    def id(self) -> str:
        return self.identity.id
