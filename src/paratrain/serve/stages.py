"""A model too big for one process, served as the pipeline cut it: stage i in process i, forward only.

    paratrain serve --model nets:make_model --stages 3 [--split-points 2,5 | --input x:float32:64] ckpt/

The serving process is stage 0 (rank 0); it starts stages 1..P-1 as processes of their own
(`python -m paratrain.serve.stages`), which join it in a Gloo group on 127.0.0.1. Every process
builds the model with the factory, loads the same checkpoint folder and keeps its blocks: the split
is `pipeline.split_model`'s, at the given points or balanced on the measured time of the blocks on a
sample micro-batch (from the declared input), decided by stage 0 and passed to the others.

A batch runs as micro-batches of `micro_batch` rows: stage 0 computes micro-batch k+1 while stage 1
computes k, and so on, with activations sent as the pipeline's training messages are (pipeline/p2p:
a small int64 header, then the tensor; no pickle). The last stage sends outputs back to stage 0,
where a receiver thread hands them to the waiting batch in order. A 0-d tensor travels the ring to
stop every stage. Stages reload nothing: restart to serve a newer checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from starlette.applications import Starlette
from torch import nn

from paratrain import checkpoint
from paratrain.checkpoint.store import META
from paratrain.pipeline import p2p
from paratrain.pipeline.split import as_blocks, split_model, stage_module
from paratrain.serve.api import InputSpec, ServeConfig, ServeError
from paratrain.serve.app import Endpoint, ServeMetrics, build_app
from paratrain.serve.model import build, load_factory
from paratrain.serve.weights import SAFETENSORS_SUFFIX, read_state

logger = logging.getLogger(__name__)

STOP = torch.zeros((), dtype=torch.int32)
"""The message that stops the ring (activations always have a row dimension)."""
TIMEOUT_S = 120.0
MAX_SENDS_IN_FLIGHT = 8


def resolve_source(source: str | Path) -> tuple[Path, int | None]:
    """One fixed checkpoint folder (or safetensors file) for every stage, and its step."""
    path = Path(source)
    if path.suffix == SAFETENSORS_SUFFIX or (path / META).is_file():
        return path, read_state(path)[1] if path.suffix == SAFETENSORS_SUFFIX else checkpoint.load(path).step
    found = checkpoint.load(path)
    return found.path, found.step


def sequential(model: nn.Module) -> nn.Sequential:
    """The factory's model, which a split into stages needs as an nn.Sequential (pipeline/split.py)."""
    if not isinstance(model, nn.Sequential):
        raise ServeError(
            f"--stages needs a model factory returning an nn.Sequential, not {type(model).__name__}"
        )
    return model


def stage_of(factory_spec: str, source: Path, stages: int, points: Sequence[int], rank: int) -> nn.Module:
    """The blocks of stage `rank` of the factory's model with the weights of `source`, in eval mode."""
    model = sequential(build(load_factory(factory_spec)))
    model.load_state_dict(read_state(source)[0])
    split = split_model(model, stages, split_points=points, verbose=False)
    return stage_module(as_blocks(model), split.stages[rank]).eval()


class SendWindow:
    """Sends in flight, waited for oldest first once more than MAX_SENDS_IN_FLIGHT are out."""

    def __init__(self) -> None:
        self.pending: p2p.Pending = []

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        p2p.send_activation(tensor, dst, self.pending)
        while len(self.pending) > 2 * MAX_SENDS_IN_FLIGHT:  # two works per message
            work, _ = self.pending.pop(0)
            if work is not None:
                work.wait()

    def flush(self) -> None:
        p2p.wait_all(self.pending)


