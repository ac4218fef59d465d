"""gpumarket: submit signed jobs to a GPU marketplace, watch them, and fetch their results
(receipt signature and hashes checked).

Exit codes: 0 ok; 1 error (bad input, broker unreachable, refused); 2 usage;
3 the job FAILED; 4 the job was CANCELLED (watch and submit --watch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from gpumarket.client import endpoints, jobs, money, offers, results, submit, tasks
from gpumarket.client.console import key_path, leave, load_identity

if TYPE_CHECKING:   # imported where a command talks to a broker: --help needs no grpc
    from gpumarket.link.client import Broker


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--broker", envvar="GPUMARKET_BROKER", default="127.0.0.1:7070",
              show_default=True, help="Broker address HOST:PORT, TLS (or $GPUMARKET_BROKER); "
              "plaintext://HOST:PORT for a plaintext broker on loopback; the brokers of one "
              "market as HOST:PORT,HOST:PORT (the next is used when one is unreachable).")
@click.option("--broker-key", envvar="GPUMARKET_BROKER_KEY", default="",
              help="The broker's key id to accept (or $GPUMARKET_BROKER_KEY); without it the "
              "key seen first is trusted and remembered in known_brokers, like SSH.")
@click.pass_context
def cli(ctx: click.Context, broker: str, broker_key: str) -> None:
    """gpumarket client: submit signed jobs to a GPU marketplace, watch them, and download
    their results (the provider's signed receipt and every hash checked).

    Exit codes: 0 ok, 1 error, 2 usage, 3 job failed, 4 job cancelled, 5 job paused (its
    hold is spent: `gpumarket topup`).
    """
    ctx.obj = _BrokerOnUse(broker, broker_key)


class _BrokerOnUse:
    """The commands' Broker, made when one first uses it: click runs the group's callback
    before a command reads its own --help, which then imports no grpc."""

    def __init__(self, address: str, pin: str) -> None:
        self._made: Broker | None = None
        self._args = (address, pin)

    def __getattr__(self, name: str):
        if self._made is None:
            from gpumarket.link.channel import Trust
            from gpumarket.link.client import Broker
            from gpumarket.proto.identity import home_dir

            address, pin = self._args
            self._made = Broker(address, Trust(pin=pin, known=home_dir() / "known_brokers"))
        return getattr(self._made, name)


# -- keys ---------------------------------------------------------------------------------

@cli.group()
def keys() -> None:
    """Manage this client's signing key ($GPUMARKET_HOME/client.key)."""


@keys.command("init")
def keys_init() -> None:
    """Create the client's Ed25519 key (mode 0600) if there is none; print its id."""
    from gpumarket.proto.identity import Identity

    path = key_path()
    if path.exists():
        identity = load_identity()
        click.echo(f"key already exists: {path}")
    else:
        identity = Identity.generate()
        identity.save(path)
        click.echo(f"created key {path}")
    click.echo(f"client id: {identity.id}")


@keys.command("show")
def keys_show() -> None:
    """Print this client's id and key file."""
    identity = load_identity()
    click.echo(f"client id: {identity.id}\nkey file:  {key_path()}")


# The commands, by what they are about: submitting a job (submit), your jobs (jobs), their
# results (results), the market's offers (offers), money (money), endpoints, array tasks.
for _module in (submit, jobs, results, offers, money):
    for _command in _module.COMMANDS:
        cli.add_command(_command)
cli.add_command(endpoints.endpoint)
cli.add_command(tasks.tasks_command)
cli.add_command(tasks.resubmit_command)


def main() -> None:
    """The ``gpumarket`` program. Plugin kinds are loaded as a command runs
    (console.command), not here: --help and keys need none."""
    try:
        cli(prog_name="gpumarket")
    except SystemExit as exc:
        leave(exc.code)
