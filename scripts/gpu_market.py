"""What scripts/gpu_check.py runs its checks on: a local marketplace of real processes (a
broker and providers on 127.0.0.1, SQLite, temporary directories: tests/helpers.py's
Marketplace, as examples/demo.py starts one), Llama models with random weights and a
tokenizer trained on the spot (nothing can be downloaded on a GPU machine), and job files.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers import Marketplace, job_processes

# Short leases: a killed provider's job moves after 4 s.
LEASE_ARGS = ("--lease-timeout", "4", "--heartbeat-interval", "0.5")
KINDS = "training,generate,embed,endpoint,script,render"

# The model: a Llama of about 1B parameters (random weights, bf16) on a GPU; a
# 2-layer one for the CPU rehearsal.
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
            "max_position_embeddings": 2048}
LLAMA_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
              "max_position_embeddings": 256}


LOG_TAIL = 12  # of a failed job's log lines, kept in its check's figures
CHECK_DEADLINE_S = 280.0  # a check's default deadline (--deadline), under 5 minutes
# ... and in the CPU rehearsal, on a host shared with other work (a loaded 2-core host ran
# its training check's 600 tiny steps at 71 tokens/s)
REHEARSAL_DEADLINE_S = 900.0


class CheckError(Exception):
    """A check's failure, with its one-line reason and figures for the results file (a
    failed job's last log lines, what a deadline interrupted)."""

    def __init__(self, message: str, **figures) -> None:
        super().__init__(message)
        self.figures = figures


class Deadline:
    """The time the running check must end by: every wait of a check is cut to it and, once
    it has passed, ends the check as FAIL "deadline" naming what it was waiting for. One per
    process (``DEADLINE``), set by the runner before each check."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.at: float | None = None
        self.waiting = ""       # what the check's current wait_for waits for

    def start(self, seconds: float) -> None:
        self.seconds, self.at = seconds, time.monotonic() + seconds

    def stop(self) -> None:
        self.at, self.waiting = None, ""

    def left(self, wanted: float, what: str) -> float:
        """``wanted`` seconds, or what is left before the deadline if less; CheckError if
        nothing is left (``what``: what the check was about to wait for)."""
        if self.at is None:
            return wanted
        left = self.at - time.monotonic()
        if left <= 0:
            raise self.passed(what)
        return min(wanted, left)

    def passed(self, what: str) -> CheckError:
        if self.waiting and self.waiting != what:
            what = f"{self.waiting} (in {what})"
        return CheckError(f"deadline: the check's {self.seconds:g} s passed while waiting"
                          f" for {what}", deadline_s=self.seconds, waiting_for=what)


DEADLINE = Deadline()


def corpus(n_words: int, lines: int, seed: int = 0) -> list[str]:
    """Sentences of made-up words: enough distinct pairs for a BPE of 32,000 tokens."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 10)))
             for _ in range(n_words)]
    return [" ".join(rng.choice(words) for _ in range(12)) for _ in range(lines)]


