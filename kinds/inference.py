"""What generate and embed share: a model sent with the job or one the provider holds, its
own code only where allowed, the engine and dtype it runs in."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
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

    # A check re-runs one batch of rows, chosen at random, with the batch size the provider
    # used (padding changes the numbers), and compares those rows.
    def check_scope(self, values: dict[str, Any], part: int, parts: int,
                    metrics: dict[str, float]) -> dict:
        total, batch = int(metrics.get(self.count_metric, 0)), int(metrics.get("batch_size", 0))
        if total <= 0 or batch <= 0:
            return {}
        first = secrets.randbelow(-(-total // batch)) * batch
        return {"rows": list(range(first, min(total, first + batch))), "batch_size": batch}

    def rows_of(self, path: Path, rows: list[int]) -> dict[int, dict]:
        wanted, out = set(rows), {}
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("index") in wanted:
                        out[record["index"]] = record
        return out

    def compare(self, expect: dict[str, Path], got: dict[str, Path], scope: dict
                ) -> tuple[bool, str]:
        (name, want_path), = expect.items()
        if name not in got:
            return False, f"the replay returned no {name}"
        rows = scope.get("rows", [])
        try:
            want, have = self.rows_of(want_path, rows), self.rows_of(got[name], rows)
        except (OSError, ValueError) as exc:
            return False, f"{name} is unreadable ({exc})"
        for i in rows:
            if i not in want:
                return False, f"row {i} is missing from the provider's {name}"
            if i not in have:
                return False, f"row {i} is missing from the replay's {name}"
            same, why = self.same_row(want[i], have[i])
            if not same:
                return False, f"row {i}: {why}"
        return True, f"{len(rows)} rows agree ({self.agreement})"

    count_metric = ""
    agreement = ""

    def same_row(self, want: dict, have: dict) -> tuple[bool, str]:
        return False, "cannot compare"
