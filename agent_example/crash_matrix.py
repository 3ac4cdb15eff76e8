"""The crash matrix: the reference article's experiment, with real SIGKILLs, and one step past it.

Starts an embedded Postgres, the demo shop and mail services and effect-gateway, each in its own
process. For each design it runs the grocery agent once without a crash, then once killed at
after-effect:4 and once at after-checkpoint:4, each time re-running it to completion; for journal +
gateway it also kills the gateway after the shop answered and before the gateway recorded it. With the
mcp extra installed, the shop also runs as an MCP server, and two more designs place the order as a
place_order tool call: straight to the server, and through the gateway with the step's key. It counts
model calls, orders and emails per run and prints the table. Exit status 1 when journal + gateway (HTTP
or MCP) ever differs from a run without a crash.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx

from agent_example import model
from agent_example.agent import DESIGNS
from agent_example.processes import Service, start_gateway, start_service
from gateway.embedded import EmbeddedPostgres

NO_CRASH = (3, 1, 1)  # model calls, orders, emails of a run that never crashed
POINTS = ("after-effect:4", "after-checkpoint:4")
GATEWAY_CRASH = "gateway killed after-upstream"
LABELS = {
    "naive": "naive",
    "journal": "journal only",
    "journal+keys": "journal + keys",
    "journal+keys-http": "journal + keys, shop ignores keys",
    "journal+gateway": "journal + gateway",
    "mcp-naive": "naive, shop over MCP",
    "mcp-journal+gateway": "journal + gateway, shop over MCP",
}
PROTECTED = ("journal+gateway", "mcp-journal+gateway")
# The MCP rows need the official MCP SDK (the mcp extra) for the shop's server and the agent's client.
HAS_MCP = importlib.util.find_spec("mcp") is not None
# The agent is re-run until it completes; twice is enough for one crash, the rest is a safety bound.
MAX_RERUNS = 4


@dataclass(frozen=True)
class Row:
    design: str
    point: str
    model_calls: int
    orders: int
    emails: int

    @property
    def same(self) -> bool:
        return (self.model_calls, self.orders, self.emails) == NO_CRASH


def gateway_config(folder: Path, dsn: str, shop: str, mail: str, mcp_shop: str) -> Path:
    config = folder / "gateway.toml"
    config.write_text(
        f"""
database_url = "{dsn}"
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
# One process, so that the fault point kills the gateway itself (with more, it kills one worker).
workers = 1
# A short lease keeps the demo quick: a gateway that died is taken over 2.5 s after its claim.
lease_grace = "500ms"

[upstreams.shop]                  # no idempotency of its own: stamp + probe
base_url = "{shop}"
timeout = "2s"
stamp = {{ json_field = "client_reference" }}
[upstreams.shop.probe]            # searches orders, so it is asked about orders alone
path = "/orders?client_reference={{key}}"
found = "items.0"
status = 201
routes = ["POST /orders"]

[upstreams.mail]                  # honours keys for 24 h
base_url = "{mail}"
timeout = "2s"
native_key = {{ header = "Idempotency-Key", ttl = "24h" }}
"""
    )
    if mcp_shop:
        with config.open("a") as more:
            more.write(
                f"""
