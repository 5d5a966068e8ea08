"""The control-plane token: bound to issuer, target worker, method, path, body and expiry; single use."""

from __future__ import annotations

import pytest

from kvxfer.registry.control_token import (
    REPLAY_SWEEP_MIN_ENTRIES,
    TokenRefused,
    TokenRejection,
    TokenSigner,
    TokenVerifier,
    WorkerIdentity,
)

KEY = b"k" * 48
OTHER_KEY = b"o" * 48
NOW = 1_700_000_000.0
BODY = b'{"request_id":"kx-1"}'
DECODE_1 = WorkerIdentity("decode", "decode-1")
DECODE_2 = WorkerIdentity("decode", "decode-2")


def verifier(identity: WorkerIdentity = DECODE_1, **kw: float) -> TokenVerifier:
    return TokenVerifier(KEY, identity, max_lifetime_s=kw.get("max_lifetime_s", 30.0),
                         clock_skew_s=kw.get("skew", 2.0))


def header(token: str) -> str:
    return f"KvxferToken {token}"


def refusal(v: TokenVerifier, hdr: str | None, *, path: str = "/reserve", body: bytes = BODY,
            now_s: float = NOW) -> TokenRejection:
    with pytest.raises(TokenRefused) as info:
        v.verify(hdr, "POST", path, body, now_s=now_s)
    return info.value.reason


def test_a_token_admits_exactly_the_request_it_was_minted_for() -> None:
    token = TokenSigner(KEY, "router", 10.0).token(DECODE_1, "POST", "/reserve", BODY, now_s=NOW)
    caller = verifier().verify(header(token), "POST", "/reserve", BODY, now_s=NOW + 1)
    assert caller.issuer == "router"


@pytest.mark.parametrize("path,body", [("/cancel", BODY), ("/reserve", BODY + b" "), ("/reserve", b"")])
def test_another_path_or_body_breaks_the_signature(path: str, body: bytes) -> None:
    token = TokenSigner(KEY, "router", 10.0).token(DECODE_1, "POST", "/reserve", BODY, now_s=NOW)
    assert refusal(verifier(), header(token), path=path, body=body) is TokenRejection.BAD_SIGNATURE


def test_a_token_from_another_cluster_key_is_a_bad_signature_403() -> None:
    token = TokenSigner(OTHER_KEY, "router", 10.0).token(DECODE_1, "POST", "/reserve", BODY, now_s=NOW)
    reason = refusal(verifier(), header(token))
    assert reason is TokenRejection.BAD_SIGNATURE and reason.status == 403


def test_a_changed_issuer_breaks_the_signature() -> None:
    token = TokenSigner(KEY, "router", 10.0).token(DECODE_1, "POST", "/reserve", BODY, now_s=NOW)
    assert refusal(verifier(), header(token.replace("v2.router.", "v2.attacker.", 1))) is TokenRejection.BAD_SIGNATURE


def test_expiry_allows_the_clock_skew_and_no_more() -> None:
    token = TokenSigner(KEY, "router", 10.0).token(DECODE_1, "POST", "/reserve", BODY, now_s=NOW)
    verifier().verify(header(token), "POST", "/reserve", BODY, now_s=NOW + 11.5)  # 1.5 s late, skew 2 s
    token = TokenSigner(KEY, "router", 10.0).token(DECODE_1, "POST", "/reserve", BODY, now_s=NOW)
    reason = refusal(verifier(), header(token), now_s=NOW + 12.5)
    assert reason is TokenRejection.EXPIRED and reason.status == 401


def test_a_token_living_longer_than_the_verifier_allows_is_refused() -> None:
    token = TokenSigner(KEY, "router", 3600.0).token(DECODE_1, "POST", "/reserve", BODY, now_s=NOW)
    assert refusal(verifier(max_lifetime_s=30.0), header(token)) is TokenRejection.TOO_LONG_LIVED


