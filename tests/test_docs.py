"""Every CLI command has --help; the committed protocol code matches the .proto files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_units_verify(tmp_path):
    """The units in deploy/ pass `systemd-analyze verify` (with ExecStart pointed at this
    environment's scripts, since /opt/gpumarket does not exist here)."""
    units = sorted((ROOT / "deploy").glob("*.service"))
    assert [u.name for u in units] == ["gpumarket-broker.service",
                                       "gpumarket-provider-isolated.service",
                                       "gpumarket-provider.service"]
    # The isolated provider runs as root with a delegated cgroup (the job sandbox needs it);
    # the others run unprivileged and hardened.
    settings = {"gpumarket-provider-isolated.service": ("User=root", "Delegate=yes",
                                                        "Restart=on-failure", "UMask=0077",
                                                        "StateDirectoryMode=0700")}
    for unit in units:
        text = unit.read_text().replace("/opt/gpumarket/venv/bin", str(Path(sys.executable).parent))
        (tmp_path / unit.name).write_text(text)
        for setting in settings.get(unit.name, ("NoNewPrivileges=true", "ProtectSystem=strict",
                                                "Restart=on-failure", "User=gpumarket")):
            assert setting in text, (unit.name, setting)
    r = subprocess.run(["systemd-analyze", "verify", *map(str, tmp_path.glob("*.service"))],
                       capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


def test_broker_example_config_loads(tmp_path):
    from gpumarket.broker.config import EXAMPLE, load

    path = tmp_path / "broker.toml"
    path.write_text(EXAMPLE)
    settings = load(path)
    assert settings["operators"] == () and settings["http"] == "127.0.0.1:7071"
