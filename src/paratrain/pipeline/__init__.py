"""Model parallelism: a model cut into stages, run over processes (or local devices) with micro-batches.

    import paratrain, torch
    from paratrain.pipeline import PipelineConfig, pipeline_for

    ctx = paratrain.init()
    model = torch.nn.Sequential(...)                  # the same blocks, the same seed, on every rank
    config = PipelineConfig(stages=2, micro_batches=4, schedule="1f1b")
    pipe = pipeline_for(model, config, loss_fn=torch.nn.functional.mse_loss, sample_input=x[:8])
    opt = torch.optim.SGD(pipe.module.parameters(), lr=0.1)   # this stage's parameters only
    for x, y in batches:                              # each replica its own batches
        opt.zero_grad()
        loss = pipe.step(x, y)                        # first stage uses x, last uses y; others ignore
        opt.step()
        if pipe.is_last_stage: print(loss.item(), pipe.bubble_fraction)

Public API
- `PipelineConfig(stages, micro_batches, schedule="1f1b"|"gpipe", split_points=None, engine="paratrain"
  |"torch", replica_sync="allreduce"|"ps", profile_repeats=3)`: frozen, validated.
  A training Strategy becomes one in train/strategy.py (`pipeline_config(strategy, **overrides)`).
  engine="torch" needs equal micro-batches and the same batch size every step (torch_engine.py).
- `pipeline_for(model, config, *, loss_fn, sample_input=None, ctx=None, device="cpu") -> StagePipeline`:
  in a job of W workers, W = stages x replicas; rank q runs stage q % stages of replica q // stages
  (mesh.py). Alone (one worker) the stages are placed on local devices in this process
  (`LocalPipeline`); with stages=1 it is the whole model. The same script runs either way.
- `StagePipeline`: `.module` (this stage's nn.Module), `.step(inputs, targets) -> loss | None` (one
  global batch: gradients of the batch's mean loss added into .grad, averaged over the stage's
  replicas; the batch's mean loss returned on the last stage), `.sync_gradients()` (done by step),
  `.bubble_fraction` and `.last_stats` (StepStats of the last step), `.stage`, `.num_stages`,
  `.replica`, `.replicas`, `.is_first_stage`, `.is_last_stage`.
- `split_model(model, stages, *, sample_input=None, split_points=None) -> Split` (`.stages`: block
  indices per stage; `.stage_times_s`): explicit points or balanced on measured forward+backward
  time; prints the split. `stage_module(blocks, indices)` builds one stage.
- `place_on_devices(stages, devices) -> nn.Module`: model parallel inside one process.
- Schedules as data: `gpipe(p, m)`, `one_f_one_b(p, m)`, `build_schedule(name, p, m)` return per stage
  its list of `Action`s ("F"/"B", micro_batch); `check_schedule`, `simulate`, `peak_in_flight`,
  `ideal_bubble(p, m)` = (p-1)/(m+p-1).
- Errors: `PipelineError` (a stage failed; names stage, rank, step and action). Bad input: ValueError.

A loss_fn must return the mean loss of the micro-batch it is given (like the default reduction of
torch's losses): each micro-batch's loss is weighted by its share of the batch, which makes the
pipelined gradient equal to the full batch's.
"""

from __future__ import annotations

from paratrain.pipeline.api import (
    ENGINES,
    REPLICA_SYNCS,
    SCHEDULES,
    PipelineConfig,
    PipelineError,
    StagePipeline,
    StepStats,
)
from paratrain.pipeline.local import LocalPipeline, local_devices, place_on_devices
from paratrain.pipeline.mesh import MeshLayout, pipeline_for
from paratrain.pipeline.schedule import (
    Action,
    build_schedule,
    check_schedule,
    format_schedule,
    gpipe,
    ideal_bubble,
    one_f_one_b,
    peak_in_flight,
    simulate,
)
from paratrain.pipeline.split import Split, as_blocks, balance, split_model, stage_module

__all__ = [
    "ENGINES",
    "REPLICA_SYNCS",
    "SCHEDULES",
    "Action",
    "LocalPipeline",
    "MeshLayout",
    "PipelineConfig",
    "PipelineError",
    "Split",
    "StagePipeline",
    "StepStats",
    "as_blocks",
    "balance",
    "build_schedule",
    "check_schedule",
    "format_schedule",
    "gpipe",
    "ideal_bubble",
    "local_devices",
    "one_f_one_b",
    "peak_in_flight",
    "pipeline_for",
    "place_on_devices",
    "simulate",
    "split_model",
    "stage_module",
]
