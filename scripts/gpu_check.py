"""Prove gpumarket's CUDA paths on this machine's NVIDIA GPU (issue 15): a real broker and a
real provider on 127.0.0.1, then one check after another, each one line
``PASS|FAIL|SKIPPED  name  detail``, a summary table, and the figures as one JSON file,
``bench/results/gpu-<gpu>-<date>.json``.

    make gpu-check                                   # or: python3 scripts/gpu_check.py
    python3 scripts/gpu_check.py --only inventory,benchmark --logs /tmp/logs
    python3 scripts/gpu_check.py --rehearse-cpu --json /tmp/rehearsal.json

Checks: the NVML inventory as the offer advertises it (against nvidia-smi); the provider's
benchmark (against plain torch here); a training job killed once (SIGKILL) and resumed,
against an uninterrupted run; generate and embed jobs through the marketplace against
their runner run directly; the endpoint engine through the broker's API against the same
engine in this process; the sandbox (the job sees only its lease's GPU, and CUDA starts
under its limits); two jobs at once on two slices of one GPU, each held to its share of
its memory (an allocation past it fails in that job only); vLLM and Blender where installed. The model is a Llama of about 1B
parameters with random weights (bf16) and a tokenizer trained on the spot.

Without an NVIDIA GPU it says so in one line and exits 0, every check SKIPPED (written only
with --json). ``--rehearse-cpu`` runs the same checks on the CPU device with a 2-layer
model, to prove the plumbing where there is no GPU; its results are labelled a CPU
rehearsal and never written as gpu-*.json. Exit status: 0 when no check FAILed, 1 when one
did, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
CHECK_NAMES = ("inventory", "benchmark", "training_resume", "generate", "embed", "endpoint",
               "sandbox", "slices", "vllm", "blender")


class Usage(Exception):
    """Bad input: one line, exit 2."""


def find_gpus() -> tuple[list, str]:
    """(the NVIDIA GPUs NVML lists, "") when torch can use them, else ([], why not)."""
    try:
        from gpumarket.provider.inventory import nvidia_devices
    except ImportError as exc:
        raise Usage(f"gpumarket is not importable in {sys.executable} ({exc}); install it"
                    " first (scripts/gpu_wheels.sh install)") from exc
    try:
        devices = nvidia_devices()
    except RuntimeError as exc:
        return [], f"NVML: {exc}"
    installed()
    import torch

    if not torch.cuda.is_available():
        return [], (f"NVML lists {len(devices)} ({devices[0].name}) but torch"
                    f" {torch.__version__} has no CUDA device")
    return devices, ""


def installed() -> None:
    """Raise Usage unless gpumarket's programs sit beside this Python (where the checks
    start the broker, the provider and the client from)."""
    here = Path(sys.executable).parent
    missing = [p for p in ("gpumarket-broker", "gpumarket-provider", "gpumarket")
               if not (here / p).exists()]
    if missing:
        raise Usage(f"{missing[0]} is not in {here}: install gpumarket into this Python"
                    " (scripts/gpu_wheels.sh install)")


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


class Context:
    """What the checks share: the mode, a temporary root, the model and the marketplace
    (each made on first use, once; a failure to make one fails every check that needs it)."""

    model_name = "llama"

    def __init__(self, cuda: bool, devices: list, root: Path) -> None:
        self.cuda = cuda
        self.devices = devices
        self.root = root
        self.models_dir = root / "models"
        self.model_dir = self.models_dir / self.model_name
        self.model_parameters = 0
        self.provider = "p1"
        self._providers = 1
        self._market = None
        self._failure: dict[str, Exception] = {}
        self.gpu_uuid = devices[0].uuid if cuda else ""
        from gpumarket.provider.inventory import cpu_device

        self.cpu_cores = cpu_device().cpu_cores

    def _once(self, what: str, make):
        if what in self._failure:
            raise self._failure[what]
        try:
            return make()
        except Exception as exc:
            self._failure[what] = exc
            raise

    def model(self) -> Path:
        """The Llama the provider holds (about 1B parameters in bf16 on a GPU; 2 layers in
        float32 for the rehearsal)."""
        if self.model_parameters:
            return self.model_dir

        def make() -> Path:
            from gpu_market import LLAMA_1B, LLAMA_TINY, make_llama

            began = time.perf_counter()
            shape, dtype = (LLAMA_1B, "bfloat16") if self.cuda else (LLAMA_TINY, "float32")
            self.model_parameters = make_llama(self.model_dir, shape, dtype,
                                               "cuda" if self.cuda else "cpu")
            if self.cuda:
                import torch

                torch.cuda.empty_cache()
            print(f"   .. model: Llama, {self.model_parameters:,} parameters"
                  f" ({dtype}, random weights), made in {time.perf_counter() - began:.0f} s",
                  file=sys.stderr, flush=True)
            return self.model_dir

        return self._once("model", make)

    def market(self):
        if self._market is not None:
            return self._market

        def start():
            from gpu_market import start_market

            self.model()     # before the provider starts: its offer lists the models it holds
            print("   .. starting a broker and a provider (it benchmarks its devices first)",
                  file=sys.stderr, flush=True)
            (self.root / "market").mkdir(exist_ok=True)
            self._market = start_market(self.root / "market", not self.cuda, self.models_dir)
            return self._market

        return self._once("market", start)

    def offer(self) -> dict:
        from gpu_market import offer_of

        return offer_of(self.market(), self.provider)

    def next_provider(self) -> str:
        self._providers += 1
        return f"p{self._providers}"

    def provider_log(self) -> str:
        path = self.root / "market" / f"{self.provider}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    @staticmethod
    def parameter_count(config: dict) -> int:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        raw = dict(config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"),
                                                                          **raw))
        return sum(p.numel() for p in model.parameters())

    def close(self, logs: Path | None) -> None:
        from gpu_market import close

        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            for log in sorted((self.root / "market").glob("*.log")):
                shutil.copyfile(log, logs / log.name)
        close(self._market, self.root)


def check_functions() -> dict:
    import gpu_checks as c
    import gpu_checks_inference as i
    import gpu_checks_slices as s

    return {"inventory": c.inventory, "benchmark": c.benchmark,
            "training_resume": c.training_resume, "generate": i.generate, "embed": i.embed,
            "endpoint": i.endpoint, "sandbox": c.sandbox, "slices": s.slices, "vllm": i.vllm,
            "blender": c.blender}


def reason(exc: BaseException) -> str:
    """A failure's one line: a CheckError's own reason, else the exception's type and its
    message's first line."""
    from gpu_market import CheckError

    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return (first if isinstance(exc, CheckError) else f"{type(exc).__name__}: {first}")[:400]


