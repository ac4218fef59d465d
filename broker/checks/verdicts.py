"""The scheduler's part of spot checks: compare what a check's replay returned with what the
checked provider returned (reading the blobs off the event loop), record the verdict, give
up on checks nobody could take, and tell providers what the verdicts ended."""

from __future__ import annotations

import asyncio
import logging

from gpumarket import kinds
from gpumarket.broker.checks import disputes
from gpumarket.broker.checks import verification
from gpumarket.broker.state import BrokerState
from gpumarket.proto.jobspec import now_ms

log = logging.getLogger(__name__)

COMPARE_TIMEOUT_S = 300


def policy(state: BrokerState, provider_id: str, draw: float) -> verification.Policy:
    """What a transaction that may choose a check needs to know: whether checks are on, and
    the device classes of the providers other than ``provider_id`` online to run one."""
    return verification.Policy(
        enabled=state.config.verify,
        others_online=frozenset(d.accelerator for o in state.sessions.offers()
                                if o.provider_id != provider_id for d in o.devices),
        draw=draw, ban_after=state.config.ban_after_failed_checks or 1 << 30)


def _compare(kind: kinds.Kind, state: BrokerState, expect: dict, got: dict,
             scope: dict) -> tuple[bool, str]:
    def paths(refs: dict) -> dict:
        return {name: state.artifacts.blob_path(ref["sha256"]) for name, ref in refs.items()}

    try:
        return kind.compare(paths(expect), paths(got), scope)
    except OSError as exc:
        return False, f"a result could not be read ({exc.strerror or exc})"
    except Exception as exc:     # a hostile file: it disagrees (the tie-break finds whose)
        return False, f"a result could not be compared ({type(exc).__name__}: {exc})"[:300]


async def _compared(kind: kinds.Kind, state: BrokerState, expect: dict, got: dict,
                    scope: dict) -> tuple[bool, str]:
    """Compare off the event loop, for at most COMPARE_TIMEOUT_S (a result that takes longer
    to read than that disagrees)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(_compare, kind, state, expect, got,
                                                        scope), COMPARE_TIMEOUT_S)
    except TimeoutError:
        return False, f"not compared within {COMPARE_TIMEOUT_S}s"


async def decide(state: BrokerState) -> int:
    """Compare every returned check and apply its verdict; skip checks no provider took in
    time. Returns the verdicts made."""
    store, made = state.store, 0
    for item in await store.read(disputes.to_compare):
        kind = kinds.get(item.kind)
        agrees, detail = await _compared(kind, state, item.expect, item.outputs, item.scope)
        agrees_first = False
        if item.role == "tiebreak":
            first = {n: r for n, r in item.first_outputs.items()
                     if n in kind.evidence(set(item.first_outputs))}
            # Two replays of the same part: neither holds the whole result.
            agrees_first, why = await _compared(kind, state, first, item.outputs,
                                                {**item.scope, "replays": True})
            detail = (f"against the checked result: {detail}; against the first check's:"
                      f" {why}")
        try:
            outcome = await store.write(disputes.conclude, item.check_id, agrees,
                                        agrees_first, detail, now_ms(),
                                        state.config.ban_after_failed_checks or 1 << 30)
        except Exception:     # one verdict that cannot be applied must not stop the others
            log.exception("check %s: the verdict could not be applied", item.check_id)
            continue
        log.info("check %s: %s (%s)", item.check_id, "agrees" if agrees else "disagrees",
                 detail)
        state.metrics.checks.labels(verdict="agree" if agrees else "disagree").inc()
        _tell(state, outcome)
        made += 1
    cutoff = now_ms() - int(state.config.check_wait_s * 1000)
    for check_id in await store.read(disputes.waiting_too_long, cutoff):
        stop = await store.write(disputes.skip, check_id, f"no other provider took it"
                                 f" within {state.config.check_wait_s:g}s", now_ms())
        _tell(state, disputes.Outcome(stop=tuple(stop)))
        state.metrics.checks.labels(verdict="skipped").inc()
        made += 1
    if made:
        state.events.notify()
        state.placement.notify()
    return made


def _tell(state: BrokerState, outcome: disputes.Outcome) -> None:
    for job_id, epoch, provider_id in outcome.stop:
        state.stop_lease(job_id, epoch, provider_id, "a spot check ended this work")
    for provider_id in outcome.banned:
        log.warning("provider %s banned: spot checks found its results wrong", provider_id)
        if state.sessions.get(provider_id) is not None:
            state.sessions.end(provider_id)
