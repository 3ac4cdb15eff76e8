"""The audit's chain without a database: entries linked by hashes, heads signed, exports verified, and
every kind of tampering found and named (gateway.chain)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gateway import chain
from gateway.chain import GENESIS, Mismatch, Settled
from gateway.record import StoredResponse

T0 = datetime(2026, 12, 7, 9, 0, tzinfo=UTC)
KEY = chain.signing_key("11" * 32)


def settlement(effect: int, tenant: str = "grocer", **changes: object) -> Settled:
    base = Settled(
        tenant=tenant,
        effect=effect,
        attempt=1,
        scope="6f1d3c1e-0000-4000-8000-00000000000" + str(effect % 10),
        upstream="shop",
        method="POST",
        path="/orders",
        fingerprint="f" * 64,
        outcome="completed",
        status=201,
        response=chain.response_digest(StoredResponse(201, (("Content-Type", "application/json"),), b"{}")),
        recovered_by=None,
        by=None,
        run="run-1",
        step=str(effect),
        created_at=T0 + timedelta(seconds=effect),
        settled_at=T0 + timedelta(seconds=effect, milliseconds=30),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def export_of(
    count: int, *, signed_at: tuple[int, ...] = (), first: int = 1, tenant: str = "grocer"
) -> list[bytes]:
    """An export of one tenant's entries ``first`` to ``count``, with heads signed after the entries named."""
    entries = chain.link(0, GENESIS, [settlement(i, tenant) for i in range(1, count + 1)])
    lines = [
        chain.format_line(T0),
        chain.start_line(tenant, first, count, entries[first - 2].hash if first > 1 else GENESIS),
    ]
    for entry in entries[first - 1 :]:
        lines.append(entry.line())
        if entry.seq in signed_at:
            lines.append(chain.sign(KEY, tenant, entry.seq, entry.hash, T0 + timedelta(hours=1)).line())
    return lines


def test_an_export_as_written_verifies_and_says_what_it_covers() -> None:
    """Five entries and a head signing the last: every entry follows the one before and is signed."""
    verified = chain.verify(export_of(5, signed_at=(3, 5)), [chain.public_key(chain.public_hex(KEY))])
    [grocer] = verified.chains
    assert (grocer.first, grocer.seq, grocer.entries, len(grocer.heads), grocer.uncovered) == (1, 5, 5, 2, 0)
    assert verified.report()[0] == "tenant grocer: entries 1 to 5 (5), each follows the one before"
    assert (
        f"the last signs entry 5 at 2026-12-07T10:00:00.000000+00:00 with key {chain.public_hex(KEY)}"
        in (verified.report()[1])
    )


def test_entries_after_the_last_signed_head_are_reported_unsigned() -> None:
    """A head at entry 3 of 5 leaves two entries that nothing signed, and the report says so."""
    verified = chain.verify(export_of(5, signed_at=(3,)))
    assert verified.chains[0].uncovered == 2
    assert "2 entries come after the last signed head, unsigned" in "\n".join(verified.report())


@pytest.mark.parametrize(("signed_at", "unsigned"), [((), 5), ((3,), 2)], ids=["no-head", "head-at-3"])
def test_given_a_key_an_export_must_end_at_a_head_it_signed(
    signed_at: tuple[int, ...], unsigned: int
) -> None:
    """With the published key, entries no head covers fail the export: whoever rewrote the chain and
    recomputed its hashes could simply have left the heads out."""
    with pytest.raises(Mismatch) as caught:
        chain.verify(export_of(5, signed_at=signed_at), [chain.public_key(chain.public_hex(KEY))])
    assert caught.value.reason == (
        f"no head signed by a given key covers tenant grocer's last {unsigned} entries (to 5)"
    )


def test_an_export_of_a_later_period_starts_from_the_hash_before_it() -> None:
    """Entries 3 to 5 alone verify, anchored on entry 2's hash."""
    assert chain.verify(export_of(5, first=3, signed_at=(5,))).chains[0].entries == 3


def flipped(line: bytes, old: bytes, new: bytes) -> bytes:
    assert old in line
    return line.replace(old, new, 1)


