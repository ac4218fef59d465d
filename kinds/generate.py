"""Generate: complete prompts with a causal language model (transformers, or vLLM where a
provider has it), batched, resumable per batch, with TTFT/TPOT figures."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpumarket.kinds import draws
from gpumarket.kinds import fingerprints as fp
from gpumarket.kinds.inference import MAX_CHECK_BATCH, Inference, model_params
from gpumarket.kinds.schema import Param, ParamError
from gpumarket.proto.v1 import types_pb2 as pb

COMPLETIONS = "completions.jsonl"
FINGERPRINTS = "fingerprints.jsonl"


class Generate(Inference):
    def rules(self, values: dict[str, Any]) -> None:
        super().rules(values)
        if values["quantization"] and values["engine"] != "vllm":
            raise ParamError("generate.quantization", 'needs engine = "vllm"')

    # Where the provider's result carries activation fingerprints (transformers), a check
    # prefills the provider's own tokens once and compares fingerprints within measured
    # tolerances (kinds/fingerprints.py): an honest provider whose batching changed a greedy
    # token is judged on the tokens it produced. Without them (vLLM), the same batch is
    # generated again on the same device class and compared text-equal: the same batch on
    # the same device class and software gives the same tokens, greedy or sampled (each
    # batch draws from its own seed).
    output = COMPLETIONS
    count_metric = "prompts"
    agreement = "completions identical"

    def evidence(self, names: set[str]) -> set[str]:
        return names & {COMPLETIONS, FINGERPRINTS}

    def check_scope(self, values: dict[str, Any], part: int, parts: int,
                    metrics: dict[str, float], done_before: int) -> dict:
        batch = int(min(max(metrics.get("batch_size", 0), 1), MAX_CHECK_BATCH))
        # what the fingerprint rule needs of the job (the client's signed word, not the
        # provider's): its dtype sets the tolerance, greedy decoding the token check
        return {"position": secrets.randbelow(1 << 30) / (1 << 30), "batch_size": batch,
                "dtype": values["dtype"], "greedy": not values["temperature"]}

    def check_claimed(self, outputs: dict[str, dict]) -> dict | None:
        if COMPLETIONS in outputs and FINGERPRINTS in outputs:
            return dict(outputs[COMPLETIONS])
        return None

    def result_rows(self, files: dict[str, Path], scope: dict) -> dict[int, dict]:
        rows = self.rows_of(files[COMPLETIONS], None)
        if not scope.get("claimed"):
            return rows
        if FINGERPRINTS not in files:
            raise ValueError(f"no {FINGERPRINTS}")
        for i, record in self.rows_of(files[FINGERPRINTS], list(rows)).items():
            rows[i] = {**rows[i], "fingerprints": record.get("fingerprints")}
        return rows

    def row_rule(self, got: dict[str, Path], scope: dict
                 ) -> Callable[[dict, dict], tuple[bool, str]]:
        if not scope.get("claimed"):
            return self.same_row
        # Two replays (a tie-break against the first check) agree on their fingerprints;
        # the token gap and the draws judge the claimed tokens, not a replay: both see the
        # same ones.
        claimed = not scope.get("replays")
        return fingerprint_rule(str(scope.get("dtype", "")),
                                bool(scope.get("greedy")) and claimed,
                                not scope.get("greedy") and claimed)

    def compare(self, expect: dict[str, Path], got: dict[str, Path], scope: dict
                ) -> tuple[bool, str]:
        agrees, why = super().compare(expect, got, scope)
        if agrees and scope.get("claimed") and not scope.get("greedy") \
                and not scope.get("replays") and COMPLETIONS in got:
            # an old checker's prefill returns no draws: its rows are judged by their
            # fingerprints only, and the verdict says so
            rows = self.rows_of(got[COMPLETIONS], None).values()
            if any("draws" not in r for r in rows):
                why += ("; sampled tokens judged by fingerprints only (the checker sent no"
                        " sampling figures)")
            else:
                why += "; sampled tokens drawn as the job's temperature and top_p say"
        return agrees, why

    def same_row(self, want: dict, have: dict) -> tuple[bool, str]:
        if want.get("completion") != have.get("completion"):
            return False, "the completions differ"
        return True, ""


def fingerprint_rule(dtype: str, greedy: bool, sampled: bool = False
                     ) -> Callable[[dict, dict], tuple[bool, str]]:
    """The row rule of a check by fingerprints, for a job that asked ``dtype``: the
    provider's text is the text of its tokens (the replay decoded them), its fingerprints
    are the replay's within the dtype's tolerance, greedy, each of its tokens was the
    replay's top one up to the dtype's rounding (the replay's ``token_gap``), and
    ``sampled``, its tokens sit in the replay's distribution as honest draws do (the
    replay's ``draws``, kinds/draws.py; a replay without them, an old checker's, leaves the
    row judged by its fingerprints)."""
    tol, limit = fp.tolerance(dtype), fp.token_gap_limit(dtype)

    def same(want: dict, have: dict) -> tuple[bool, str]:
        if want.get("completion") != have.get("completion"):
            return False, "the completion is not the text of its tokens"
        agrees, why = fp.same_fingerprints(want.get("fingerprints"),
                                           have.get("fingerprints"), tol)
        if not agrees:
            return False, why
        gap = have.get("token_gap")
        if greedy and not (type(gap) in (int, float) and gap <= limit):
            said = f"{gap:.2f}" if type(gap) in (int, float) else "?"
            return False, (f"a greedy token is not the replay's top one (its logit {said}"
                           f" standard deviations below; at most {limit:g})")
        if sampled and "draws" in have:
            drawn, why = draws.judge(have["draws"], dtype)
            if drawn is False:
                return False, why
        return True, ""

    return same


KIND = Generate(
    name="generate", number=pb.JOB_KIND_GENERATE, proto_field="generate",
    runner="gpumarket.provider.runners.generate", sizing="inference", verify="rows",
    checkpoints=True,
    params=model_params() + (
        Param("prompts", "file", required=True, input_name="prompts.jsonl",
              doc='JSONL, one {"prompt": ...} object per line'),
        Param("max_tokens", "int", max=1_000_000, doc="new tokens per prompt; 0 = 64"),
        Param("temperature", "float", min=0, max=100, doc="0 = greedy"),
        Param("top_p", "float", min=0, max=1, doc="0 = 1.0"),
        Param("seed", "int"),
        Param("stop", "strings", max_items=16, max_chars=256),
        Param("batch_size", "int", max=4096, doc="0 = chosen from free memory"),
        Param("quantization", "str", doc="passed to vLLM"),
    ),
)
