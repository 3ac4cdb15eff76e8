"""The operator's command line as the tests run it: in this process, or off the event loop."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main


@dataclass
class Done:
    status: int
    out: str
    err: str


def in_process(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., Done]:
    """``main()`` in this process (a subprocess costs seconds of imports); same arguments, same output.

    The ``run`` fixture (tests/conftest.py).
    """
    for name in list(os.environ):
        if name.startswith("EFFECT_GATEWAY_"):
            monkeypatch.delenv(name)

    def invoke(*args: str, config: Path | None = None, env: dict[str, str] | None = None) -> Done:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        status = main([*(["--config", str(config)] if config else []), *args])
        out, err = capsys.readouterr()
        return Done(status, out, err)

    return invoke


async def in_thread(run: Callable[..., Done], *args: str, **kwargs: Any) -> Done:
    """``run`` off the event loop, for tests whose upstream server runs on that loop."""
    return await asyncio.to_thread(run, *args, **kwargs)
