"""The kvpool worker: the pod runtime (LMCache config, environment contract) and the CPU
reference engine whose real KV goes through the real LMCache engine.
"""
