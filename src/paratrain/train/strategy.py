"""A strategy: the whole choice of how one training script's work is split, as one frozen value.

    Strategy.parse("dist_async")                      # MXNet names map onto strategies
    Strategy(architecture="collective", accumulation_steps=4, compression="bf16")
    Strategy.parse("collective").replace(local_sgd_period=8)

Switching strategy is a change of this value (or of the PARATRAIN_STRATEGY environment variable, which
`paratrain launch --strategy` sets), never of the training script.

This module is the one place where a Strategy becomes the lower layers' configurations
(`kvstore_config`, `pipeline_config`); the consistency and aggregation vocabularies are the kvstore's.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paratrain.compression import CompressionConfig
from paratrain.kvstore.api import AGGREGATION as AGGREGATIONS
from paratrain.kvstore.api import KVStoreConfig
from paratrain.kvstore.consistency import Async, Backup, Policy, Sync, parse

if TYPE_CHECKING:
    from paratrain.pipeline.api import PipelineConfig

ARCHITECTURES = ("local", "collective", "ps", "hybrid", "fsdp")
UPDATE_ON = ("server", "worker")
COMPRESSIONS = (None, "2bit", "topk", "fp16", "bf16", "powersgd")
PRECISIONS = ("32", "bf16", "fp16")
SCHEDULES = ("1f1b", "gpipe")
ENV_VAR = "PARATRAIN_STRATEGY"


@dataclass(frozen=True)
class Strategy:
    architecture: str = "collective"
    """local: no communication (one process, or independent workers); collective: gradients averaged by
    all-reduce (torch DDP); ps: parameters on the servers (the kvstore); hybrid: dense parameters by
    all-reduce, embedding tables (kvstore.worker.embedding.DistributedEmbedding) on the servers; fsdp:
    sharded data parallel (torch's FSDP2): each worker holds 1/N of the parameters, gradients and
    optimizer state (collective/fsdp.py)."""
    consistency: Policy = Sync()
    """ps, and hybrid's embedding tables: a kvstore/consistency.py policy, Sync(), Async() (each
    worker's push is applied on arrival), Bounded(s) (a worker runs at most s steps ahead of the
    slowest) or, ps only, Backup(b) (sync rounds that apply once all but b workers pushed:
    docs/concepts/backup_workers.md). Its name is accepted too ("bounded" with `staleness`) and made the
    policy."""
    staleness: dataclasses.InitVar[int] = 0
    """With consistency="bounded" (a name): its bound s. Not kept: it is the policy's field."""
    update_on: str = "server"
    """ps only. server: the optimizer runs on the servers and workers pull weights; worker: servers
    only sum gradients and every worker steps its own optimizer on the pulled mean."""
    aggregation: str = "process"
    """ps only. host: the workers of one machine reduce first and one of them talks to the servers."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step; gradients sync only on the last and are averaged over all."""
    local_sgd_period: int = 0
    """collective only. >0: no per-step all-reduce; parameters are averaged every this many steps."""
    compression: str | None = None
    """2bit, topk, fp16, bf16 (collective and ps) or powersgd (collective): gradients travel
    compressed, with error feedback (paratrain.compression). topk sends the optimizer's updates
    instead: every worker steps its own optimizer (CompressionConfig.sends_updates)."""
    compression_threshold: float = 0.02
    """2bit: a worker's mean gradient element is sent as +-threshold where |element| >= threshold,
    else 0; the rest waits in the error feedback. How to choose it: docs/concepts/threshold.md."""
    compression_ratio: float = 0.01
    """topk: the fraction of each update's elements sent (those of largest magnitude)."""
    compression_rank: int = 1
    """powersgd: the rank of each gradient matrix's approximation."""
    error_feedback: bool = True
    """Keep what compression did not send, per tensor, and add it to the next gradient."""
    pipeline_stages: int = 1
    """>1: the model (an nn.Sequential) is cut into this many stages, one per worker (pipeline/)."""
    micro_batches: int = 1
    """Micro-batches per pipelined step."""
    pipeline_schedule: str = "1f1b"
    """1f1b or gpipe."""
    bucket_mb: float = 25.0
    """Gradients are sent in buckets of about this size as backward produces them."""
    precision: str = "32"
    """32, bf16 or fp16: the forward runs under torch.autocast in that dtype (weights, gradients
    and optimizer state stay fp32). fp16 scales the loss dynamically as torch.amp.GradScaler does:
    a step whose aggregated gradient holds inf or NaN is skipped on every worker and the scale
    halves (train/precision.py); with the optimizer on the servers (sync rounds) every server
    drops such a round on the workers' flags (kvstore/server/overflow.py). Under fsdp it is FSDP's
    MixedPrecisionPolicy instead: parameters are gathered and computed in that dtype, the sharded
    ones and the optimizer stay fp32 (collective/fsdp.py; reduce_precision)."""
    clip_grad_norm: float | None = None
    """Clip the aggregated gradient to this global L2 norm before each optimizer step: what
    torch.nn.utils.clip_grad_norm_ gives in one process on the global batch (a pipeline's norm
    spans every stage; under ps with update_on='server', in sync mode, the servers clip each
    round's mean by the norm their shares add up to; in async and bounded modes, which have no
    one mean per round, each worker clips its own gradient before pushing it). The optimizer's
    parameters are clipped: an embedding table's rows (hybrid) are not parameters, and are
    stepped unclipped as in one process. Under ps a clip_grad_norm_ of the user's own between
    backward and step cannot reach the servers, and raises an error."""
    fsdp_blocks: str | None = None
    """fsdp only. The submodules sharded one by one (dotted names, separated by spaces), each
    gathered whole for its forward and backward; default: a Sequential's children, else the modules
    of every ModuleList (a transformer's blocks)."""
    reshard_after_forward: bool = True
    """fsdp only. Free each block's gathered parameters after its forward (gathered again for
    backward): less memory, one more all-gather per block."""
    reduce_precision: str = "32"
    """fsdp only. The dtype gradients are reduce-scattered in: 32 (default, whatever `precision`
    is: the sum over workers keeps its low bits), bf16 or fp16 (half the bytes)."""
    backup_workers: dataclasses.InitVar[int] = 0
    """ps with sync consistency: b > 0 makes the policy Backup(b), rounds that apply once all but
    b workers pushed ("dist_sync:backup_workers=1"). Not kept: it is the policy's field."""
    tensor_parallel: int = 1
    """fsdp only. >1: each block's layers are split across this many workers (torch's DTensor tensor
    parallelism, Megatron's column and row splits), and fsdp shards over the rest: workers =
    data x tensor_parallel, laid on one DeviceMesh with the tensor dimension innermost (train/mesh.py)."""
    tp_plan: str | Mapping[str, str] | Callable[..., Any] | None = None
    """With tensor_parallel > 1: which modules are split how, as "pattern:style" items separated by
    spaces (or a dict of them): patterns are dotted module names where `*` stands for one name
    ("blocks.*.mlp.0"), styles colwise, rowwise or colwise_rep (collective/tensor_parallel.py). Or a
    function (model, tp_mesh) that splits the model itself. Default: the Linear pairs of every
    Sequential MLP (Linear, activation, Linear) as colwise then rowwise."""

    def __post_init__(self, staleness: int, backup_workers: int) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"Strategy.{field}={getattr(self, field)!r} {why}")

        for field in ("precision", "reduce_precision"):
            if getattr(self, field) in (32, "fp32", "float32"):  # what a user may write for the default
                object.__setattr__(self, field, "32")
        consistency = parse(self.consistency, staleness, "Strategy", backup_workers)
        object.__setattr__(self, "consistency", consistency)
        for field, allowed in (
            ("architecture", ARCHITECTURES),
            ("update_on", UPDATE_ON),
            ("aggregation", AGGREGATIONS),
            ("compression", COMPRESSIONS),
            ("pipeline_schedule", SCHEDULES),
            ("precision", PRECISIONS),
            ("reduce_precision", PRECISIONS),
        ):
            value = getattr(self, field)
            if value not in allowed:
                choices = ", ".join(map(str, allowed))
                raise bad(field, f"is not one of {choices}{did_you_mean(value, allowed)}")
        for field, least in (
            ("accumulation_steps", 1),
            ("local_sgd_period", 0),
            ("pipeline_stages", 1),
            ("micro_batches", 1),
            ("compression_rank", 1),
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise bad(field, f"must be an int >= {least}")
        if not isinstance(self.bucket_mb, (int, float)) or not self.bucket_mb > 0:
            raise bad("bucket_mb", "must be a number > 0")
        if not isinstance(self.compression_threshold, (int, float)) or not self.compression_threshold > 0:
            raise bad("compression_threshold", "must be a number > 0")
        if not isinstance(self.compression_ratio, (int, float)) or not 0 < self.compression_ratio <= 1:
            raise bad("compression_ratio", "must be a number in (0, 1]")
        if not isinstance(self.error_feedback, bool):
            raise bad("error_feedback", "must be a bool")
        clip = self.clip_grad_norm
        if clip is not None and (
            isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0
        ):
            raise bad("clip_grad_norm", "must be a number > 0, or None for no clipping")
        if not isinstance(self.reshard_after_forward, bool):
            raise bad("reshard_after_forward", "must be a bool")
        if self.fsdp_blocks is not None and not isinstance(self.fsdp_blocks, str):
            raise bad("fsdp_blocks", "must be module names separated by spaces, or None")
        fsdp = self.architecture == "fsdp"
        fsdp_only = {"fsdp_blocks": bool(self.fsdp_blocks), "reduce_precision": self.reduce_precision != "32"}
        fsdp_only["reshard_after_forward"] = not self.reshard_after_forward
        if not fsdp and any(fsdp_only.values()):
            field = next(name for name, changed in fsdp_only.items() if changed)
            raise bad(field, f"needs architecture='fsdp', not {self.architecture!r}")
        if fsdp and (self.compression or self.pipeline_stages > 1):
            field = "compression" if self.compression else "pipeline_stages"
            raise bad(field, "cannot run with architecture='fsdp'")
        ps = self.architecture == "ps"
        if not ps and self.architecture != "hybrid" and self.consistency != Sync():
            raise bad("consistency", f"needs architecture='ps' or 'hybrid', not {self.architecture!r}")
        if not ps and self.aggregation != "process":
            raise bad("aggregation", f"needs architecture='ps', not {self.architecture!r}")
        if isinstance(self.consistency, Backup) and (not ps or self.aggregation != "process"):
            raise bad(
                "consistency",
                f"needs architecture='ps' and aggregation='process', not {self.architecture!r} and "
                f"{self.aggregation!r}: a round of backup workers counts the workers that push",
            )
        if ps and self.consistency != Sync() and self.update_on == "worker":
            raise bad(
                "update_on",
                f"with consistency={self.consistency} needs 'server': workers stepping on stale sums "
                "would drift apart",
            )
        if self.local_sgd_period and self.architecture != "collective":
            raise bad("local_sgd_period", f"needs architecture='collective', not {self.architecture!r}")
        if self.local_sgd_period and self.compression:
            raise bad("compression", "does nothing with local SGD (parameters are averaged in full)")
        if self.compression == "powersgd" and self.architecture not in ("collective", "hybrid"):
            raise bad(
                "compression", f"needs architecture='collective' or 'hybrid', not {self.architecture!r}"
            )
        if self.pipeline_stages > 1 and self.accumulation_steps > 1:
            raise bad("accumulation_steps", "is micro_batches in a pipeline; set that instead")
        self._check_tensor_parallel()
        self._check_loop_features()

    def _check_tensor_parallel(self) -> None:
        """tensor_parallel and tp_plan: types, the architecture they run under, the plan's words."""
        tp = self.tensor_parallel
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"Strategy.tensor_parallel={tp!r} must be an int >= 1")
        if tp > 1 and self.architecture != "fsdp":
            raise ValueError(
                f"Strategy.tensor_parallel={tp} needs architecture='fsdp' (the tensor dimension inside, "
                f"fsdp across the rest of the workers), not {self.architecture!r}"
            )
        if tp > 1 and self.precision == "fp16":
            raise ValueError(
                f"Strategy.precision='fp16' with tensor_parallel={tp}: each worker holds a part of the "
                "gradient, so an overflow in one part must skip the step on every worker, which the "
                "loss scaler does not agree on yet; use precision='bf16' (no loss scaling)"
            )
        if self.tp_plan is None or callable(self.tp_plan):
            if self.tp_plan is not None and tp == 1:
                raise ValueError(f"Strategy.tp_plan={self.tp_plan!r} needs tensor_parallel > 1")
            return
        from paratrain.collective.tensor_parallel import plan_text

        object.__setattr__(self, "tp_plan", plan_text(self.tp_plan))  # one canonical, hashable form
        if tp == 1:
            raise ValueError(f"Strategy.tp_plan={self.tp_plan!r} needs tensor_parallel > 1")

    def _check_loop_features(self) -> None:
        """Loss scaling and clipping need the aggregated gradient on the workers before they step."""
        sends_updates = self.compression == "topk"
        if self.precision == "fp16" and self.compression is not None:
            raise ValueError(
                f"Strategy.precision='fp16' with compression={self.compression!r}: a loss-scaled "
                "gradient that overflows would enter the compression's error feedback; use "
                "precision='bf16' (no loss scaling) or no compression"
            )
        # A pipeline's stages step their own optimizers (the servers only sum their replicas).
        on_servers = self.distributed_optimizer and not sends_updates and self.pipeline_stages == 1
        # The servers drop a sync round any worker's gradient overflowed in (train/ps.py); an
        # async or bounded push is applied before its worker's backward has ended.
        if self.precision == "fp16" and on_servers and self.consistency != Sync():
            raise ValueError(
                f"Strategy.precision='fp16' with the optimizer on the servers needs consistency="
                f"'sync', not {self.consistency}: a skipped step must be agreed before any server "
                "applies it, and an async or bounded push is applied as it arrives, before its "
                "worker's backward (and overflow check) has ended; use precision='bf16' (no loss "
                "scaling), or update_on='worker'"
            )
        if self.clip_grad_norm is not None and on_servers and isinstance(self.consistency, Backup):
            raise ValueError(
                f"Strategy.clip_grad_norm={self.clip_grad_norm!r} with consistency={self.consistency}: "
                "the servers clip a round by the norm of its mean, and a backup round's mean is over "
                "the pushes that made it, known only once it closed; use update_on='worker'"
            )
        if self.clip_grad_norm is not None and sends_updates:
            raise ValueError(
                f"Strategy.clip_grad_norm={self.clip_grad_norm!r} with compression='topk': each "
                "worker steps on its own gradient, so there is no aggregated gradient to clip"
            )

    def replace(self, **changes: Any) -> Strategy:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain data (a checkpoint's metadata): the policy as it is written,
        "bounded(2)"."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if callable(self.tp_plan):  # a function: its name says which
            fields["tp_plan"] = f"{self.tp_plan.__module__}.{self.tp_plan.__qualname__}"
        return fields | {"consistency": str(self.consistency)}

    @property
    def compression_config(self) -> CompressionConfig | None:
        """The compression fields as the compression layer takes them."""
        if self.compression is None:
            return None
        return CompressionConfig(
            self.compression,
            threshold=self.compression_threshold,
            ratio=self.compression_ratio,
            rank=self.compression_rank,
            error_feedback=self.error_feedback,
        )

    @property
    def distributed_optimizer(self) -> bool:
        """Whether the optimizer runs on the servers."""
        return self.architecture == "ps" and self.update_on == "server"

    @classmethod
    def parse(cls, name: str | Strategy) -> Strategy:
        """A strategy from its name: local, device, dist_sync, dist_async, dist_sync_device,
        dist_async_device (MXNet's kvstore types), collective (or ddp), ps, hybrid, fsdp, with optional
        `field=value` settings after a colon: "collective:accumulation_steps=4,compression=bf16"."""
        if isinstance(name, Strategy):
            return name
        if not isinstance(name, str):
            raise TypeError(f"strategy must be a str or a Strategy, not {type(name).__name__}")
        base, _, settings = name.partition(":")
        base = base.strip()
        if base not in NAMED:
            raise ValueError(f"strategy {base!r} is not one of {', '.join(NAMED)}{did_you_mean(base, NAMED)}")
        changes = {}
        for item in filter(None, (s.strip() for s in settings.split(","))):
            field, eq, text = item.partition("=")
            field = field.strip()
            if field not in FIELD_TYPES:
                raise ValueError(
                    f"strategy setting {item!r}: Strategy has no field {field!r} (its fields: "
                    f"{', '.join(FIELD_TYPES)}){did_you_mean(field, FIELD_TYPES)}"
                )
            if not eq:
                raise ValueError(f"strategy setting {item!r} is not field=value (e.g. {field}=...)")
            changes[field] = _convert(field, text.strip())
        return NAMED[base].replace(**changes)


FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(Strategy)} | {
    "staleness": "int",
    "backup_workers": "int",
}


