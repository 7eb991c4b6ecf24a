"""Trainer parity job: a strategy's parameters against a reference computed in this process.

argv: strategy steps [options]   options: compile, tol=X, ckpt=DIR, stop=N (checkpoint every step,
stop after step N: the next run with the same ckpt resumes), loss=mse|ce, delay=S (sleep S seconds
after each step, so that a test can kill a process in the middle of training), recipe (AdamW with
two parameter groups, no weight decay on biases, and a warmup LambdaLR), rel (tol is relative to
each tensor's largest value), inject=N (replica 0's batch of step N holds an inf: with fp16 that
step must be skipped everywhere, exactly, and the loss scale halve), ref32 (the reference runs in
fp32 whatever the strategy's precision), adamw (AdamW in place of SGD with momentum), schedule
(the learning rate halves every 2 steps: a StepLR made after the Trainer; not with ckpt, whose
checkpoints hold no scheduler; recipe's warmup goes on from the restored step), heldsave (fsdp
with ckpt: each background write of a checkpoint waits until the next step has begun, which
checks that the checkpoint is still in flight and not yet the latest), dieat=N (with heldsave:
worker 0 exits at the start of step N, while step N-1's checkpoint is being written), norm (a
LayerNorm ends the model: parameters that tensor parallelism leaves whole), table (the model
adds rows of an embedding table on the servers, a DistributedEmbedding stepped by its own SGD, to
its output: in the reference an nn.Embedding that SGD steps on the sum of the replicas' gradients,
as a sync round of the table sums the workers' pushes; the optimizer and clipping take the dense
parameters only, as they do in one process, where the table's rows are no parameters)

The reference simulates the workers in one process: W replicas of the same model, each computing the
gradient of its own ShardedLoader batches (split into the strategy's micro-batches), then: averaged
and stepped (sync data parallel: one model on the global batch), or stepped alone and averaged every
H steps (local SGD), or never averaged (architecture "local").
"""

import math
import os
import sys
import threading
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain import checkpoint
from paratrain.collective.fsdp import full_state_dict
from paratrain.data import ShardedLoader
from paratrain.train import Strategy, Trainer, unwrap

ctx = paratrain.init()
strategy_name, steps = sys.argv[1], int(sys.argv[2])
opts = dict(a.partition("=")[::2] for a in sys.argv[3:])
strategy = Strategy.parse(strategy_name)
W, k = ctx.num_workers, strategy.accumulation_steps  # the global batch is 12 samples
tol = float(opts.get("tol", "1e-5"))
inject = int(opts.get("inject", -1))
AUTOCAST = (
    None if "ref32" in opts else {"bf16": torch.bfloat16, "fp16": torch.float16}.get(strategy.precision)
)

g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(150, 8, generator=g), torch.randn(150, 3, generator=g))


TABLE_LR = 0.5


class WithTable(nn.Module):
    """The dense model plus one of 4 table rows per sample, picked by the signs of x[:, :2]."""

    def __init__(self, dense: nn.Module, table: nn.Module) -> None:
        super().__init__()
        self.dense, self.table = dense, table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        return self.dense(x) + self.table(ids)


def with_table(model: nn.Module, reference: bool) -> nn.Module:
    if reference:
        table = nn.Embedding(4, 3)
        nn.init.zeros_(table.weight)
    else:
        from paratrain.kvstore import DistributedEmbedding, TableConfig

        config = TableConfig("zeros")
        table = DistributedEmbedding(
            "rows", 3, config=config, optimizer=torch.optim.SGD, optimizer_args={"lr": TABLE_LR}
        )
    return WithTable(model, table)


def build(seed: int = 0, reference: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    if "norm" in opts:
        model.append(nn.LayerNorm(3))
    if "table" in opts:
        model = with_table(model, reference)
    dense = [(name, p) for name, p in model.named_parameters() if not name.startswith("table.")]
    if "adamw" in opts:
        return model, torch.optim.AdamW([p for _, p in dense], lr=0.01, weight_decay=1e-2)
    if "recipe" not in opts:
        return model, torch.optim.SGD([p for _, p in dense], lr=0.1, momentum=0.9, weight_decay=1e-3)
    weights = [p for name, p in dense if name.endswith("weight")]
    biases = [p for name, p in dense if name.endswith("bias")]
    groups = [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=0.02)


def schedule(optimizer: torch.optim.Optimizer, done: int = 0) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The recipe's warmup, `done` steps in (a resumed run's: its optimizer's groups hold initial_lr)."""
    if "recipe" not in opts:
        return None
    warmup = lambda step: min(1.0, (step + 1) / 3)  # noqa: E731
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup, last_epoch=done - 1)


def poisoned(x: torch.Tensor, step: int, replica: int) -> torch.Tensor:
    if step != inject or replica != 0:
        return x
    x = x.clone()
    x[0, 0] = float("inf")
    return x


