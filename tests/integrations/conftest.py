"""The vLLM pair the integration modules share (test_vllm_api_conformance.py,
test_vllm_block_checksums.py, test_vllm_own_command_lines.py, test_vllm_connector.py):
started on first use, stopped after the last test that uses it, so the rest of the suite
does not carry two idle vLLM instances."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from support.vllm_instances import SharedConnectorFleet

_FIXTURE = "shared_vllm_pair"
_shared: list[SharedConnectorFleet] = []
#: The last test of this module kills the pair's prefiller (a restart costs a minute): its
#: tests run after those of every other module that uses the pair.
_RUNS_LAST = "test_vllm_connector.py"


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


def _halves_engine() -> Iterator[Any]:
    from support.connector_halves import halves_engine
    from kvxfer.transfer.engine import available_providers

    engine = halves_engine("net" if "net" in available_providers() else "tcp")
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def decoder_engine() -> Iterator[Any]:
    """An engine as the connector's decode half makes one, on loopback, for one module."""
    yield from _halves_engine()


@pytest.fixture(scope="module")
def prefill_engine() -> Iterator[Any]:
    """An engine as the connector's prefill half makes one, on loopback, for one module."""
    yield from _halves_engine()


@pytest.fixture(scope="module")
def same_host_decoder() -> Iterator[Any]:
    """A decoder engine that offers the same-host path (a prefiller on this host writes into
    it by memcpy, and the decoder pins its process to prove its death), for one module."""
    from kvxfer.transfer.engine import TransferEngine, available_providers

    engine = TransferEngine("net" if "net" in available_providers() else "tcp", same_host=True,
                            bind_host="127.0.0.1", imm_admission="claimed")
    try:
        yield engine
    finally:
        engine.close()


def _uses_pair(item: pytest.Item) -> bool:
    return _FIXTURE in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    # The pair's modules run one after another (one start serves them all), _RUNS_LAST's
    # last: its tests move to the end of the block, the others keep their order.
    users = [i for i, item in enumerate(items) if _uses_pair(item)]
    if not users:
        return
    block = [items[i] for i in users]
    block = [t for t in block if t.path.name != _RUNS_LAST] + [t for t in block if t.path.name == _RUNS_LAST]
    rest = [item for item in items if not _uses_pair(item)]
    items[:] = rest[:users[0]] + block + rest[users[0]:]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # Stop the pair as soon as no further test needs it (the session fixture would keep it
    # to the end of the whole suite); a later module asking again starts it again.
    if _uses_pair(item) and not (nextitem is not None and _uses_pair(nextitem)):
        for pair in _shared:
            pair.close()
