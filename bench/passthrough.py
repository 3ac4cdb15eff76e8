"""A pass-through aiohttp proxy with no database: the floor for any Python proxy in front of the upstream.

Run: `python -m bench.passthrough --upstream http://127.0.0.1:PORT`. ``/<name>/<path>`` is forwarded to
``<upstream>/<path>`` (the gateway's URL scheme), headers and body as they came, and the answer returned.
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)
# Hop-by-hop headers and those aiohttp computes itself: forwarding them would corrupt the message.
DROP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


async def forward(request: web.Request) -> web.Response:
    rest = request.match_info["tail"].partition("/")[2]
    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROP}
    body = await request.read()
    async with request.app[SESSION].request(
        request.method, f"/{rest}", params=request.query, headers=headers, data=body
    ) as resp:
        data = await resp.read()
        out = {k: v for k, v in resp.headers.items() if k.lower() not in DROP}
        return web.Response(status=resp.status, headers=out, body=data)


async def serve(upstream: str, port: int) -> None:
    app = web.Application()
    # No connection limit: aiohttp's default of 100 would be the bottleneck at high concurrency.
    app[SESSION] = aiohttp.ClientSession(upstream, connector=aiohttp.TCPConnector(limit=0))
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(serve(args.upstream, args.port))


if __name__ == "__main__":
    main()
