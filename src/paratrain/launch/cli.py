"""The `paratrain` command.

    paratrain launch [--backend local|ray|slurm|k8s] -w 4 -s 2 [--strategy NAME] [engine options]
                     [--] train.py [args...]

The same flags start the same job on every engine; each engine adds what it needs (`--address` for
Ray, `--partition`/`--time`/`--nodes` for Slurm, `--image`/`--namespace` for Kubernetes, `--dry-run`
to print what Slurm or Kubernetes would be given). Everything after the script is passed to it
unparsed, options included. The command exits with the job's exit status: 0 when every worker
succeeded, 130 when interrupted by SIGINT (Ctrl-C) and 143 by SIGTERM (as a shell reports them), 1
otherwise (for a submitted Slurm or Kubernetes job: whether it was submitted). A strategy that cannot
run fails here, before any process starts (exit 2, naming the setting and the nearest valid one).
"""

from __future__ import annotations

import difflib
import logging
import os
from typing import Any

import click

from paratrain.launch import engines
from paratrain.launch.api import LaunchConfig
from paratrain.launch.engines.api import LaunchArgs
from paratrain.launch.jobs_cli import COMMANDS as JOB_COMMANDS
from paratrain.launch.observe_cli import dashboard_config, observe_env, observe_options, trace
from paratrain.launch.stacks_cli import stacks
from paratrain.transport.ports import PortUnavailable
from paratrain.version import __version__

STRATEGY_VAR = "PARATRAIN_STRATEGY"


@click.group()
@click.version_option(__version__, prog_name="paratrain")
def main() -> None:
    """paratrain: distributed training for PyTorch."""


for _command in JOB_COMMANDS:  # submit, jobs, logs, stop, checkpoints (jobs_cli.py)
    main.add_command(_command)
main.add_command(stacks)


