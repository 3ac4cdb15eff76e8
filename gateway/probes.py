"""Probes: ask the upstream whether an effect exists, by the key stamped into it.

Two kinds: the built-in HTTP probe configured per upstream, and Python callables registered under the
entry-point group ``effect_gateway.probes``. Anything short of a clear answer raises ProbeFailed, and
the caller leaves the record as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import quote

import aiohttp
from yarl import URL

from gateway import jsonbody, mcp
from gateway.errors import ConfigError, JsonRefused, NotASearchAnswer, ProbeFailed
from gateway.policy import HttpProbe, PythonProbe, ToolProbe, UpstreamPolicy
from gateway.record import StoredResponse
from gateway.upstream import UpstreamClient, read_limited

ENTRY_POINT_GROUP = "effect_gateway.probes"
JSON = ("Content-Type", "application/json")


@dataclass(frozen=True, slots=True)
class ProbeContext:
    """What a Python probe is given: the derived key it should look for and a way to reach the upstream."""

    key: str
    upstream: str
    base_url: str
    headers: dict[str, str]
    session: aiohttp.ClientSession
    timeout: float


# A Python probe returns the effect as JSON when it exists, None when it does not, and raises otherwise.
PythonProbeFn = Callable[[ProbeContext], Awaitable[Any | None]]


def load_python_probe(name: str) -> PythonProbeFn:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            fn: PythonProbeFn = ep.load()
            return fn
    raise ConfigError(f"bad setting probe.entry_point: no probe named {name!r} in group {ENTRY_POINT_GROUP}")


def dig(doc: Any, path: str) -> Any | None:
    """Follow an ``items.0.id``-style path into a search's answer; None where its list ends first.

    Only a list that is there and shorter than the index says "not found". Anything else (a key
    missing, null, an object where the list should be: an error document, a changed API) raises
    :class:`NotASearchAnswer`, since taking it for "not found" would send the effect again.
    """
    parts = path.split(".") if path else []
    for depth, part in enumerate(parts, 1):
        if isinstance(doc, list) and part.isascii() and part.isdigit():
            index = int(part)
            if index >= len(doc):
                return None
            doc = doc[index]
        elif isinstance(doc, dict) and doc.get(part) is not None:
            doc = doc[part]
        else:
            raise NotASearchAnswer(f"nothing at {'.'.join(parts[:depth])!r} ({type(doc).__name__} there)")
    return doc


def carries(doc: Any, key: str) -> bool:
    """Whether ``key`` is in a string anywhere in ``doc``: what the stamp put there, as the search lists it.

    A derived key is 128 random-looking bits, so no other effect's item holds it by chance.
    """
    if isinstance(doc, str):
        return key in doc
    if isinstance(doc, dict):
        return any(carries(value, key) for value in doc.values())
    if isinstance(doc, list):
        return any(carries(value, key) for value in doc)
    return False  # a number (kept as its literal bytes), true, false or null


def _effect_in(doc: Any, found_at: str, derived_key: str, no_list: str, who: str, hint: str) -> Any | None:
    """The effect a search's answer ``doc`` lists at ``found_at``, or None where its list is there and
    ends first; raises ProbeFailed for an answer that is no such list (``no_list`` says so) or an item
    that does not carry the key (``hint`` says what to check)."""
    try:
        found = dig(doc, found_at)
    except NotASearchAnswer as exc:
        raise ProbeFailed(f"{no_list}: {exc}") from None
    if found is not None and not carries(found, derived_key):
        # A search that ignores a filter it does not know (a typo in probe.path, an API that changed)
        # lists other effects: the first may be another tenant's, and this one may never have happened.
        raise ProbeFailed(f"{who} found an item at {found_at!r} that does not carry the effect's key: {hint}")
    return found


class Prober:
    """Probes go through the upstream's own connections, and their answers obey max_response_bytes.

    A probe's answer becomes the stored response of the effect, so it is read and kept within the same
    limit as any upstream answer; a larger one is a failed probe, never stored.
    """

    def __init__(self, client: UpstreamClient) -> None:
        self._client = client
        self._python: dict[str, PythonProbeFn] = {}

    def check(self, policy: UpstreamPolicy) -> None:
        """Load Python probes at start-up, so a missing one stops the gateway instead of a recovery."""
        if isinstance(policy.probe, PythonProbe):
            self._python[policy.probe.entry_point] = load_python_probe(policy.probe.entry_point)

    async def probe(self, policy: UpstreamPolicy, derived_key: str) -> StoredResponse | None:
        """The effect as a response to replay, or None when the upstream says it does not exist."""
        match policy.probe:
            case HttpProbe() as http:
                return await self._http(policy, http, derived_key)
            case PythonProbe() as py:
                return await self._call_python(policy, py, derived_key)
            case ToolProbe() as tool:
                return await self._tool_call(policy, tool, derived_key)
            case None:
                raise ProbeFailed(f"upstream {policy.name} has no probe")

    async def _http(self, policy: UpstreamPolicy, http: HttpProbe, derived_key: str) -> StoredResponse | None:
        url = URL(policy.base_url + http.path.replace("{key}", quote(derived_key, safe="")), encoded=True)
        limit = self._client.max_response_bytes
        try:
            async with self._client.session(policy.name).request(
                http.method,
                url,
                headers=policy.inject.headers,
                timeout=aiohttp.ClientTimeout(total=policy.timeout.total_seconds()),
                allow_redirects=False,
            ) as resp:
                body = await read_limited(resp, limit)
                status = resp.status
        except TimeoutError:
            raise ProbeFailed(f"the probe of {policy.name} did not answer in time") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise ProbeFailed(f"the probe of {policy.name} failed: {type(exc).__name__}: {exc}") from None
        if body is None:
            raise ProbeFailed(f"the probe of {policy.name} answered more than {limit} bytes")
        # A search answers a list to look into at `found`; anything else asks for the effect by its key
        # (the settings refuse `found` with HEAD, whose answer has no body).
        found_at = http.found
        if status == 404 and found_at is None:
            return None  # no effect under that key
        if status == 404:
            # A search answers a list, found or not: a 404 is the search itself missing (a route renamed,
            # a proxy in front that does not know it), which says nothing about the effect.
            raise ProbeFailed(
                f"the probe of {policy.name} answered 404: a search (probe.found is set) answers a list "
                "whether it finds the effect or not, so its route is missing; check probe.path"
            )
        if not 200 <= status < 300:
            raise ProbeFailed(f"the probe of {policy.name} answered {status}")
        if found_at is None:
            # No JSON to look into: a 2xx means the effect exists, and there is nothing more to replay.
            return StoredResponse(http.status, (JSON,), b"{}")
        try:
            # Strict, and numbers kept as written: the item found is stored as the effect's answer.
            doc = jsonbody.parse(body).value
        except JsonRefused as exc:
            raise ProbeFailed(
                f"the probe of {policy.name} answered something that is not JSON: {exc}"
            ) from None
        found = _effect_in(
            doc,
            found_at,
            derived_key,
            f"the probe of {policy.name} answered {status} without the list probe.found = {found_at!r} "
            "looks into",
            f"the probe of {policy.name}",
            "does probe.path filter by {key}?",
        )
        if found is None:
            return None
        return self._stored(http.status, jsonbody.compact(found).encode(), f"the probe of {policy.name}")

    async def _tool_call(
        self, policy: UpstreamPolicy, probe: ToolProbe, derived_key: str
    ) -> StoredResponse | None:
        """Call the MCP server's read-only tool in a session of the probe's own, and look in its result."""
        who = f"the probe of {policy.name}"
        try:
            async with asyncio.timeout(policy.timeout.total_seconds()):
                answer = await self._tool_session(policy, probe, derived_key)
        except TimeoutError:
            raise ProbeFailed(f"{who} did not answer in time") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise ProbeFailed(f"{who} failed: {type(exc).__name__}: {exc}") from None
        if answer is None:
            raise ProbeFailed(f"{who}: the MCP server's answer holds no response to the tool call")
        if answer.ran != "yes":
            raise ProbeFailed(f"{who}: the tool {probe.tool} gave no result: {answer.stored[:200]!r}")
        try:
            result = jsonbody.parse(answer.stored).value["result"]
        except JsonRefused as exc:
            raise ProbeFailed(f"{who}: the tool's result is not JSON: {exc}") from None
        if isinstance(result, dict) and result.get("isError") is True:
            raise ProbeFailed(f"{who}: the tool {probe.tool} answered an error result")
        found = _effect_in(
            result,
            probe.found,
            derived_key,
            f"{who}: the result of {probe.tool} has no list where probe.found = {probe.found!r} looks",
            who,
            "do the probe's arguments filter by {key}?",
        )
        if found is None:
            return None
        return self._stored(200, mcp.found_as_result(jsonbody.compact(found)), who)

    async def _tool_session(
        self, policy: UpstreamPolicy, probe: ToolProbe, key: str
    ) -> mcp.ToolAnswer | None:
        """initialize, initialized, then the tool call; the session is ended after, as a client would."""
        session = self._client.session(policy.name)
        url = URL(policy.base_url + probe.path, encoded=True)
        limit = self._client.max_response_bytes
        headers = {
            **policy.inject.headers,
            "Accept": "application/json, text/event-stream",
            "Content-Type": "application/json",
        }
        async with session.post(
            url, data=mcp.initialize_message(), headers=headers, allow_redirects=False
        ) as resp:
            body = await read_limited(resp, limit)
            opened = mcp.answer_of(
                resp.status, resp.headers.get("Content-Type", ""), body or b"", mcp.INITIALIZE_ID
            )
            if opened is None or opened.ran != "yes":
                raise ProbeFailed(
                    f"the probe of {policy.name}: the MCP server did not open a session ({resp.status})"
                )
            if "Mcp-Session-Id" in resp.headers:
                headers["Mcp-Session-Id"] = resp.headers["Mcp-Session-Id"]
        try:
            hello = jsonbody.loads(opened.stored)["result"]  # ToolAnswer "yes": a result member
        except JsonRefused as exc:
            raise ProbeFailed(f"the probe of {policy.name}: the server's initialize result: {exc}") from None
        version = hello.get("protocolVersion") if isinstance(hello, dict) else None
        headers["MCP-Protocol-Version"] = version if isinstance(version, str) else mcp.PROBE_PROTOCOL
        try:
            async with session.post(
                url, data=mcp.INITIALIZED, headers=headers, allow_redirects=False
            ) as resp:
                await resp.read()
            async with session.post(
                url,
                data=mcp.probe_call(probe.tool, probe.arguments, key),
                headers=headers,
                allow_redirects=False,
            ) as resp:
                body = await read_limited(resp, limit)
                if body is None:
                    raise ProbeFailed(f"the probe of {policy.name} answered more than {limit} bytes")
                return mcp.answer_of(
                    resp.status, resp.headers.get("Content-Type", ""), body, mcp.PROBE_CALL_ID
                )
        finally:
            if "Mcp-Session-Id" in headers:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with session.delete(url, headers=headers, allow_redirects=False) as resp:
                        await resp.read()

    async def _call_python(
        self, policy: UpstreamPolicy, py: PythonProbe, derived_key: str
    ) -> StoredResponse | None:
        fn = self._python.get(py.entry_point) or load_python_probe(py.entry_point)
        ctx = ProbeContext(
            key=derived_key,
            upstream=policy.name,
            base_url=policy.base_url,
            headers=dict(policy.inject.headers),
            session=self._client.session(policy.name),
            timeout=policy.timeout.total_seconds(),
        )
        try:
            found = await fn(ctx)
        except ProbeFailed:
            raise
        except Exception as exc:  # a plug-in's failure of any kind is a probe that could not tell
            raise ProbeFailed(f"the probe {py.entry_point} failed: {type(exc).__name__}: {exc}") from None
        if found is None:
            return None
        try:
            body = json.dumps(found, allow_nan=False).encode()
        except (TypeError, ValueError):
            raise ProbeFailed(f"the probe {py.entry_point} returned something that is not JSON") from None
        return self._stored(py.status, body, f"the probe {py.entry_point}")

    def _stored(self, status: int, body: bytes, probe: str) -> StoredResponse:
        """The effect as found, as the response to replay; within the limit of any stored answer."""
        if len(body) > self._client.max_response_bytes:
            raise ProbeFailed(f"{probe} found an effect larger than {self._client.max_response_bytes} bytes")
        return StoredResponse(status, (JSON,), body)
