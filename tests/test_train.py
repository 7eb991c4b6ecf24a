"""The Trainer and its strategies: parity with single-process training, accumulation, resume."""

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paratrain import checkpoint
from paratrain.kvstore.consistency import Async, Bounded, Sync
from paratrain.node import Context
from paratrain.testing import run_job
from paratrain.train import Strategy, Trainer, prepare, resolve_strategy
from paratrain.train.ps import changed_hyperparameters, group_hyperparameters, server_hyperparameters

JOBS = Path(__file__).parent / "jobs"


# -- strategies, without processes ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("local", {"architecture": "local"}),
        ("device", {"architecture": "local"}),
        ("dist_sync", {"architecture": "ps", "consistency": Sync(), "update_on": "server"}),
        ("dist_async", {"architecture": "ps", "consistency": Async()}),
        ("dist_sync_device", {"architecture": "ps", "aggregation": "host"}),
        ("dist_async_device", {"architecture": "ps", "consistency": Async(), "aggregation": "host"}),
        ("collective", {"architecture": "collective"}),
        ("hybrid", {"architecture": "hybrid"}),
        ("ps:consistency=bounded,staleness=2", {"consistency": Bounded(2)}),
        (
            "collective:accumulation_steps=4,compression=bf16",
            {"accumulation_steps": 4, "compression": "bf16"},
        ),
        ("collective: local_sgd_period = 8", {"local_sgd_period": 8}),
        ("ps:update_on=worker,compression=fp16,bucket_mb=0.5", {"compression": "fp16", "bucket_mb": 0.5}),
    ],
)
def test_strategy_names_and_settings(name, fields):
    strategy = Strategy.parse(name)
    for field, value in fields.items():
        assert getattr(strategy, field) == value


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Strategy(architecture="mesh"), "Strategy.architecture='mesh'"),
        (lambda: Strategy(accumulation_steps=0), "Strategy.accumulation_steps=0"),
        (lambda: Strategy(compression="int8"), "Strategy.compression='int8'"),
        (
            lambda: Strategy(architecture="ps", staleness=2),
            "Strategy.staleness=2 needs consistency='bounded'",
        ),
        (lambda: Strategy(consistency="async"), "Strategy.consistency=Async() needs architecture='ps'"),
        (lambda: Strategy(architecture="ps", local_sgd_period=4), "Strategy.local_sgd_period=4"),
        (lambda: Strategy(architecture="ps", consistency="async", update_on="worker"), "Strategy.update_on"),
        (
            lambda: Strategy(architecture="ps", compression="powersgd"),
            "needs architecture='collective' or 'hybrid', not 'ps'",
        ),
        (lambda: Strategy(compression="2bit", compression_threshold=0), "Strategy.compression_threshold=0"),
        (lambda: Strategy(compression="topk", compression_ratio=2.0), "Strategy.compression_ratio=2.0"),
        (lambda: Strategy.parse("ps:error_feedback=maybe"), "error_feedback='maybe' is not true or false"),
        (lambda: Strategy(aggregation="host"), "Strategy.aggregation='host' needs architecture='ps'"),
        (lambda: Strategy.parse("dist_fast"), "strategy 'dist_fast' is not one of"),
        (lambda: Strategy.parse("ps:speed=3"), "strategy setting 'speed=3'"),
        (lambda: Strategy.parse("ps:staleness=two"), "staleness='two' is not a number"),
    ],
)
def test_bad_strategies_name_the_field_and_value(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_default_strategy_follows_the_environment_and_the_job(monkeypatch):
    monkeypatch.delenv("PARATRAIN_STRATEGY", raising=False)
    assert resolve_strategy(None, num_servers=2).architecture == "ps"
    assert resolve_strategy(None, num_servers=0).architecture == "collective"
    monkeypatch.setenv("PARATRAIN_STRATEGY", "dist_async")
    assert resolve_strategy(None, num_servers=1).consistency == Async()
    with pytest.raises(ValueError, match="needs servers, and this job has none"):
        resolve_strategy("dist_sync", num_servers=0)
    assert resolve_strategy("dist_sync", num_servers=0, distributed=False).architecture == "ps"


def test_server_optimizer_takes_each_groups_hyperparameters():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    hyper = server_hyperparameters(torch.optim.Adam([a, b], lr=0.01, betas=(0.8, 0.9)))
    assert hyper["lr"] == 0.01 and tuple(hyper["betas"]) == (0.8, 0.9) and "params" not in hyper
    assert "foreach" not in hyper and "fused" not in hyper
    mixed = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5, "weight_decay": 0.1}], lr=0.1)
    first, second = group_hyperparameters(mixed)
    assert (first["lr"], first["weight_decay"]) == (0.1, 0) and (second["lr"], second["weight_decay"]) == (
        0.5,
        0.1,
    )
    assert changed_hyperparameters([first, first], [first, second]) == [(1, {"lr": 0.5, "weight_decay": 0.1})]


