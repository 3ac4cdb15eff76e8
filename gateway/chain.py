"""The audit's chain: each settlement's facts, linked by hashes per tenant, and its signed heads.

An effect settles when it completes (answered, recovered, or an operator said it happened) and when an
operator says it did not happen. Each settlement becomes an entry of its tenant's chain: its facts
(the effect, its scope and fingerprint, the outcome and the response's digest, who resolved it and
how, the times), its number in the chain (``seq``, from 1, without gaps) and the hash of the entry
before it (``prev``); the entry's ``hash`` is the SHA-256 of all that. The chain's newest entry (its
head) is signed with an Ed25519 key at intervals and on demand.

What it proves: an export whose entries all check, up to a head signed by the key you know, is what
the gateway chained up to that head; a changed byte, an entry removed, two entries swapped, are each
found and named. What it does not: whoever holds both the database and the signing key can write a
different history and sign it; the chain says only what the gateway saw, not what an upstream did. A
head once published (sent to the auditor, pasted in a ticket) cannot be taken back: a chain rewritten
after it no longer leads to it.

No I/O here: gateway.chaining writes the chain into Postgres and exports it; this module builds the
entries, signs heads, and verifies an export, so an auditor checks one with this file alone (and the
``cryptography`` package).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gateway.record import StoredResponse, head_bytes

# Settlements per round: a gateway settles a few thousand a second at most, so one round a second keeps
# up, and 5,000 entries (about 2 MB of rows) keep its transaction to tens of milliseconds.
ROUND = 5000
# The hash a tenant's first entry follows.
GENESIS = "0" * 64
# The first line of an export names its format; a verifier refuses any other.
FORMAT = "effect-gateway audit chain 1"
OUTCOMES = frozenset({"completed", "not_happened"})


def canonical(doc: dict[str, Any]) -> bytes:
    """The one way a document is written, hashed and signed: keys sorted, no spaces, UTF-8.

    Only strings, integers, null and nested objects occur (times are strings), so two writers agree
    byte for byte; a verifier also refuses a line not written this way, so no byte can change unseen.
    """
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def time_text(at: datetime) -> str:
    """A time as the chain writes it: UTC, to the microsecond."""
    return at.astimezone(UTC).isoformat(timespec="microseconds")


def response_digest(response: StoredResponse) -> str:
    """The SHA-256 of a response as the gateway stores and replays it: its status, its headers as
    stored (gateway.record.head_bytes), an empty line, its body. The block of headers never holds an
    empty line, so the parts cannot be shifted into one another."""
    message = b"%d\r\n%s\r\n\r\n%s" % (response.status, head_bytes(response.headers), response.body)
    return hashlib.sha256(message).hexdigest()


@dataclass(frozen=True, slots=True)
class Settled:
    """What settled: one effect's settlement, as the statement that settled it recorded it for the chain."""

    tenant: str
    effect: int
    attempt: int
    scope: str
    upstream: str
    method: str
    path: str
    fingerprint: str
    outcome: str  # completed, or not_happened (an operator's verdict)
    status: int | None
    response: str | None  # response_digest of the answer on record, if any
    recovered_by: str | None
    by: str | None  # who resolved it (gateway.operators.recorded_as), for an operator's verdict
    run: str | None
    step: str | None
    created_at: datetime
    settled_at: datetime

    def facts(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "effect": self.effect,
            "attempt": self.attempt,
            "scope": self.scope,
            "upstream": self.upstream,
            "method": self.method,
            "path": self.path,
            "fingerprint": self.fingerprint,
            "outcome": self.outcome,
            "status": self.status,
            "response": self.response,
            "recovered_by": self.recovered_by,
            "by": self.by,
            "run": self.run,
            "step": self.step,
            "created_at": time_text(self.created_at),
            "settled_at": time_text(self.settled_at),
        }


@dataclass(frozen=True, slots=True)
class Entry:
    """A settlement in its place in the chain."""

    settlement: Settled
    seq: int
    prev: str
    hash: str

    def line(self) -> bytes:
        """The entry as an export holds it (without the newline)."""
        return canonical({**self.settlement.facts(), "seq": self.seq, "prev": self.prev, "hash": self.hash})


def entry_hash(doc: dict[str, Any]) -> str:
    """The hash of an entry's document: everything in it but the hash itself."""
    return hashlib.sha256(canonical({k: v for k, v in doc.items() if k != "hash"})).hexdigest()


def order(settled: Settled) -> tuple[datetime, int, int]:
    """The order settlements enter the chain: by when their settle began (the statement's time; one
    begun earlier may commit later, and then enters a later round), then by effect and attempt."""
    return settled.settled_at, settled.effect, settled.attempt


