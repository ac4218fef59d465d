"""A job kind that exists only in the tests: proof that a kind is one module. It is loaded by
naming it in $GPUMARKET_KINDS; nothing else in the codebase knows it.

A checksum job hashes its input file ``rounds`` times over (each round hashes the previous
digest with the data), reporting progress, and writes outputs/checksum.json. Its runner is
this module: ``python -m tests.kind_checksum WORKDIR``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from gpumarket.kinds.base import Kind
from gpumarket.kinds.runner_job import RunnerJob
from gpumarket.kinds.schema import Param

KIND = Kind(
    name="checksum", number=101, runner="tests.kind_checksum",
    params=(
        Param("data", "file", required=True, input_name="data.bin", doc="the file to hash"),
        Param("algorithm", "str", default="sha256", choices=("sha256", "blake2b")),
        Param("rounds", "int", default=1, min=1, max=1000),
    ),
)


def digest(data: bytes, algorithm: str, rounds: int) -> str:
    out = b""
    for _ in range(rounds):
        out = hashlib.new(algorithm, out + data).digest()
    return out.hex()


def run(workdir: Path, report) -> None:
    job = RunnerJob.from_json((workdir / "job.json").read_bytes())
    p = job.params
    data = Path(job.inputs[p["data"]]).read_bytes()
    for r in range(1, p["rounds"] + 1):
        report.progress(r, p["rounds"])
    out = workdir / "outputs"
    out.mkdir(exist_ok=True)
    (out / "checksum.json").write_text(json.dumps(
        {"algorithm": p["algorithm"], "rounds": p["rounds"],
         "digest": digest(data, p["algorithm"], p["rounds"])}))
    report.done(rounds=float(p["rounds"]))


def warm_up() -> None:
    pass


def main() -> int:
    from gpumarket.provider.runners.base import run_main

    return run_main("checksum", run)


if __name__ == "__main__":
    sys.exit(main())
