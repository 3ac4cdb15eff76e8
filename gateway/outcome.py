"""What one attempt at the upstream came to, and what a probe came to, as the upstream seam reports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.record import StoredResponse

# What an answer says of the effect where its protocol says it: an MCP server's answer to a tool call
# does, in JSON-RPC, whatever its HTTP status ("no": the tool never ran; "maybe": it may have).
Ran = Literal["yes", "no", "maybe"]


@dataclass(frozen=True, slots=True)
class Answered:
    """The upstream answered with a status (which may still leave the effect in doubt)."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    # What the answer says of the effect where its protocol says it (gateway.mcp reads an MCP server's
    # answer to a tool call); None: its HTTP status says.
    ran: Ran | None = None


@dataclass(frozen=True, slots=True)
class NotSent:
    """The request never left the gateway (connection refused, DNS failure): nothing happened."""

    reason: str


@dataclass(frozen=True, slots=True)
class NoAnswer:
    """The request left, but no usable answer came back (timeout, reset, an answer too large to keep)."""

    reason: str
    timed_out: bool = False
    too_large: bool = False


Outcome = Answered | NotSent | NoAnswer


# --- what a probe came to ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Found:
    """The upstream says the effect exists; ``response`` is what to replay for it."""

    response: StoredResponse


@dataclass(frozen=True, slots=True)
class NotFound:
    """The upstream's search does not list the effect (which proves nothing past its horizon)."""


@dataclass(frozen=True, slots=True)
class ProbeError:
    """The probe could not tell (timeout, bad status, garbage, an answer too large to keep)."""

    reason: str


ProbeResult = Found | NotFound | ProbeError
