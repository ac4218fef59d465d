"""What every client command shares: the consoles, the client's key, the async-command
wrapper (plugin kinds loaded; one line on stderr for a GpumarketError), JSON output, times,
and the process's exit.

Every ``gpumarket`` process imports this and every command's module (its --help lists
them all), so their top levels import only click and what the commands' options need; the
rest (rich, asyncio, cryptography, grpc, the job kinds) is imported where a command uses it.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gpumarket.proto.errors import GpumarketError

if TYPE_CHECKING:
    from rich.console import Console

    from gpumarket.proto.identity import Identity


class ConsoleOnUse:
    """A rich Console made when a command first prints through it: importing rich took
    ~20 ms, which --help, --json and plain-text commands need not pay."""

    def __init__(self, stderr: bool) -> None:
        self._stderr = stderr
        self._made: Console | None = None

    @property
    def rich(self) -> Console:
        if self._made is None:
            from rich.console import Console

            self._made = Console(stderr=self._stderr, highlight=False, soft_wrap=True)
        return self._made

    def print(self, *objects, **kwargs) -> None:
        self.rich.print(*objects, **kwargs)


out = ConsoleOnUse(stderr=False)
err = ConsoleOnUse(stderr=True)


def key_path() -> Path:
    from gpumarket.proto.identity import home_dir

    return home_dir() / "client.key"


def load_identity() -> Identity:
    from gpumarket.proto.identity import Identity

    path = key_path()
    if not path.exists():
        raise click.ClickException(f"no client key at {path}; run `gpumarket keys init` first")
    return Identity.load(path)


def load_plugin_kinds() -> None:
    """Register the plugin kinds ($GPUMARKET_KINDS, installed ``gpumarket.kinds`` entry
    points; gpumarket.kinds.load_plugins) before a command runs, so that it knows their
    names. Where there are none, the kinds are not imported here: a command that reads a
    job file imports them itself. Raises InvalidArgument for a module that cannot be
    imported or has no KIND."""
    from importlib.metadata import entry_points

    modules = os.environ.get("GPUMARKET_KINDS", "")
    if modules.strip() or entry_points(group="gpumarket.kinds"):
        from gpumarket import kinds

        kinds.load_plugins(modules)


def command(fn):
    """Run an async command, the plugin kinds loaded first (load_plugin_kinds); a
    GpumarketError becomes one line on stderr and exit 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import asyncio

        try:
            load_plugin_kinds()
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
    import logging      # imported already (grpc imports it): what exit would have run

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
