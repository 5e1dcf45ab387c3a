"""The kvpool gateway: an OpenAI-compatible router that sends each request to the instance
already holding the longest prefix of its KV.
"""