def train_micro(model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: callable) -> None:
    for xm, ym in zip(x.chunk(k), y.chunk(k), strict=True):
        step(nn.functional.mse_loss(model(xm), ym))


# -- the job under test ---------------------------------------------------------------------------
# Each worker builds its own initial model: data parallel strategies start all from worker 0's. (Not
# "local"; and a pipeline's stage replicas start from their first replica's: stages may differ.)
same_start = strategy.architecture == "local" or strategy.pipeline_stages > 1
model, optimizer = build(seed=0 if same_start else ctx.rank, reference=False)
if "compile" in opts:
    model = torch.compile(model, backend=opts["compile"] or "aot_eager")
ckpt = opts.get("ckpt")
stop = int(opts.get("stop", steps))
pipelined = strategy.pipeline_stages > 1
# Alone, the stages (and a tensor-parallel group) share one process.
replicas = max(1, W // (strategy.pipeline_stages * strategy.tensor_parallel))
BATCH = 12 // replicas
trainer = Trainer(
    model,
    optimizer,
    DataLoader(data, batch_size=BATCH, shuffle=True),
    loss_fn=nn.functional.mse_loss,
    strategy=strategy,
    checkpoint_dir=ckpt,
    checkpoint_every=1 if ckpt else 0,
    progress=False,
)
resumed_at = trainer.steps
released = threading.Semaphore(0)  # heldsave: one token per background write
if "heldsave" in opts:
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def held_write(self, plan, planner):  # on the writing thread
        assert released.acquire(timeout=120), "the held checkpoint write was never released"
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = held_write


def check_held_save() -> None:
    """heldsave: the step about to run finds the last step's checkpoint in flight, not yet latest."""
    in_flight = trainer.checkpoint_in_flight
    assert in_flight == trainer.steps, f"step {trainer.steps} starts with {in_flight} in flight"
    latest = checkpoint.latest(ckpt)
    assert latest is None or latest.step < in_flight, f"{latest.path} is latest while being written"
    if trainer.steps == int(opts.get("dieat", -1)) and ctx.rank == 0:
        print(f"exiting during the write of checkpoint {in_flight}", flush=True)
        os._exit(3)
    released.release()


computed_in = set()  # the first block's weight dtype in each forward
first_block = next(m for m in unwrap(trainer.model).modules() if isinstance(m, nn.Linear))
first_block.register_forward_pre_hook(lambda module, args: computed_in.add(module.weight.dtype))
sched = schedule(optimizer, resumed_at)
halving = "schedule" in opts
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5) if halving else None
if "delay" in opts:  # a test that kills this run checks where it started
    print(f"starting at step {resumed_at}", flush=True)
for _ in trainer.epochs(100):
    for x, y in trainer.loader:
        if trainer.steps >= stop:
            break
        if "heldsave" in opts and trainer.steps > resumed_at:
            check_held_save()
        x, before = poisoned(x, trainer.steps, trainer.replica), None
        if trainer.steps == inject:
            before = {name: p.detach().clone() for name, p in unwrap(trainer.model).named_parameters()}
        if pipelined:
            trainer.train_step(x, y)  # the pipeline cuts the batch into micro-batches itself
        else:
            train_micro(trainer.model, x, y, trainer.step)
        if before is not None:  # the overflowing step left every parameter as it was
            after = dict(unwrap(trainer.model).named_parameters())
            assert all(torch.equal(before[name], after[name]) for name in before), "step not skipped"
        if sched is not None:
            sched.step()
        if scheduler is not None:
            scheduler.step()
        time.sleep(float(opts.get("delay", 0)))
    if trainer.steps >= stop:
        break
released.release()  # the last checkpoint, which close() commits
print(f"trained steps {resumed_at}..{trainer.steps}")
x_eval = torch.randn(7, 8, generator=torch.Generator().manual_seed(5))
outputs = trainer.eval_step(x_eval)  # forward only; pipelined: through the stages, on the last one
table_rows = None
if "table" in opts:  # the rows as the servers hold them after the last round
    table_rows = torch.empty(4, 3)
    table = unwrap(trainer.model).table
    table.kv.row_sparse_pull("rows", out=table_rows, row_ids=torch.arange(4), train=False)
trainer.close()
if stop < steps:
    sys.exit(0)

# -- the reference --------------------------------------------------------------------------------
replica_models = [build() for _ in range(replicas)]
scalers = [torch.amp.GradScaler("cpu", enabled=strategy.precision == "fp16") for _ in replica_models]
schedules = [schedule(opt) for _, opt in replica_models]
norms = []


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if AUTOCAST is None:
        return model(x)
    with torch.autocast("cpu", dtype=AUTOCAST):
        return model(x).float()