[upstreams.mcp-shop]              # an MCP server: each place_order call is an effect
base_url = "{mcp_shop}"
protocol = "mcp"
timeout = "2s"
stamp = {{ json_field = "params.arguments.client_reference" }}
[upstreams.mcp-shop.probe]        # a read-only tool call that finds orders by that reference
path = "/mcp"
tool = "find_orders"
arguments = {{ client_reference = "{{key}}" }}
found = "structuredContent.orders.0"
tools = ["place_order"]
"""
            )
    return config


class Demo:
    def __init__(self, folder: Path, dsn: str, say: Callable[[str], None]) -> None:
        self.folder = folder
        self.dsn = dsn
        self.say = say
        self.shop = start_service(["-m", "agent_example.upstreams", "shop"])
        self.mail = start_service(["-m", "agent_example.upstreams", "mail", "--key-ttl", "24h"])
        self.mcp_shop = start_service(["-m", "agent_example.upstreams", "mcp-shop"]) if HAS_MCP else None
        mcp_url = self.mcp_shop.url if self.mcp_shop else ""
        self.config = gateway_config(folder, dsn, self.shop.url, self.mail.url, mcp_url)
        self.gateway = self.start_gateway()

    def start_gateway(self, fault: str | None = None) -> Service:
        env = {"EFFECT_GATEWAY_FAULT": fault} if fault else {}
        return start_gateway(["-m", "gateway", "--config", str(self.config), "serve"], env)

    def close(self) -> None:
        for service in (self.gateway, self.mail, self.shop, self.mcp_shop):
            if service is not None:
                service.stop()

    def agent(self, design: str, run_id: str, crash: str | None = None) -> int:
        args = [
            sys.executable,
            "-m",
            "agent_example.agent",
            "--design",
            design,
            "--run-id",
            run_id,
            "--dsn",
            self.dsn,
            "--shop",
            self.shop.url,
            "--mail",
            self.mail.url,
            "--gateway",
            self.gateway.url,
            "--mcp-shop",
            self.mcp_shop.url if self.mcp_shop else "",
        ]
        if crash:
            args += ["--crash", crash]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        return done.returncode

    def complete(self, design: str, run_id: str) -> None:
        for _ in range(MAX_RERUNS):
            if self.agent(design, run_id) == 0:
                return
        raise RuntimeError(f"the {design} agent did not complete run {run_id} in {MAX_RERUNS} re-runs")

    async def count(self, design: str, point: str, run_id: str) -> Row:
        conn = await asyncpg.connect(self.dsn)
        try:
            calls = await model.calls(conn, run_id)
            in_db = await conn.fetchval("select count(*) from orders where run_id = $1", run_id)
        finally:
            await conn.close()
        async with httpx.AsyncClient() as http:
            in_shop = (await http.get(f"{self.shop.url}/_stats", params={"run_id": run_id})).json()["orders"]
            emails = (await http.get(f"{self.mail.url}/_stats", params={"run_id": run_id})).json()["messages"]
            in_mcp_shop = 0
            if self.mcp_shop is not None:
                stats = await http.get(f"{self.mcp_shop.url}/_stats", params={"run_id": run_id})
                in_mcp_shop = stats.json()["orders"]
        return Row(design, point, calls, int(in_db) + int(in_shop) + int(in_mcp_shop), int(emails))

    async def scenario(self, design: str, point: str) -> Row:
        # Run ids become keys, which are visible ASCII: no spaces.
        run_id = f"{design}.{point.replace(' ', '-')}.{time.time_ns()}"
        if point == "none":
            self.complete(design, run_id)
        elif point == GATEWAY_CRASH:
            # The gateway dies between the shop's answer and its own record; the agent's call fails.
            self.gateway.stop()
            shop = "mcp-shop" if design.startswith("mcp-") else "shop"
            self.gateway = self.start_gateway(fault=f"after-upstream:{shop}")
            status = self.agent(design, run_id)
            if self.gateway.proc.wait(30) != -signal.SIGKILL:
                raise RuntimeError("the gateway did not die at its fault point")
            if status == 0:
                raise RuntimeError("the agent completed although its gateway died under it")
            self.gateway = self.start_gateway()
            self.complete(design, run_id)
        else:
            if self.agent(design, run_id, crash=point) != -signal.SIGKILL:
                raise RuntimeError(f"the agent was not killed at {point}")
            self.complete(design, run_id)
        return await self.count(design, point, run_id)


def scenarios() -> list[tuple[str, str]]:
    designs = [d for d in DESIGNS if HAS_MCP or not d.startswith("mcp-")]
    plan = [(design, point) for design in designs for point in ("none", *POINTS)]
    for design in PROTECTED:
        if design in designs:
            plan.insert(plan.index((design, POINTS[-1])) + 1, (design, GATEWAY_CRASH))
    return plan


def table(rows: list[Row]) -> str:
    lines = [
        "| design | crash point | model calls | orders | emails | same as no crash |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        same = "yes" if row.same else "NO"
        counts = f"{row.model_calls} | {row.orders} | {row.emails}"
        lines.append(f"| {LABELS[row.design]} | {row.point} | {counts} | {same} |")
    return "\n".join(lines)


async def run_matrix(folder: Path, dsn: str, say: Callable[[str], None]) -> list[Row]:
    demo = Demo(folder, dsn, say)
    rows = []
    try:
        plan = scenarios()
        for i, (design, point) in enumerate(plan, 1):
            started = time.monotonic()
            row = await demo.scenario(design, point)
            rows.append(row)
            verdict = "same as no crash" if row.same else "DIFFERS"
            say(
                f"[{i:>2}/{len(plan)}] {LABELS[design]:<34} {point:<30} {row.model_calls} model calls, "
                f"{row.orders} orders, {row.emails} emails: {verdict} ({time.monotonic() - started:.1f}s)"
            )
    finally:
        demo.close()
    return rows


def main(database_url: str | None = None) -> int:
    """`effect-gateway demo`: returns the exit status."""
    started = time.monotonic()

    def say(line: str) -> None:
        print(line, flush=True)

    say("effect-gateway demo: the grocery agent, killed for real at the worst moments")
    with tempfile.TemporaryDirectory(prefix="effect-gateway-demo-") as tmp:
        folder = Path(tmp)
        embedded = None
        dsn = database_url or os.environ.get("EFFECT_GATEWAY_DEMO_DATABASE_URL")
        if dsn is None:
            embedded = EmbeddedPostgres(folder / "data")
            dsn = embedded.start()
            say(f"embedded Postgres started (pid {embedded.pid})")
        try:
            rows = asyncio.run(run_matrix(folder, dsn, say))
        finally:
            if embedded is not None:
                embedded.stop()
    say("")
    say(table(rows))
    bad = [row for row in rows if row.design in PROTECTED and not row.same]
    say("")
    calls, orders, emails = NO_CRASH
    say(f"a run without a crash makes {calls} model calls, places {orders} order, sends {emails} email")
    if bad:
        points = ", ".join(r.point for r in bad)
        say(f"FAILED: journal + gateway differs from a run without a crash at {points}")
    else:
        say("journal + gateway matched the run without a crash at every crash point, the gateway's too")
    if not HAS_MCP:
        say("the rows with the shop over MCP need the mcp extra: pip install 'effect-gateway[mcp]'")
    say(f"demo took {time.monotonic() - started:.1f}s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
