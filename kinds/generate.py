"""Generate: complete prompts with a causal language model (transformers, or vLLM where a
provider has it), batched, resumable per batch, with TTFT/TPOT figures."""

from __future__ import annotations

from typing import Any

from gpumarket.kinds.inference import Inference, model_params
from gpumarket.kinds.schema import Param, ParamError
from gpumarket.proto.v1 import types_pb2 as pb


class Generate(Inference):
    def rules(self, values: dict[str, Any]) -> None:
        super().rules(values)
        if values["quantization"] and values["engine"] != "vllm":
            raise ParamError("generate.quantization", 'needs engine = "vllm"')

    # The same batch on the same device class and software gives the same tokens: greedy,
    # and sampled too (each batch draws from its own seed).
    count_metric = "prompts"
    agreement = "completions identical"

    def evidence(self, names: set[str]) -> set[str]:
        return names & {"completions.jsonl"}

    def same_row(self, want: dict, have: dict) -> tuple[bool, str]:
        if want.get("completion") != have.get("completion"):
            return False, "the completions differ"
        return True, ""


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
