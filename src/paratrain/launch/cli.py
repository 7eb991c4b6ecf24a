"""The `paratrain` command.

    paratrain launch [--backend local|ray|slurm|k8s] -w 4 -s 2 [--strategy NAME] [engine options]
                     [--] train.py [args...]

The same flags start the same job on every engine; each engine adds what it needs (`--address` for
Ray, `--partition`/`--time`/`--nodes` for Slurm, `--image`/`--namespace` for Kubernetes, `--dry-run`
to print what Slurm or Kubernetes would be given). Everything after the script is passed to it
unparsed, options included. The command exits with the job's exit status: 0 when every worker
succeeded, 130 when interrupted, 1 otherwise (for a submitted Slurm or Kubernetes job: whether it
was submitted).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import click

from paratrain import __version__
from paratrain.launch.api import BACKENDS, LaunchConfig
from paratrain.launch.observe_cli import dashboard_config, observe_env, observe_options, trace


@click.group()
@click.version_option(__version__, prog_name="paratrain")
def main() -> None:
    """paratrain: distributed training for PyTorch."""


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--backend",
    type=click.Choice(BACKENDS),
    default="local",
    show_default=True,
    help="Where the processes run: this machine, a Ray cluster, Slurm (sbatch) or Kubernetes.",
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
    help="local: the address every process binds and advertises.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Stop the whole job after this many seconds.",
)
@click.option("--address", default="auto", show_default=True, help="ray: the Ray cluster to run on.")
@click.option("--partition", default=None, help="slurm: the partition to submit to.")
@click.option("--time", "time_limit", default=None, help="slurm: the job's time limit (sbatch --time).")
@click.option("--nodes", type=click.IntRange(min=1), default=None, help="slurm: number of nodes.")
@click.option("--image", default=None, help="k8s: the container image every pod runs.")
@click.option("--namespace", default="default", show_default=True, help="k8s: the namespace.")
@click.option(
    "--cpus-per-worker",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="ray, slurm, k8s: CPUs reserved for each worker.",
)
@click.option(
    "--cpus-per-server",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="ray, slurm, k8s: CPUs reserved for each server.",
)
@click.option(
    "--gpus-per-worker",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="ray, slurm, k8s: GPUs reserved for each worker.",
)
@click.option("--dry-run", is_flag=True, help="slurm, k8s: print the sbatch script or manifests only.")
@observe_options
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def launch(
    ctx: click.Context,
    backend: str,
    workers: int,
    servers: int,
    strategy: str | None,
    host: str,
    timeout_s: float | None,
    address: str,
    partition: str | None,
    time_limit: str | None,
    nodes: int | None,
    image: str | None,
    namespace: str,
    cpus_per_worker: float,
    cpus_per_server: float,
    gpus_per_worker: int,
    dry_run: bool,
    script: str,
    script_args: tuple[str, ...],
    **observe: Any,
) -> None:
    """Run SCRIPT as a scheduler, SERVERS servers and WORKERS workers."""
    logging.basicConfig(level=logging.INFO, format="paratrain: %(message)s")
    if backend != "k8s" and not os.path.isfile(script):  # under k8s the script is in the image
        raise click.BadParameter(f"{script!r} is not a file", param_hint="'SCRIPT'")
    try:
        config = LaunchConfig(
            script=script,
            args=script_args,
            num_workers=workers,
            num_servers=servers,
            strategy=strategy,
            timeout_s=timeout_s,
            env=observe_env(observe, local=backend == "local"),
        )
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc)) from None
    resources = {
        "cpus_per_worker": cpus_per_worker,
        "cpus_per_server": cpus_per_server,
        "gpus_per_worker": gpus_per_worker,
    }
    if backend == "local":
        from paratrain.launch.local import run_launch

        ctx.exit(run_launch(config, host=host, dashboard=dashboard_config(observe)))
    if backend == "ray":
        from paratrain.launch.ray import RayOptions, run_ray_job

        ctx.exit(run_ray_job(config, RayOptions(address=address, **resources)))
    if backend == "slurm":
        from paratrain.launch.slurm import SlurmOptions, run_slurm_job

        slurm = SlurmOptions(partition=partition, time=time_limit, nodes=nodes, dry_run=dry_run, **resources)
        ctx.exit(run_slurm_job(config, slurm))
    from paratrain.launch.k8s import K8sOptions, run_k8s_job

    if image is None and not dry_run:
        raise click.UsageError("--backend k8s needs --image (the container image every pod runs)")
    options = K8sOptions(image=image or "IMAGE", namespace=namespace, dry_run=dry_run, **resources)
    ctx.exit(run_k8s_job(config, options))


main.add_command(trace)
