"""``make serve``: the gateway with examples/gateway.toml, in front of the demo upstreams, to try by hand.

Starts the shop (9001), mail (9002) and payments (9003) services and the shop as an MCP server (9004),
then ``effect-gateway serve`` with the
example configuration on the embedded Postgres, prints what to try first, and stops everything it
started on Ctrl+C.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from agent_example.processes import Service, start_gateway, start_service

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "gateway.toml"
# The ports examples/gateway.toml names for each upstream.
UPSTREAMS = {"shop": 9001, "mail": 9002, "payments": 9003, "mcp-shop": 9004}

TRY = """
effect-gateway is listening on {url}, in front of the demo shop, mail and payments services and the
shop as an MCP server ({url}/mcp-shop/mcp, for an MCP client);
its audit, effects API and metrics are on {admin} (a listener of their own).
Try, in another terminal:

  # place an order through the gateway (the shop has no idempotency of its own)
  curl -s -H 'Idempotency-Key: run-1:4' -H 'Content-Type: application/json' \\
       -d '{{"items": ["atta", "toor dal"]}}' {url}/shop/orders

  # the same again: replayed (Idempotent-Replayed: true), no second order
  curl -si -H 'Idempotency-Key: run-1:4' -H 'Content-Type: application/json' \\
       -d '{{"items": ["atta", "toor dal"]}}' {url}/shop/orders

  # the same key with another body: 422 key-reused, nothing sent
  curl -s -H 'Idempotency-Key: run-1:4' -H 'Content-Type: application/json' \\
       -d '{{"items": ["ghee"]}}' {url}/shop/orders

  # the audit, as JSON (or as a page: {admin}/_gateway/audit in a browser)
  curl -s {admin}/_gateway/effects

Ctrl+C stops the gateway and the services.
"""


def main() -> int:
    started: list[Service] = []
    try:
        for name, port in UPSTREAMS.items():
            command = ["-m", "agent_example.upstreams", name, "--port", str(port)]
            started.append(start_service(command, own_stderr=True))
        # Its log reaches this terminal through a pipe (the announcement is read from it), where "auto"
        # would choose JSON: a person reads text, unless they chose a format themselves.
        text = sys.stderr.isatty() and "EFFECT_GATEWAY_LOG_FORMAT" not in os.environ
        gateway = start_gateway(
            ["-m", "gateway", "--config", str(CONFIG), "serve"],
            {"EFFECT_GATEWAY_LOG_FORMAT": "text"} if text else None,
            timeout=60,
            cwd=str(ROOT),
            echo=sys.stderr,
        )
        started.append(gateway)
        print(TRY.format(url=gateway.url, admin=gateway.admin_url), flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(0.5):
            if (dead := next((s for s in started if s.proc.poll() is not None), None)) is not None:
                print(f"{dead.url} stopped; stopping the rest", file=sys.stderr)
                return 1
        return 0
    except RuntimeError as exc:  # a service did not start (a port in use, say)
        print(f"make serve: {exc}", file=sys.stderr)
        return 2
    finally:
        for service in reversed(started):
            service.stop()


if __name__ == "__main__":
    sys.exit(main())