def test_a_token_is_good_once() -> None:
    v = verifier()
    token = TokenSigner(KEY, "router", 10.0).token(DECODE_1, "POST", "/reserve", BODY, now_s=NOW)
    v.verify(header(token), "POST", "/reserve", BODY, now_s=NOW)
    assert refusal(v, header(token)) is TokenRejection.REPLAYED


@pytest.mark.parametrize("hdr,reason", [
    (None, TokenRejection.MISSING),
    ("", TokenRejection.MISSING),
    ("Bearer abc", TokenRejection.MALFORMED),
    ("KvxferToken v1.router.1.2.3", TokenRejection.MALFORMED),
    ("KvxferToken " + "a" * 5000, TokenRejection.MALFORMED),
    # a v1 token (no target worker): no longer accepted anywhere
    ("KvxferToken v1.router.1700000010000." + "0" * 32 + "." + "0" * 64, TokenRejection.MALFORMED),
    ("KvxferToken v3.router." + "0" * 16 + ".1700000010000." + "0" * 32 + "." + "0" * 64, TokenRejection.MALFORMED),
])
def test_missing_or_malformed_headers_are_401(hdr: str | None, reason: TokenRejection) -> None:
    got = refusal(verifier(), hdr)
    assert got is reason and got.status == 401


def test_a_well_formed_forgery_is_403() -> None:
    forged = f"v2.router.{DECODE_1.fingerprint}.{int((NOW + 5) * 1000)}.{'0' * 32}.{'f' * 64}"
    assert refusal(verifier(), header(forged)) is TokenRejection.BAD_SIGNATURE


def test_the_replay_memory_holds_live_tokens_only_and_still_refuses_their_replay() -> None:
    # A worker verifies every control call's token for as long as it runs. Nonces of
    # expired tokens cannot be replayed (the token is refused as expired), so the memory
    # must follow the tokens alive, not grow with every token ever seen.
    v = verifier()
    signer = TokenSigner(KEY, "router", 10.0)
    per_second, seconds = 100, 200
    tokens = []
    for i in range(per_second * seconds):
        now = NOW + i / per_second
        tokens.append((signer.token(DECODE_1, "POST", "/reserve", BODY, now_s=now), now))
        v.verify(header(tokens[-1][0]), "POST", "/reserve", BODY, now_s=now)
    alive = per_second * (10 + 2)  # lifetime plus skew
    assert len(v._seen) <= 2 * alive + REPLAY_SWEEP_MIN_ENTRIES, len(v._seen)  # 20,000 before
    last, now = tokens[-1]
    assert refusal(v, header(last), now_s=now) is TokenRejection.REPLAYED
    oldest_alive, _ = tokens[-alive + per_second]
    assert refusal(v, header(oldest_alive), now_s=now) is TokenRejection.REPLAYED


def test_a_token_minted_for_one_worker_is_refused_by_another_403() -> None:
    # The replay of the probe: a /reserve captured on its way to decode-1, sent to decode-2.
    token = TokenSigner(KEY, "router", 10.0).token(DECODE_1, "POST", "/reserve", BODY, now_s=NOW)
    verifier(DECODE_1).verify(header(token), "POST", "/reserve", BODY, now_s=NOW)
    reason = refusal(verifier(DECODE_2), header(token))
    assert reason is TokenRejection.WRONG_WORKER and reason.status == 403
    # A worker of another role under the same id is another worker too.
    assert refusal(verifier(WorkerIdentity("prefill", "decode-1")), header(token)) is TokenRejection.WRONG_WORKER


def test_a_token_retargeted_by_hand_breaks_the_signature() -> None:
    # The target field is only a fast refusal: the tag covers the identity in full.
    token = TokenSigner(KEY, "router", 10.0).token(DECODE_1, "POST", "/reserve", BODY, now_s=NOW)
    retargeted = token.replace(DECODE_1.fingerprint, DECODE_2.fingerprint, 1)
    assert refusal(verifier(DECODE_2), header(retargeted)) is TokenRejection.BAD_SIGNATURE
