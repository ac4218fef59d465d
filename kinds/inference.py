"""What generate and embed share: a model sent with the job or one the provider holds, its
own code only where allowed, the engine and dtype it runs in."""

from __future__ import annotations

from typing import Any

from gpumarket.kinds.base import Kind
from gpumarket.kinds.schema import NAME_RE, UINT32, Param, ParamError

ENGINES = ("", "transformers", "vllm")
DTYPES = ("", "auto", "float32", "bfloat16", "float16")


def model_params(engines: tuple[str, ...] = ENGINES) -> tuple[Param, ...]:
    return (
        Param("model", "file_or_dir", input_name="model.tar", dir_needs="config.json",
              doc="a model directory (config, safetensors, tokenizer) sent with the job"),
        Param("model_name", "str", doc="or: a model the provider holds (see its offer)"),
        Param("trust_remote_code", "bool",
              doc="run the model's own Python code; only where the provider allows it"),
        Param("engine", "str", choices=engines),
        Param("dtype", "str", choices=DTYPES),
        Param("checkpoint_every", "int", max=UINT32,
              doc="items between checkpoints; 0 = the broker decides"),
    )


class Inference(Kind):
    def rules(self, values: dict[str, Any]) -> None:
        if bool(values["model"]) == bool(values["model_name"]):
            raise ParamError(self.name, "give exactly one of model or model_name")
        if values["model_name"] and not NAME_RE.match(values["model_name"]):
            raise ParamError(f"{self.name}.model_name",
                             f"{values['model_name']!r} is not a plain name")

    def config_input(self, values: dict[str, Any]) -> tuple[str, bool] | None:
        return (values["model"], True) if values["model"] else None
