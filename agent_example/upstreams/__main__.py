"""``python -m agent_example.upstreams NAME [--host H] --port N [--key-ttl 24h]``: run one demo upstream
(``mcp-shop``: the shop as an MCP server, at ``/mcp``; it needs the mcp extra)."""

from __future__ import annotations

import argparse
import asyncio
import signal

from aiohttp import web

from agent_example.upstreams import mail, payments, shop
from gateway.settings import parse_duration


async def serve(name: str, host: str, port: int, key_ttl: float) -> None:
    if name == "mcp-shop":
        await serve_mcp_shop(host, port)
        return
    if name == "shop":
        app = shop.make_app()
    elif name == "mail":
        app = mail.make_app(key_ttl)
    else:
        app = payments.make_app(key_ttl)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(f"{name} listening on http://{host}:{runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


async def serve_mcp_shop(host: str, port: int) -> None:
    """The shop as an MCP server (needs the mcp extra), at http://host:port/mcp."""
    import uvicorn

    from agent_example.upstreams import mcp_shop

    server = uvicorn.Server(uvicorn.Config(mcp_shop.make_app(), host=host, port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            serving.result()
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    print(f"mcp-shop listening on http://{host}:{bound}", flush=True)
    await serving


def main() -> None:
    parser = argparse.ArgumentParser(description="Run one of the demo's upstreams.")
    parser.add_argument("name", choices=["shop", "mail", "payments", "mcp-shop"])
    # Loopback unless told otherwise; a container's loopback is its own, so compose gives 0.0.0.0.
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--key-ttl", default="24h", help="how long mail and payments remember keys")
    args = parser.parse_args()
    asyncio.run(serve(args.name, args.host, args.port, parse_duration(args.key_ttl).total_seconds()))


main()
