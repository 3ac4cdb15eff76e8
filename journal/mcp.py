"""MCP tool calls made inside a step carry the step's key, as the httpx integration's requests do.

The gateway reads a tool call's key from ``params._meta["effect-gateway/idempotency-key"]``; this puts
``{run_id}:{step}`` there (``{run_id}:{step}:{n}`` for the n-th distinct call of a step), so a re-run
after a crash calls the tool under the same key and the gateway replays the first call's result. No
dependency on an MCP SDK: :func:`call_tool` takes any session with the official Python SDK's
``call_tool(name, arguments, ..., meta=...)``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from journal.journal import current_step

# Where the gateway looks for a tool call's key (gateway.mcp.KEY_META; tests/test_journal_mcp.py checks
# that the two agree, so the agent's side needs none of the gateway installed).
KEY_META = "effect-gateway/idempotency-key"


def tool_meta(name: str, arguments: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The ``_meta`` that gives a tool call made inside a step the step's key; none outside a step.

    ``name`` and ``arguments`` tell a step's distinct calls apart, so the same call made again (a retry
    of the SDK's, or the agent's) gets the key it had.
    """
    ctx = current_step()
    if ctx is None:
        return {}
    digest = hashlib.sha256(b"tools/call\0" + name.encode() + b"\0")
    digest.update(json.dumps(arguments or {}, sort_keys=True, separators=(",", ":")).encode())
    return {KEY_META: ctx.key_for(digest.digest())}


async def call_tool(
    session: Any, name: str, arguments: Mapping[str, Any] | None = None, **options: Any
) -> Any:
    """``session.call_tool(name, arguments, **options)`` with the step's key in the call's ``_meta``
    (added to any ``meta`` given)."""
    meta = {**(options.pop("meta", None) or {}), **tool_meta(name, arguments)}
    return await session.call_tool(
        name, dict(arguments) if arguments is not None else None, meta=meta or None, **options
    )
