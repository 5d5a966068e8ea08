"""The prefill/decode hand-off, written once for the builtin workers and the vLLM connector.

Decode side: reserve pages and an immediate, scope the registration the prefiller writes
through, admit once every expected write has landed (and the checksums agree), fence
before pages are reused, cancel. Prefill side: plan each layer's writes, post them, track
what is in flight, abort. Each is an explicit state machine without threads of its own;
the builtin workers and the connector are adapters that own the threads and decide how a
reservation travels (relayed by the router, or sent over the fabric).

This layer sits on kv (geometry, protocol, page allocator, checksums) and transfer.
"""
