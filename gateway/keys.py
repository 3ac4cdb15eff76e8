"""Idempotency keys: their syntax, their scope, and the key the gateway derives for the upstream."""

from __future__ import annotations

import hashlib
import hmac
import re
import uuid
from dataclasses import dataclass

from gateway.errors import KeySyntaxError

# 255: Stripe's limit, and what the IETF draft's examples fit in; longer keys are a sign of misuse.
MAX_KEY_LENGTH = 255
# A key that ends in a UUID's 8-4-4-4-12 hex form, after any prefix: what SDKs make up per call
# (stripe-python's 128 random bits in that layout, with no version digit set; the OpenAI and Anthropic
# SDKs' "stainless-python-retry-" and a v4 UUID). Every version is matched, because stripe-python's
# keys carry a random digit where the version goes.
_UUID_AT_END = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z", re.IGNORECASE)
# The audit's run and step labels: as long as a key, so any journal's ids fit.
MAX_LABEL = MAX_KEY_LENGTH


def key_digest(key: str) -> uuid.UUID:
    """Return the digest that effect_keys finds ``key`` by: the first 16 bytes of SHA-256 of its UTF-8.

    The same as Postgres's effect_key_digest() (migration 005), computed here: that SQL function calls
    convert_to(), which Postgres does not let it inline, so each claim ran the SQL-function executor
    for it (0.05 to 0.085 ms of Postgres CPU per new effect).
    """
    return uuid.UUID(bytes=hashlib.sha256(key.encode("utf-8")).digest()[:16])


def parse_key(value: str) -> str:
    """Accept the IETF sf-string form (``"abc"``) and Stripe's bare form (``abc``).

    A key is 1 to 255 visible ASCII characters (0x21-0x7e); inside the quoted form only
    ``\\"`` and ``\\\\`` are escapes, as RFC 8941 says.
    """
    value = value.strip(" \t")
    if value.startswith('"'):
        value = _unquote(value)
    if not value:
        raise KeySyntaxError("the key is empty")
    if len(value) > MAX_KEY_LENGTH:
        raise KeySyntaxError(f"the key is {len(value)} characters long; at most {MAX_KEY_LENGTH} are allowed")
    bad = next((ch for ch in value if not "\x21" <= ch <= "\x7e"), None)
    if bad is not None:
        raise KeySyntaxError(f"the key may hold only visible ASCII characters, not {bad!r}")
    return value


def looks_made_up(key: str) -> bool:
    """Whether ``key`` looks like one an SDK made up for a single call, rather than a step's key."""
    return _UUID_AT_END.search(key) is not None


def _unquote(value: str) -> str:
    if len(value) < 2 or not value.endswith('"'):
        raise KeySyntaxError("a quoted key must end with a double quote")
    out: list[str] = []
    inner = value[1:-1]
    i = 0
    while i < len(inner):
        ch = inner[i]
        if ch == "\\":
            if i + 1 >= len(inner) or inner[i + 1] not in '"\\':
                raise KeySyntaxError('in a quoted key, a backslash may only escape " or \\')
            out.append(inner[i + 1])
            i += 2
            continue
        if ch == '"':
            raise KeySyntaxError('a quoted key must escape an inner " as \\"')
        out.append(ch)
        i += 1
    return "".join(out)


@dataclass(frozen=True, slots=True)
class ScopedKey:
    """A key as the gateway stores it: one tenant can never see another's."""

    tenant: str
    upstream: str
    key: str

    def derived(self, secret: bytes) -> str:
        """The key the upstream receives: stable across retries, unique per tenant and upstream.

        The agent's own key never reaches the upstream, so two tenants that pick the same key (or an
        agent that reuses one across upstreams) cannot collide in the upstream's key space. It is a
        keyed MAC, not a plain hash: a tenant who knows another's key still cannot compute the value a
        probe will look for, so it cannot plant an effect that the probe would take for the other's.
        """
        # 32 hex digits (128 bits): collision-free for any number of effects a gateway will see.
        return "eg_" + self._mac(secret, b"").hex()[:32]

    def _mac(self, secret: bytes, purpose: bytes) -> bytes:
        return hmac.digest(secret, purpose + _parts(self.tenant, self.upstream, self.key), "sha256")


def _parts(*parts: str) -> bytes:
    """The parts, each length-prefixed so that ("a", "bc") and ("ab", "c") differ."""
    message: list[bytes] = []
    for part in parts:
        raw = part.encode()
        message += (len(raw).to_bytes(4, "big"), raw)
    return b"".join(message)


class LogHash:
    """What the log says of a key: the same for every retry of it, and no way back to the key.

    A keyed BLAKE2b under a key made from the gateway's secret, apart from the derived key, so the log
    reveals neither the key the agent sent nor the one the upstream holds. It is taken on every request
    (replays from memory among them), and BLAKE2b with its key set once costs a fraction of an HMAC.
    8 bytes (16 hex digits, 64 bits) tell the keys in any log apart.
    """

    def __init__(self, secret: bytes) -> None:
        key = hashlib.blake2b(secret, digest_size=32, person=b"effect-gw-log").digest()
        self._keyed = hashlib.blake2b(key=key, digest_size=8, person=b"effect-gw-key")

    def of(self, tenant: str, upstream: str, key: str) -> str:
        mac = self._keyed.copy()
        # NUL between the parts is unambiguous: names and keys are visible ASCII (see parse_key).
        mac.update(f"{tenant}\0{upstream}\0{key}".encode())
        return mac.hexdigest()
