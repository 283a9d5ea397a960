"""What kvgate reproduces of the vLLM engine: its tokenization and its KV-cache event wire format.

Shared by the gateway (precise routing) and the simulator (which must speak as vLLM speaks).
"""
