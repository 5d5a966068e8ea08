"""The transfer layer: the native WriteImm engine's Python face and shared memory.

Imports only `kvxfer.errors` and the native extension (and torch, in `device_staging`,
which moves device caches through pinned host memory). Everything above (KV cache, push,
workers) moves bytes through `TransferEngine`; nothing above touches libfabric.
"""
