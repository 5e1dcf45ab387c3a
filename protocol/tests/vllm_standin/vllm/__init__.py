"""A stand-in for the few lines of vLLM that lmcache 0.5.6's ChunkedTokenDatabase calls.

vLLM cannot be installed on these machines (CUDA/NPU builds that pin another torch), yet with
vLLM importable LMCache hashes differently: it takes vLLM's hash function and lets vLLM seed
NONE_HASH from PYTHONHASHSEED. The parity tests put this directory on PYTHONPATH of the lmcache
oracle process only, so lmcache's real lookup code (its import probing, its fallback to the
builtin hash for names vLLM does not know, its bytes-to-int folding) runs against vLLM's
behaviour as written in vllm/utils/hashing.py and vllm/v1/core/kv_cache_utils.py (vLLM
>= 0.10.2). Only what lmcache touches is here.
"""
