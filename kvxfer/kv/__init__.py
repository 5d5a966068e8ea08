"""The KV data plane: page geometry, the paged cache, the page allocator and the push.

Imports only the transfer layer and `kvxfer.errors`; the model builds on it, never the
other way round (the cache takes any object with the `KVGeometry` fields).
"""
