"""Page checksums on the vLLM path, with the real vLLM pair the integration modules share
(tests/integrations/conftest.py): the decoder (kv_integrity full, the default) checks every
landed block against the prefiller's CRC-32C table before it reports the load finished.

The prefiller flips one bit of one block it pushes, after taking its checksum (the
connector hook `flip_bit` of tests/support/vllm_faults.py, for this transfer only): the
decoder must fail that request (kv_load_failure_policy fail) with an error naming the
request, the layer and the block, and never admit it; the next request is exact.

Named to run between test_vllm_api_conformance.py and test_vllm_connector.py: both use the
pair, and the last test of the latter kills its prefiller (a restart costs a minute).
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed")

from support.vllm_instances import SharedConnectorFleet, VllmFleet  # noqa: E402
from support.vllm_legs import disaggregated_legs, prompt_ids  # noqa: E402
from support.waiting import wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fleet(shared_vllm_pair: SharedConnectorFleet) -> VllmFleet:
    return shared_vllm_pair.fleet()


def _legs(fleet: VllmFleet, prompt: list[int], tid: str) -> tuple[httpx.Response, httpx.Response]:
    """Both legs at once, as the router sends them: (prefill reply, decode reply)."""
    return disaggregated_legs(fleet, "prefill-a", "decode-a", prompt, tid, salt=tid, logprobs=None)


def test_a_flipped_bit_in_one_pushed_block_fails_that_request_and_is_never_admitted(fleet: VllmFleet) -> None:
    digests = fleet.digests  # type: ignore[attr-defined]
    tid = f"fault-flip_bit-{uuid.uuid4().hex[:8]}"
    on_p, on_d = _legs(fleet, prompt_ids(100, seed=81), tid)
    assert on_p.status_code == 200, on_p.text  # the prefiller does not know: only the check can tell
    assert on_d.status_code >= 400 or on_d.json()["choices"][0].get("finish_reason") == "error", on_d.text
    decode_log = fleet.instances["decode-a"].log_text

    def failure() -> str:
        return next((ln for ln in decode_log().splitlines() if f"transfer {tid} " in ln and "load failed" in ln), "")

    line = wait_until(failure, timeout_s=10, interval_s=0.1, what="the decoder's integrity error")
    assert "checksum_mismatch" in line and "layer 1, block " in line and "prompt page 0" in line, line
    assert not (digests / f"decode-{tid}.json").exists(), "the corrupted load was admitted"
    # The decoder serves the next hand-off, its blocks exactly the prefiller's.
    ok = f"after-flip-{uuid.uuid4().hex[:8]}"
    _, on_d = _legs(fleet, prompt_ids(100, seed=81), ok)
    assert on_d.status_code == 200, on_d.text
    files = [digests / f"{role}-{ok}.json" for role in ("prefill", "decode")]
    wait_until(lambda: all(f.exists() for f in files), timeout_s=30, interval_s=0.1, what=f"the digests of {ok}")
    prefill_pages, decode_pages = (json.loads(f.read_text())["pages"] for f in files)
    assert prefill_pages == decode_pages
