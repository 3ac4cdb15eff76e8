"""The requests a probe can find: routes such as ``POST /orders`` or ``POST /orders/*/refund``.

A probe searches one kind of effect (orders, charges); an upstream has others (refunds, emails) that its
search never lists. Its "not found" says something only about effects of the routes it is written for,
so each probe names them (``probe.routes``), and recovery asks it about no other. No I/O here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# What one path segment of a route may be: anything but the separators, or * for any one segment.
WILDCARD = "*"
# An HTTP method as the settings name one: in capitals (methods are case-sensitive, and the usual are so).
METHOD = re.compile(r"^[A-Z][A-Z-]{0,31}$")


@dataclass(frozen=True, slots=True)
class Route:
    """A method and a path whose segments are literal, or ``*`` for any one segment."""

    method: str
    segments: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Route:
        """Read ``"POST /orders/*/refund"``; raises ValueError saying what is wrong with it."""
        method, space, path = text.partition(" ")
        if not space or not METHOD.match(method):
            raise ValueError(
                f"{text!r} is not a route such as 'POST /orders': a method in capitals, a space, a path"
            )
        if not path.startswith("/") or any(c in path for c in "?# \t"):
            raise ValueError(f"{text!r}: the path must start with / and hold no query, fragment or space")
        segments = tuple(path[1:].split("/"))
        for segment in segments:
            if WILDCARD in segment and segment != WILDCARD:
                raise ValueError(f"{text!r}: * stands for one whole segment, as in /orders/*/refund")
        return cls(method, segments)

    def covers(self, method: str, path: str) -> bool:
        """Whether a request of ``method`` to ``path`` (as the agent sent it, still percent-encoded) is one
        of this route's: the same method, and as many segments, each the same or matched by ``*``.

        Compared as written, so a path spelt another way (``/Orders``, ``/orders/``, ``/%6Frders``) is
        not covered, nor is an empty segment (``/orders//refund``): recovery then relies on no probe for
        it, which is the safe side.
        """
        if method != self.method or not path.startswith("/"):
            return False
        segments = path[1:].split("/")
        return len(segments) == len(self.segments) and all(
            mine == theirs or (mine == WILDCARD and theirs != "")
            for mine, theirs in zip(self.segments, segments, strict=True)
        )

    def __str__(self) -> str:
        return f"{self.method} /{'/'.join(self.segments)}"


def covered(routes: tuple[Route, ...], method: str, path: str) -> bool:
    """Whether any of ``routes`` covers a request of ``method`` to ``path``."""
    return any(route.covers(method, path) for route in routes)
