"""Digests of KV pages for the connector's test hook (`kv_digest_dir`).

Both legs write the digest of every page they pushed or admitted, so a test can prove the
decoder's blocks are byte-identical to the prefiller's without reading either process's
memory. Off unless configured: it reads every page once more.
"""

from __future__ import annotations

import hashlib


def page_digest(raw: bytes) -> str:
    """A short, collision-resistant digest of one page (hex)."""
    return hashlib.blake2b(raw, digest_size=16).hexdigest()
