"""`paratrain serve` and `paratrain export` (registered on the `paratrain` group by launch/cli.py).

paratrain serve --model MODULE:FACTORY [--input x:float32:3x32x32] [--max-batch 32]
                [--batch-wait-ms 5] [--stages P [--split-points 2,4]] [--join] SOURCE
paratrain export CHECKPOINT out.safetensors
"""

from __future__ import annotations

import logging

import click

from paratrain.errors import ParatrainError


def _check_extra(command: str) -> None:
    """A clear error naming the extra when the serving stack is not installed."""
    import importlib.util

    for package in ("starlette", "uvicorn", "prometheus_client", "safetensors"):
        if importlib.util.find_spec(package) is None:
            raise click.ClickException(
                f"{command} needs {package}, which is not installed: pip install 'paratrain[serve]'"
            )


def _source(path: str) -> str:
    """A checkpoint, a checkpoint root, a .safetensors file, or a job's output folder: its
    checkpoints/ (as `paratrain checkpoints` and load_latest read it)."""
    from paratrain.checkpoint.reader import checkpoint_root

    return str(checkpoint_root(path))


def _inputs(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple:
    from paratrain.serve.api import InputSpec

    try:
        return tuple(InputSpec.parse(v) for v in values)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _points(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(p) for p in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r} must be comma-separated ints, e.g. 2,4") from None


@click.command()
@click.option(
    "--model", "model_spec", required=True, help="MODULE:FACTORY or FILE.py:FACTORY building the model."
)
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to listen on.")
@click.option(
    "--model-name",
    default="model",
    show_default=True,
    help="The model's name in the Open Inference Protocol's routes: POST /v2/models/NAME/infer.",
)
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0: a free port."
)
@click.option(
    "--input",
    "inputs",
    multiple=True,
    callback=_inputs,
    help="NAME:DTYPE:SHAPE of one row, e.g. "
    "x:float32:3x32x32 (repeat per input; 'inputs' is the one positional input). Checked on "
    "every request.",
)
@click.option(
    "--max-batch",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Most rows run as one batch (1: batching off).",
)
@click.option(
    "--batch-wait-ms",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="How long a batch's first request waits for others.",
)
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=16 << 20, show_default=True)
@click.option("--max-request-rows", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option(
    "--reload-interval",
    "reload_interval_s",
    type=click.FloatRange(min=0),
    default=2.0,
    show_default=True,
    help="Seconds between checks of an output folder for a newer checkpoint (0: off).",
)
@click.option(
    "--stages",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Cut an nn.Sequential into this many stages, each in its own process.",
)
@click.option(
    "--split-points",
    callback=_points,
    default=None,
    help="First block of every stage but the first, e.g. 2,4 (default: balanced by measured time).",
)
@click.option(
    "--micro-batch",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="With --stages: rows per micro-batch in flight.",
)
@click.option(
    "--join",
    is_flag=True,
    help="Read DistributedEmbedding tables from the running job whose "
    "PARATRAIN_SCHEDULER and PARATRAIN_SECRET(_FILE) are in the environment (read-only).",
)
@click.option(
    "--cache-rows",
    type=click.IntRange(min=0),
    default=100_000,
    show_default=True,
    help="With --join: rows kept per table (0: no cache).",
)
@click.option(
    "--cache-ttl",
    "cache_ttl_s",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="With --join: seconds a cached row is served before it is pulled again.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="torch intra-op threads for batches of 8 rows or more (default torch's: the machine's cores); "
    "smaller batches run on one.",
)
@click.option(
    "--channels-last/--no-channels-last",
    default=True,
    show_default=True,
    help="Run a model with 2-D convolutions channels-last (NHWC: oneDNN's fast path on CPU).",
)
@click.option(
    "--http",
    "parser",
    type=click.Choice(["auto", "httptools", "h11"]),
    default="auto",
    show_default=True,
    help="The HTTP parser: httptools (fast, in uvicorn[standard]), h11 (pure Python), or auto "
    "(httptools where installed).",
)
@click.argument("source", type=click.Path(exists=True))
def serve(
    model_spec: str,
    host: str,
    model_name: str,
    port: int,
    inputs: tuple,
    max_batch: int,
    batch_wait_ms: float,
    max_body_bytes: int,
    max_request_rows: int,
    reload_interval_s: float,
    stages: int,
    split_points: tuple[int, ...] | None,
    micro_batch: int,
    join: bool,
    cache_rows: int,
    cache_ttl_s: float,
    threads: int | None,
    channels_last: bool,
    parser: str,
    source: str,
) -> None:
    """Serve the model of SOURCE (a checkpoint; a checkpoint root or a job's output folder: its
    newest checkpoint, reloaded when a newer one appears; or a .safetensors file) over HTTP:
    POST /predict, GET /healthz, GET /metrics, and the Open Inference Protocol (KServe v2) under /v2."""
    import torch

    _check_extra("paratrain serve")
    from paratrain.serve.api import ServeConfig
    from paratrain.serve.http import HttpServer
    from paratrain.serve.model import load_factory
    from paratrain.transport.ports import binding

    logging.basicConfig(level=logging.INFO, format="paratrain serve: %(message)s")
    source = _source(source)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        config = ServeConfig(
            max_batch=max_batch,
            batch_wait_s=batch_wait_ms / 1e3,
            max_body_bytes=max_body_bytes,
            max_request_rows=max_request_rows,
            inputs=inputs,
            model_name=model_name,
            reload_interval_s=reload_interval_s,
            channels_last=channels_last,
        )
        factory = load_factory(model_spec)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        if stages > 1:
            if join:
                raise click.UsageError("--stages and --join cannot be combined")
            from paratrain.serve.stages import StagedModel, staged_app

            staged = StagedModel.start(model_spec, source, stages, split_points, micro_batch, config.inputs)
            app = staged_app(staged, config)
        else:
            from paratrain.serve.service import model_app

            kv = None
            if join:
                from paratrain.serve.remote import join_tables

                kv = join_tables(cache_rows=cache_rows, cache_ttl_s=cache_ttl_s)
            app = model_app(factory, source, config, kv=kv)
        with binding(host, port, "choose another with --port (0: a free one)"):
            server = HttpServer(app, host, port, parser=parser)
    except ParatrainError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"paratrain serve: {model_spec} from {source} on {server.url} (max batch {max_batch}, "
        f"wait {batch_wait_ms} ms{f', {stages} stages' if stages > 1 else ''})",
        err=True,
    )
    server.run()


@click.command()
@click.argument("checkpoint_path", metavar="CHECKPOINT", type=click.Path(exists=True))
@click.argument("out", type=click.Path(dir_okay=False))
def export(checkpoint_path: str, out: str) -> None:
    """Write the model weights of CHECKPOINT (a folder, or the newest of a checkpoint root or a job's
    output folder) to OUT, a
    .safetensors file that loads with no code execution."""
    _check_extra("paratrain export")
    from paratrain.serve.weights import export as export_weights

    try:
        path = export_weights(_source(checkpoint_path), out)
    except (ParatrainError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {path}")