class _LaunchCommand(click.Command):
    """`launch`, whose -m MODULE ends its own options as python's -m does: what follows is the
    module's, options included."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        takes_value = {
            name: not (param.is_flag or param.count)
            for param in self.params
            if isinstance(param, click.Option)
            for name in (*param.opts, *param.secondary_opts)
        }
        i = 0
        while i < len(args) and args[i].startswith("-") and args[i] != "--":
            name = args[i].split("=", 1)[0]
            if name not in takes_value:
                break  # unknown: the script's (or misspelt: said once the script is read)
            if name == "-m" and "=" not in args[i] and i + 1 < len(args):
                args = [*args[: i + 2], "--", *args[i + 2 :]]
                break
            i += 2 if takes_value[name] and "=" not in args[i] else 1
        return super().parse_args(ctx, args)


@main.command(
    cls=_LaunchCommand,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--backend",
    type=engines.EngineChoice(),
    default=engines.DEFAULT,
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
    "--nproc-per-node",
    "--nproc_per_node",
    "nproc_per_node",
    type=click.IntRange(min=1),
    default=None,
    help="torchrun's spelling of -w on one machine.",
)
@click.option(
    "--nnodes",
    default=None,
    help="torchrun's: 1 is accepted; the local engine runs on one machine (see the guide for more).",
)
@click.option(
    "--node-rank", "--node_rank", "node_rank", type=int, default=None, help="torchrun's: 0 is accepted."
)
@click.option(
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "rdzv_endpoint",
    default=None,
    help="torchrun's: not needed on one machine (the launcher picks a free port).",
)
@click.option(
    "-s",
    "--servers",
    type=click.IntRange(min=0),
    default=None,
    help="Number of server processes (0: no servers, e.g. a collective job). Default: 0 for a strategy "
    "that uses none (collective, ddp, fsdp, local), else 1; the first line printed says what was chosen.",
)
@click.option(
    "--strategy",
    default=None,
    help="The Trainer's strategy for this job (PARATRAIN_STRATEGY): dist_sync, dist_async, collective "
    "(or ddp), hybrid, ... with optional settings, e.g. 'collective:accumulation_steps=4'. Default: "
    "dist_sync with servers, collective without.",
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
@click.option(
    "--server-losses",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="local: servers that may die without failing the job, for replicated servers "
    "(JobConfig.replication - 1 in the script).",
)
@click.option(
    "--elastic",
    is_flag=True,
    help="local, ray, slurm: a worker that dies does not stop the job (the script sets "
    "JobConfig.elastic; the scheduler drops it and stops the job below min_workers).",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="local, ray, slurm: start a dead worker process again, up to this many times in all (per worker "
    "task under slurm; implies --elastic); the new process joins the running job. local: with "
    "--server-losses a dead server is restarted too; it rejoins as a backup and catches up. The "
    "scheduler is not restarted.",
)
@click.option("--address", default="auto", show_default=True, help="ray: the Ray cluster to run on.")
@click.option("--partition", default=None, help="slurm: the partition to submit to.")
@click.option("--time", "time_limit", default=None, help="slurm: the job's time limit (sbatch --time).")
@click.option("--nodes", type=click.IntRange(min=1), default=None, help="slurm: number of nodes.")
@click.option("--account", default=None, help="slurm: the account charged (sbatch --account).")
@click.option("--qos", default=None, help="slurm: the quality of service (sbatch --qos).")
@click.option("--constraint", default=None, help="slurm: node features needed (sbatch --constraint).")
@click.option(
    "--sbatch",
    "extra_sbatch",
    multiple=True,
    metavar="--NAME[=VALUE]",
    help="slurm: one more sbatch option, e.g. --sbatch=--mail-type=END (repeatable).",
)
@click.option(
    "--setup",
    multiple=True,
    metavar="COMMAND",
    help="slurm: a shell command run before the tasks start, e.g. 'module load cuda' (repeatable).",
)
@click.option("--image", default=None, help="k8s: the container image every pod runs.")
@click.option("--namespace", default="default", show_default=True, help="k8s: the namespace.")
@click.option(
    "--pod-overrides",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="k8s: a YAML file of pod template fragments merged into the pods: {all|scheduler|server|worker: "
    "{metadata: {labels, annotations}, spec: {nodeSelector, tolerations, ...}}}.",
)
@click.option(
    "--k8s-form",
    type=click.Choice(["jobs", "jobset"]),
    default="jobs",
    show_default=True,
    help="k8s: one indexed Job per role, or the same as one JobSet (jobset.x-k8s.io).",
)
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
    help="GPUs of its own for each worker (servers and the scheduler get none where the engine can say so).",
)
@click.option("--dry-run", is_flag=True, help="slurm, k8s: print the sbatch script or manifests only.")
@click.option(
    "-m",
    "module",
    default=None,
    metavar="MODULE",
    help="Run a module as `python -m MODULE` (from this directory) instead of SCRIPT; "
    "the arguments after it are the module's.",
)
@observe_options
@click.argument("script", type=click.Path(dir_okay=False), required=False)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def launch(
    ctx: click.Context,
    backend: str,
    workers: int,
    nproc_per_node: int | None,
    nnodes: str | None,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    servers: int | None,
    strategy: str | None,
    host: str,
    timeout_s: float | None,
    server_losses: int,
    elastic: bool,
    max_restarts: int,
    address: str,
    partition: str | None,
    time_limit: str | None,
    nodes: int | None,
    account: str | None,
    qos: str | None,
    constraint: str | None,
    extra_sbatch: tuple[str, ...],
    setup: tuple[str, ...],
    image: str | None,
    namespace: str,
    pod_overrides: str | None,
    k8s_form: str,
    cpus_per_worker: float,
    cpus_per_server: float,
    gpus_per_worker: int,
    dry_run: bool,
    module: str | None,
    script: str | None,
    script_args: tuple[str, ...],
    **observe: Any,
) -> None:
    """Run SCRIPT as a scheduler, SERVERS servers and WORKERS workers."""
    logging.basicConfig(level=logging.INFO, format="paratrain: %(message)s")
    if module is not None:  # what click read as the script is the module's first argument
        script_args = (*(() if script is None else (script,)), *script_args)
        script = module
    elif script is None:
        raise click.UsageError("Missing argument 'SCRIPT' (or -m MODULE).")
    elif script.startswith("-"):  # an option this command does not know, read as the script's path
        raise _no_such_option(ctx, script)
    engine = engines.get(backend)
    if module is None and engine.paths_here and not os.path.isfile(script):  # else it is in the image
        raise click.BadParameter(f"{script!r} is not a file", param_hint="'SCRIPT'")
    if (elastic or max_restarts) and not engine.elastic:
        where = ", ".join(engines.names(lambda e: e.elastic))
        raise click.UsageError(f"--elastic and --max-restarts work with --backend {where}; not {backend}")
    workers = _torchrun_workers(ctx, workers, nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    source = "--strategy"
    if strategy is None and os.environ.get(STRATEGY_VAR):
        strategy, source = os.environ[STRATEGY_VAR], f"{STRATEGY_VAR} (from the environment)"
    said = _defaults_line(workers, servers, strategy)
    servers = _default_servers(strategy) if servers is None else servers
    try:
        config = LaunchConfig(
            script=script,
            args=script_args,
            num_workers=workers,
            num_servers=servers,
            strategy=strategy,
            timeout_s=timeout_s,
            env=observe_env(observe, local=engine.binds_dashboard),
            server_losses=server_losses,
            elastic=elastic,
            max_restarts=max_restarts,
            module=module is not None,
        )
    except (ValueError, TypeError) as exc:
        raise click.UsageError(_as_given(str(exc), source)) from None
    if said:
        logging.getLogger(__name__).info("%s", said)
    for warning in config.warnings():
        logging.getLogger(__name__).warning("warning: %s", _as_given(warning, source))
    args = LaunchArgs(
        host=host,
        dashboard=dashboard_config(observe),
        address=address,
        partition=partition,
        time_limit=time_limit,
        nodes=nodes,
        account=account,
        qos=qos,
        constraint=constraint,
        extra_sbatch=extra_sbatch,
        setup=setup,
        image=image,
        namespace=namespace,
        pod_overrides=_read_overrides(pod_overrides),
        k8s_form=k8s_form,
        cpus_per_worker=cpus_per_worker,
        cpus_per_server=cpus_per_server,
        gpus_per_worker=gpus_per_worker,
        dry_run=dry_run,
    )
    try:
        options = engine.options(args)
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc)) from None
    try:
        exit_code = engine.launch(config, options)
    except PortUnavailable as exc:  # --dashboard-port taken: one line, no traceback
        raise click.ClickException(str(exc)) from None
    ctx.exit(exit_code)


def _read_overrides(path: str | None) -> dict[str, Any]:
    """The --pod-overrides file's mapping ({} without one)."""
    if path is None:
        return {}
    import yaml

    try:
        with open(path, encoding="utf-8") as file:
            data = yaml.safe_load(file)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise click.BadParameter(f"{path}: {exc}", param_hint="'--pod-overrides'") from None
    if not isinstance(data, dict):
        what = f"{path} must hold a mapping of role to pod template"
        raise click.BadParameter(what, param_hint="'--pod-overrides'")
    return data


