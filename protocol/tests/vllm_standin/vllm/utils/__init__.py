"""vllm.utils stand-in: vLLM >= PR#27151 keeps its hash functions in vllm.utils.hashing."""