def did_you_mean(word: object, choices: Iterable[object]) -> str:
    """The end of an error about a misspelt word: "; did you mean 'x'?" naming the nearest choice,
    or "" when none is near."""
    names = [str(choice) for choice in choices if choice is not None]
    nearest = difflib.get_close_matches(str(word), names, n=1, cutoff=0.6)
    return f"; did you mean {nearest[0]!r}?" if nearest else ""


def _convert(field: str, text: str) -> Any:
    kind = FIELD_TYPES[field]
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "float | None":
            return None if text in ("", "none", "None") else float(text)
        if kind == "bool":
            return {"true": True, "1": True, "false": False, "0": False}[text.lower()]
    except KeyError:
        raise ValueError(f"strategy setting {field}={text!r} is not true or false") from None
    except ValueError:
        raise ValueError(f"strategy setting {field}={text!r} is not a number") from None
    return None if text in ("", "none", "None") else text


NAMED = {
    "local": Strategy(architecture="local"),
    "device": Strategy(architecture="local"),
    "collective": Strategy(architecture="collective"),
    "ps": Strategy(architecture="ps"),
    "dist_sync": Strategy(architecture="ps"),
    "dist_async": Strategy(architecture="ps", consistency=Async()),
    "dist_sync_device": Strategy(architecture="ps", aggregation="host"),
    "dist_async_device": Strategy(architecture="ps", consistency=Async(), aggregation="host"),
    "hybrid": Strategy(architecture="hybrid"),
    "fsdp": Strategy(architecture="fsdp"),
    "ddp": Strategy(architecture="collective"),  # torch's name for it: DistributedDataParallel
}


