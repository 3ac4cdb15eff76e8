"""Named fault points: a crash test kills the gateway exactly there, with a real SIGKILL.

Off unless ``EFFECT_GATEWAY_FAULT`` names a point (optionally ``point:upstream`` to hit one upstream
only). ``EFFECT_GATEWAY_FAULT_SIGNAL=SIGSTOP`` stalls the process there instead (a frozen VM, a long
pause), for a test to resume with SIGCONT. Read once at import: a process that was not started with it
can never crash here.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "EFFECT_GATEWAY_FAULT"
# After the claim is durable, after the upstream answered (before our record), after the record.
POINTS = ("after-claim", "after-upstream", "after-record")

SIGNAL_ENV = "EFFECT_GATEWAY_FAULT_SIGNAL"

_point, _, _only = os.environ.get(FAULT_ENV, "").partition(":")
if _point and _point not in POINTS:
    raise SystemExit(f"{FAULT_ENV}={_point!r} is not one of {', '.join(POINTS)}")
_signal = os.environ.get(SIGNAL_ENV, "SIGKILL")
if _signal not in ("SIGKILL", "SIGSTOP"):
    raise SystemExit(f"{SIGNAL_ENV}={_signal!r} is not SIGKILL or SIGSTOP")


def fault(point: str, upstream: str) -> None:
    if _point == point and (not _only or _only == upstream):
        os.kill(os.getpid(), signal.Signals[_signal])