def _default_servers(strategy: str | None) -> int:
    """-s when not given: none for a strategy that uses none, else one (a parameter-server job)."""
    from paratrain.train.strategy import Strategy  # train/ is below launch/; imported late for speed

    try:
        architecture = Strategy.parse(strategy).architecture if strategy else "ps"
    except (ValueError, TypeError):
        return 1  # LaunchConfig names what is wrong with it
    return 0 if architecture in ("collective", "local", "fsdp") else 1


def _defaults_line(workers: int, servers: int | None, strategy: str | None) -> str:
    """What the launch chose for the user, said before anything starts: a torchrun user's
    `paratrain launch -w 4 train.py` is a parameter-server job, and must say so. "" when both the
    servers and the strategy were given."""
    if servers is not None and strategy is not None:
        return ""
    count = servers if servers is not None else _default_servers(strategy)
    job = f"{workers} worker{'s' * (workers != 1)}, {count} server{'s' * (count != 1)}"
    if strategy is not None:
        why = "it uses none; -s N to add servers" if count == 0 else "the default for it; -s N for more"
        return f"{job}, strategy {strategy} ({why})"
    if count:
        hint = "; -s 0 for all-reduce (ddp)" if servers is None else ""
        return f"{job}, strategy dist_sync (the default with servers{hint})"
    return f"{job}, strategy collective (the default without servers: all-reduce, as DDP)"


def _torchrun_workers(
    ctx: click.Context,
    workers: int,
    nproc_per_node: int | None,
    nnodes: str | None,
    node_rank: int | None,
    rdzv_endpoint: str | None,
) -> int:
    """-w, from torchrun's options where they mean the same on one machine; a UsageError saying
    what to use where they ask for more machines."""
    if nnodes not in (None, "1", "1:1") or node_rank not in (None, 0):
        asked = f"--nnodes {nnodes}" if nnodes not in (None, "1", "1:1") else f"--node-rank {node_rank}"
        raise click.UsageError(
            f"{asked}: paratrain launch starts every process itself, from one command on one machine "
            "(--backend local). Across machines: --backend slurm --nodes N, --backend ray or "
            "--backend k8s; or start the script with torchrun itself (paratrain reads its RANK, "
            "WORLD_SIZE and MASTER_ADDR; PARATRAIN_NUM_SERVERS=S makes S of the processes servers)"
        )
    if rdzv_endpoint is not None:
        logging.getLogger(__name__).info(
            "--rdzv-endpoint %s is not needed on one machine: the scheduler listens on a free port",
            rdzv_endpoint,
        )
    if nproc_per_node is None:
        return workers
    given = ctx.get_parameter_source("workers") == click.core.ParameterSource.COMMANDLINE
    if given and workers != nproc_per_node:
        raise click.UsageError(f"-w {workers} and --nproc-per-node {nproc_per_node} disagree: give one")
    return nproc_per_node


def _as_given(message: str, source: str) -> str:
    """LaunchConfig's message about `strategy=...`, naming it as the user gave it: `--strategy 'x'`
    or `PARATRAIN_STRATEGY (from the environment) 'x'`. Other messages are unchanged."""
    return message.replace("strategy=", f"{source} ", 1) if message.startswith("strategy=") else message


def _no_such_option(ctx: click.Context, given: str) -> click.NoSuchOption:
    """Click's own error for an unknown option, with the nearest known one. (The command takes
    unknown options as the script's, so click cannot tell a misspelt launcher option itself.)"""
    name = given.split("=", 1)[0]
    known = [opt for param in ctx.command.params for opt in (*param.opts, *param.secondary_opts)]
    near = difflib.get_close_matches(name, [opt for opt in known if opt.startswith("-")], n=1)
    return click.NoSuchOption(name, possibilities=near, ctx=ctx)


def _add_serving_commands() -> None:
    from paratrain.serve.cli import export, serve

    main.add_command(serve)
    main.add_command(export)


_add_serving_commands()


main.add_command(trace)
