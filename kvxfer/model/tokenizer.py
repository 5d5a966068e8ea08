"""Byte-level tokenizer: token ids 0..255 are UTF-8 bytes, then BOS and EOS.

Nothing is downloaded or trained, so every worker tokenizes identically and any string
round-trips. The vocabulary is the smallest that can encode arbitrary text.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Ids below this are raw bytes.
NUM_BYTE_TOKENS = 256
#: Beginning-of-sequence id, prepended by `ByteTokenizer.encode` unless told otherwise.
BOS_ID = 256
#: End-of-sequence id; generation stops when the model emits it.
EOS_ID = 257
#: Number of ids the tokenizer can produce; a model's vocab_size must be at least this.
VOCAB_SIZE = 258


class ByteTokenizer:
    """Encode text as its UTF-8 bytes (one token per byte) and decode ids back to text.

    `encode` prepends BOS by default, as the model is meant to see it at position 0.
    `decode` drops the special ids and replaces byte sequences that are not valid UTF-8
    (a generation can stop in the middle of a multi-byte character) with U+FFFD rather
    than raising.
    """

    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    vocab_size: int = VOCAB_SIZE

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Return the token ids of `text`: optional BOS followed by one id per UTF-8 byte."""
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Return the text of `ids`, skipping BOS/EOS; invalid UTF-8 becomes U+FFFD.

        Raises ValueError for an id outside the vocabulary, since that means the caller
        mixed up tokenizers or models.
        """
        out = bytearray()
        for token in ids:
            if 0 <= token < NUM_BYTE_TOKENS:
                out.append(token)
            elif token in (BOS_ID, EOS_ID):
                continue
            else:
                raise ValueError(f"token id {token} is outside the byte tokenizer's vocabulary 0..{VOCAB_SIZE - 1}")
        return out.decode("utf-8", errors="replace")
