"""The ``kv_aware`` pair policy: the pair with the lowest estimated time to first token.

For each (decode, prefill) pair the estimate, in milliseconds, is::

    prefill_token_cost_ms  x  prompt tokens the prefill worker does not hold (its own cache)
  + transfer_page_cost_ms  x  KV pages the decode worker does not hold (they cross the wire)
  + load_cost_ms           x  (requests on the decode worker + requests on the prefill worker)

and a decode worker that holds at least ``skip_prefill_fraction`` of the prompt's blocks may
serve it alone, without a prefill leg (it computes the rest itself)::

    prefill_token_cost_ms x tokens it does not hold  +  load_cost_ms x requests on it

What each worker holds comes from the router's :class:`~kvxfer_router.kv_index.KvIndex`; a
worker the index knows nothing usable of (no report, or a stale one) counts as holding
nothing; when that is true of every candidate the estimates differ by load alone (outcome
``fallback``). Equal estimates take turns, as in ``least_loaded``.
"""

from __future__ import annotations

import math
from typing import Sequence

from .directory import WorkerView
from .kv_index import KvIndex, PromptBlocks
from .policies import FairTies, LeastLoadedPolicy, LocalLoad, PairPolicy, RoutingEstimate, WorkerPair
from .settings import RouterSettings


class KvAwarePolicy(PairPolicy):
    """Chooses the pair (or the decode worker alone) with the lowest estimated time to
    first token from where the prompt's KV already is and the load on each worker; see the
    module docs for the estimate. Without a prompt it chooses as ``least_loaded`` does."""

    name = "kv_aware"

    def __init__(self, settings: RouterSettings, index: KvIndex | None = None) -> None:
        self._s = settings
        self.kv_index = index if index is not None else KvIndex(settings)
        self._by_load = LeastLoadedPolicy()
        self._ties = FairTies()

    def choose_decode(self, candidates: Sequence[WorkerView], load: LocalLoad) -> WorkerView:
        """As ``least_loaded``: used when there is no prompt to weigh."""
        return self._by_load.choose_decode(candidates, load)

    def choose_prefill(self, candidates: Sequence[WorkerView], load: LocalLoad) -> WorkerView:
        """As ``least_loaded``: used when there is no prompt to weigh."""
        return self._by_load.choose_prefill(candidates, load)

    def choose_pair(self, decodes: Sequence[WorkerView], prefills: Sequence[WorkerView], load: LocalLoad, *,
                    needs_prefill: bool, prompt: PromptBlocks | None) -> WorkerPair:
        """The option with the lowest estimate (module docs); ``fallback`` to load alone when
        the index knows nothing of any candidate."""
        index = self.kv_index
        assert index is not None
        if prompt is None:
            chosen = self._by_load.choose_pair(decodes, prefills, load, needs_prefill=needs_prefill, prompt=None)
            return WorkerPair(chosen.decode, chosen.prefill, RoutingEstimate("fallback"))
        held = {w.worker_id: index.held_units(w, prompt) for w in (*decodes, *prefills)}
        # Knowing nothing, every worker counts as holding nothing: the estimates then differ
        # by load alone, which is the fallback.
        knows_nothing = all(v is None for v in held.values())
        s = self._s
        units_per_token = s.text_bytes_per_token if prompt.is_text else 1.0
        # A prefill worker's part of the estimate does not depend on the decoder: the best
        # one of each compatible group is chosen once, so the options grow with decoders +
        # prefillers rather than their product (this runs on the event loop per request).
        groups: dict[tuple[str, str, str], list[tuple[float, WorkerView]]] = {}
        for p in prefills if needs_prefill else ():
            cost = (s.prefill_token_cost_ms * (prompt.units - (held[p.worker_id] or 0)) / units_per_token
                    + s.load_cost_ms * (p.queue_depth + load.get(p.worker_id)))
            groups.setdefault(_compatibility(p), []).append((cost, p))
        best_prefill = {key: self._ties.pick("prefill", group, key=lambda o: o[0], worker_id=lambda o: o[1].worker_id)
                        for key, group in groups.items()}
        # Sort key: a decoder without free pages last, then the estimate, then the decoder
        # alone before a pair of equal estimate (a leg more is never free).
        options: list[tuple[tuple[bool, float, bool], WorkerPair]] = []
        for d in decodes:
            d_held = held[d.worker_id] or 0
            d_block = index.block_size(d, prompt)
            d_blocks = d_held // d_block
            missing_tokens = (prompt.units - d_held) / units_per_token
            d_load = d.running + load.get(d.worker_id)
            full = d.free_pages <= 0  # its /reserve would fail: last resort only
            total_blocks = prompt.units // d_block
            if not needs_prefill or (total_blocks and d_blocks >= s.skip_prefill_fraction * total_blocks):
                cost = s.prefill_token_cost_ms * missing_tokens + s.load_cost_ms * d_load
                options.append(((full, cost, False), WorkerPair(d, None, RoutingEstimate("decoder_only", d_blocks))))
            prefill = best_prefill.get(_compatibility(d))
            if prefill is None:
                continue
            p_cost, p = prefill
            tokens_per_page = s.approximate_block_tokens if prompt.is_text else d_block
            cost = (p_cost + s.transfer_page_cost_ms * math.ceil(missing_tokens / tokens_per_page)
                    + s.load_cost_ms * d_load)
            p_blocks = (held[p.worker_id] or 0) // index.block_size(p, prompt)
            options.append(((full, cost, True), WorkerPair(d, p, RoutingEstimate("pair", d_blocks, p_blocks))))
        chosen = self._ties.pick("pair", options, key=lambda o: o[0], worker_id=_option_ids)[1]
        if knows_nothing:
            return WorkerPair(chosen.decode, chosen.prefill, RoutingEstimate("fallback"))
        return chosen

    def served(self, pair: WorkerPair, prompt: PromptBlocks | None) -> None:
        """Record that ``pair``'s workers now hold ``prompt``'s KV (approximate feed)."""
        if prompt is None or self.kv_index is None:
            return
        self.kv_index.record_routed(pair.decode, prompt)
        if pair.prefill is not None:
            self.kv_index.record_routed(pair.prefill, prompt)


def _compatibility(worker: WorkerView) -> tuple[str, str, str]:
    # What policies.compatible compares: a prefill worker may serve a decoder with the same key.
    return (worker.model, worker.layout_key, worker.engine)


def _option_ids(option: tuple[tuple[bool, float, bool], WorkerPair]) -> str:
    # Sort key of tied options: decode id, then prefill id ("" for the decoder alone).
    pair = option[1]
    return f"{pair.decode.worker_id}\0{pair.prefill.worker_id if pair.prefill else ''}"
