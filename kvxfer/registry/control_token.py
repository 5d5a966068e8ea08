"""Short-lived signed tokens for the control plane (router -> worker, worker -> worker HTTP).

Anyone who could reach a worker's HTTP port could reserve its pages, cancel streams and make
a prefiller push KV wherever it was told. With a cluster key, every control call carries

    Authorization: KvxferToken v2.<issuer>.<target hex>.<expires_ms>.<nonce hex>.<tag hex>

where `tag` is HMAC-SHA256, keyed by the cluster key's "control" derivation (never valid as a
registry signature: `signing.derive_key`), over the issuer, the target worker (its role and
registry worker id), the HTTP method, the path, the expiry, the nonce and the SHA-256 of the
exact body bytes. So a token is good for one request to one worker only: another path,
method, body or worker breaks the tag, the expiry bounds its life, and each worker remembers
nonces until their token expires, so a captured token cannot be replayed on it either. (v1
tokens named no worker, and each worker keeps its own nonces: a `/reserve` captured on the
way to one decoder reserved pages on every other one, once each.) `target` is a short digest
of the target's identity, so a worker refuses a token minted for another with its own reason
(`wrong_worker`, 403) before computing any tag; the tag itself covers the identity in full.
The issuer names the caller (a router, a worker id): it scopes request ids and per-caller
limits on the worker. Every holder of the cluster key can mint any issuer and target; the
key is the trust boundary (docs/architecture.md, "Threat model").

Parsing is bounded: the header is refused before any work if it is longer than
`MAX_TOKEN_CHARS`, and every part has a fixed alphabet and length.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from dataclasses import dataclass
from enum import Enum

from kvxfer.errors import RegistryError
from kvxfer.registry.signing import derive_key

TOKEN_VERSION = "v2"
#: The HTTP auth scheme of the header.
AUTH_SCHEME = "KvxferToken"
#: Longest header value parsed at all; a real token is about 190 characters.
MAX_TOKEN_CHARS = 512
#: The replay memory drops expired nonces once it has doubled since the last time it did
#: (and holds at least this many): each verified token then pays for about one entry of
#: that walk, and the memory follows the tokens still alive, not every token ever seen.
REPLAY_SWEEP_MIN_ENTRIES = 1024
_ISSUER = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
_TOKEN = re.compile(r"^v2\.([A-Za-z0-9_\-]{1,64})\.([0-9a-f]{16})\.([0-9]{1,16})\.([0-9a-f]{32})\.([0-9a-f]{64})$")


class TokenRejection(str, Enum):
    """Why a token was refused; the `reason` label of `kvxfer_worker_auth_rejected_total`."""

    MISSING = "missing"  # no Authorization header: 401
    MALFORMED = "malformed"  # not a kvxfer token of this version: 401
    EXPIRED = "expired"  # past its expiry (beyond the skew tolerance): 401
    TOO_LONG_LIVED = "too_long_lived"  # expires further ahead than the verifier allows: 401
    REPLAYED = "replayed"  # its nonce was seen already: 401
    BAD_SIGNATURE = "bad_signature"  # the tag does not verify for this request: 403
    WRONG_WORKER = "wrong_worker"  # minted for another worker (a replay elsewhere, or a stale directory): 403

    @property
    def status(self) -> int:
        """401 when no valid credential was presented, 403 when a forged or misdirected one was."""
        return 403 if self in (TokenRejection.BAD_SIGNATURE, TokenRejection.WRONG_WORKER) else 401


class TokenRefused(RegistryError):
    """A control-plane token that does not admit this request; `reason` says why."""

    def __init__(self, reason: TokenRejection, detail: str) -> None:
        self.reason = reason
        super().__init__(detail)


@dataclass(frozen=True)
class WorkerIdentity:
    """The worker a token is for: its role ("prefill", "decode") and registry worker id."""

    role: str
    worker_id: str

    @property
    def fingerprint(self) -> str:
        """The token's `target` field: 16 hex digits of SHA-256 over role and worker id."""
        return hashlib.sha256(f"{self.role}\n{self.worker_id}".encode()).hexdigest()[:16]


def _message(issuer: str, target: WorkerIdentity, method: str, path: str, expires_ms: int, nonce: str,
             body: bytes) -> bytes:
    digest = hashlib.sha256(body).hexdigest()
    return "\n".join((TOKEN_VERSION, issuer, target.role, target.worker_id, method.upper(), path, str(expires_ms),
                      nonce, digest)).encode()