def by_tenant(settled: Sequence[Settled]) -> dict[str, list[Settled]]:
    """``settled`` split into each tenant's chain, each in its order, the tenants by name."""
    chains: dict[str, list[Settled]] = {}
    for one in settled:
        chains.setdefault(one.tenant, []).append(one)
    return dict(sorted(chains.items()))


def link(seq: int, prev: str, settlements: Sequence[Settled]) -> list[Entry]:
    """``settlements`` as the entries after entry ``seq`` (whose hash is ``prev``), in their order."""
    entries = []
    for settlement in settlements:
        seq += 1
        doc = {**settlement.facts(), "seq": seq, "prev": prev}
        prev = entry_hash(doc)
        entries.append(Entry(settlement, seq, doc["prev"], prev))
    return entries


# --- signed heads -----------------------------------------------------------------------------------


def signing_key(text: str) -> Ed25519PrivateKey:
    """The private key the configuration gives: a PEM (PKCS#8) block, or its 32 raw bytes in hex or
    base64 (what ``effect-gateway audit new-key`` prints). Raises ValueError saying what it expected."""
    text = text.strip()
    if text.startswith("-----BEGIN"):
        key = serialization.load_pem_private_key(text.encode(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError("the PEM key is not an Ed25519 key")
        return key
    return Ed25519PrivateKey.from_private_bytes(_raw_key(text, "private"))


def public_key(text: str) -> Ed25519PublicKey:
    """A public key as ``effect-gateway audit new-key`` prints it (hex or base64), or a PEM block."""
    text = text.strip()
    if text.startswith("-----BEGIN"):
        key = serialization.load_pem_public_key(text.encode())
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError("the PEM key is not an Ed25519 key")
        return key
    return Ed25519PublicKey.from_public_bytes(_raw_key(text, "public"))


def _raw_key(text: str, which: str) -> bytes:
    try:
        raw = bytes.fromhex(text) if len(text) == 64 else base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 {which} key is 32 bytes, in hex (64 digits) or base64, or a PEM block")
    return raw


def public_hex(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The public half of ``key`` in hex: how heads name the key that signed them."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def new_key() -> tuple[str, str]:
    """A new signing key: (private, public), each 32 bytes in hex."""
    key = Ed25519PrivateKey.generate()
    raw = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return raw.hex(), public_hex(key)


@dataclass(frozen=True, slots=True)
class Head:
    """A tenant's chain up to entry ``seq`` (whose hash is ``hash``), signed at ``signed_at``."""

    tenant: str
    seq: int
    hash: str
    signed_at: datetime
    key: str  # public_hex of the key that signed it
    signature: str  # hex

    def signed(self) -> dict[str, Any]:
        """What the signature covers."""
        return {
            "tenant": self.tenant,
            "seq": self.seq,
            "hash": self.hash,
            "signed_at": time_text(self.signed_at),
            "key": self.key,
        }

    def line(self) -> bytes:
        return canonical({"head": self.signed(), "signature": self.signature})


@dataclass(frozen=True, slots=True)
class Signer:
    """The key that signs the heads, and how long a moved head may wait for its next signature."""

    key: Ed25519PrivateKey
    every: timedelta


@dataclass(frozen=True, slots=True)
class Round:
    """What one round of the chain did: settlements linked, heads signed; ``busy``: another gateway
    was running one."""

    chained: int
    signed: list[Head]
    busy: bool = False


def due(tip: int, last: tuple[int, datetime] | None, now: datetime, every: timedelta, sign_now: bool) -> bool:
    """Whether a tenant's head (entry ``tip``) is to be signed now: never signed yet, or moved since
    the ``last`` signature (its entry, its time) and either ``every`` has passed since that or an
    export asks (``sign_now``)."""
    if last is None:
        return True
    signed, at = last
    return tip > signed and (sign_now or now - at >= every)


def sign(key: Ed25519PrivateKey, tenant: str, seq: int, hash: str, at: datetime) -> Head:
    """Sign the chain of ``tenant`` up to entry ``seq``."""
    unsigned = Head(tenant, seq, hash, at, public_hex(key), "")
    signature = key.sign(canonical(unsigned.signed())).hex()
    return Head(tenant, seq, hash, at, unsigned.key, signature)


def start_line(tenant: str, first: int, last: int, prev: str) -> bytes:
    """The line that opens a tenant's part of an export: its first and last entries, and the hash
    before the first. The last lets a verifier tell a file cut short (its tail lost in a copy) from a
    whole one; one cut on purpose, this line changed with it, is found only against a head you hold."""
    return canonical({"chain": tenant, "first": first, "last": last, "prev": prev})


def format_line(exported_at: datetime) -> bytes:
    return canonical({"format": FORMAT, "exported_at": time_text(exported_at)})


# --- verification -----------------------------------------------------------------------------------


class Mismatch(Exception):
    """What of an export does not check: the first such line, and why."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line = line
        self.reason = reason


@dataclass(slots=True)
class TenantChain:
    """What a verification has seen of one tenant's chain so far."""

    tenant: str
    first: int
    last: int  # the last entry the export says it holds
    seq: int  # the last entry's seen (first - 1 before any)
    hash: str
    entries: int = 0
    heads: list[Head] = field(default_factory=list)

    @property
    def uncovered(self) -> int:
        """Entries after the last signed head: nothing shows they were not written afterwards."""
        signed = self.heads[-1].seq if self.heads else self.first - 1
        return self.seq - max(signed, self.first - 1)


@dataclass(frozen=True, slots=True)
class Verification:
    """An export verified: every tenant's chain in it, in the order they came."""

    chains: list[TenantChain]

    def report(self) -> list[str]:
        """What was checked, as lines for a person."""
        lines = []
        for chain in self.chains:
            span = f"entries {chain.first} to {chain.seq}"
            lines.append(f"tenant {chain.tenant}: {span} ({chain.entries}), each follows the one before")
            if chain.heads:
                last = chain.heads[-1]
                lines.append(
                    f"  {len(chain.heads)} signed head(s) check out; the last signs entry {last.seq} "
                    f"at {time_text(last.signed_at)} with key {last.key}"
                )
            else:
                lines.append("  no signed head: nothing shows that the chain was not rewritten whole")
            if chain.heads and chain.uncovered:
                lines.append(f"  {chain.uncovered} entries come after the last signed head, unsigned")
        return lines


def verify(lines: Iterable[bytes], keys: Sequence[Ed25519PublicKey] = ()) -> Verification:
    """Check an export (its lines, each without or with its newline) and return what it holds.

    ``keys``: the public keys the heads must be signed with (the ones you published: more than one
    across a change of key). Given, every tenant's part must end at a head one of them signed, or it
    proves nothing: whoever rewrote the chain could have dropped the heads. Without them, each head is
    checked against the key it names, which the report prints for you to compare.
    Raises :class:`Mismatch` at the first line that does not check, saying why.
    """
    chains: dict[str, TenantChain] = {}
    number = 0
    for number, raw in enumerate(lines, start=1):
        text = raw.rstrip(b"\n")
        doc = _parsed(number, text)
        if number == 1:
            if doc.get("format") != FORMAT:
                raise Mismatch(1, f"not an audit chain export (its first line does not say {FORMAT!r})")
            _fields(1, doc, _FORMAT_FIELDS, "the first line")
            continue
        if "chain" in doc:
            tenant = _text(number, doc, "chain")
            _fields(number, doc, _START_FIELDS, f"the start of tenant {_shown(tenant)}'s chain")
            if tenant in chains:
                raise Mismatch(number, f"tenant {_shown(tenant)}'s chain starts a second time")
            first, last = _number(number, doc, "first"), _number(number, doc, "last")
            if last < first:
                raise Mismatch(
                    number,
                    f"tenant {_shown(tenant)}'s chain ends at entry {last}, before its first ({first})",
                )
            chains[tenant] = TenantChain(tenant, first, last, first - 1, _text(number, doc, "prev"))
        elif "head" in doc:
            _check_head(number, doc, chains, keys)
        else:
            _check_entry(number, doc, chains)
    if number == 0:
        raise Mismatch(1, "the file is empty")
    if keys and not chains:
        raise Mismatch(number, "the file holds no chain, so nothing a given key signed")
    for chain in chains.values():
        if keys and (not chain.heads or chain.uncovered):
            unsigned = f"tenant {chain.tenant}'s last {chain.uncovered} entries (to {chain.seq})"
            raise Mismatch(number, f"no head signed by a given key covers {unsigned}")
        if chain.seq != chain.last:
            stops = f"tenant {chain.tenant}'s chain stops at entry {chain.seq}, not {chain.last}"
            raise Mismatch(number, f"{stops}: the file is cut")
    return Verification(list(chains.values()))


def _parsed(number: int, text: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except ValueError:
        raise Mismatch(number, "not JSON: the line was cut or changed") from None
    if not isinstance(doc, dict):
        raise Mismatch(number, "not a JSON object")
    if canonical(doc) != text:
        raise Mismatch(number, "not written as the export writes it: its bytes were changed")
    return doc


# The fields of each kind of line, exactly: a line with one more (a note slipped in) is not as exported.
_FORMAT_FIELDS = frozenset({"format", "exported_at"})
_START_FIELDS = frozenset({"chain", "first", "last", "prev"})
# An entry's facts are named as Settled's fields (Settled.facts).
_ENTRY_FIELDS = frozenset({*Settled.__dataclass_fields__, "seq", "prev", "hash"})
_HEAD_FIELDS = frozenset({"head", "signature"})
_SIGNED_FIELDS = frozenset({"tenant", "seq", "hash", "signed_at", "key"})
# An Ed25519 signature as heads write it: 64 bytes in lower-case hex, and no other spelling.
_SIGNATURE = re.compile(r"[0-9a-f]{128}")


def _fields(number: int, doc: dict[str, Any], expected: frozenset[str], what: str) -> None:
    if (given := set(doc)) != expected:
        odd = sorted(given - expected) or sorted(expected - given)
        raise Mismatch(number, f"{what} does not hold the fields an export writes ({', '.join(odd)})")


def _shown(name: str) -> str:
    """A name from the file as a message shows it: a long one cut (the file may be anything)."""
    return name if len(name) <= 64 else name[:64] + "..."


def _text(number: int, doc: dict[str, Any], name: str) -> str:
    value = doc.get(name)
    if not isinstance(value, str):
        raise Mismatch(number, f"{name} is missing or not a string")
    return value


def _number(number: int, doc: dict[str, Any], name: str) -> int:
    value = doc.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise Mismatch(number, f"{name} is missing or not a positive integer")
    return value


def _chain_of(number: int, chains: dict[str, TenantChain], tenant: str) -> TenantChain:
    if tenant not in chains:
        raise Mismatch(number, f"a line of tenant {_shown(tenant)} before the line that starts its chain")
    return chains[tenant]


def _check_entry(number: int, doc: dict[str, Any], chains: dict[str, TenantChain]) -> None:
    chain = _chain_of(number, chains, _text(number, doc, "tenant"))
    seq = _number(number, doc, "seq")
    what = f"entry {seq} of tenant {_shown(chain.tenant)} (effect {_shown(str(doc.get('effect')))})"
    _fields(number, doc, _ENTRY_FIELDS, what)
    expected = chain.seq + 1
    if seq > expected:
        missing = f"entry {expected} is" if seq == expected + 1 else f"entries {expected} to {seq - 1} are"
        raise Mismatch(number, f"{missing} missing: {what} comes next")
    if seq < expected:
        raise Mismatch(number, f"{what} comes after entry {chain.seq}: entries are out of order or repeated")
    if doc.get("prev") != chain.hash:
        raise Mismatch(number, f"{what} does not follow the entry before it (prev is not that one's hash)")
    if doc.get("outcome") not in OUTCOMES:
        raise Mismatch(number, f"{what} has no outcome the gateway writes")
    if entry_hash(doc) != doc.get("hash"):
        raise Mismatch(number, f"{what} does not match its hash: it was changed after it was chained")
    chain.seq, chain.hash = seq, _text(number, doc, "hash")
    chain.entries += 1


def _check_head(
    number: int, doc: dict[str, Any], chains: dict[str, TenantChain], keys: Sequence[Ed25519PublicKey]
) -> None:
    signed = doc["head"]
    if not isinstance(signed, dict):
        raise Mismatch(number, "head is not a JSON object")
    chain = _chain_of(number, chains, _text(number, signed, "tenant"))
    _fields(number, doc, _HEAD_FIELDS, f"a head of tenant {_shown(chain.tenant)}")
    _fields(number, signed, _SIGNED_FIELDS, f"a head of tenant {_shown(chain.tenant)}")
    try:
        head = Head(
            chain.tenant,
            _number(number, signed, "seq"),
            _text(number, signed, "hash"),
            datetime.fromisoformat(_text(number, signed, "signed_at")),
            _text(number, signed, "key"),
            _text(number, doc, "signature"),
        )
        named = public_key(head.key)
        signature = bytes.fromhex(head.signature)
    except ValueError as exc:
        raise Mismatch(number, f"the head of tenant {_shown(chain.tenant)} is malformed: {exc}") from None
    what = f"the head of tenant {_shown(chain.tenant)} signed at entry {head.seq}"
    # Written again from what was read, it must be the very same: one spelling of each time and key.
    if head.signed() != signed or not _SIGNATURE.fullmatch(head.signature):
        raise Mismatch(number, f"{what} is not written as the export writes it: its bytes were changed")
    if chain.heads and chain.heads[-1].seq == head.seq:
        raise Mismatch(number, f"{what} comes twice")
    if head.seq != chain.seq:
        raise Mismatch(number, f"{what} stands after entry {chain.seq}: heads follow the entry they sign")
    if head.hash != chain.hash:
        raise Mismatch(number, f"{what} does not match that entry's hash: the chain was rewritten")
    if keys and head.key not in {public_hex(key) for key in keys}:
        raise Mismatch(number, f"{what} was signed by key {head.key}, not one given")
    try:
        named.verify(signature, canonical(head.signed()))
    except InvalidSignature:
        raise Mismatch(number, f"{what} has a signature that does not check") from None
    chain.heads.append(head)
