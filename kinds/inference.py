"""What generate and embed share: a model sent with the job or one the provider holds, its
own code only where allowed, the engine and dtype it runs in."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpumarket.kinds.base import Kind
from gpumarket.kinds.schema import NAME_RE, UINT32, Param, ParamError

ENGINES = ("", "transformers", "vllm")
MAX_CHECK_BATCH = 4096     # rows one check replays at most (the kinds' largest batch_size)
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


def check_model(kind: str, values: dict[str, Any]) -> None:
    """Exactly one of ``model`` (sent) and ``model_name`` (a plain name the provider holds)."""
    if bool(values["model"]) == bool(values["model_name"]):
        raise ParamError(kind, "give exactly one of model or model_name")
    if values["model_name"] and not NAME_RE.match(values["model_name"]):
        raise ParamError(f"{kind}.model_name", f"{values['model_name']!r} is not a plain name")


class Inference(Kind):
    def rules(self, values: dict[str, Any]) -> None:
        check_model(self.name, values)

    def config_input(self, values: dict[str, Any]) -> tuple[str, bool] | None:
        return (values["model"], True) if values["model"] else None

    # A check re-runs one batch of rows with the batch size the provider says it used
    # (padding changes the numbers; a size it did not use makes its rows disagree). Which
    # batch: a random position among the batches the lease did itself, turned into rows by
    # the checker's runner from the input it reads (not from anything the provider claims).
    def check_scope(self, values: dict[str, Any], part: int, parts: int,
                    metrics: dict[str, float], done_before: int) -> dict:
        batch = int(min(max(metrics.get("batch_size", 0), 1), MAX_CHECK_BATCH))
        return {"position": secrets.randbelow(1 << 30) / (1 << 30), "batch_size": batch}

    def rows_of(self, path: Path, rows: list[int] | None) -> dict[int, dict]:
        """The records of ``path`` by their integer ``index`` (of ``rows`` only, if given)."""
        wanted, out = set(rows or ()), {}
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    index = record.get("index") if isinstance(record, dict) else None
                    if type(index) is int and (rows is None or index in wanted):
                        out[index] = record
        return out

    def compare(self, expect: dict[str, Path], got: dict[str, Path], scope: dict
                ) -> tuple[bool, str]:
        name = self.output
        if name not in expect:
            return False, "no result to compare"
        if name not in got:
            return False, f"the replay returned no {name}"
        try:
            have = self.result_rows(got, scope)
            rows = sorted(have)
            want = self.result_rows(expect, scope)
            total = json.loads(got["metrics.json"].read_text())[self.count_metric] \
                if "metrics.json" in got else None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return False, f"{name} is unreadable ({exc})"
        if not rows:
            return False, "the replay returned no rows"
        same_row = self.row_rule(got, scope)
        if total is not None and not scope.get("replays") and \
                sorted(want) != list(range(int(total))):
            return False, (f"the provider's {name} has {len(want)} rows, not the input's"
                           f" {int(total)}")
        for i in rows:
            if i not in want:
                return False, f"row {i} is missing from the provider's {name}"
            if i not in have:
                return False, f"row {i} is missing from the replay's {name}"
            same, why = same_row(want[i], have[i])
            if not same:
                return False, f"row {i}: {why}"
        return True, f"rows {rows[0]}-{rows[-1]} agree ({self.agreement})"

    output = ""          # the output file whose rows are compared
    count_metric = ""
    agreement = ""

    def result_rows(self, files: dict[str, Path], scope: dict) -> dict[int, dict]:
        """The rows of a result (its files by name) that ``row_rule`` compares, by index."""
        return self.rows_of(files[self.output], None)

    def row_rule(self, got: dict[str, Path], scope: dict
                 ) -> Callable[[dict, dict], tuple[bool, str]]:
        """How a row of the replay (``got``, by name) is compared with the provider's:
        (agrees, where they differ). A kind whose rule depends on how the replay ran (its
        dtype, say) reads that from the replay's outputs, or on what the check is, from
        its ``scope``."""
        return self.same_row

    def same_row(self, want: dict, have: dict) -> tuple[bool, str]:
        return False, "cannot compare"
