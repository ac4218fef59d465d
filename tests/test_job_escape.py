"""A stranger's job that runs code of its own (a model with remote code, on a provider that
allows it) attacks the provider through what the daemon does after the job: it swaps its
outputs directory for a link to the provider's data directory as it exits, hoping the daemon
(root) uploads the provider's key as the job's result. Real broker, provider and client."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import pytest

from tests.models import tiny_causal_lm
from tests.test_inference import generate_job, write_prompts

pytestmark = pytest.mark.e2e

EVIL = '''
import atexit
import os

from transformers import LlamaConfig, LlamaForCausalLM


def _swap():
    # Run as the job exits: outputs/ becomes a link to the provider's data directory.
    os.rename("outputs", "outputs.real")
    os.symlink(os.path.abspath(os.path.join("..", "..")), "outputs")
    print("evil: outputs now points at", os.readlink("outputs"), flush=True)


atexit.register(_swap)


class EvilConfig(LlamaConfig):
    pass


class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
'''


def evil_model(target):
    tiny_causal_lm(target)
    (target / "evil.py").write_text(EVIL)
    config = json.loads((target / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig",
                          "AutoModelForCausalLM": "evil.EvilModel"}
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_a_job_cannot_hand_the_providers_key_to_its_owner(market, tmp_path):
    provider_conf = tmp_path / "provider.toml"
    provider_conf.write_text("allow_remote_code = true\n")
    market.start_provider("p1", 1.0, "--no-warm", "--config", str(provider_conf))  # generate
    offers = market.wait_for_offers(1)
    assert offers[0]["offer"]["policy"].get("allow_remote_code"), offers[0]  # isolated here
    job = generate_job(tmp_path / "job.toml", evil_model(tmp_path / "model"),
                       write_prompts(tmp_path / "prompts.jsonl", 2), max_tokens=4,
                       trust_remote_code=True)
    # One attempt: a failure is otherwise tried again (elsewhere first) before it counts.
    job.write_text(job.read_text().replace("max_price = 2.0", "max_price = 2.0\nmax_attempts = 1"))
    r = market.cli("submit", str(job), "--watch")
    job_id = r.stdout.split()[0]
    state = market.wait_state(job_id, "FAILED", "SUCCEEDED")
    logs = market.cli("logs", job_id).stdout
    assert "evil: outputs now points at" in logs, logs            # the attack ran
    assert state["state"] == "FAILED", state
    assert "outputs is a link" in state["error"], state["error"]

    key = (market.root / "p1" / "provider.key").read_bytes()
    digest = hashlib.sha256(key).hexdigest()
    blobs = list((market.root / "broker" / "artifacts" / "blobs").rglob("*"))
    assert blobs and not any(b.name == digest for b in blobs), "the key reached the broker"
    out = tmp_path / "out"
    market.cli("results", job_id, "-o", str(out))
    assert not (out / "provider.key").exists()


# -- a script job (the client's own Python) against the next job on its device -------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the job sandbox (a job uid of its"
                                " own, namespaces, a job cgroup) needs root")

BAD_REPORTS_AND_A_SURVIVOR = r'''
import json, os, sys
from gpumarket.provider.runners import task

# Reports the daemon once took on trust: a step that is no number, and one below zero.
with open(os.environ["GPUMARKET_REPORT_FILE"], "a") as reports:
    for step in ("abc", -5):
        reports.write(json.dumps({"event": "progress", "step": step, "total": 10}) + "\n")
# A survivor, detached: it finds the work directories of the jobs beside it by the names in
# /proc/*/cgroup and plants a file in their outputs, until something ends it.
LOOP = (r'while :; do for f in /proc/[0-9]*/cgroup; do for n in $(grep -o "[^/]*$" "$f");'
        r' do [ -d "$2/$n/outputs" ] && echo planted > "$2/$n/outputs/planted.txt";'
        r' done; done 2>/dev/null; sleep 0.1; done')
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sh", ["/bin/sh", "-c", LOOP, "sh", sys.argv[1],
                             os.path.dirname(os.environ["HOME"])])
    os._exit(0)
task.progress(1, 1)
(task.output_dir() / "a.txt").write_text("a")
'''

VICTIM = r'''
import time
from gpumarket.provider.runners import task

out = task.output_dir()
time.sleep(3)           # long enough for anything left on this device to find it
(out / "b.txt").write_text("b")
'''


def script_job(path: Path, code: Path, *args: str) -> Path:
    path.write_text(f'''
name = "{path.stem}"
kind = "script"
max_price = 2.0

[script]
code = "{code}"
args = {json.dumps(list(args))}
''')
    return path


def processes_named(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@needs_root
def test_bad_reports_and_a_survivor_do_not_reach_the_next_job(market, tmp_path):
    """Job A writes reports that once failed the daemon's own code (the job was marked
    FAILED and its device handed on while its processes ran on) and forks a detached
    survivor that plants a file in any job's outputs it can find. A's bad reports are
    dropped, A succeeds, nothing of it outlives it, and job B on the same device (the same
    uid) gets back only what it wrote."""
    market.start_provider("p1", 1.0, "--kinds", "script")
    market.wait_for_offers(1)
    marker = f"gpumarket-survivor-{os.urandom(6).hex()}"
    (tmp_path / "a.py").write_text(BAD_REPORTS_AND_A_SURVIVOR)
    (tmp_path / "b.py").write_text(VICTIM)
    try:
        r = market.cli("submit", str(script_job(tmp_path / "a.toml", tmp_path / "a.py", marker)))
        assert r.returncode == 0, r.stderr
        a = market.wait_state(r.stdout.split()[0], "SUCCEEDED", "FAILED")
        assert a["state"] == "SUCCEEDED", a
        assert not processes_named(marker), "a process of job A outlived it"
        assert "report lines dropped" in market.providers["p1"].text()
        r = market.cli("submit", str(script_job(tmp_path / "b.toml", tmp_path / "b.py")))
        assert r.returncode == 0, r.stderr
        b_id = r.stdout.split()[0]
        b = market.wait_state(b_id, "SUCCEEDED", "FAILED")
        assert b["state"] == "SUCCEEDED", b
        out = tmp_path / "out"
        r = market.cli("results", b_id, "-o", str(out))
        assert r.returncode == 0, r.stderr
        assert sorted(p.name for p in out.iterdir()) == ["b.txt", "receipt.json"]
    finally:
        for pid in processes_named(marker):
            os.kill(pid, signal.SIGKILL)


JOB_ENVIRONMENT = r'''
import getpass, json, os, pwd
from gpumarket.provider.runners import task

try:
    pwd.getpwuid(os.getuid())
    passwd = True
except KeyError:
    passwd = False
user = getpass.getuser()
import torch._dynamo, torch._inductor            # both ask getpass.getuser() on some versions
from torch._inductor.runtime.cache_dir_utils import cache_dir
import huggingface_hub.constants as hf

names = ["HOME", "USER", "LOGNAME", "TMPDIR", "XDG_CACHE_HOME", "HF_HOME", "TORCH_HOME",
         "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH", "MPLCONFIGDIR"]
(task.output_dir() / "env.json").write_text(json.dumps({
    "uid": os.getuid(), "passwd": passwd, "user": user, "cwd": os.getcwd(),
    "env": {k: os.environ.get(k) for k in names}, "hf_home": hf.HF_HOME,
    "inductor_cache": cache_dir()}))
'''


@needs_root
def test_a_job_uid_without_a_passwd_entry_runs_torchs_compilers(market, tmp_path):
    """What every CUDA job of a real H100 failed on (issue 31): a job uid has no passwd
    entry, and getpass.getuser() — called by torch._dynamo and torch._inductor — needs one
    or $USER / $LOGNAME. A job gets both, and its home and every cache inside its own
    directory."""
    market.start_provider("p1", 1.0, "--kinds", "script")
    market.wait_for_offers(1)
    (tmp_path / "env.py").write_text(JOB_ENVIRONMENT)
    r = market.cli("submit", str(script_job(tmp_path / "env.toml", tmp_path / "env.py")))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.split()[0]
    job = market.wait_state(job_id, "SUCCEEDED", "FAILED", timeout=300)
    assert job["state"] == "SUCCEEDED", (job, market.cli("logs", job_id).stdout)
    out = tmp_path / "out"
    r = market.cli("results", job_id, "-o", str(out))
    assert r.returncode == 0, r.stderr
    seen = json.loads((out / "env.json").read_text())
    assert seen["uid"] != 0 and not seen["passwd"], seen
    assert seen["user"] == "job" and seen["env"]["USER"] == seen["env"]["LOGNAME"] == "job"
    home = seen["env"]["HOME"]
    assert home == seen["cwd"] and Path(home).parent.name == "jobs", seen
    for name, value in seen["env"].items():
        if name not in ("HOME", "USER", "LOGNAME"):
            assert value and value.startswith(home + "/"), (name, value)
    assert seen["hf_home"].startswith(home + "/") and seen["inductor_cache"].startswith(home + "/")
