"""The demo: the reference article's experiment with real processes and real SIGKILLs, end to end."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.crash

# The article's findings, and ours past it: (model calls, orders, emails, same as no crash)
EXPECTED = {
    ("naive", "none"): "3 | 1 | 1 | yes",
    ("naive", "after-effect:4"): "5 | 2 | 1 | NO",
    ("naive", "after-checkpoint:4"): "5 | 2 | 1 | NO",
    ("journal only", "none"): "3 | 1 | 1 | yes",
    ("journal only", "after-effect:4"): "3 | 2 | 1 | NO",
    ("journal only", "after-checkpoint:4"): "3 | 1 | 1 | yes",
    ("journal + keys", "after-effect:4"): "3 | 1 | 1 | yes",
    ("journal + keys", "after-checkpoint:4"): "3 | 1 | 1 | yes",
    ("journal + keys, shop ignores keys", "after-effect:4"): "3 | 2 | 1 | NO",
    ("journal + keys, shop ignores keys", "after-checkpoint:4"): "3 | 1 | 1 | yes",
    ("journal + gateway", "none"): "3 | 1 | 1 | yes",
    ("journal + gateway", "after-effect:4"): "3 | 1 | 1 | yes",
    ("journal + gateway", "after-checkpoint:4"): "3 | 1 | 1 | yes",
    ("journal + gateway", "gateway killed after-upstream"): "3 | 1 | 1 | yes",
    # The shop as an MCP server, the order a place_order tool call.
    ("naive, shop over MCP", "after-effect:4"): "5 | 2 | 1 | NO",
    ("journal + gateway, shop over MCP", "none"): "3 | 1 | 1 | yes",
    ("journal + gateway, shop over MCP", "after-effect:4"): "3 | 1 | 1 | yes",
    ("journal + gateway, shop over MCP", "after-checkpoint:4"): "3 | 1 | 1 | yes",
    ("journal + gateway, shop over MCP", "gateway killed after-upstream"): "3 | 1 | 1 | yes",
}


def test_the_demo_prints_the_articles_table_and_goes_past_it() -> None:
    """`effect-gateway demo` kills agents and the gateway for real and prints what held up."""
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "demo"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0] not in ("design", "---"):
            rows[(cells[0], cells[1])] = " | ".join(cells[2:])
    for scenario, expected in EXPECTED.items():
        assert rows.get(scenario) == expected, f"{scenario}: {rows.get(scenario)}"
    assert "matched the run without a crash at every crash point" in done.stdout
