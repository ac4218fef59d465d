"""Runs a ``script`` job: the client's own Python entry point, as ``__main__``, with its
arguments, in the job's sandbox (the provider started this process there). Its code comes
as an input: one .py file, or a tar of a directory unpacked beside it. It talks to the
provider through ``gpumarket.provider.runners.task``.

    python -m gpumarket.provider.runners.script WORKDIR
"""

from __future__ import annotations

import shutil
import sys
import tarfile
import traceback
import types
from pathlib import Path
from types import CodeType

from gpumarket.provider.runners import task
from gpumarket.provider.runners.base import JobError, listen_for_drain, read_job, run_main
from gpumarket.provider.runners.report import Reporter


def unpack(code: Path, target: Path, entry: str) -> Path:
    """The code in ``target``; returns the entry point's path (JobError if it is missing)."""
    target.mkdir(exist_ok=True)
    if tarfile.is_tarfile(code):
        try:
            with tarfile.open(code) as tar:
                tar.extractall(target, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise JobError(f"script.code: cannot unpack ({exc})") from exc
    else:
        shutil.copyfile(code, target / entry)
    path = target / entry
    if not path.is_file():
        raise JobError(f"script.entry: {entry!r} is not in the code")
    return path


# The code unpacked by this process, by (input, entry): the tasks of an array's lease (one
# client's, one array's, in one process) share the first task's copy instead of each
# unpacking its own, and its entry point compiled once (runpy.run_path read, looked for
# importers and compiled it again for every task: a sixth of a short task's time).
_unpacked: dict[tuple[str, str], Path] = {}
_compiled: dict[Path, CodeType] = {}


def run_entry(entry: Path) -> None:
    """Run the entry point as ``__main__``, as runpy.run_path runs a script file (its own
    globals, a module of its own as ``sys.modules["__main__"]`` meanwhile)."""
    code = _compiled.get(entry)
    if code is None:
        code = _compiled[entry] = compile(entry.read_bytes(), str(entry), "exec")
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=str(entry), __cached__=None, __loader__=None,
                           __package__="", __spec__=None)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)  # noqa: S102 (the job's own script, as runpy ran it)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def run(workdir: Path, reporter: Reporter) -> None:
    listen_for_drain()
    job = read_job(workdir)
    params = job.params
    key = (job.inputs[params["code"]], params["entry"])
    entry = _unpacked.get(key)
    if entry is None or not entry.is_file():
        entry = _unpacked[key] = unpack(Path(key[0]), workdir / "code", params["entry"])
    task._start(job, workdir, reporter)
    argv, path = sys.argv, list(sys.path)
    sys.argv = [str(entry), *params["args"]]
    sys.path.insert(0, str(entry.parent))
    try:
        run_entry(entry)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise JobError(f"the script exited with {exc.code}") from exc
    except Exception as exc:
        traceback.print_exc()
        raise JobError(f"the script raised {type(exc).__name__}: {str(exc)[:300]}") from exc
    finally:
        sys.argv, sys.path[:] = argv, path
    if task._need().get("drained"):
        return          # it checkpointed and stopped on the drain request (task.checkpoint)
    reporter.done(**task._need()["metrics"])


def warm_up() -> None:
    """A script may import torch: the forkserver imports it once for every job. And what
    the runner itself reads job.json with (the kinds, 0.4-0.6 s of imports on a loaded
    machine), which each of its children imported again before its first task."""
    import torch  # noqa: F401
    from gpumarket.kinds import runner_job  # noqa: F401


def main() -> int:
    return run_main("script", run)


if __name__ == "__main__":
    sys.exit(main())
