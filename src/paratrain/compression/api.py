"""What a user sets for gradient compression: one frozen, validated value."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

KINDS = ("2bit", "topk", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class CompressionConfig:
    type: str
    """2bit, topk, fp16, bf16 or powersgd (collective only)."""
    threshold: float = 0.02
    """2bit: an element is sent as +threshold where it is >= threshold, -threshold where it is
    <= -threshold, else 0 (MXNet's rule); the rest stays in the error feedback. It should be near
    the gradient elements' size: MXNet's 0.5 is far above most models' (docs/concepts/threshold.md)."""
    ratio: float = 0.01
    """topk: the fraction of each tensor's elements sent (at least one): those of largest |value|."""
    rank: int = 1
    """powersgd: the rank of the low-rank approximation of each gradient matrix."""
    error_feedback: bool = True
    """Keep what a lossy encoding did not send, per tensor, and add it to the next gradient."""
    min_elements: int = 1024
    """Tensors (kvstore keys, DDP buckets) of fewer elements travel uncompressed: their bytes are
    few, and compressing them (biases, norms) costs accuracy for little (BytePS and DGC leave
    them out too)."""

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"compression {field}={getattr(self, field)!r} {why}")

        if self.type not in KINDS:
            raise bad("type", f"is not one of {KINDS}")

        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        number = (int, float)
        if (
            not isinstance(self.threshold, number)
            or isinstance(self.threshold, bool)
            or not self.threshold > 0
        ):
            raise bad("threshold", "must be a number > 0")
        if not isinstance(self.ratio, number) or isinstance(self.ratio, bool) or not 0 < self.ratio <= 1:
            raise bad("ratio", "must be a number in (0, 1]")
        if not is_int(self.rank) or self.rank < 1:
            raise bad("rank", "must be an int >= 1")
        if (
            not isinstance(self.min_elements, int)
            or isinstance(self.min_elements, bool)
            or self.min_elements < 0
        ):
            raise bad("min_elements", "must be an int >= 0")
        if not isinstance(self.error_feedback, bool):
            raise bad("error_feedback", "must be a bool")

    @classmethod
    def parse(cls, spec: str | dict | CompressionConfig | None) -> CompressionConfig | None:
        """A config from a kind name ("2bit"), MXNet's dict ({"type": "2bit", "threshold": 0.5}),
        a config, or None (no compression; also the dict {"type": "none"})."""
        if spec is None or isinstance(spec, CompressionConfig):
            return spec
        if isinstance(spec, str):
            return None if spec == "none" else cls(type=spec)
        if not isinstance(spec, dict):
            raise TypeError(f"compression must be a kind name, a dict or a CompressionConfig, not {spec!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - fields)
        if unknown:
            raise ValueError(f"compression setting {unknown[0]!r} is not one of {sorted(fields)}")
        if "type" not in spec:
            raise ValueError(f"compression {spec!r} has no 'type' (one of {KINDS})")
        return None if spec["type"] == "none" else cls(**spec)

    def to_wire(self) -> dict[str, Any]:
        """Plain data for a frame's header (the servers decode with it)."""
        return dataclasses.asdict(self)

    @property
    def sends_updates(self) -> bool:
        """Whether a training engine sends the optimizer's update rather than the gradient (topk).

        Top-k with error feedback holds an element back until its accumulated value is among the
        largest: on digits about half of each compressed weight is never sent in 264 steps. SGD
        does not mind (the total reaches the weights late), but an adaptive optimizer fed the
        accumulated value in one step moves it by about one step's size, where the same gradient
        spread over T steps moves it T times (Adam on the server moved the compressed layers 0.3-0.8x
        as far as uncompressed). So the workers run the optimizer on their own gradients and the
        update travels, top-k'd with error feedback (DGC's momentum correction, for any optimizer):
        what reaches the weights is, delayed, the sum of the updates. 2bit sends gradients (MXNet's
        rule); its threshold sends most elements every few steps."""
        return self.type == "topk"

    @property
    def lossy(self) -> bool:
        return True  # every kind rounds something away (fp16 and bf16 their mantissas)

    def replace(self, **changes: Any) -> CompressionConfig:
        return dataclasses.replace(self, **changes)
