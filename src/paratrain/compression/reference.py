"""The codecs in plain Python, one element at a time: obviously right, slow, for tests only.

tests/test_compression.py checks codecs.py (torch and numba) against these on random tensors.
"""

from __future__ import annotations


def encode_2bit(
    values: list[float], residual: list[float] | None, threshold: float
) -> tuple[bytes, list[float]]:
    """MXNet's 2-bit rule: (packed codes, new residual). Element i sits in bits 2 (i % 4).. of byte
    i // 4: 1 for +threshold, 2 for -threshold, 0 for zero."""
    packed = bytearray((len(values) + 3) // 4)
    left = []
    for i, value in enumerate(values):
        v = value + (residual[i] if residual is not None else 0.0)
        code = 0
        if v >= threshold:
            code, v = 1, v - threshold
        elif v <= -threshold:
            code, v = 2, v + threshold
        packed[i // 4] |= code << (2 * (i % 4))
        left.append(v)
    return bytes(packed), left


def decode_2bit(packed: bytes, count: int, threshold: float) -> list[float]:
    values = []
    for i in range(count):
        code = (packed[i // 4] >> (2 * (i % 4))) & 3
        values.append(threshold if code == 1 else -threshold if code == 2 else 0.0)
    return values


def encode_topk(
    values: list[float], residual: list[float] | None, k: int
) -> tuple[dict[int, float], list[float]]:
    """The k elements of largest |value + residual| as {index: value}, and the new residual (the
    rest; zero where sent)."""
    corrected = [v + (residual[i] if residual is not None else 0.0) for i, v in enumerate(values)]
    order = sorted(range(len(corrected)), key=lambda i: -abs(corrected[i]))
    sent = {i: corrected[i] for i in order[:k]}
    return sent, [0.0 if i in sent else v for i, v in enumerate(corrected)]


def decode_topk(sent: dict[int, float], count: int) -> list[float]:
    return [sent.get(i, 0.0) for i in range(count)]
