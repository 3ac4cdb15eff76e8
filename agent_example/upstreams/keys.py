"""Idempotency keys as an API that honours them keeps them: for a while, then forgotten."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class KeyMemory:
    ttl: float
    _seen: dict[str, tuple[float, int, Any]] = field(default_factory=dict)

    def recall(self, key: str | None) -> tuple[int, Any] | None:
        """The first answer given for ``key``, while the key is younger than the TTL."""
        if key is None or key not in self._seen:
            return None
        at, status, body = self._seen[key]
        if time.monotonic() - at >= self.ttl:
            del self._seen[key]  # forgotten, as Stripe forgets keys once they are 24 h old
            return None
        return status, body

    def remember(self, key: str | None, status: int, body: Any) -> None:
        if key is not None:
            self._seen[key] = (time.monotonic(), status, body)