def test_async_workers_clip_their_own_gradient_before_it_leaves():
    """dist_async has no one mean per round: each worker pushes its gradient clipped to norm c,
    as clip_grad_norm_ clips it in one process, and none leaves during backward."""
    from paratrain.train.ps import PSEngine

    model, data = _model_and_data()
    twin = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PSEngine(model, optimizer, Strategy.parse("dist_async:clip_grad_norm=0.05"), ALONE)
    sent = []
    pushpull = engine.kv.pushpull_async
    engine.kv.pushpull_async = lambda keys, values, out: (
        sent.append([v.clone() for v in values]) or pushpull(keys, values, out)
    )
    x, y = data.tensors
    nn.functional.mse_loss(model(x), y).backward()
    assert sent == []  # held until step(): the norm needs the whole gradient
    engine.step(optimizer, lambda: None)
    nn.functional.mse_loss(twin(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
    assert len(sent) == 1 and norm > 0.05 and engine.last_norm == pytest.approx(float(norm))
    assert float(torch.nn.utils.get_total_norm(sent[0])) <= 0.05 * (1 + 1e-6)
    for value, p in zip(sent[0], twin.parameters(), strict=True):
        torch.testing.assert_close(value, p.grad, rtol=0, atol=0)
    engine.close()


def test_an_lr_change_is_found_by_group_whatever_made_it():
    """What the PS engine sends the servers before a round: the groups' changed values only."""
    weights, biases = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW(
        [{"params": [weights]}, {"params": [biases], "weight_decay": 0.0}], lr=0.1, betas=(0.9, 0.99)
    )
    sent = group_hyperparameters(optimizer)
    assert changed_hyperparameters(sent, group_hyperparameters(optimizer)) == []
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 4)
    assert changed_hyperparameters(sent, group_hyperparameters(optimizer)) == [
        (0, {"lr": 0.025}),
        (1, {"lr": 0.025}),
    ]
    sent = group_hyperparameters(optimizer)
    optimizer.step()
    warmup.step()
    assert changed_hyperparameters(sent, group_hyperparameters(optimizer)) == [
        (0, {"lr": 0.05}),
        (1, {"lr": 0.05}),
    ]
    sent = group_hyperparameters(optimizer)
    optimizer.param_groups[1]["lr"] = 0.5  # by hand, one group
    assert changed_hyperparameters(sent, group_hyperparameters(optimizer)) == [(1, {"lr": 0.5})]
    cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=10)  # moves betas too
    now = group_hyperparameters(optimizer)
    assert {k for _, change in changed_hyperparameters(sent, now) for k in change} == {"lr", "betas"}
    assert isinstance(now[0]["betas"], list)  # as it travels
    del cycle
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    with pytest.raises(ValueError, match="the groups are fixed"):
        changed_hyperparameters(now, group_hyperparameters(optimizer))


# -- the Trainer in one process -------------------------------------------------------------------
ALONE = Context("worker", 0, 1, 0)


def _model_and_data(seed: int = 0) -> tuple[nn.Module, TensorDataset]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(3)
    return model, TensorDataset(torch.randn(64, 5, generator=g), torch.randn(64, 2, generator=g))


