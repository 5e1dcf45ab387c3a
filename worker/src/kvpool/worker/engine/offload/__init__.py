"""KV offload of the reference engine through the real LMCache engine.

Why this package exists: the engine core imports one name, :class:`LMCacheOffload`, and never
sees LMCache. Inside: the CPU paged connector, the chunk integrity guard, tier handling and the
LMCache engine wrapper.
"""

from kvpool.worker.engine.offload.config import OffloadConfigError, load_config
from kvpool.worker.engine.offload.lmcache_offload import LMCacheOffload

__all__ = ["LMCacheOffload", "OffloadConfigError", "load_config"]