@pytest.mark.parametrize(
    ("tamper", "line", "reason"),
    [
        # One byte of one entry: the status 201 made 200.
        (
            lambda ls: [*ls[:4], flipped(ls[4], b'"status":201', b'"status":200'), *ls[5:]],
            5,
            "entry 3 of tenant grocer (effect 3) does not match its hash: "
            "it was changed after it was chained",
        ),
        # One entry removed.
        (lambda ls: ls[:4] + ls[5:], 5, "entry 3 is missing: entry 4 of tenant grocer (effect 4) comes next"),
        # Two entries swapped.
        (
            lambda ls: [*ls[:3], ls[4], ls[3], *ls[5:]],
            4,
            "entry 2 is missing: entry 3 of tenant grocer (effect 3) comes next",
        ),
        # A byte that changes no value (a space) still changes the line.
        (
            lambda ls: [*ls[:4], ls[4].replace(b",", b", ", 1), *ls[5:]],
            5,
            "not written as the export writes it: its bytes were changed",
        ),
        # The line cut short.
        (lambda ls: [*ls[:4], ls[4][:-5], *ls[5:]], 5, "not JSON: the line was cut or changed"),
        # The file cut after entry 3: its start said it runs to 5.
        (lambda ls: ls[:5], 5, "tenant grocer's chain stops at entry 3, not 5: the file is cut"),
        # The same entry twice.
        (
            lambda ls: [*ls[:5], ls[4], *ls[5:]],
            6,
            "entry 3 of tenant grocer (effect 3) comes after entry 3: entries are out of order or repeated",
        ),
    ],
    ids=[
        "one-byte-changed",
        "entry-removed",
        "two-reordered",
        "space-added",
        "line-cut",
        "file-cut",
        "entry-repeated",
    ],
)
def test_tampering_is_found_at_the_first_line_it_touches(tamper, line: int, reason: str) -> None:  # type: ignore[no-untyped-def]
    """Each change an export can suffer is caught, and the message names the entry and what is wrong."""
    lines = export_of(5, signed_at=(5,))
    chain.verify(lines)  # as written it verifies
    with pytest.raises(Mismatch) as caught:
        chain.verify(tamper(lines))
    assert (caught.value.line, caught.value.reason) == (line, reason)


def rewritten(lines: list[bytes], at: int) -> list[bytes]:
    """The export with entry ``at`` changed and every hash after it made again, as someone with the
    database but not the key could do."""
    docs = [json.loads(line) for line in lines]
    out, prev = lines[:2], GENESIS
    for doc in docs[2:]:
        if "head" in doc:
            out.append(chain.canonical(doc))
            continue
        if doc["seq"] == at:
            doc["status"] = 500
        doc["prev"] = prev
        doc["hash"] = prev = chain.entry_hash(doc)
        out.append(chain.canonical(doc))
    return out


def test_a_chain_rewritten_whole_no_longer_leads_to_its_signed_head() -> None:
    """Hashes made again after a change check among themselves; the head signed before does not."""
    with pytest.raises(Mismatch) as caught:
        chain.verify(rewritten(export_of(5, signed_at=(5,)), at=2))
    assert caught.value.reason == (
        "the head of tenant grocer signed at entry 5 does not match that entry's hash: "
        "the chain was rewritten"
    )


def test_a_head_signed_by_another_key_is_refused_when_the_key_is_given() -> None:
    """Given the published key, a head that another key signed (re-signed history) does not verify."""
    other = chain.signing_key("22" * 32)
    lines = export_of(3)
    entry = json.loads(lines[-1])
    lines.append(chain.sign(other, "grocer", 3, entry["hash"], T0).line())
    chain.verify(lines)  # alone it checks: the head names its own key
    with pytest.raises(Mismatch, match=r"was signed by key .*, not one given"):
        chain.verify(lines, [chain.public_key(chain.public_hex(KEY))])
    # Across a change of key both are given: the head by the other key is then taken.
    both = [chain.public_key(chain.public_hex(KEY)), chain.public_key(chain.public_hex(other))]
    assert len(chain.verify(lines, both).chains[0].heads) == 1


def test_a_forged_signature_does_not_check() -> None:
    """A head whose signature is not the key's over its fields is refused."""
    lines = export_of(3, signed_at=(3,))
    doc = json.loads(lines[-1])
    doc["signature"] = ("0" if doc["signature"][0] != "0" else "1") + doc["signature"][1:]
    with pytest.raises(Mismatch, match="has a signature that does not check"):
        chain.verify([*lines[:-1], chain.canonical(doc)])


