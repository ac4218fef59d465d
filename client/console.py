"""What every client command shares: the consoles, the client's key, the async-command
wrapper (one line on stderr for a GpumarketError), JSON output, times, and the process's exit."""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import json
import logging
import os
import sys
from pathlib import Path

import click
from rich.console import Console

from gpumarket.proto.errors import GpumarketError
from gpumarket.proto.identity import Identity, home_dir

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def key_path() -> Path:
    return home_dir() / "client.key"


def load_identity() -> Identity:
    path = key_path()
    if not path.exists():
        raise click.ClickException(f"no client key at {path}; run `gpumarket keys init` first")
    return Identity.load(path)


def command(fn):
    """Run an async command; a GpumarketError becomes one line on stderr and exit 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return asyncio.run(fn(*args, **kwargs))
        except GpumarketError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            sys.exit(130)

    return wrapper


def leave(code: int | str | None) -> None:
    """End the ``gpumarket`` process with ``code`` (a SystemExit's). Where a command talked
    to a broker (grpc imported), its output is flushed and the process ends at once: the
    interpreter's finalization of grpc and the client's modules took 50-190 ms after the
    last line (against 4-9 ms without it), on the clock of every `submit --watch` and
    `watch` that waits for a job's end. Elsewhere (``--help``, ``keys init``, a caller
    that imports ``main``) it is an ordinary SystemExit."""
    if "grpc" not in sys.modules or not (code is None or isinstance(code, int)):
        raise SystemExit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed pipe (`| head`): nothing more to say
            pass
    os._exit(code or 0)


def dump(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True))


def clock(ms: int) -> str:
    """A time of day for tables ("-" for none)."""
    if not ms:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000).strftime("%H:%M:%S")