def test_accumulating_k_micro_batches_equals_one_batch_k_times_larger():
    big, data = _model_and_data()
    small, _ = _model_and_data()
    opt_big = torch.optim.Adam(big.parameters(), lr=0.01)
    opt_small = torch.optim.Adam(small.parameters(), lr=0.01)
    trainer = Trainer(small, opt_small, strategy="collective:accumulation_steps=4", progress=False, ctx=ALONE)
    x, y = data.tensors
    for step in range(3):
        xb, yb = x[step * 16 : (step + 1) * 16], y[step * 16 : (step + 1) * 16]
        opt_big.zero_grad()
        nn.functional.mse_loss(big(xb), yb).backward()
        opt_big.step()
        for xm, ym in zip(xb.chunk(4), yb.chunk(4), strict=True):
            trainer.step(nn.functional.mse_loss(trainer.model(xm), ym))
        assert trainer.steps == step + 1
    for p, q in zip(big.parameters(), small.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_prepare_keeps_the_loop_and_lr_schedulers_work():
    model, data = _model_and_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer, loader = prepare(
        model,
        optimizer,
        DataLoader(data, batch_size=8),
        strategy="collective:accumulation_steps=2",
        ctx=ALONE,
    )
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    kept, alone = [], []
    for i, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        twin = copy.deepcopy(model)
        nn.functional.mse_loss(twin(x), y).backward()
        nn.functional.mse_loss(model(x), y).backward()
        kept.append(model[0].weight.grad.clone())
        alone.append(twin[0].weight.grad)
        optimizer.step()
        if i % 2 == 1:
            schedule.step()
    assert len(kept) == 8 and optimizer.trainer.steps == 4
    assert optimizer.param_groups[0]["lr"] == 1.0 / 2**4
    for i in range(0, 8, 2):  # zero_grad clears after a real step and keeps between micro-steps
        torch.testing.assert_close(kept[i], alone[i])
        torch.testing.assert_close(kept[i + 1], alone[i] + alone[i + 1])


def test_checkpoint_resumes_the_same_run_and_metrics_are_written(tmp_path):
    def run(stop: int) -> nn.Module:
        model, data = _model_and_data()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        loader = DataLoader(data, batch_size=8, shuffle=True)
        trainer = Trainer(
            model,
            optimizer,
            loader,
            checkpoint_dir=tmp_path / "ckpt",
            checkpoint_every=3,
            metrics_dir=tmp_path / "metrics",
            log_every=1,
            progress=False,
            ctx=ALONE,
        )
        for _ in trainer.epochs(3):
            for x, y in trainer.loader:
                if trainer.steps == stop:
                    trainer.close()
                    return trainer.model
                trainer.step(nn.functional.mse_loss(trainer.model(x), y))
        trainer.close()
        return trainer.model

    run(stop=12)  # 24 steps in all (3 epochs of 8); stops at a checkpoint, mid-epoch 2
    assert checkpoint.latest(tmp_path / "ckpt").step == 12
    resumed = run(stop=-1)
    (tmp_path / "other").mkdir()
    straight, data = _model_and_data()
    optimizer = torch.optim.Adam(straight.parameters(), lr=0.01)
    trainer = Trainer(
        straight, optimizer, DataLoader(data, batch_size=8, shuffle=True), progress=False, ctx=ALONE
    )
    for _ in trainer.epochs(3):
        for x, y in trainer.loader:
            trainer.step(nn.functional.mse_loss(trainer.model(x), y))
    assert trainer.steps == 24
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    lines = [
        json.loads(line) for line in (tmp_path / "metrics" / "metrics-rank0.jsonl").read_text().splitlines()
    ]
    assert [line["step"] for line in lines] == list(range(1, 25))
    assert all("loss" in line and "lr" in line for line in lines)


def test_a_pipeline_strategy_trains_through_train_step_alone():
    model, data = _model_and_data()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        strategy="collective:pipeline_stages=3,micro_batches=4,pipeline_schedule=gpipe",
        loss_fn=nn.functional.mse_loss,
        progress=False,
        ctx=ALONE,
    )
    x, y = data.tensors
    for step in range(3):
        xb, yb = x[step * 16 : (step + 1) * 16], y[step * 16 : (step + 1) * 16]
        loss = trainer.train_step(xb, yb)
        ref_opt.zero_grad()
        expected = nn.functional.mse_loss(reference(xb), yb)
        expected.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, expected.detach())
    assert len(trainer.pipe.module.stages) == 3  # alone: every stage in this process
    torch.testing.assert_close(trainer.eval_step(x[:8]), reference(x[:8]).detach())
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    with pytest.raises(ValueError, match="needs Trainer\\(loss_fn=...\\)"):
        Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            strategy="collective:pipeline_stages=2",
            ctx=ALONE,
        )


