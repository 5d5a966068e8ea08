"""Mamba/SSM state groups of vLLM's KV cache: which groups hold a running state instead of
a page per token, whether the connector can push them, and their block ids per prompt page.

A Mamba-bearing hybrid model (attention plus Mamba-2 mixers, e.g. GraniteMoeHybrid) runs
under vLLM's hybrid KV cache manager with one `MambaSpec` group per set of mixers. Without
prefix caching (`mamba_cache_mode` "none") a request holds one block of such a group: per
mixer layer, its conv window and SSM state after the tokens computed so far, in the first
`real_page_size_bytes` of a page that vLLM pads to the attention page size and overlays on
the attention groups' allocation (one block pool). The connector pushes that block once,
after the prompt's last step, and names it in the reservation as the group's block of the
last prompt page (every earlier page -1: nothing pushed there), so the plan, the counts and
the checksums of attention groups carry it unchanged.

The state is cumulative, and a decoder recomputes the last prompt token itself (vLLM
samples the first token there): it must receive the state after all prompt tokens but
the last. So, as vLLM's NixlConnector does, a prefill leg computes the prompt less its
last token (`truncate_prefill_prompt`) and a decode leg loads that many tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .settings import ConnectorConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: Prompt tokens a decoder recomputes on top of a loaded state (vLLM's last-token recompute).
RECOMPUTED_TOKENS = 1

#: The mixer kinds (vLLM's `MambaAttentionBackendEnum` names) whose state the connector
#: pushes, each with the model on which vLLM decoding it was shown equal to colocated
#: (tests/integrations/test_vllm_mamba.py). Kinds differ in their state tensors and kernels:
#: one not run through the connector is refused rather than assumed alike.
SHOWN_MIXER_KINDS = {"MAMBA2": "GraniteMoeHybrid (Mamba-2)"}
#: Kinds run through the connector and refused for what was seen there.
REFUSED_MIXER_KINDS = {
    "GDN_ATTN": "run through the connector on a seeded Qwen3-Next, the state arrives byte-equal, but the decoder "
                "computes the last prompt token with vLLM's one-token delta-rule step where colocated vLLM uses its "
                "chunked kernel, and the two round differently: greedy tokens and logprobs differ from colocated "
                "(vLLM alone differs between the two kernels as much)",
}


@dataclass(frozen=True)
class StateGroup:
    """One Mamba/SSM group: its index among vLLM's KV cache groups and what its state is."""

    group: int
    layer_names: tuple[str, ...]
    #: Bytes of one layer's state at the start of its page (conv window then SSM state).
    state_bytes: int
    #: The state tensors' shapes and dtypes, for the kv_layout (peers must agree on them;
    #: the conv window's orientation, vLLM's SD or DS conv state layout, is in its shape).
    shapes: str


def state_groups(kv_cache_config: KVCacheConfig | None) -> list[StateGroup]:
    """The Mamba/SSM groups of `kv_cache_config`, in group order (empty: attention only)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    out = []
    for index, group in enumerate([] if kv_cache_config is None else kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            shapes = "+".join(f"{'x'.join(map(str, shape))}-{str(dtype).removeprefix('torch.')}"
                              for shape, dtype in zip(spec.shapes, spec.dtypes))
            out.append(StateGroup(index, tuple(group.layer_names), int(spec.real_page_size_bytes), shapes))
    return out


def check_state_groups(kv_cache_config: KVCacheConfig) -> None:
    """Refuses Mamba/SSM state the connector cannot push (ConnectorConfigError with the
    reason): a mixer kind not in `SHOWN_MIXER_KINDS`, prefix caching's per-block states
    (`mamba_cache_mode` align or all), speculative state blocks, and a model with no
    attention layer (the state rides in the attention groups' allocation). Any tensor
    parallel size passes here: a pairing of different sizes is refused per request
    (`unequal_tensor_parallel_state`), as a peer's size is known only then."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    groups = list(kv_cache_config.kv_cache_groups)
    for group in groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, MambaSpec):
            continue
        name = f"KvxferConnector: the Mamba/SSM state group ({len(group.layer_names)} layers)"
        kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
        if kind not in SHOWN_MIXER_KINDS:
            seen = REFUSED_MIXER_KINDS.get(kind, "the connector was never shown to hand their state over equal to "
                                                 "colocated vLLM")
            raise ConnectorConfigError(f"{name} holds {kind} mixers: {seen}; it pushes the state of "
                                       f"{', '.join(SHOWN_MIXER_KINDS.values())} mixers only")
        if spec.mamba_cache_mode != "none":
            raise ConnectorConfigError(
                f"{name} keeps a state per block position (mamba_cache_mode {spec.mamba_cache_mode!r}, prefix "
                "caching); the connector pushes one state per request: add --no-enable-prefix-caching")
        if spec.num_speculative_blocks:
            raise ConnectorConfigError(f"{name} has {spec.num_speculative_blocks} speculative state blocks; the "
                                       "connector pushes one state per request (no speculative decoding)")
    if not any(isinstance(g.kv_cache_spec, AttentionSpec) for g in groups):
        raise ConnectorConfigError("KvxferConnector: the KV cache has no attention layer; Mamba/SSM state is pushed "
                                   "for hybrid models (attention plus state) only")


def unequal_tensor_parallel_state(has_state: bool, prefill_tp: int, decode_tp: int) -> str:
    """Why a hand-off of a cache with Mamba/SSM state (`has_state`) between these tensor
    parallel sizes is refused ("" where it is not): a rank's state holds its heads' slice of
    every mixer (conv channels, SSM heads), which goes whole from prefill rank r to decode
    rank r at equal sizes; between different sizes it would have to be cut per head, which
    the head-slice plans of attention pages do not describe."""
    if not has_state or prefill_tp == decode_tp:
        return ""
    return (f"Mamba/SSM state is handed over between equal tensor parallel sizes only (prefill {prefill_tp}, decode "
            f"{decode_tp}): a rank's state is its heads' slice of each mixer, which is not cut between sizes")


def per_prompt_page(block_ids: list[int], pages: int) -> list[int]:
    """A state group's block ids as the per-prompt-page list a reservation and a push carry:
    the request's one state block at the last of `pages`, -1 before it (nothing pushed)."""
    if len(block_ids) != 1:
        raise ValueError(f"a request holds {len(block_ids)} blocks of a Mamba/SSM group; one was expected "
                         "(mamba_cache_mode none)")
    return [-1] * (pages - 1) + [int(block_ids[0])] if pages > 0 else []


def truncate_prefill_prompt(request: Any) -> bool:
    """Drops the last prompt token of a prefill leg's request (and lets it sample one
    token only), so that its state is the one a decoder needs before it recomputes that
    token; True if it did. A prompt of one token, or of embeddings, is left whole (and
    not pushed)."""
    if request.num_prompt_tokens <= RECOMPUTED_TOKENS or request.prompt_token_ids is None:
        return False
    del request.prompt_token_ids[-RECOMPUTED_TOKENS:]
    del request._all_token_ids[-RECOMPUTED_TOKENS:]
    request.num_prompt_tokens -= RECOMPUTED_TOKENS
    request.max_tokens = 1
    return True
