"""How many of the project's source files one job's submission runs through on the broker:
from `MarketplaceServicer.SubmitJob` to the signed lease in its provider's outbox (the
placement pass that makes it included), traced in-process over a real SQLite store.

    .venv/bin/python bench/submit_path.py [--kind training|split|array]

A broker's state with one provider session offering one CPU device; the client's job file
is read and its inputs uploaded before tracing starts (the client side is not counted, nor
is api/auth, which checks the call's token before the servicer is called). Every Python
function call in every thread is profiled while the submission and one placement pass run;
a file counts if any of its code ran. Prints the files by package, then one JSON line:
{"files": N, "by_package": {...}, "kind": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EXAMPLES = ROOT / "examples"

JOBS = {
    "training": f"""
name = "path"
kind = "training"
max_price = 2.0
[resources]
gpus = 1
accelerator = "any"
[training]
model_config = "{EXAMPLES / 'data' / 'tiny-llama.json'}"
dataset = "{EXAMPLES / 'data' / 'tiny-corpus.jsonl'}"
steps = 30
batch_size = 4
seq_len = 32
learning_rate = 3e-3
seed = 7
checkpoint_every = 10
""",
    "array": """
name = "path"
kind = "script"
max_price = 2.0
max_runtime = 600
[script]
code = "main.py"
[array]
grid = { steps = [1, 2, 3, 4] }
per_lease = 4
""",
}

_recording = False
_files: set[str] = set()


def _profile(frame, event, arg):
    if _recording and event == "call":
        _files.add(frame.f_code.co_filename)


async def run(kind: str, where: Path) -> set[str]:
    global _recording
    from gpumarket.broker.api import auth
    from gpumarket.broker.api.artifacts import ArtifactsServicer
    from gpumarket.broker.api.marketplace import MarketplaceServicer
    from gpumarket.broker.config import BrokerConfig
    from gpumarket.broker.market import providers, scheduler
    from gpumarket.broker.money import ledger
    from gpumarket.broker.server import install_reactions
    from gpumarket.broker.state import BrokerState
    from gpumarket.broker.store.artifact_store import ArtifactStore
    from gpumarket.broker.store.store import Store
    from gpumarket.client import jobfile
    try:
        from gpumarket.client.submit import build_spec
    except ImportError:     # before client/cli.py was split
        from gpumarket.client.cli import build_spec
    from gpumarket.proto.envelope import open_envelope, seal
    from gpumarket.proto.identity import Identity
    from gpumarket.proto.jobspec import now_ms
    from gpumarket.proto.v1 import artifacts_pb2 as ap
    from gpumarket.proto.v1 import marketplace_pb2 as mp
    from gpumarket.proto.v1 import types_pb2 as pb

    class Context:
        async def abort(self, code, message):
            raise RuntimeError(f"{code}: {message}")

        def peer(self):
            return "ipv4:127.0.0.1:1"

    install_reactions()
    store = Store(where / "broker.db")
    store.open()
    state = BrokerState(BrokerConfig(data_dir=where), Identity.generate(), store,
                        ArtifactStore(where / "artifacts", 1 << 30))
    marketplace, artifacts = MarketplaceServicer(state), ArtifactsServicer(state)
    client, provider = Identity.generate(), Identity.generate()
    await store.write(ledger.credit, client.id, ledger.units(1000), "client", "", "op", "k",
                      now_ms())
    # One provider online, offering one CPU device for every kind.
    device = pb.Device(index=0, name="fake CPU", uuid="FAKE-0", accelerator=pb.ACCELERATOR_CPU,
                       memory_bytes=64 << 30, cpu_cores=8,
                       benchmark=pb.Benchmark(matmul_flops=1e11, matmul_dtype="fp32",
                                              memory_bandwidth_bytes_per_s=1e10))
    offer_env = seal(provider, pb.Offer(
        provider_id=provider.id, devices=[device], price_per_gpu_hour=0.5,
        kinds=[pb.JOB_KIND_TRAINING, pb.JOB_KIND_SCRIPT], engines=["transformers"],
        created_at_ms=now_ms(), software_version="0.1.0"))
    await store.write(providers.online, provider.id, provider.public_key, now_ms())
    session = state.sessions.open(provider.id)
    session.offer, _ = open_envelope(offer_env, pb.Offer)
    session.offer_envelope = offer_env
    # The client's side: the job file read, its inputs uploaded.
    (where / "main.py").write_text("pass\n")
    path = where / "job.toml"
    path.write_text(JOBS[kind])
    job = jobfile.load(path)
    refs, blobs = [], []
    for item in job.inputs:
        data = item.data if item.data is not None else (
            jobfile.pack_directory(item.path) if item.path.is_dir() else item.path.read_bytes())
        sha = hashlib.sha256(data).hexdigest()
        blobs.append(ap.Blob(sha256=sha, data=data))
        refs.append(pb.ArtifactRef(name=item.name, sha256=sha, size_bytes=len(data)))

    async def each():
        yield ap.Blobs(blobs=blobs)
    auth._caller.set(client.id)
    await artifacts.UploadBlobs(each(), Context())
    request = mp.SubmitJobRequest(spec=seal(client, build_spec(job, refs, now_ms())))

    _recording = True
    try:
        resp = await marketplace.SubmitJob(request, Context())
        made = await scheduler.place_queued(state)
    finally:
        _recording = False
    message = session.outbox.get_nowait()
    assert made >= 1 and message.HasField("lease"), (made, message)
    lease, _ = open_envelope(message.lease, pb.Lease)
    assert lease.job_id.startswith(resp.job_id), (lease.job_id, resp.job_id)
    store.close()
    return set(_files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=sorted(JOBS), default="training")
    args = parser.parse_args()
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    with tempfile.TemporaryDirectory() as tmp:
        files = asyncio.run(run(args.kind, Path(tmp)))
    sys.setprofile(None)
    threading.setprofile(None)
    packages = ("broker", "kinds", "link", "proto")      # what the broker runs of this tree
    ours = sorted(str(Path(f).resolve().relative_to(ROOT)) for f in files
                  if Path(f).resolve().is_relative_to(ROOT) and "_pb2" not in f
                  and Path(f).resolve().relative_to(ROOT).parts[0] in packages)
    by_package: Counter = Counter()
    for rel in ours:
        parts = rel.split("/")
        room = "/".join(parts[:2]) if parts[0] == "broker" and len(parts) > 2 else parts[0]
        by_package[room] += 1
    for rel in ours:
        print(rel)
    print(f"{len(ours)} files from SubmitJob to the lease in the provider's outbox ({args.kind})")
    print(json.dumps({"files": len(ours), "by_package": dict(sorted(by_package.items())),
                      "kind": args.kind}))


if __name__ == "__main__":
    main()