class StagedModel:
    """Stage 0 here, stages 1..P-1 in child processes (see the module docstring)."""

    def __init__(
        self,
        stage: nn.Module,
        stages: int,
        procs: list[subprocess.Popen],
        step: int | None,
        source: Path,
        points: tuple[int, ...],
        micro_batch: int,
    ) -> None:
        self.stage, self.stages, self.procs, self.step = stage, stages, procs, step
        self.source, self.points, self.micro_batch = source, points, micro_batch
        self._outputs: queue.Queue = queue.Queue()
        self._window = SendWindow()
        self._closed = False
        self._receiver = threading.Thread(target=self._receive, name="stage-receiver", daemon=True)
        self._receiver.start()

    @classmethod
    def start(
        cls,
        factory_spec: str,
        source: str | Path,
        stages: int,
        split_points: Sequence[int] | None = None,
        micro_batch: int = 8,
        inputs: Sequence[InputSpec] = (),
    ) -> StagedModel:
        path, step = resolve_source(source)
        model = sequential(build(load_factory(factory_spec)))
        model.load_state_dict(read_state(path)[0])
        sample = _sample(inputs, micro_batch) if split_points is None else None
        if split_points is None and sample is None:
            raise ServeError("--stages without --split-points needs one --input to balance the stages on")
        split = split_model(model, stages, sample_input=sample, split_points=split_points, verbose=False)
        points = split.split_points
        port = _free_port()
        procs = [_spawn(factory_spec, path, stages, points, rank, port) for rank in range(1, stages)]
        try:
            _init_group(0, stages, port)
        except Exception as exc:
            for proc in procs:
                proc.kill()
            raise ServeError(f"the stage processes did not join: {exc}") from exc
        stage = stage_module(as_blocks(model), split.stages[0]).eval()
        return cls(stage, stages, procs, step, path, points, micro_batch)

    def run_batch(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int | None]:
        if len(inputs) != 1:
            raise ValueError(f"a staged model takes one input, not {sorted(inputs)}")
        x = next(iter(inputs.values()))
        pieces = torch.split(x, self.micro_batch)
        for piece in pieces:  # the next stages work on piece k while this one computes k + 1
            self._window.send(self.stage(piece), 1)
        outputs = []
        for _ in pieces:
            try:
                out = self._outputs.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise ServeError(
                    f"no output from the last stage within {TIMEOUT_S} s; {self._health()}"
                ) from None
            if isinstance(out, BaseException):
                raise ServeError(f"the stage ring broke: {out}; {self._health()}")
            outputs.append(out)
        return torch.cat(outputs), self.step

    def _receive(self) -> None:
        while True:
            try:
                out = p2p.recv_activation(self.stages - 1, torch.device("cpu"))
            except Exception as exc:  # the group broke (a stage died): fail whoever waits
                if not self._closed:
                    self._outputs.put(exc)
                return
            if out.dim() == 0:
                return
            self._outputs.put(out)

    def _health(self) -> str:
        codes = [(rank + 1, proc.poll()) for rank, proc in enumerate(self.procs)]
        dead = [f"stage {rank} exited with {code}" for rank, code in codes if code is not None]
        return ", ".join(dead) or "every stage process is running"

    @property
    def pids(self) -> list[int]:
        return [os.getpid()] + [proc.pid for proc in self.procs]

    def close(self) -> None:
        """Stop the ring, wait for the stage processes (killed after a grace period)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._window.send(STOP, 1)
            self._window.flush()
            self._receiver.join(30.0)
        except Exception as exc:
            logger.warning("stopping the stages: %s", exc)
        for proc in self.procs:
            try:
                proc.wait(30.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        dist.destroy_process_group()


def staged_app(staged: StagedModel, config: ServeConfig) -> Starlette:
    def info() -> dict:
        return {"stages": staged.stages, "split_points": list(staged.points), "pids": staged.pids}

    endpoint = Endpoint(staged.run_batch, lambda: staged.step, lambda: str(staged.source), staged.close, info)
    app = build_app(endpoint, config, ServeMetrics(config.max_batch))
    app.state.staged = staged
    return app


def _sample(inputs: Sequence[InputSpec], rows: int) -> torch.Tensor | None:
    if len(inputs) != 1:
        return None
    spec = inputs[0]
    if spec.torch_dtype.is_floating_point:
        return torch.randn(rows, *spec.shape, dtype=spec.torch_dtype)
    return torch.zeros(rows, *spec.shape, dtype=spec.torch_dtype)


def _free_port() -> int:
    """A port free on 127.0.0.1 a moment ago, for the stages' Gloo store (stage 0 binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_group(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )


def _spawn(factory_spec: str, source: Path, stages: int, points: Sequence[int], rank: int, port: int):  # noqa: ANN202
    argv = [sys.executable, "-m", "paratrain.serve.stages", factory_spec, str(source)]
    argv += ["--stages", str(stages), "--points", ",".join(map(str, points)), "--rank", str(rank)]
    argv += ["--port", str(port)]
    return subprocess.Popen(argv)


def stage_main(argv: Sequence[str] | None = None) -> int:
    """A stage process: receive, run its blocks, send on, until the STOP message comes."""
    parser = argparse.ArgumentParser(prog="paratrain.serve.stages")
    parser.add_argument("model")
    parser.add_argument("source")
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--points", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"stage {args.rank}: %(message)s")
    points = [int(p) for p in args.points.split(",")]
    stage = stage_of(args.model, Path(args.source), args.stages, points, args.rank)
    _init_group(args.rank, args.stages, args.port)
    window, after = SendWindow(), (args.rank + 1) % args.stages
    with torch.inference_mode():
        while True:
            x = p2p.recv_activation(args.rank - 1, torch.device("cpu"))
            if x.dim() == 0:
                window.send(STOP, after)
                break
            window.send(stage(x), after)
    window.flush()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(stage_main())
