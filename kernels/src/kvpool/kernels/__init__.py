"""kvpool kernels: device-agnostic KV operations in PyTorch (CPU, CUDA, NPU via torch_npu).

Paged KV gather/scatter between engine layouts and LMCache chunks, the CacheGen codec and
CacheBlend re-rotation and selective recompute.
"""
