"""The `paratrain` command.

    paratrain launch -w 4 -s 2 [--strategy NAME] [--host H] [--timeout SECONDS] [--] train.py [args...]

Everything after the script is passed to it unparsed, options included. The command exits with
the job's exit status: 0 when every worker succeeded, 130 when interrupted, 1 otherwise.
"""

from __future__ import annotations

import logging

import click

from paratrain import __version__
from paratrain.launch.local import LocalJobConfig, run_local_job


@click.group()
@click.version_option(__version__, prog_name="paratrain")
def main() -> None:
    """paratrain: distributed training for PyTorch."""


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "-w",
    "--workers",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Number of worker processes.",
)
@click.option(
    "-s",
    "--servers",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Number of server processes (0: no servers, e.g. a collective job).",
)
@click.option(
    "--strategy",
    default=None,
    help="The Trainer's strategy for this job (PARATRAIN_STRATEGY): dist_sync, dist_async, collective, "
    "hybrid, ... with optional settings, e.g. 'collective:accumulation_steps=4'. Default: dist_sync with "
    "servers, collective without.",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address every process binds and advertises.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Stop the whole job after this many seconds.",
)
@click.argument("script", type=click.Path(exists=True, dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def launch(
    ctx: click.Context,
    workers: int,
    servers: int,
    strategy: str | None,
    host: str,
    timeout_s: float | None,
    script: str,
    script_args: tuple[str, ...],
) -> None:
    """Run SCRIPT as a scheduler, SERVERS servers and WORKERS workers on this machine."""
    logging.basicConfig(level=logging.INFO, format="paratrain: %(message)s")
    config = LocalJobConfig(
        script=script,
        args=script_args,
        num_workers=workers,
        num_servers=servers,
        host=host,
        timeout_s=timeout_s,
        env={"PARATRAIN_STRATEGY": strategy} if strategy else {},
    )
    ctx.exit(run_local_job(config).exit_code)
