"""The request as the agent sent it: what of it the audit records, and what is sent upstream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from gateway import browser, mcp, problems
from gateway.body import RequestBody, read_body
from gateway.errors import FormRefused, JsonRefused, NotAsFirstSent, StampError
from gateway.fingerprint import NEVER_FINGERPRINTED
from gateway.keys import looks_made_up, parse_key
from gateway.policy import UpstreamPolicy
from gateway.record import EffectRecord, KeyCarriers, NewEffect
from gateway.stamp import reserved_use
from gateway.upstream import GATEWAY_REQUEST_HEADERS, HOP_BY_HOP, Outbound, build_outbound


@dataclass(frozen=True, slots=True)
class Inbound:
    """A request to an upstream as gateway.proxy read it off the wire, before anything is decided."""

    tenant: str
    upstream: UpstreamPolicy
    method: str
    path: str  # as the agent sent it, still percent-encoded, starting with "/"
    query: str
    headers: Mapping[str, str]
    body: RequestBody
    key: str | None
    wait: float
    run_id: str | None = None
    step: str | None = None
    # Whether the agent has hung up (asked while the request waits for another with its key).
    client_left: Callable[[], bool] = lambda: False
    # The MCP tool the request calls (gateway.mcp_proxy); None for an HTTP request.
    tool: str | None = None


# Past this size a body is parsed off the event loop: the parse then takes milliseconds, which the
# other requests in flight should not wait for. An encoded body is always read off the loop: its size
# says nothing of its decoded size (a kilobyte of gzip inflates to a megabyte in 2 to 3 ms here), and
# zlib lets go of the interpreter while it inflates, so the loop runs meanwhile.
OFF_LOOP_BYTES = 64 * 1024


def step_key(raw: str, policy: UpstreamPolicy) -> str:
    """The agent's key, checked: its syntax (KeySyntaxError, a 400 key-malformed) and, where the upstream
    takes step keys only, that it is not one an SDK made up for a single call."""
    key = parse_key(raw)
    if policy.refuse_random_keys and looks_made_up(key):
        raise problems.KeyRandom(
            f"{policy.name} takes step keys only, and this one ends in a UUID, as keys an SDK makes up "
            "for a single call do; a key made up per call is new on the agent's re-run, which would do "
            "the effect again. Send the step's key (run:step), e.g. from the journal"
        )
    return key


async def refuse_reserved(
    policy: UpstreamPolicy, headers: Mapping[str, str], query: str, body: RequestBody
) -> None:
    """Refuse a request that sets what the gateway stamps its key into (StampReserved, a 400)."""
    if len(body.raw) > OFF_LOOP_BYTES:  # searched for the stamp's name: 6 ms a megabyte
        taken = await asyncio.to_thread(reserved_use, policy, headers, query, body)
    else:
        taken = reserved_use(policy, headers, query, body)
    if taken is not None:
        raise problems.StampReserved(
            f"{taken} is where the gateway puts its key for {policy.name}; the request may not set it"
        )


# Credentials, hop-by-hop headers and the gateway's own: never in the audit, whatever the upstream.
NEVER_AUDITED = NEVER_FINGERPRINTED | HOP_BY_HOP | GATEWAY_REQUEST_HEADERS


def redacted(headers: Mapping[str, str], policy: UpstreamPolicy) -> dict[str, str]:
    """Request headers as the audit keeps them: credentials and secrets never reach the database."""
    never = policy.never_stored
    return {
        name: value
        for name, value in headers.items()
        if name.lower() not in never and name.lower() not in NEVER_AUDITED
    }


def to_send(inbound: Inbound, derived_key: str | None) -> Outbound:
    """Return the request as it goes upstream: under ``derived_key`` (stamped, or as the upstream's
    native key), and without a browser's cookies. Raises StampError when it has no place for the stamp.
    """
    outbound = build_outbound(
        inbound.upstream,
        derived_key,
        inbound.method,
        inbound.path,
        inbound.query,
        browser.cookieless(inbound.headers),
        inbound.body,
    )
    if inbound.upstream.protocol == "mcp" and inbound.body.json is not None:
        # The id in the body that goes: a later attempt sends the first call's body, under its id.
        return replace(outbound, answer_to=mcp.id_of(inbound.body.json.value))
    return outbound


def as_first_sent(inbound: Inbound, record: EffectRecord) -> Outbound:
    """The request of an attempt after the first: the body ``record`` was claimed with (read back by the
    take-over that sends), under its derived key, with the retry's headers and query.

    Not the retry's body: it is the same request by its fingerprint, but may differ in the fields the
    fingerprint leaves out (fingerprint_ignore, fingerprint_fields), and an upstream that checks that a key
    is reused with the same parameters, as Stripe does, would refuse it with an error that would be
    recorded and replayed for ever, though the effect happened. The headers are the retry's: credentials
    are never stored, and every header the fingerprint covers is the same. Raises NotAsFirstSent.
    """
    cannot = "the request the effect was first sent with cannot be sent again"
    if record.request_body is None:
        raise NotAsFirstSent(f"{cannot}: {record.unreadable.get('request', 'it was not read back')}")
    content_type = next((v for k, v in inbound.headers.items() if k.lower() == "content-type"), "")
    try:
        body = read_body(record.request_body, content_type, inbound.upstream.json_stamp_path)
        return to_send(replace(inbound, body=body), record.derived_key)
    except (JsonRefused, FormRefused, StampError) as exc:
        raise NotAsFirstSent(f"{cannot}: {exc}") from None


def to_record(
    inbound: Inbound, key: str, derived_key: str, fingerprint: str, *, keyless: bool = False
) -> NewEffect:
    """The effect as the audit records it, with the headers it may keep."""
    return NewEffect(
        tenant=inbound.tenant,
        upstream=inbound.upstream.name,
        key=key,
        derived_key=derived_key,
        method=inbound.method,
        path=inbound.path,
        query=inbound.query,
        fingerprint=fingerprint,
        request_headers=redacted(inbound.headers, inbound.upstream),
        request_body=inbound.body.raw,
        run_id=inbound.run_id,
        step=inbound.step,
        keyless=keyless,
        # A keyless request is sent as it came, with no derived key anywhere.
        key_carriers=KeyCarriers() if keyless else inbound.upstream.decision.key_carriers,
        tool=inbound.tool,
    )
