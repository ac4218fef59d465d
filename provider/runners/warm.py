"""A runner started ahead of its job: it imports torch and the kind's runner (transformers
included) while idle, then waits for one job on stdin — so a leased job, and above all a job
resuming after a failover, starts in milliseconds instead of seconds.

    python -m gpumarket.provider.runners.warm RUNNER_MODULE JOBS_DIR

Reads one JSON line ``{"workdir": ..., "env": {...}}``, takes on that environment, work
directory and log, and runs the kind's runner as if started as
``python -m RUNNER_MODULE WORKDIR``. EOF on stdin means "not needed": exit.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

def main() -> int:
    if len(sys.argv) != 3:
        print("usage: python -m gpumarket.provider.runners.warm RUNNER_MODULE JOBS_DIR",
              file=sys.stderr)
        return 2
    module = importlib.import_module(sys.argv[1])
    module.warm_up()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    order = json.loads(line)
    workdir = order["workdir"]
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update(order["env"])
    log = os.open(os.path.join(workdir, "job.log"), os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    if order.get("sandbox"):
        from gpumarket.provider import sandbox

        if not sandbox.enter(order["sandbox"]):
            return 1
    sys.argv = [module.__file__, workdir]
    return module.main()


if __name__ == "__main__":
    sys.exit(main())
