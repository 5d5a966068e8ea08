"""The vLLM pair the integration modules share (test_vllm_connector.py and
test_vllm_api_conformance.py): started on first use, stopped after the last test that uses
it, so the rest of the suite does not carry two idle vLLM instances."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from support.vllm_instances import SharedConnectorFleet

_FIXTURE = "shared_vllm_pair"
_shared: list[SharedConnectorFleet] = []


@pytest.fixture(scope="session")
def shared_vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedConnectorFleet]:
    """The shared pair (not started until a module asks it for its fleet or router)."""
    work = tmp_path_factory.mktemp("vllm")
    model = Path(os.environ.get("KVXFER_TEST_MODEL_DIR", work / "model"))
    pair = SharedConnectorFleet(work, model)
    _shared.append(pair)
    try:
        yield pair
    finally:
        pair.close()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # Stop the pair as soon as no further test needs it (the session fixture would keep it
    # to the end of the whole suite); a later module asking again starts it again.
    uses = _FIXTURE in getattr(item, "fixturenames", ())
    next_uses = nextitem is not None and _FIXTURE in getattr(nextitem, "fixturenames", ())
    if uses and not next_uses:
        for pair in _shared:
            pair.close()