def make_llama(target: Path, shape: dict, dtype_name: str, device: str) -> int:
    """A LlamaForCausalLM of ``shape`` with random weights (seed 0) and a byte-level BPE
    tokenizer trained here to the shape's vocabulary, saved as safetensors in ``dtype_name``
    into ``target``, readable by the jobs' own uids. Returns its parameter count."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=shape["vocab_size"],
                                  special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    big = shape["vocab_size"] > 1000
    tok.train_from_iterator(corpus(40000, 20000) if big else corpus(200, 200), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    config = LlamaConfig(**{**shape, "vocab_size": len(fast)}, bos_token_id=fast.bos_token_id,
                         eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)       # made in its dtype on its device: seconds, not minutes
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    fast.save_pretrained(target)
    count = sum(p.numel() for p in model.parameters())
    del model
    for path in (target.parent, target, *target.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return count


def start_market(root: Path, cpu: bool, models_dir: Path) -> Marketplace:
    """A broker (with its HTTP side, for endpoints) and one provider ``p1`` holding the
    models of ``models_dir``, offering the GPUs (or, for the rehearsal, the CPU)."""
    market = Marketplace(root)
    market.start_broker(*LEASE_ARGS, "--http", "127.0.0.1:0")
    r = market.cli("keys", "init", timeout=60)
    if r.returncode != 0:
        raise CheckError(f"client key: {r.stderr.strip()}")
    start_provider(market, "p1", cpu, models_dir)
    wait_for(lambda: offers(market), "the provider's offer (it benchmarks its devices first)",
             timeout=600, interval=1.0)
    return market


def start_provider(market: Marketplace, name: str, cpu: bool, models_dir: Path):
    """Start provider ``name``; a later one takes the first one's benchmark figures (cached
    per device, driver and torch: the same machine) instead of measuring for a minute."""
    cached = market.root / "p1" / "benchmark.json"
    if name != "p1" and cached.exists():
        (market.root / name).mkdir(exist_ok=True)
        shutil.copyfile(cached, market.root / name / "benchmark.json")
    return market.start_provider(name, 1.0, "--models-dir", str(models_dir), "--kinds", KINDS,
                                 *(("--cpu-only",) if cpu else ()))


def cli(market: Marketplace, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``gpumarket ARGS`` against the check's broker, within the check's deadline."""
    what = f"gpumarket {' '.join(args[:2])}"
    try:
        return market.cli(*args, timeout=DEADLINE.left(timeout, what))
    except subprocess.TimeoutExpired as exc:
        if DEADLINE.at is not None and time.monotonic() >= DEADLINE.at:
            raise DEADLINE.passed(what) from exc
        raise CheckError(f"{what} took over {timeout:.0f} s") from exc


def offers(market: Marketplace) -> list[dict]:
    r = cli(market, "offers", "--json", timeout=60)
    if r.returncode != 0:
        raise CheckError(f"gpumarket offers: {last_line(r.stderr)}")
    return json.loads(r.stdout)


def offer_of(market: Marketplace, name: str) -> dict:
    pid = market.provider_id(name)
    for row in offers(market):
        if row["offer"].get("provider_id") == pid:
            return row["offer"]
    raise CheckError(f"provider {name} has no offer on the broker")


SUBMITTED: list[str] = []  # the jobs the running check submitted (cancel_unfinished)


def submit(market: Marketplace, job_file: Path) -> str:
    r = cli(market, "submit", str(job_file), timeout=600)
    if r.returncode != 0:
        raise CheckError(f"submit {job_file.name}: {last_line(r.stderr)}")
    SUBMITTED.append(r.stdout.split()[0])
    return SUBMITTED[-1]


def cancel_unfinished(market: Marketplace | None) -> list[str]:
    """Cancel the jobs the check that just ended submitted and that have not ended (one
    that failed or ran out of time must not hold the device the next check needs);
    returns their ids. Forgets them either way."""
    ids, SUBMITTED[:] = list(SUBMITTED), []
    cancelled = []
    for job_id in ids if market is not None else ():
        try:
            r = market.cli("status", job_id, "--json", timeout=60)
            state = json.loads(r.stdout).get("state") if r.returncode == 0 else ""
            if state in ("QUEUED", "LEASED", "RUNNING", "VERIFYING"):
                market.cli("cancel", job_id, timeout=60)
                cancelled.append(job_id)
        except (subprocess.TimeoutExpired, ValueError):
            continue
    return cancelled


def job(market: Marketplace, job_id: str) -> dict:
    """``gpumarket status JOB --json``."""
    r = cli(market, "status", job_id, "--json", timeout=60)
    if r.returncode != 0:
        raise CheckError(f"status of {job_id}: {last_line(r.stderr)}")
    return json.loads(r.stdout)


