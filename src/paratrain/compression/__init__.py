"""Gradient compression: the codecs (pure tensor code) that the kvstore and the collective share.

    config = CompressionConfig.parse({"type": "2bit", "threshold": 0.5})   # MXNet's form
    codec = make_codec(config)
    payload = codec.encode(grad, residual)      # residual: this tensor's error feedback, updated
    codec.decode(payload, out, add=True)        # out += what was sent

Kinds: 2bit (MXNet's: +threshold, -threshold or 0 per element, four to a byte), topk (the largest
|values| and their indices, DGC / BytePS), fp16 and bf16 (a cast). Error feedback (Seide et al. 2014;
Karimireddy et al. 2019) keeps what a lossy encoding did not send and adds it to the next gradient of
the same tensor. PowerSGD (a low-rank pair of all-reduces) is the collective's only: torch's hook.
"""

from paratrain.compression.api import KINDS, CompressionConfig
from paratrain.compression.codecs import Codec, compressible, make_codec

__all__ = ["KINDS", "Codec", "CompressionConfig", "compressible", "make_codec"]
