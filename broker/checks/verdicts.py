"""The scheduler's part of spot checks: compare what a check's replay returned with what the
checked provider returned (reading the blobs off the event loop, COMPARERS checks at once),
record the verdict, give up on checks nobody could take, and tell providers what the
verdicts ended."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from gpumarket import kinds
from gpumarket.broker.checks import disputes
from gpumarket.broker.checks import verification
from gpumarket.broker.state import BrokerState
from gpumarket.kinds.base import Unfinished
from gpumarket.proto.jobspec import now_ms

log = logging.getLogger(__name__)

COMPARE_TIMEOUT_S = 300
# Checks compared at once, each in a thread of this pool (not the loop's default executor,
# which the store and the blob reads share): a render sample that takes its 120 s a pass no
# longer holds back a check behind it that needs a second. The pool has room beyond them
# for comparisons still running past their timeout (a thread cannot be stopped).
COMPARERS = 2
_comparers = ThreadPoolExecutor(COMPARERS + 2, thread_name_prefix="compare")


def policy(state: BrokerState, provider_id: str, draw: float) -> verification.Policy:
    """What a transaction that may choose a check needs to know: whether checks are on, and
    the device classes of the providers other than ``provider_id`` online to run one."""
    return verification.Policy(
        enabled=state.config.verify,
        others_online=frozenset(d.accelerator for o in state.sessions.offers()
                                if o.provider_id != provider_id for d in o.devices),
        draw=draw, ban_after=state.config.ban_after_failed_checks or 1 << 30)


def _compare(kind: kinds.Kind, state: BrokerState, expect: dict, got: dict,
             scope: dict) -> tuple[bool | None, str, dict]:
    def paths(refs: dict) -> dict:
        return {name: state.artifacts.blob_path(ref["sha256"]) for name, ref in refs.items()}

    try:
        return (*kind.compare(paths(expect), paths(got), scope), {})
    except Unfinished as part:
        return None, str(part), part.progress
    except OSError as exc:
        return False, f"a result could not be read ({exc.strerror or exc})", {}
    except Exception as exc:     # a hostile file: it disagrees (the tie-break finds whose)
        return (False, f"a result could not be compared ({type(exc).__name__}: {exc})"[:300],
                {})


async def _compared(kind: kinds.Kind, state: BrokerState, expect: dict, got: dict,
                    scope: dict, memo: dict | None) -> tuple[bool | None, str, dict]:
    """Compare off the event loop, for at most COMPARE_TIMEOUT_S (a result that takes longer
    to read than that disagrees), going on from ``memo``, what an earlier pass kept of this
    comparison. Returns (agrees, why, the memo to keep): agrees None while it is unfinished
    (kinds.base.Unfinished: the kind's progress is kept, and the next pass compares the
    rest); once finished, the memo holds the verdict, so that a tie-break's other
    comparison going on does not redo this one."""
    if memo and "verdict" in memo:
        agrees, why = memo["verdict"]
        return agrees, why, memo
    try:
        agrees, why, progress = await asyncio.wait_for(
            asyncio.get_running_loop().run_in_executor(
                _comparers, _compare, kind, state, expect, got, {**scope, **(memo or {})}),
            COMPARE_TIMEOUT_S)
    except TimeoutError:
        agrees, why, progress = False, f"not compared within {COMPARE_TIMEOUT_S}s", {}
    return agrees, why, progress if agrees is None else {"verdict": [agrees, why]}


async def _judged(state: BrokerState, item: disputes.ToCompare, gate: asyncio.Semaphore
                  ) -> tuple[disputes.ToCompare, bool | None, bool | None, str, dict, dict]:
    """One returned check compared, once ``gate`` lets it (so that its time bound counts
    from its start, not from its place in the queue): (item, agrees, agrees_first, detail,
    the memos of its comparisons against the checked result and, for a tie-break, the first
    check's)."""
    async with gate:
        return await _judged_now(state, item)


async def _judged_now(state: BrokerState, item: disputes.ToCompare
                      ) -> tuple[disputes.ToCompare, bool | None, bool | None, str, dict, dict]:
    kind = kinds.get(item.kind)
    memo = item.scope.get(disputes.PROGRESS, {})
    agrees, detail, mine = await _compared(kind, state, item.expect, item.outputs,
                                           item.scope, memo.get("checked"))
    agrees_first, theirs = False, memo.get("first")
    if item.role == "tiebreak" and agrees is not None:
        first = {n: r for n, r in item.first_outputs.items()
                 if n in kind.evidence(set(item.first_outputs))}
        # Two replays of the same part: neither holds the whole result.
        agrees_first, why, theirs = await _compared(
            kind, state, first, item.outputs, {**item.scope, "replays": True}, theirs)
        detail = (f"against the checked result: {detail}; against the first check's:"
                  f" {why}")
    return item, agrees, agrees_first, detail, mine, theirs


async def _apply(state: BrokerState, item: disputes.ToCompare, agrees: bool | None,
                 agrees_first: bool | None, detail: str, mine: dict, theirs: dict) -> int:
    """Record one check's comparison: kept for the next pass if unfinished, else its verdict
    applied and told. Returns the verdicts made (0 or 1)."""
    store = state.store
    if agrees is None or agrees_first is None:
        # Neither a pass nor a disagreement: kept, and compared further next pass.
        await store.write(disputes.compared_in_part, item.check_id,
                          {"checked": mine, "first": theirs})
        log.info("check %s: compared in part (%s)", item.check_id, detail)
        return 0
    try:
        outcome = await store.write(disputes.conclude, item.check_id, agrees, agrees_first,
                                    detail, now_ms(),
                                    state.config.ban_after_failed_checks or 1 << 30)
    except Exception:     # one verdict that cannot be applied must not stop the others
        log.exception("check %s: the verdict could not be applied", item.check_id)
        return 0
    log.info("check %s: %s (%s)", item.check_id, "agrees" if agrees else "disagrees", detail)
    state.metrics.checks.labels(verdict="agree" if agrees else "disagree").inc()
    _tell(state, outcome)
    return 1


async def decide(state: BrokerState) -> int:
    """Compare every returned check and apply its verdict, each as soon as its comparison
    ends (a long one does not hold back the others' verdicts); skip checks no provider took
    in time. Returns the verdicts made."""
    store, made, gate = state.store, 0, asyncio.Semaphore(COMPARERS)
    judging = [asyncio.ensure_future(_judged(state, item, gate))
               for item in await store.read(disputes.to_compare)]
    try:
        for judged in asyncio.as_completed(judging):
            made += await _apply(state, *await judged)
    finally:      # stopped part-way (the broker stopping): what was not applied is redone
        for task in judging:
            task.cancel()
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
