"""What a provider checks before it runs anything. No grpc here."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from gpumarket import kinds as job_kinds
from gpumarket.kinds import arrays
from gpumarket.kinds.runner_job import ArrayTask, RunnerJob, check_params
from gpumarket.proto.envelope import open_envelope, payload_sha256
from gpumarket.proto.errors import (
    BadSignature, Expired, GpumarketError, InvalidArgument, PermissionDenied,
)
from gpumarket.proto.identity import fingerprint
from gpumarket.proto.jobspec import check_fresh, kind_name, now_ms
from gpumarket.proto.policy import Policy
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb


@dataclass(frozen=True)
class Assignment:
    """A lease that checked out, with the client's spec it carries."""

    lease: pb.Lease
    spec: pb.JobSpec
    client_id: str
    spec_sha256: str


def check_lease(
    envelope: pb.Envelope,
    *,
    broker_public_key: bytes,
    provider_id: str,
    device_indices: set[int],
    kinds: set[int],
    engines: frozenset[str] = frozenset({"transformers"}),
    models: frozenset[str] = frozenset(),
    policy: Policy | None = None,
    at_ms: int | None = None,
    runs_code: bool | None = None,
) -> Assignment:
    """Verify a lease and the job spec inside it; return the assignment.

    Raises BadSignature (lease not from this broker, spec not from the lease's client,
    tampered bytes), Expired (lease or spec past expiry) or InvalidArgument (a lease this
    provider cannot honour, or PermissionDenied: code of its own where ``runs_code`` is
    False). Nothing may run unless this returns.
    """
    at = now_ms() if at_ms is None else at_ms
    lease, signer = open_envelope(envelope, pb.Lease)
    if signer != fingerprint(broker_public_key):
        raise BadSignature("lease is not signed by the broker of this session")
    if lease.provider_id != provider_id:
        raise BadSignature(f"lease is for provider {lease.provider_id}, not this one")
    if lease.expires_at_ms <= at:
        raise Expired("lease expired before it arrived")
    spec, client_id = open_envelope(lease.job_spec, pb.JobSpec)
    if client_id != lease.client_id:
        raise BadSignature("job spec is not signed by the lease's client")
    values = job_kinds.check_spec(spec)
    kind = job_kinds.get(spec.kind)
    check_fresh(spec, at)
    if spec.kind not in kinds:
        raise InvalidArgument(f"this provider does not run {kind_name(spec.kind)} jobs")
    if policy is not None:
        if not policy.accepts(client_id):
            raise PermissionDenied("this provider does not serve this client")
        when = datetime.fromtimestamp(at / 1000, timezone.utc)
        if not policy.available(when):
            raise PermissionDenied("this provider is outside its hours of availability")
        if policy.max_job_s and spec.max_runtime_s > policy.max_job_s:
            raise PermissionDenied(f"job asks {spec.max_runtime_s}s; this provider runs jobs"
                                   f" of at most {policy.max_job_s:.0f}s")
    engine = kind.engine(values)
    if engine and engine not in engines:
        raise InvalidArgument(f"this provider has no {engine} engine (it has:"
                              f" {', '.join(sorted(engines)) or 'none'})")
    if kind.remote_code(values) and not (policy and policy.allow_remote_code):
        raise PermissionDenied("this provider does not run a model's own code"
                               " (trust_remote_code)")
    if kind.remote_code(values) and runs_code is False:
        raise PermissionDenied("this provider cannot isolate a model's own code on this"
                               " host (see gpumarket-provider doctor)")
    if arrays.is_array(spec) != bool(lease.tasks):
        raise InvalidArgument("a job array's lease must name its tasks (and only such a"
                              " lease may)")
    if len(lease.tasks) > arrays.MAX_PER_LEASE:
        raise InvalidArgument(f"a lease runs at most {arrays.MAX_PER_LEASE:,} tasks")
    if spec.array.only and not set(lease.tasks) <= set(spec.array.only):
        raise InvalidArgument("lease names a task the client's array does not run")
    model = kind.model_name(values)
    if model and model not in models:
        raise InvalidArgument(f"this provider holds no model named {model!r}")
    wanted = set(lease.device_indices)
    if len(wanted) != spec.resources.gpus or not wanted <= device_indices:
        raise InvalidArgument(f"lease names devices {sorted(wanted)} this provider cannot give")
    return Assignment(lease, spec, client_id, payload_sha256(lease.job_spec))