def job_failure(job: dict) -> str:
    """Why a job the check waits on has failed ("" if it has not): FAILED or CANCELLED, or
    an attempt of it that failed (its code crashed: the broker may retry it, the check does
    not wait for that). A lost attempt (a provider killed) is no failure."""
    jid = job.get("job_id", "?")
    if job.get("state") in ("FAILED", "CANCELLED"):
        return f"job {jid} {job['state']}: {job.get('error', '')}".strip().rstrip(":")
    for attempt in job.get("attempts", []):
        if attempt.get("outcome") == "failed":
            return (f"job {jid}'s attempt {attempt.get('attempt', '?')} failed:"
                    f" {attempt.get('reason', '')}").strip().rstrip(":")
    return ""


def failed_job(market: Marketplace, job_id: str, why: str) -> CheckError:
    """The CheckError of a failed job: ``why`` and the last lines of its log (in the
    detail, and LOG_TAIL of them in the figures)."""
    tail = last_lines(job_log(market, job_id), LOG_TAIL)
    shown = " | ".join(tail[-3:])
    return CheckError(f"{why}; its log ends: {shown}" if shown else f"{why} (no log)",
                      failed_job=job_id, log_tail=tail)


def finish(market: Marketplace, job_id: str, timeout: float) -> dict:
    """The job once it SUCCEEDED; CheckError with its last log lines as soon as it failed
    (job_failure), or at the timeout or deadline."""
    def ended() -> dict | None:
        found = job(market, job_id)
        if why := job_failure(found):
            raise failed_job(market, job_id, why)
        return found if found["state"] == "SUCCEEDED" else None

    return wait_for(ended, f"job {job_id} to end", timeout, interval=0.5)


def results(market: Marketplace, job_id: str, out: Path) -> Path:
    r = cli(market, "results", job_id, "-o", str(out), timeout=600)
    if r.returncode != 0:
        raise CheckError(f"results of {job_id}: {last_line(r.stderr)}")
    return out


def job_log(market: Marketplace, job_id: str) -> str:
    try:
        r = market.cli("logs", job_id, timeout=60)   # also after the deadline: for the FAIL
    except subprocess.TimeoutExpired:
        return ""
    return r.stdout if r.returncode == 0 else ""


def kill_machine(market: Marketplace, name: str) -> None:
    """SIGKILL a provider daemon and every job process of it: the machine is gone."""
    market.providers[name].stop(signal.SIGKILL)
    for pid in job_processes(str(market.root / name)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def close(market: Marketplace | None, root: Path) -> None:
    """Stop every process of the marketplace under ``root``, and any job process a killed
    provider left running (jobs outlive their daemon by design)."""
    if market is not None:
        for proc in market.providers.values():
            proc.stop(timeout=20)
        if market.broker is not None:
            market.broker.stop(timeout=20)
    for pid in job_processes(str(root)):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def last_line(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def last_lines(text: str, n: int) -> list[str]:
    """The last ``n`` non-blank lines of ``text``, each at most 300 characters."""
    return [ln[:300] for ln in (text or "").splitlines() if ln.strip()][-n:]


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)


def job_file(path: Path, kind: str, params: dict, *, accelerator: str,
             gpus: int = 1, max_runtime: int = 3600) -> Path:
    """Write a job file of ``kind`` with ``params`` (its table), for any provider at up to
    5 credits per device-hour."""
    lines = [f'name = "gpu-check-{path.stem}"', f'kind = "{kind}"', "max_price = 5.0",
             f"max_runtime = {max_runtime}", "", "[resources]", f"gpus = {gpus}",
             f'accelerator = "{accelerator}"', "", f"[{kind}]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in params.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def wait_for(check, what: str, timeout: float, interval: float = 0.5, failed=None):
    """``check()``'s first true value. CheckError at once when ``failed()`` returns one (a
    job or replica waited on has failed: there is nothing left to wait for), after
    ``timeout`` seconds, or when the check's deadline passes (naming ``what``)."""
    end = time.monotonic() + timeout
    outer, DEADLINE.waiting = DEADLINE.waiting, what
    try:
        while True:
            if failed is not None and (error := failed()) is not None:
                raise error
            value = check()
            if value:
                return value
            if time.monotonic() >= end:
                raise CheckError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(min(interval, DEADLINE.left(interval, what)))
            DEADLINE.left(interval, what)
    finally:
        DEADLINE.waiting = outer
