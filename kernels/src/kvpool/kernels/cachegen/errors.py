"""The one exception the CacheGen codec raises for bad input or a bad container.

Why its own module: every layer of the codec (quantizer, coders, container parser) reports
problems through this single class, so a caller that decodes bytes from a remote tier or a
peer needs exactly one ``except`` clause and never sees an IndexError or a numba crash.
"""

from __future__ import annotations


class CacheGenError(ValueError):
    """Bad KV input, bad codec parameters, or a container that fails validation.

    The message names the field that is wrong and, where there is one, the fix.
    """