def idle_servers_warning(strategy: Strategy, num_servers: int, tables: int) -> str | None:
    """What to tell the user when the job's servers will have nothing to do: a hybrid strategy keeps
    only embedding tables on them, and the model has `tables` of them. None when they have work."""
    if strategy.architecture != "hybrid" or not num_servers or tables:
        return None
    return (
        "strategy hybrid keeps only embedding tables (paratrain.kvstore.DistributedEmbedding) on the "
        f"servers, and this model has none: the job's {num_servers} server(s) are idle. Use strategy "
        "'collective' (launch with -s 0), or 'ps' to keep every parameter on the servers"
    )


def resolve_strategy(strategy: str | Strategy | None, num_servers: int, distributed: bool = True) -> Strategy:
    """The given strategy, else PARATRAIN_STRATEGY, else dist_sync where the job has servers and
    collective where it has none. A script run alone (not `distributed`) may name any strategy."""
    if strategy is None:
        strategy = os.environ.get(ENV_VAR) or ("dist_sync" if num_servers else "collective")
    strategy = Strategy.parse(strategy)
    if distributed and strategy.architecture in ("ps", "hybrid") and not num_servers:
        raise ValueError(
            f"strategy architecture={strategy.architecture!r} needs servers, and this job has none "
            "(launch with -s 1 or more, or use strategy 'collective')"
        )
    return strategy


def kvstore_config(strategy: Strategy, *, average: bool = False) -> KVStoreConfig:
    """The kvstore settings of a strategy (ps: the dense keys; hybrid: the embedding tables).
    `average`: rounds apply the mean of their pushes (the trainer's dense keys), not the sum."""
    return KVStoreConfig(
        consistency=strategy.consistency,
        aggregation=strategy.aggregation,
        average=average,
    )


def pipeline_config(strategy: Strategy, **overrides: Any) -> PipelineConfig:
    """The pipeline settings of a strategy: its stages, micro-batches and schedule; replicas of a
    stage sync through the servers ("ps") in a parameter-server strategy, else by all-reduce.
    `overrides` set any PipelineConfig field directly."""
    from paratrain.pipeline.api import PipelineConfig  # torch: imported only where a pipeline runs

    fields = {
        "stages": strategy.pipeline_stages,
        "micro_batches": strategy.micro_batches,
        "schedule": strategy.pipeline_schedule,
        "replica_sync": "ps" if strategy.architecture == "ps" else "allreduce",
    }
    return PipelineConfig(**{**fields, **overrides})
