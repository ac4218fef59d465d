"""What a stranger's model archive costs the broker to size a job: a tar with many empty
entries before its config.json, read the way the broker reads it (at most 10,000 headers
and 2 s) against reading every header (tarfile's getmembers, as the broker once did).

    .venv/bin/python bench/archive_scan.py [--entries 300000]

Prints both CPU times and their ratio; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpumarket.broker.market import admission
from gpumarket.proto.errors import InvalidArgument  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=300_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(args.entries):
                tar.addfile(tarfile.TarInfo(f"junk/{i:07d}"))
            config = json.dumps({"model_type": "llama"}).encode()
            info = tarfile.TarInfo("config.json")
            info.size = len(config)
            tar.addfile(info, io.BytesIO(config))
        began = time.process_time()
        with tarfile.open(path, "r:") as tar:
            found = any(m.name == "config.json" for m in tar.getmembers())
        every = time.process_time() - began
        began = time.process_time()
        try:
            admission._config_from_blob(path, archive=True)
            outcome = "read"
        except InvalidArgument as exc:
            outcome = f"refused: {exc.message}"
        bounded = time.process_time() - began
    print(f"every header: {every:.3f} s CPU (config.json found: {found})")
    print(f"the broker's bounded scan: {bounded:.3f} s CPU ({outcome})")
    print(json.dumps({"entries": args.entries, "every_header_cpu_s": round(every, 4),
                      "bounded_cpu_s": round(bounded, 4),
                      "ratio": round(every / max(bounded, 1e-9), 1)}))


if __name__ == "__main__":
    main()