def test_prepare_refuses_a_pipeline_strategy_before_anything_starts():
    model, _ = _model_and_data()
    with pytest.raises(ValueError, match=r"pipeline_stages=2 cannot run under paratrain.prepare\(\)"):
        prepare(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            strategy="collective:pipeline_stages=2",
            loss_fn=nn.functional.mse_loss,
            ctx=ALONE,
        )


def test_a_checkpoint_from_another_number_of_workers_is_refused(tmp_path):
    model, data = _model_and_data()
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=tmp_path, progress=False, ctx=ALONE
    )
    trainer.save_checkpoint()
    meta = tmp_path / "step-00000000" / "meta.json"
    meta.write_text(meta.read_text().replace('"num_workers": 1', '"num_workers": 4'))
    with pytest.raises(checkpoint.CheckpointError, match="taken with 4 workers; this job has 1"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_dir=tmp_path, ctx=ALONE)


# -- jobs: parity with the single-process reference ------------------------------------------------
PARITY = [
    (2, 0, "collective", ()),
    (3, 0, "collective:accumulation_steps=2", ()),
    (2, 0, "collective:local_sgd_period=2", ()),
    (2, 0, "collective:compression=bf16", ("tol=1e-2",)),
    (2, 0, "collective", ("compile",)),
    (2, 1, "dist_sync:bucket_mb=0.001", ()),
    (3, 2, "ps:update_on=worker,accumulation_steps=2,bucket_mb=0.0001", ()),
    (3, 2, "ps:consistency=bounded", ()),
    (2, 1, "dist_sync", ("compile",)),
    (2, 1, "ps:update_on=worker,compression=fp16", ("tol=1e-3",)),
    (2, 1, "dist_sync_device", ()),
    (4, 0, "collective:pipeline_stages=2,micro_batches=3", ()),  # a 2 x 2 mesh through train_step
    # AdamW with two parameter groups, a warmup LambdaLR and clipping (the clip is reached: the job
    # checks), against one process calling clip_grad_norm_ on the global batch's gradient:
    (2, 0, "collective:clip_grad_norm=0.3", ("recipe", "rel")),
    (2, 0, "collective:pipeline_stages=2,micro_batches=3,clip_grad_norm=0.3", ("recipe", "rel")),
    # hybrid: the dense parameters by all-reduce, clipped (as one process clips them: the table's
    # rows are no parameters), and an embedding table's rows on the server, stepped by its own SGD:
    (2, 1, "hybrid:clip_grad_norm=0.3", ("recipe", "rel", "table")),
    # The same groups and warmup with the optimizer on the servers (each group's weight decay per
    # key, the lr of each step sent ahead of its round), on one server and split over two:
    (2, 1, "dist_sync", ("recipe", "rel")),
    (2, 2, "dist_sync:bucket_mb=0.0001,clip_grad_norm=0.3", ("recipe", "rel")),
    # fp16: step 2 overflows on one worker only; every worker skips it exactly, and the loss scale
    # and parameters are those of one process with torch.amp.GradScaler (the same fp16 arithmetic,
    # hence 1e-5). A pipeline's micro-batches round their fp16 weight gradients apart before they
    # are summed (the reference rounds the batch's once): fp16's unit roundoff 2^-11 = 4.9e-4 per
    # gradient, so 1e-3 after six steps.
    (2, 0, "collective:precision=fp16,clip_grad_norm=0.3", ("recipe", "rel", "inject=2")),
    (2, 1, "ps:update_on=worker,precision=fp16,clip_grad_norm=0.3", ("recipe", "rel", "inject=2")),
    # With the optimizer on the servers: each server drops the round on the workers' flags
    # (kvstore/server/overflow.py), and clips the others by the norm of their shares.
    (2, 2, "dist_sync:bucket_mb=0.0001,precision=fp16,clip_grad_norm=0.3", ("recipe", "rel", "inject=2")),
    # A host's workers reduce first; its leader sends the host's check, asks for the norm and
    # gives both to the others.
    (2, 1, "dist_sync_device:precision=fp16,clip_grad_norm=0.3", ("recipe", "rel", "inject=2")),
    (2, 0, "collective:pipeline_stages=2,micro_batches=3,precision=fp16", ("recipe", "inject=2", "tol=1e-3")),
    # bf16 against an fp32 reference: bf16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3
    # per rounding, several per gradient), and six AdamW steps moved the parameters 0.3% from the
    # fp32 run's (measured 2.9e-3 of each tensor's largest value), so 1e-2.
    (2, 0, "collective:precision=bf16,clip_grad_norm=0.3", ("recipe", "rel", "ref32", "tol=1e-2")),
]