def runner_config(a: Assignment, inputs: dict[str, str], resume_dir: Path | None,
                  cuda: bool, model_dir: Path | None = None) -> RunnerJob:
    """The job.json a runner reads: its parameters (checked against its kind's schema once
    more: InvalidArgument), input paths, checkpoint cadence, device and the checkpoint to
    resume from."""
    kind = job_kinds.get(a.spec.kind)
    params = kind.values_of(a.spec)      # every parameter, its default where not given
    try:
        check_params(kind, params, set(inputs))
    except job_kinds.ParamError as exc:
        raise InvalidArgument(str(exc)) from exc
    tasks = array_tasks(a, kind, params, inputs) if a.lease.tasks else None
    return RunnerJob(
        tasks=tasks,
        job_id=a.lease.job_id,
        attempt=a.lease.attempt,
        kind=kind.name,
        params=params,
        inputs=inputs,
        checkpoint_every=kind.checkpoint_every(params) or a.lease.checkpoint_every,
        checkpoint_interval_s=a.lease.checkpoint_interval_s,
        provider_mtbf_s=a.lease.provider_mtbf_s,
        device="cuda" if cuda else "cpu",
        resume_from=str(resume_dir) if resume_dir else None,
        world_size=len(a.lease.device_indices),
        model_dir=str(model_dir) if model_dir else None,
        part=a.lease.part,
        parts=a.lease.parts,
        **check_config(a.lease),
    )


def array_tasks(a: Assignment, kind: job_kinds.Kind, base: dict, inputs: dict[str, str]
                ) -> tuple[ArrayTask, ...]:
    """The tasks of a job array's lease with their parameters, read from the signed spec's
    tasks input and checked again here (InvalidArgument)."""
    spec = a.spec
    try:
        data = Path(inputs[spec.array.tasks_input]).read_bytes()
        lines = arrays.read_tasks(data, spec.array.count)
        if any(t >= len(lines) for t in a.lease.tasks):
            raise job_kinds.ParamError("lease.tasks", "a task the array does not have")
        names = {ref.name for ref in spec.inputs}
        return tuple(ArrayTask(t, arrays.task_values(kind, base, lines[t], names, t))
                     for t in a.lease.tasks)
    except (job_kinds.ParamError, KeyError, OSError) as exc:
        raise InvalidArgument(f"job array: {exc}") from exc


def check_config(lease: pb.Lease) -> dict:
    """What a check lease (a replay of another provider's work: its ``check`` is set) tells
    its runner: train up to ``stop_at`` and return the state there; redo only ``rows`` (in
    batches of ``check_batch_size``); render only ``frames``. RunnerJob's check fields, by
    name; ``check_of`` is the check's own name (the lease's job_id): a check lease does not
    say which job it checks."""
    if not lease.HasField("check"):
        return {}
    c = lease.check
    out: dict = {"check_of": lease.job_id}
    if c.batch_size:
        out.update(check_position=c.position, check_batch_size=c.batch_size,
                   check_from_row=c.step_from)
    elif c.frames:
        # (step_from: the frames the checked lease resumed with; it previews the rest)
        out.update(check_frames=tuple(c.frames), check_from_row=c.step_from)
    else:
        out["stop_at"] = c.step_to
    return out


def refusal(exc: GpumarketError) -> str:
    return f"{type(exc).__name__}: {exc.message}"


def rejection(envelope: pb.Envelope, broker_key: bytes | None,
              reason: str) -> gw.ProviderMessage | None:
    """The answer to a lease that failed its checks; only one signed by the broker gets an
    answer (None otherwise), since anything else names nothing a provider should act on."""
    try:
        lease, _ = open_envelope(envelope, pb.Lease)
    except GpumarketError:
        return None
    if not broker_key or envelope.signer_public_key != broker_key:
        return None
    return gw.ProviderMessage(job_update=gw.JobUpdate(
        job_id=lease.job_id, epoch=lease.epoch, rejected=gw.JobRejected(reason=reason)))