halving_schedulers = [torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) for _, opt in replica_models if halving]
loaders = [ShardedLoader(data, BATCH, num_replicas=replicas, rank=r, shuffle=True) for r in range(replicas)]
taken = 0
while taken < steps:
    for batches in zip(*loaders, strict=True):
        if taken == steps:
            break
        grads = []
        for r, ((m, _), (x, y), scaler) in enumerate(zip(replica_models, batches, scalers, strict=True)):
            m.zero_grad()
            x = poisoned(x, taken, r)
            for xm, ym in zip(x.chunk(k), y.chunk(k), strict=True):
                scaler.scale(nn.functional.mse_loss(forward(m, xm), ym) / k).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        taken += 1
        if strategy.architecture != "local" and not strategy.local_sgd_period:
            # A table's sync round sums the workers' pushes; the dense parameters are averaged.
            names = [name for name, _ in replica_models[0][0].named_parameters()]
            mean = [
                sum(gs) / (1 if name.startswith("table.") else replicas)
                for name, gs in zip(names, zip(*grads, strict=True), strict=True)
            ]
            for m, _ in replica_models:
                for p, gm in zip(m.parameters(), mean, strict=True):
                    p.grad.copy_(gm)
        for (m, opt), scaler, sched in zip(replica_models, scalers, schedules, strict=True):
            scaler.unscale_(opt)
            if strategy.clip_grad_norm is not None:
                stepped = [p for group in opt.param_groups for p in group["params"]]
                norms.append(float(torch.nn.utils.clip_grad_norm_(stepped, strategy.clip_grad_norm)))
            scaler.step(opt)
            if "table" in opts:
                torch.optim.SGD(m.table.parameters(), lr=TABLE_LR).step()
            scaler.update()
            if sched is not None:
                sched.step()
        for reference_scheduler in halving_schedulers:
            reference_scheduler.step()
        if strategy.local_sgd_period and taken % strategy.local_sgd_period == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m, _ in replica_models), strict=True):
                    mean = sum(p for p in ps) / replicas
                    for p in ps:
                        p.copy_(mean)

expected = replica_models[trainer.replica][0].state_dict()
got = (
    full_state_dict(trainer.model) if strategy.architecture == "fsdp" else unwrap(trainer.model).state_dict()
)
got = {name: value.cpu() for name, value in got.items()}  # on any device
if table_rows is not None:
    got["table.weight"] = table_rows
if pipelined:  # this worker trained its stage's parameters only
    mine = {id(p) for p in trainer.pipe.module.parameters()}
    names = {name for name, p in unwrap(trainer.model).named_parameters() if id(p) in mine}
    expected = {name: value for name, value in expected.items() if name in names}


def error(got: torch.Tensor, value: torch.Tensor) -> float:
    scale = value.abs().max().item() if "rel" in opts else 1.0
    return (got - value).abs().max().item() / scale


diff = max(error(got[name], value) for name, value in expected.items())
if ctx.distributed and strategy.architecture == "fsdp":  # FSDP's policy gathers them in that dtype
    wanted = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(strategy.precision, torch.float32)
    assert computed_in == {wanted}, f"the forward ran with {computed_in} weights, not {wanted}"
if strategy.clip_grad_norm is not None:  # else the check would not show that clipping matches
    reached = max(n for n in norms if math.isfinite(n))
    assert reached > strategy.clip_grad_norm, f"the gradient never reached the clip: {reached}"
    if strategy.distributed_optimizer:  # the servers' norm, summed from their shares, is logged
        assert abs(trainer.gate.last_norm - norms[-1]) <= 1e-5 * norms[-1], (trainer.gate.last_norm, norms)
if inject >= 0:
    assert trainer.gate.skipped == 1, f"worker {ctx.rank}: {trainer.gate.skipped} steps skipped, not 1"
    assert trainer.gate.scaler.scale == scalers[0].get_scale(), (
        trainer.gate.scaler.scale,
        scalers[0].get_scale(),
    )
moved = max(error(build()[0].state_dict()[name], value) for name, value in expected.items())
assert moved > 10 * tol, f"the reference barely moved ({moved}): the check would prove nothing"
assert diff <= tol, f"worker {ctx.rank}: parameters differ from the reference by {diff} > {tol}"
if outputs is not None:  # None on a pipeline's other stages
    with torch.no_grad():
        out_diff = (outputs.cpu() - forward(replica_models[trainer.replica][0], x_eval)).abs().max().item()
    assert out_diff <= 10 * tol, f"worker {ctx.rank}: eval_step differs from the reference by {out_diff}"
elif not pipelined or trainer.pipe.is_last_stage:
    raise AssertionError(f"worker {ctx.rank}: eval_step returned None")
print(f"parity ok: max abs diff {diff:.2e} (parameters moved {moved:.2e})")
