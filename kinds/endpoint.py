"""Endpoint: a model served behind the broker's OpenAI-compatible API (docs/serving.md). Its
replicas are leases that do not end, each an engine kept warm in the provider's sandboxed
child (provider/runners/serve.py); the broker routes requests to them over the providers'
own sessions and scales their number between ``min_replicas`` and ``max_replicas``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpumarket.kinds.base import Kind
from gpumarket.kinds.inference import DTYPES, check_model
from gpumarket.kinds.schema import Param, ParamError
from gpumarket.proto.v1 import types_pb2 as pb

ENGINES = ("", "auto", "batch", "continuous", "vllm")
MAX_REPLICAS = 64
DEFAULT_CONCURRENCY = 8
DEFAULT_WINDOW_S = 10
DEFAULT_IDLE_S = 300


class Endpoint(Kind):
    def rules(self, values: dict[str, Any]) -> None:
        check_model(self.name, values)
        if values["min_replicas"] > values["max_replicas"]:
            raise ParamError(f"{self.name}.min_replicas",
                             f"{values['min_replicas']} is more than max_replicas"
                             f" {values['max_replicas']}")
        if values["engine"] == "vllm" and values["task"] == "embed":
            raise ParamError(f"{self.name}.engine", "vllm serves generate endpoints only")

    def config_input(self, values: dict[str, Any]) -> tuple[str, bool] | None:
        return (values["model"], True) if values["model"] else None

    def check_config(self, values: dict[str, Any], config: dict) -> None:
        # A replica asked for more positions than the model has fails as it loads, on every
        # provider: refused here instead.
        positions = model_positions(config)
        for field in ("max_seq_len", "max_tokens"):
            if positions and values[field] > positions:
                raise ParamError(f"{self.name}.{field}", f"{values[field]} is over the model's"
                                 f" max_position_embeddings {positions} (its config.json)")

    def engine(self, values: dict[str, Any]) -> str:
        # Only vLLM is an engine a provider must advertise; the others are transformers.
        return "vllm" if values.get("engine") == "vllm" else ""

    # A check of a replica's answers (docs/verification.md): the checker prefills the sampled
    # requests plus the replica's token ids (ANSWERS, without the fingerprints: those stay
    # the broker's evidence) and returns the fingerprints and token gaps it saw; the broker
    # compares them with the replica's by the generate kind's rule.
    def evidence(self, names: set[str]) -> set[str]:
        return names & {ANSWERS}

    def compare(self, expect: dict[str, Path], got: dict[str, Path], scope: dict
                ) -> tuple[bool, str]:
        from gpumarket.kinds.generate import fingerprint_rule

        if ANSWERS not in expect:
            return False, "no answers to compare"
        if scope.get("task") == "embed":
            return compare_embeddings(expect[ANSWERS], got, scope)
        if ANSWERS not in got:
            return False, f"the replay returned no {ANSWERS}"
        try:
            want, have = answer_rows(expect[ANSWERS]), answer_rows(got[ANSWERS])
        except (OSError, ValueError, TypeError) as exc:
            return False, f"{ANSWERS} is unreadable ({exc})"[:300]
        if not want:
            return False, "no answers to compare"
        dtype = str(scope.get("dtype", ""))
        unjudged = undrawn = 0
        for i in sorted(want):
            if i not in have:
                return False, f"answer {i}: the replay has none"
            if have[i].get("error"):
                return False, f"answer {i}: {str(have[i]['error'])[:200]}"
            if want[i].get("tokens_only") and not scope.get("replays"):
                # vLLM's answers, and the batch engine's fallback's, commit to their token
                # ids alone
                agrees, why = _tokens_agree(dtype, want[i], have[i])
                if not agrees:
                    return False, f"answer {i}: {why}"
                unjudged += why == UNJUDGED
                continue
            # Two replays (a tie-break) agree on fingerprints; the token gap and the draws
            # judge the replica's tokens, which both replays see.
            greedy, claimed = bool(want[i].get("greedy")), not scope.get("replays")
            rule = fingerprint_rule(dtype, greedy and claimed, not greedy and claimed)
            agrees, why = rule({"completion": "", "fingerprints": want[i].get("fingerprints")},
                               {"completion": "", **{k: have[i][k] for k in (
                                   "fingerprints", "token_gap", "draws") if k in have[i]}})
            if not agrees:
                return False, f"answer {i}: {why}"
            # an old checker's replay has no draws: the sampled answer is judged by its
            # fingerprints only, and the verdict says so
            undrawn += not greedy and claimed and "draws" not in have[i]
        if undrawn:
            agrees_said = f"{len(want)} answers agree (fingerprints within the" \
                          f" {dtype or 'auto'} tolerance)"
            return True, (f"{agrees_said}; {undrawn} sampled judged by fingerprints only"
                          " (the checker sent no sampling figures)")
        if unjudged:
            return True, (f"{len(want) - unjudged} of {len(want)} answers agree; {unjudged}"
                          " sampled (temperature > 0) of an engine that records no"
                          " fingerprints (vLLM, or a batch engine's fallback) could not be"
                          " judged")
        return True, f"{len(want)} answers agree (fingerprints within the {dtype or 'auto'}" \
                     " tolerance)"


UNJUDGED = "not judged"


def compare_embeddings(expect: Path, got: dict[str, Path], scope: dict) -> tuple[bool, str]:
    """An embed endpoint's sampled answers: every vector the replica returned against the
    checker's own of the same input, by the embed kind's rule (kinds/embed.py
    ``same_vector``) in the tolerance of the precision the replay computed in (its
    metrics.json ``float_bits``: the checker's word, as for an embed job's rows). A vector
    missing, one too many or out of tolerance disagrees."""
    from gpumarket.kinds.embed import replay_float_bits, same_vector, tolerance

    if ANSWERS not in got:
        return False, f"the replay returned no {ANSWERS}"
    try:
        want, have = answer_rows(expect), answer_rows(got[ANSWERS])
    except (OSError, ValueError, TypeError) as exc:
        return False, f"{ANSWERS} is unreadable ({exc})"[:300]
    if not want:
        return False, "no answers to compare"
    tol = tolerance(replay_float_bits(got.get("metrics.json")))
    vectors = 0
    for i in sorted(want):
        if i not in have:
            return False, f"answer {i}: the replay has none"
        if have[i].get("error"):
            return False, f"answer {i}: {str(have[i]['error'])[:200]}"
        mine, theirs = want[i].get("embeddings"), have[i].get("embeddings")
        if not isinstance(mine, list) or not mine:
            return False, f"answer {i}: the replica returned no vectors"
        if not isinstance(theirs, list) or len(theirs) != len(mine):
            return False, (f"answer {i}: {len(mine)} vectors against the replay's"
                           f" {len(theirs) if isinstance(theirs, list) else 0}")
        for j, (a, b) in enumerate(zip(mine, theirs)):
            same, why = same_vector(a, b, tol)
            if not same:
                return False, f"answer {i}, input {j}: {why}"
        vectors += len(mine)
    return True, (f"{len(want)} answers agree ({vectors} vectors within the embed tolerance"
                  f" for {'float32' if tol.rel_l2 < 1e-2 else 'half precision'})")


def _tokens_agree(dtype: str, want: dict, have: dict) -> tuple[bool, str]:
    """An answer that committed to its token ids alone (no fingerprints): greedy, each token
    must be the replay's top one up to the dtype's rounding (the replay's token gap, as for
    fingerprints); sampled, nothing can be judged (UNJUDGED). No token ids: it commits to
    nothing, and is wrong."""
    from gpumarket.kinds import fingerprints as fp

    if not isinstance(want.get("token_ids"), list) or not want["token_ids"]:
        return False, "the answer commits to no token ids"
    if not want.get("greedy"):
        return True, UNJUDGED
    gap, limit = have.get("token_gap"), fp.token_gap_limit(dtype)
    if not (type(gap) in (int, float) and gap <= limit):
        said = f"{gap:.2f}" if type(gap) in (int, float) else "?"
        return False, (f"a greedy token is not the replay's top one (its logit {said}"
                       f" standard deviations below; at most {limit:g})")
    return True, ""


ANSWERS = "answers.jsonl"     # a check's sampled answers (broker/checks/answers.py)
MAX_ANSWER_ROWS = 64


def answer_rows(path: Path) -> dict[int, dict]:
    """The records of an answers file by their ``index`` (at most MAX_ANSWER_ROWS, the rest
    ignored; a line that is not an object with an integer index raises ValueError)."""
    out: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            index = record.get("index") if isinstance(record, dict) else None
            if type(index) is not int:
                raise ValueError("an answer without an integer index")
            if len(out) < MAX_ANSWER_ROWS:
                out[index] = record
    return out


# How the batch engine describes its fallback for a model whose cache cannot be joined step
# by step (sliding-window or linear-attention layers: provider/runners/batching.py): one
# model.generate call at a time, which records no fingerprints yet.
CALLS_FALLBACK = "batch (one transformers generate call at a time"


def batch_engine(settings: dict, accelerator: int) -> bool:
    """Whether a replica with these endpoint ``settings``, leased on this device class, runs
    the batch engine: "batch", or "auto" on a CPU (provider/runners/engine.py load_engine)."""
    engine = settings.get("engine", "")
    return engine == "batch" or (engine in ("", "auto") and accelerator == pb.ACCELERATOR_CPU)


def fingerprinted(settings: dict, accelerator: int, engine_said: str = "") -> bool:
    """Whether a replica of an endpoint with these ``settings`` commits each completion it
    answers to what a check prefills: every generate replica, whatever its engine. Every
    completion must carry its token ids, and its fingerprints unless ``tokens_only``: the
    batch engine records them as it decodes, the continuous engine (CUDA's default) makes
    them by one prefill as an answer ends; vLLM's answers carry their token ids alone. No
    replica goes unchecked by what it says of its engine (docs/verification.md)."""
    return settings.get("task") == "generate"


def answers_sampled(settings: dict, accelerator: int, engine_said: str = "") -> bool:
    """Whether the router samples a replica's answers for a check: a generate replica that
    ``fingerprinted`` says commits to its answers, and every replica of an embed endpoint
    (its answer is its vectors: a checker embeds the same inputs with the endpoint's model
    and compares them, kinds/embed.py's rule; docs/verification.md)."""
    return settings.get("task") == "embed" or fingerprinted(settings, accelerator, engine_said)


def tokens_only(settings: dict, accelerator: int, engine_said: str) -> bool:
    """Whether a generate replica's answers commit to their token ids alone: a vLLM
    endpoint's (the client's signed ``engine``; vLLM keeps no activations a replica could
    fingerprint), or a batch engine's that said (``engine_said``, its ReplicaReady) it fell
    back to generate calls, which record no fingerprints; a replica of another engine saying
    so is not believed. Such an answer is judged by its tokens only: greedy, each must be
    the replay's top token (the token gap); sampled, it cannot be judged."""
    if settings.get("engine") == "vllm":
        return True
    return batch_engine(settings, accelerator) and engine_said.startswith(CALLS_FALLBACK)


def model_positions(config: dict) -> int:
    """The longest sequence a transformers config says its model takes (its text model's,
    for a multimodal one); 0 if it does not say."""
    text = config.get("text_config")
    for cfg in (config, text if isinstance(text, dict) else {}):
        for key in ("max_position_embeddings", "n_positions"):
            value = cfg.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def settings(values: dict[str, Any]) -> dict[str, Any]:
    """The endpoint's scaling settings with their defaults filled in."""
    concurrency = values["max_concurrency"] or DEFAULT_CONCURRENCY
    return {"task": values["task"] or "generate",
            "min_replicas": values["min_replicas"], "max_replicas": values["max_replicas"],
            "max_concurrency": concurrency, "target": values["target"] or concurrency,
            "window_s": values["scale_window_s"] or DEFAULT_WINDOW_S,
            "idle_s": values["idle_s"] or DEFAULT_IDLE_S,
            "max_tokens": values["max_tokens"], "max_seq_len": values["max_seq_len"],
            "engine": values["engine"], "dtype": values["dtype"]}


def settings_of(spec_envelope: bytes) -> dict[str, Any]:
    """An endpoint's settings (``settings``) from its stored signed spec."""
    envelope = pb.Envelope.FromString(spec_envelope)
    return settings(KIND.values_of(pb.JobSpec.FromString(envelope.payload)))


KIND = Endpoint(
    name="endpoint", number=pb.JOB_KIND_ENDPOINT, runner="gpumarket.provider.runners.serve",
    sizing="inference", serves=True, verify="answers",
    params=(
        Param("model", "file_or_dir", input_name="model.tar", dir_needs="config.json",
              doc="a model directory (config, safetensors, tokenizer) sent with the endpoint"),
        Param("model_name", "str", doc="or: a model the provider holds (see its offer)"),
        Param("task", "str", choices=("", "generate", "embed"),
              doc="generate (completions, chat) or embed (embeddings); \"\" = generate"),
        Param("trust_remote_code", "bool",
              doc="run the model's own Python code; only where the provider allows it"),
        Param("engine", "str", choices=ENGINES,
              doc="auto (\"\"): continuous batching on CUDA, the dynamic batcher on the CPU"),
        Param("dtype", "str", choices=DTYPES),
        Param("max_seq_len", "int", max=1_048_576,
              doc="prompt + output tokens per request; 0 = the model's, at most 4096"),
        Param("max_concurrency", "int", max=1024,
              doc=f"sequences one replica serves at once; 0 = {DEFAULT_CONCURRENCY}"),
        Param("max_tokens", "int", max=1_048_576,
              doc="the largest max_tokens a request may ask; 0 = max_seq_len"),
        Param("min_replicas", "int", default=1, max=MAX_REPLICAS,
              doc="0 = scale to zero when idle"),
        Param("max_replicas", "int", default=1, min=1, max=MAX_REPLICAS),
        Param("target", "int", max=4096,
              doc="requests in flight per replica above which it scales out;"
                  " 0 = max_concurrency"),
        Param("scale_window_s", "int", max=3600,
              doc=f"how long load stays over target before a replica is added;"
                  f" 0 = {DEFAULT_WINDOW_S}"),
        Param("idle_s", "int", max=86_400 * 7,
              doc=f"idle time before a replica above min_replicas goes; 0 = {DEFAULT_IDLE_S}"),
    ),
)
