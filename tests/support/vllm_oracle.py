"""The oracle of the vLLM tests: a disaggregated answer equals colocated vLLM's.

Greedy text and token ids exactly; top logprobs as the same token sets, each logprob within
one bf16 step of colocated's (the two caches may round the last bit differently).
"""

from __future__ import annotations

from typing import Any

#: One bf16 step at these magnitudes (|logprob| < 16): 2**-8 relative, 0.0625 absolute at most.
LOGPROB_TOLERANCE = 0.0625


def assert_same_as_colocated(choice: dict[str, Any], ref: dict[str, Any]) -> None:
    """Asserts that completion choice `choice` (with logprobs) equals colocated's `ref`."""
    assert choice["text"] == ref["text"]
    got, want = choice["logprobs"], ref["logprobs"]
    assert got["tokens"] == want["tokens"]
    for mine, theirs in zip(got["top_logprobs"], want["top_logprobs"]):
        assert set(mine) == set(theirs), (mine, theirs)
        for tok, lp in theirs.items():
            assert abs(mine[tok] - lp) <= LOGPROB_TOLERANCE, (tok, mine[tok], lp)