def line(name: str, status: str, detail: str) -> str:
    return f"{status:<7}  {name:<15}  {detail}"


class DeadlineAlarm(BaseException):
    """SIGALRM's, BACKSTOP_S after a check's deadline: the check did not notice it (a wait
    not cut to it). A BaseException, so that no ``except Exception`` of the check or of a
    library swallows it."""


BACKSTOP_S = 30.0


def run_checks(ctx: Context, names: list[str], records: list[dict], save,
               deadline_s: float = 0.0) -> None:
    """Run the checks ``names`` in order, appending a record for each to ``records`` and
    calling ``save()`` after each (a run cut short still leaves its results). Each has
    ``deadline_s`` (default CHECK_DEADLINE_S): its waits end there as FAIL "deadline", and
    SIGALRM ends it BACKSTOP_S later if one did not. On Ctrl-C (or SIGTERM) the checks not
    ended are recorded SKIPPED and KeyboardInterrupt goes on."""
    from gpu_checks import Outcome
    from gpu_market import CHECK_DEADLINE_S, DEADLINE, CheckError, cancel_unfinished

    deadline_s = deadline_s or CHECK_DEADLINE_S
    functions = check_functions()

    def alarm(signum, frame):
        raise DeadlineAlarm

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        for name in names:
            began = time.perf_counter()
            print(f"   .. {name}", file=sys.stderr, flush=True)
            DEADLINE.start(deadline_s)
            signal.setitimer(signal.ITIMER_REAL, deadline_s + BACKSTOP_S)
            try:
                outcome = functions[name](ctx)
            except DeadlineAlarm:
                outcome = Outcome("FAIL", f"deadline: the check's {deadline_s:g} s (and"
                                          f" {BACKSTOP_S:g} s more) passed in a wait"
                                          " that did not watch it", {
                                              "deadline_s": deadline_s})
            except Exception as exc:  # noqa: BLE001 (one check's failure must not stop the others)
                outcome = Outcome("FAIL", reason(exc), dict(getattr(exc, "figures", {})))
                if not isinstance(exc, CheckError):     # ours or the code's: where it broke
                    trace = traceback.format_exc()
                    print(trace, file=sys.stderr, flush=True)
                    outcome.figures["traceback"] = trace.strip().splitlines()[-12:]
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                DEADLINE.stop()
            # a failed check's jobs still running would hold the device the next one needs
            left = cancel_unfinished(getattr(ctx, "_market", None)
                                     if outcome.status == "FAIL" else None)
            if left:
                outcome.figures["cancelled_jobs"] = left
            seconds = round(time.perf_counter() - began, 2)
            print(line(name, outcome.status, outcome.detail), flush=True)
            records.append({"name": name, "status": outcome.status, "detail": outcome.detail,
                            "seconds": seconds, **outcome.figures})
            save()
    except KeyboardInterrupt:
        done = {r["name"] for r in records}
        for name in names:
            if name not in done:
                records.append({"name": name, "status": "SKIPPED",
                                "detail": "interrupted (Ctrl-C) before it ended"})
                print(line(name, "SKIPPED", "interrupted"), flush=True)
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def software() -> dict:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    from importlib.metadata import PackageNotFoundError, version

    for name in ("torch", "transformers", "gpumarket"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue       # a version not there is not written
    try:
        import torch

        if torch.cuda.is_available():
            out["torch_cuda"] = torch.version.cuda
    except ImportError:
        pass
    return out


def summary_table(records: list[dict], title: str, file=None) -> None:
    """The checks as a table on stdout (or ``file``); what they say is text, never rich
    markup (a detail such as "pip install 'gpumarket[vllm]'" is shown as it is)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title))
    table.add_column("check")
    table.add_column("status")
    table.add_column("seconds", justify="right")
    table.add_column("detail", overflow="fold")
    colour = {"PASS": "green", "FAIL": "red", "SKIPPED": "yellow"}
    for r in records:
        table.add_row(escape(r["name"]), f"[{colour[r['status']]}]{r['status']}[/]",
                      f"{r['seconds']:.1f}" if "seconds" in r else "", escape(r["detail"]))
    Console(width=160, file=file).print(table)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="checks: " + ", ".join(CHECK_NAMES))
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="write the results here (default on a GPU:"
                             " bench/results/gpu-<gpu>-<date>.json; otherwise nowhere)")
    parser.add_argument("--rehearse-cpu", action="store_true",
                        help="run the checks on the CPU device with a tiny model (labelled a"
                             " rehearsal; a GPU here is not used)")
    parser.add_argument("--only", metavar="NAMES", default="",
                        help="comma-separated checks to run (the others are SKIPPED)")
    parser.add_argument("--logs", type=Path, metavar="DIR",
                        help="copy the broker's and providers' logs here at the end")
    parser.add_argument("--merge", action="store_true",
                        help="keep, from the results file already there (same GPU), the"
                             " checks not run now: a run split over several calls with --only"
                             " ends as one file")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary directory (models, work dirs) and say where")
    parser.add_argument("--deadline", type=float, metavar="SECONDS",
                        help="each check's deadline: it ends there as FAIL \"deadline\","
                             " naming what it waited for (default 280; 900 in the CPU"
                             " rehearsal)")
    args = parser.parse_args(argv)
    if args.deadline is not None and not 10 <= args.deadline <= 3600:
        raise Usage(f"--deadline {args.deadline:g}: give 10 to 3600 seconds")
    only = [n for n in args.only.split(",") if n]
    unknown = [n for n in only if n not in CHECK_NAMES]
    if unknown:
        raise Usage(f"unknown check {unknown[0]!r}; checks: {', '.join(CHECK_NAMES)}")
    args.names = [n for n in CHECK_NAMES if n in only] if only else list(CHECK_NAMES)
    if args.json is not None and args.json.is_dir():
        raise Usage(f"--json {args.json}: is a directory; give a file path")
    return args


def earlier_checks(path: Path | None, gpu: str | None, mode: str) -> dict[str, dict]:
    """Every check in the results file at ``path``, by name, if it is of the same GPU and
    mode, each marked ``earlier_run``; {} otherwise. SKIPPED ones are kept with their
    reasons (vLLM not installed is worth keeping), except those the earlier run itself only
    left out ("not asked for", "not run yet")."""
    try:
        old = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(old, dict) or old.get("gpu") != gpu or old.get("mode") != mode:
        return {}
    return {c["name"]: {**c, "earlier_run": True} for c in old.get("checks", [])
            if isinstance(c, dict) and c.get("name") in CHECK_NAMES
            and not (c.get("status") == "SKIPPED" and c.get("detail", "").startswith(
                (NOT_ASKED, NOT_RUN_YET)))}


NOT_ASKED = "not asked for (--only)"
NOT_RUN_YET = "not run yet (the run was cut short)"


def merged_checks(records: list[dict], earlier: dict[str, dict], asked: list[str]
                  ) -> list[dict]:
    """Every check once, in CHECK_NAMES' order: those run now (``records``), then, for the
    ones not asked for now, an earlier run's (``earlier``), else SKIPPED "not asked for";
    a check asked for that has no record yet is SKIPPED "not run yet"."""
    run = {r["name"]: r for r in records}
    out = []
    for name in CHECK_NAMES:
        if name in run:
            out.append(run[name])
        elif name not in asked and name in earlier:
            out.append(earlier[name])
        else:
            out.append({"name": name, "status": "SKIPPED",
                        "detail": NOT_ASKED if name not in asked else NOT_RUN_YET})
    return out


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        devices, why = ([], "CPU rehearsal asked for") if args.rehearse_cpu else find_gpus()
        if args.rehearse_cpu:
            installed()
    except Usage as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return 2
    date = datetime.now(UTC).strftime("%Y-%m-%d")
    if not devices and not args.rehearse_cpu:
        print(f"gpu-check: no NVIDIA GPU here ({why}): every check SKIPPED", flush=True)
        if args.json is not None:
            write_json(args.json, {
                "gpu": None, "date": date, "mode": "no-gpu", "reason": why,
                "software": software(),
                "checks": [{"name": n, "status": "SKIPPED", "detail": f"no NVIDIA GPU ({why})"}
                           for n in CHECK_NAMES]})
        return 0
    cuda = bool(devices)
    mode = "cuda" if cuda else "cpu-rehearsal"
    gpu = devices[0].name if cuda else None
    title = (f"gpu-check on {len(devices)} x {gpu}" if cuda
             else "gpu-check: CPU REHEARSAL (no GPU used; not GPU results)")
    print(title, flush=True)
    root = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    root.chmod(0o755)      # the jobs' own uids pass through to the models and work dirs
    ctx = Context(cuda, devices, root)

    def stop(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):   # SIGINT too where a shell ignored it
        signal.signal(sig, stop)
    records: list[dict] = []
    began = time.perf_counter()
    path = args.json
    if path is None and cuda:
        path = ROOT / "bench" / "results" / f"gpu-{slug(gpu)}-{date}.json"

    earlier = earlier_checks(path, gpu, mode) if args.merge else {}

    def report(complete: bool) -> dict:
        checks = merged_checks(records, earlier, args.names)
        return {"gpu": gpu, "date": date, "mode": mode, "complete": complete,
                "devices": [dataclasses.asdict(d) for d in devices],
                "software": software(), "seconds": round(time.perf_counter() - began, 1),
                "checks": checks,
                "figures": {r["name"]: {k: v for k, v in r.items()
                                        if k not in ("name", "status", "detail")}
                            for r in checks if r["status"] != "SKIPPED"}}

    def save() -> None:
        if path is not None:
            write_json(path, report(False))

    interrupted = False
    try:
        from gpu_market import CHECK_DEADLINE_S, REHEARSAL_DEADLINE_S

        run_checks(ctx, args.names, records, save, args.deadline
                   or (CHECK_DEADLINE_S if cuda else REHEARSAL_DEADLINE_S))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):     # the clean-up is not interrupted
            signal.signal(sig, signal.SIG_IGN)
        ctx.close(args.logs)
        if args.keep:
            print(f"gpu-check: kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    final = report(not interrupted)
    summary_table(final["checks"], title)
    if path is not None:
        write_json(path, final)
        print(f"gpu-check: results written to {path}", flush=True)
    if interrupted:
        print("gpu-check: interrupted", file=sys.stderr)
        return 130
    return 1 if any(r["status"] == "FAIL" for r in final["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