@pytest.mark.parametrize(("workers", "servers", "strategy", "options"), PARITY)
def test_strategy_matches_single_process_training(workers, servers, strategy, options):
    outcome = run_job(
        JOBS / "train_parity.py",
        workers=workers,
        servers=servers,
        args=(strategy, "6", *options),
        timeout_s=240,
    )
    for rank in range(workers):
        assert any(line.startswith("parity ok") for line in outcome.lines("worker", rank)), outcome.stdout


# dist_sync with the recipe: the servers' AdamW state, each group's weight decay and the warmup's lr
# at the restored step all continue.
@pytest.mark.parametrize(
    ("servers", "strategy", "options"), [(0, "collective", ()), (1, "dist_sync", ("recipe", "rel"))]
)
def test_resuming_from_a_checkpoint_ends_where_an_uninterrupted_run_does(
    tmp_path, servers, strategy, options
):
    args = (strategy, "6", f"ckpt={tmp_path}", *options)
    first = run_job(
        JOBS / "train_parity.py", workers=2, servers=servers, args=(*args, "stop=3"), timeout_s=240
    )
    assert "trained steps 0..3" in first.lines("worker", 0)
    assert checkpoint.latest(tmp_path).step == 3
    second = run_job(JOBS / "train_parity.py", workers=2, servers=servers, args=args, timeout_s=240)
    for rank in range(2):
        lines = second.lines("worker", rank)
        assert "trained steps 3..6" in lines and any(line.startswith("parity ok") for line in lines), lines


def test_every_engine_has_what_the_trainer_calls():
    # The Trainer calls its engine only through train/api.py's Engine: each engine class has all of it.
    from paratrain.train.api import Engine
    from paratrain.train.elastic import ElasticCollectiveEngine
    from paratrain.train.ps import PSEngine
    from paratrain.train.trainer import CollectiveEngine, LocalEngine

    members = [n for n in vars(Engine) if not n.startswith("_")] + list(Engine.__annotations__)
    for engine in (LocalEngine, CollectiveEngine, PSEngine, ElasticCollectiveEngine):
        assert [m for m in members if not hasattr(engine, m) and m != "model"] == [], engine


def test_a_strategy_as_plain_data_names_its_consistency_policy():
    # A checkpoint's metadata: the policy as written, not a dataclass's fields without its name.
    data = json.loads(json.dumps(Strategy.parse("ps:consistency=bounded,staleness=2").as_dict()))
    assert data["consistency"] == "bounded(2)" and data["architecture"] == "ps"
