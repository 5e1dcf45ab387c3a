"""CacheBlend: reuse non-prefix chunks' KV with RoPE re-rotation and selective (HKVD) recompute.

Pure tensor code (no I/O) on whatever device the tensors live on: :mod:`.rope` re-rotates
cached K, :mod:`.select` scores and picks rows, :mod:`.model` is the decoder math shared by full
prefill and blending, :mod:`.blend` is the blend prefill itself, :mod:`.segment` splits a
request into independently cached segments, and :mod:`.synthetic` builds the random-weight
model and RAG prompts that the tests and the benchmark share.
"""

from kvpool.kernels.blend.blend import (
    BlendConfig,
    BlendResult,
    CachedSegment,
    CheckStep,
    LoadedCache,
    blend_forward,
    blend_prefill,
    load_segments,
    reposition_keys,
)
from kvpool.kernels.blend.model import (
    DecoderWeights,
    KVCache,
    MaskKind,
    PrefillResult,
    full_prefill,
    logits,
)
from kvpool.kernels.blend.rope import RopeConfig, RopeStyle, apply_rope, rerope, rerope_two_step
from kvpool.kernels.blend.segment import Segment, segment_key, split_segments
from kvpool.kernels.blend.select import Selector

__all__ = [
    "BlendConfig",
    "BlendResult",
    "CachedSegment",
    "CheckStep",
    "DecoderWeights",
    "KVCache",
    "LoadedCache",
    "MaskKind",
    "PrefillResult",
    "RopeConfig",
    "RopeStyle",
    "Segment",
    "Selector",
    "apply_rope",
    "blend_forward",
    "blend_prefill",
    "full_prefill",
    "load_segments",
    "logits",
    "reposition_keys",
    "rerope",
    "rerope_two_step",
    "segment_key",
    "split_segments",
]
