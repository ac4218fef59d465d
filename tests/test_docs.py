"""Every CLI command has --help; the committed protocol code matches the .proto files."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from gpumarket.broker.cli import cli as broker_cli
from gpumarket.client.cli import cli as client_cli
from gpumarket.provider.cli import cli as provider_cli
from tests.helpers import ROOT


def commands(group: click.Group, prefix=()):
    yield prefix
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name)


ALL = [(cli, path) for cli in (client_cli, broker_cli, provider_cli) for path in commands(cli)]


@pytest.mark.parametrize("cli,path", ALL, ids=[f"{c.name}:{' '.join(p)}" for c, p in ALL])
def test_every_command_has_help(cli, path):
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    cmd = cli
    for name in path:
        cmd = cmd.commands[name]
    assert cmd.help and len(cmd.help.strip()) > 20, f"{path} needs real help text"


def test_generated_protocol_code_has_not_drifted():
    r = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
