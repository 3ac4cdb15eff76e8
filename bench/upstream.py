"""A trivial upstream in a process of its own: what the load benchmarks call, directly and through proxies.

Run: `python -m bench.upstream` prints "listening on http://127.0.0.1:PORT" once it accepts requests.
``POST /orders`` answers 201 with a small JSON document, as a shop's order API would (``?pad=N`` adds N
characters of random hex to it, for responses of a realistic size that compress no better than real
ones). ``POST /hang``
answers only once ``POST /release`` is called: a request held there keeps its effect in flight, so a twin
sent meanwhile is the gateway's 409.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets

from aiohttp import web

RELEASE = web.AppKey("release", asyncio.Event)
# Random, so that Postgres's compression of stored responses gains what it would on real data: little.
NOISE = secrets.token_hex(32 * 1024)


async def create(request: web.Request) -> web.Response:
    await request.read()
    pad = min(int(request.query.get("pad", "0")), len(NOISE))
    doc = {"order": "O-1", "status": "placed"}
    if pad:
        doc["detail"] = NOISE[:pad]
    return web.json_response(doc, status=201)


async def hang(request: web.Request) -> web.Response:
    await request.read()
    await request.app[RELEASE].wait()
    return web.json_response({"order": "O-2", "status": "placed"}, status=201)


async def release(request: web.Request) -> web.Response:
    request.app[RELEASE].set()
    request.app[RELEASE] = asyncio.Event()  # the next /hang holds again
    return web.json_response({"released": True})


async def serve(port: int) -> None:
    app = web.Application()
    app[RELEASE] = asyncio.Event()
    app.router.add_post("/orders", create)
    app.router.add_post("/hang", hang)
    app.router.add_post("/release", release)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