def test_tenants_chain_apart() -> None:
    """Two tenants' chains in one export: each numbered from 1, each verified on its own."""
    lines = export_of(2, tenant="a") + export_of(3, tenant="b")[1:]
    assert [(c.tenant, c.entries) for c in chain.verify(lines).chains] == [("a", 2), ("b", 3)]


def test_the_response_digest_covers_status_headers_and_body() -> None:
    """A response differing in any part has another digest; the parts cannot be shifted across."""
    base = StoredResponse(201, (("A", "1"),), b"x")
    digests = {
        chain.response_digest(r)
        for r in (
            base,
            StoredResponse(200, base.headers, base.body),
            StoredResponse(201, (("A", "2"),), b"x"),
            StoredResponse(201, base.headers, b"y"),
            StoredResponse(201, (), b"A: 1\r\n\r\nx"),
        )
    }
    assert len(digests) == 5


@pytest.mark.parametrize(
    "text", ["", "abc", "11" * 31, "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----"]
)
def test_a_bad_signing_key_says_what_was_expected(text: str) -> None:
    """A key that is not 32 bytes in hex or base64, nor a PEM block, is refused with what it must be."""
    with pytest.raises(ValueError, match=r"Ed25519|PEM|key"):
        chain.signing_key(text)


def test_a_new_key_signs_what_its_public_half_verifies() -> None:
    """audit new-key's two lines work together: the private signs, the public checks."""
    private, public = chain.new_key()
    head = chain.sign(chain.signing_key(private), "t", 1, "a" * 64, T0)
    assert head.key == public
    # A head right after the start signs the entry before the export's first.
    [second] = chain.link(1, "a" * 64, [settlement(2, "t")])
    last = chain.sign(chain.signing_key(private), "t", 2, second.hash, T0)
    lines = [
        chain.format_line(T0),
        chain.start_line("t", 2, 2, "a" * 64),
        head.line(),
        second.line(),
        last.line(),
    ]
    assert chain.verify(lines, [chain.public_key(public)]).chains[0].heads == [head, last]


REWRITTEN_HEAD = (
    "the head of tenant grocer signed at entry 3 is not written as the export writes it: "
    "its bytes were changed"
)


def head_changed(lines: list[bytes], change: Callable[[dict[str, Any]], object]) -> list[bytes]:
    """The export with its last line, a head, changed by ``change`` (which edits the parsed line)."""
    doc = json.loads(lines[-1])
    change(doc)
    return [*lines[:-1], chain.canonical(doc)]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (
            lambda d: d.update(note="auditor approved"),
            "a head of tenant grocer does not hold the fields an export writes (note)",
        ),
        (
            lambda d: d["head"].update(note="x"),
            "a head of tenant grocer does not hold the fields an export writes (note)",
        ),
        (
            lambda d: d.update(signature=d["signature"].upper()),
            REWRITTEN_HEAD,
        ),
        (
            lambda d: d["head"].update(signed_at="2026-12-07T11:00:00+01:00"),
            REWRITTEN_HEAD,
        ),
    ],
    ids=["note-beside-the-head", "note-inside-the-head", "signature-upper-case", "time-in-another-zone"],
)
def test_a_head_changed_in_any_byte_is_refused_though_its_meaning_stays(
    change: Callable[[dict[str, Any]], object], reason: str
) -> None:
    """A head spelled another way (a note added, the signature in capitals, the time in another zone)
    checks as the same signature, and is refused all the same: nothing can be slipped into a file."""
    with pytest.raises(Mismatch) as caught:
        chain.verify(head_changed(export_of(3, signed_at=(3,)), change))
    assert caught.value.reason == reason


def test_a_head_repeated_is_refused() -> None:
    """The same head twice would count as two signatures: refused."""
    lines = export_of(3, signed_at=(3,))
    with pytest.raises(Mismatch, match="signed at entry 3 comes twice"):
        chain.verify([*lines, lines[-1]])


def test_given_a_key_a_tenant_added_or_an_empty_file_does_not_verify() -> None:
    """With the published key, a tenant whose part no head of that key signs (one added by hand) fails,
    and so does a file with no chain at all."""
    key = [chain.public_key(chain.public_hex(KEY))]
    added = export_of(3, signed_at=(3,)) + export_of(2, tenant="evil")[1:]
    with pytest.raises(Mismatch, match="no head signed by a given key covers tenant evil's last 2 entries"):
        chain.verify(added, key)
    with pytest.raises(Mismatch, match="the file holds no chain"):
        chain.verify([chain.format_line(T0)], key)
