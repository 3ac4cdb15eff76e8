"""What the whole suite shares: where the project is, the lines that put a gateway on port 0, and what
tests leave for the summary at the end of the run (tests/conftest.py prints it).

The real parts the tests run against live by concern: tests/upstreams.py (HTTP servers on loopback),
tests/gateways.py (gateways in this process or their own), tests/database.py (the test Postgres),
tests/plans.py (the audit at volume) and tests/factories.py (effects and records to start from).
"""

from __future__ import annotations

from pathlib import Path

# Rows of the crash matrix, filled by tests/test_crash.py and printed at the end of the run.
CRASH_MATRIX: list[tuple[str, str, int, int, int, str, str | None]] = []
# Cases tried per operation and generation mode by tests/test_schemathesis.py, printed at the end.
FUZZ_COUNTS: list[tuple[str, str, int]] = []
# Screenshots the browser tests took (tests/test_audit_browser.py), listed at the end of the run.
SCREENSHOTS: list[Path] = []
ROOT = Path(__file__).resolve().parent.parent
# The lines that put both of a gateway's listeners on port 0: a user's `make serve` may hold the defaults,
# and so may another test's gateway.
PORT_ZERO = 'listen = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'
