"""Names for prompt prefixes: one chained hash per full block of tokens.

Block `i`'s hash covers every token of blocks ``0..i`` (it folds in block `i - 1`'s
hash), as vLLM's prefix cache names its blocks, so two prompts share block `i`'s hash
exactly when they share their first ``(i + 1) * block_size`` tokens. A partial last block
has no hash: it may still grow, and a cache keeps only full blocks.

The router's KV index and the builtin workers' prefix caches use this one definition, so a
hash a worker reports means the same prefix to the router. Hashes are 16-byte BLAKE2b
digests written as 32 hex characters on the wire (JSON-safe, no pickle); `namespace`
separates models or tokenizers whose token ids mean different things.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

#: Bytes of one block hash (hex on the wire is twice as long).
BLOCK_HASH_BYTES = 16
#: The parent hash of block 0.
ROOT_HASH = bytes(BLOCK_HASH_BYTES)


def block_hashes(tokens: Sequence[int], block_size: int, namespace: str = "") -> list[bytes]:
    """Chained hashes of the full `block_size`-token blocks of `tokens`, block 0 first.

    Raises ValueError for a block size below 1 or a token id that is negative or does not
    fit 32 bits.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    parent = hashlib.blake2b(namespace.encode(), digest_size=BLOCK_HASH_BYTES).digest() if namespace else ROOT_HASH
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start:start + block_size]
        try:
            packed = struct.pack(f"<{block_size}I", *block)
        except struct.error as exc:
            raise ValueError(f"token ids must fit in 32 unsigned bits: {exc}") from None
        parent = hashlib.blake2b(parent + packed, digest_size=BLOCK_HASH_BYTES).digest()
        hashes.append(parent)
    return hashes


def block_hashes_hex(tokens: Sequence[int], block_size: int, namespace: str = "") -> list[str]:
    """:func:`block_hashes` as hex strings, the form they take in JSON."""
    return [h.hex() for h in block_hashes(tokens, block_size, namespace)]


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a `num_tokens`-token prompt a cache may serve: every
    full block but the one holding the prompt's last token, whose hidden state makes the
    first generated token and so must be computed by the request itself."""
    return max(num_tokens - 1, 0) // block_size


def matched_blocks(hashes: Sequence[bytes] | Sequence[str], held: "set[bytes] | set[str]") -> int:
    """How many leading blocks of `hashes` are in `held` (a prefix match stops at the first miss)."""
    count = 0
    for h in hashes:
        if h not in held:
            break
        count += 1
    return count