class TokenSigner:
    """Mints one token per outgoing control call, for one issuer."""

    def __init__(self, cluster_key: bytes, issuer: str, lifetime_s: float) -> None:
        if not _ISSUER.match(issuer):
            raise ValueError(f"issuer {issuer!r} must match {_ISSUER.pattern}")
        if lifetime_s <= 0:
            raise ValueError(f"token lifetime must be positive, got {lifetime_s}")
        self._key = derive_key(cluster_key, "control")
        self.issuer = issuer
        self.lifetime_s = lifetime_s

    def token(self, target: WorkerIdentity, method: str, path: str, body: bytes, *,
              now_s: float | None = None) -> str:
        """The token for one request to the worker `target`: `method` `path` carrying exactly `body`."""
        expires_ms = int(((time.time() if now_s is None else now_s) + self.lifetime_s) * 1000)
        nonce = secrets.token_hex(16)
        tag = hmac.new(self._key, _message(self.issuer, target, method, path, expires_ms, nonce, body),
                       hashlib.sha256)
        return f"{TOKEN_VERSION}.{self.issuer}.{target.fingerprint}.{expires_ms}.{nonce}.{tag.hexdigest()}"

    def header(self, target: WorkerIdentity, method: str, path: str, body: bytes) -> dict[str, str]:
        """The Authorization header for one request to the worker `target`."""
        return {"Authorization": f"{AUTH_SCHEME} {self.token(target, method, path, body)}"}


@dataclass(frozen=True)
class Caller:
    """Who a verified token says made the request."""

    issuer: str
    expires_ms: int


class TokenVerifier:
    """Checks the tokens of incoming control calls to the worker `identity`; thread-safe.

    Tokens minted for another worker are refused (`WRONG_WORKER`). `max_lifetime_s` refuses tokens that expire further ahead than that (a leaked token
    is worth little), `clock_skew_s` is the tolerance between the two machines' clocks.
    Nonces are remembered until their token's expiry (at most `max_replay_entries` at once;
    when that is full the token is refused as a replay rather than the memory growing).
    Expired ones are dropped as it goes (see REPLAY_SWEEP_MIN_ENTRIES): they used to stay
    until the memory was full, 100,000 nonces (about 15 MB) in a decode worker after some
    40,000 requests.
    """

    def __init__(self, cluster_key: bytes, identity: WorkerIdentity, *, max_lifetime_s: float, clock_skew_s: float,
                 max_replay_entries: int = 100_000) -> None:
        self._key = derive_key(cluster_key, "control")
        self.identity = identity
        self.max_lifetime_s = max_lifetime_s
        self.clock_skew_s = clock_skew_s
        self._max_entries = max_replay_entries
        self._seen: dict[str, int] = {}  # nonce -> expiry (ms), for replay refusal
        self._sweep_at = REPLAY_SWEEP_MIN_ENTRIES  # entries at which expired ones are dropped
        self._lock = threading.Lock()

    def verify(self, header: str | None, method: str, path: str, body: bytes, *,
               now_s: float | None = None) -> Caller:
        """The caller of a request whose Authorization header is `header`; TokenRefused otherwise."""
        if not header:
            raise TokenRefused(TokenRejection.MISSING, "control call without an Authorization header")
        if len(header) > MAX_TOKEN_CHARS:
            raise TokenRefused(TokenRejection.MALFORMED, f"Authorization header longer than {MAX_TOKEN_CHARS}")
        scheme, _, token = header.partition(" ")
        match = _TOKEN.match(token.strip()) if scheme == AUTH_SCHEME else None
        if match is None:
            raise TokenRefused(TokenRejection.MALFORMED, f"Authorization is not a {AUTH_SCHEME} {TOKEN_VERSION} token")
        issuer, target, expires_text, nonce, tag = match.groups()
        if target != self.identity.fingerprint:
            raise TokenRefused(TokenRejection.WRONG_WORKER, f"token of {issuer} was minted for another worker, "
                               f"not {self.identity.role} worker {self.identity.worker_id}")
        expires_ms = int(expires_text)
        now_ms = int((time.time() if now_s is None else now_s) * 1000)
        skew_ms = int(self.clock_skew_s * 1000)
        if now_ms > expires_ms + skew_ms:
            raise TokenRefused(TokenRejection.EXPIRED, f"token of {issuer} expired {(now_ms - expires_ms) / 1000:.1f} s ago")
        if expires_ms - now_ms > int(self.max_lifetime_s * 1000) + skew_ms:
            raise TokenRefused(TokenRejection.TOO_LONG_LIVED,
                               f"token of {issuer} expires beyond the allowed {self.max_lifetime_s} s")
        expected = hmac.new(self._key, _message(issuer, self.identity, method, path, expires_ms, nonce, body),
                            hashlib.sha256)
        if not hmac.compare_digest(tag, expected.hexdigest()):
            raise TokenRefused(TokenRejection.BAD_SIGNATURE,
                               f"token does not verify for {method} {path} (forged, other key, or altered body)")
        self._remember(nonce, expires_ms + skew_ms, now_ms)
        return Caller(issuer, expires_ms)

    def _remember(self, nonce: str, forget_at_ms: int, now_ms: int) -> None:
        with self._lock:
            if nonce in self._seen:
                raise TokenRefused(TokenRejection.REPLAYED, "token was used before")
            if len(self._seen) >= min(self._sweep_at, self._max_entries):
                self._seen = {n: t for n, t in self._seen.items() if t >= now_ms}
                self._sweep_at = max(REPLAY_SWEEP_MIN_ENTRIES, 2 * len(self._seen))
                if len(self._seen) >= self._max_entries:
                    raise TokenRefused(TokenRejection.REPLAYED, "replay memory full; retry shortly")
            self._seen[nonce] = forget_at_ms
