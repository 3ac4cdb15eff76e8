"""One stored answer per effect: however many requests restore a purged response at once, and wherever.

After the retention drops a completed effect's response, the upstream's probe may supply it again. A
probe's answer is not stable (a search stamps the time it ran, a page count, a cursor), so each
request that restores the response gets a different one; only the first to be stored may be given,
by every request, from Postgres and from any worker's memory alike.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import asyncpg
from aiohttp import web

from agent_example.processes import Service
from gateway.decision import restore
from gateway.record import StoredResponse
from gateway.store import Store, opened
from tests.database import backdate_bodies, effect_rows, runtime_url
from tests.gateways import decisions, gateway_server, start_gateway_process
from tests.support import PORT_ZERO
from tests.test_store_contract import RETENTION, completed
from tests.upstreams import Upstream

BODY = b'{"items":["atta"]}'
# Agents retrying one key at once, more than the workers, so that both restore it in the same moment.
AGENTS = 16
# The search answers after this long: every agent reads the purged record and probes before any
# restore is stored, as when a slow search meets a burst of retries.
SEARCH_TAKES = 0.3


def changing_search(upstream: Upstream) -> list[int]:
    """A search that finds the order and numbers each answer (as a real one stamps the time it ran);
    returns the numbers of the searches made so far."""
    searches: list[int] = []

    async def search(request: web.Request) -> web.Response:
        made = len(searches) + 1
        searches.append(made)
        await asyncio.sleep(SEARCH_TAKES)
        return web.json_response({"items": [{"reference": request.query.get("ref", ""), "search": made}]})

    upstream.routes["/orders/search"] = search
    return searches


def shop(upstream: Upstream) -> str:
    return (
        f'[upstreams.shop]\nbase_url = "{upstream.url}"\ntimeout = "5s"\n'
        'stamp = { json_field = "client_reference" }\n'
        'probe = { method = "GET", path = "/orders/search?ref={key}", found = "items.0", status = 201, '
        'routes = ["POST /orders"] }\n'
    )


async def purge(dsn: str, store: Store) -> None:
    """Ten days pass and the retention drops the order's response (its audit row stays)."""
    await backdate_bodies(dsn, days=10)
    await store.maintain(RETENTION)
    (row,) = await effect_rows(dsn)
    assert row["response_body"] is None


@dataclass
class Pinned:
    """One keep-alive connection to ``serve``, and so to the one worker that accepted it."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    host: str
    worker: int = 0

    @classmethod
    async def open(cls, url: str) -> Pinned:
        host, port = url.removeprefix("http://").split(":")
        return cls(*await asyncio.open_connection(host, int(port)), f"{host}:{port}")

    async def send(self, method: str, target: str, body: bytes = b"", **headers: str) -> Answer:
        head = f"{method} {target} HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{name.replace('_', '-')}: {value}\r\n" for name, value in headers.items())
        self.writer.write(head.encode() + b"\r\n" + body)
        status_line, *lines = (await self.reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        got = {name.lower(): value for name, _, value in (line.partition(": ") for line in lines if line)}
        content = await self.reader.readexactly(int(got["content-length"]))
        return int(status_line.split()[1]), got.get("idempotent-replayed"), content

    def close(self) -> None:
        self.writer.close()


Answer = tuple[int, str | None, bytes]  # status, Idempotent-Replayed, body


async def pinned_to_each_worker(gateway: Service, each: int) -> list[Pinned]:
    """``each`` connections accepted by each of serve's two workers: which one accepted a connection is
    up to the kernel, and is read from the log line of a request sent on it."""
    assert gateway.stderr is not None
    kept: dict[int, list[Pinned]] = {}
    for n in range(200):
        conn = await Pinned.open(gateway.url)
        assert (await conn.send("GET", f"/shop/whoami/{n}"))[0] == 201
        for _ in range(100):  # the worker logs its line just before it answers
            said = [d["pid"] for d in decisions(gateway.stderr.lines) if d["path"] == f"/whoami/{n}"]
            if said:
                break
            await asyncio.sleep(0.01)
        conn.worker = said[0]
        on = kept.setdefault(conn.worker, [])
        if len(on) < each:
            on.append(conn)
        else:
            conn.close()
        if len(kept) == 2 and all(len(conns) == each for conns in kept.values()):
            return [conn for conns in kept.values() for conn in conns]
    raise AssertionError(f"200 connections did not reach both workers {each} times: {kept}")


async def retry(conn: Pinned) -> Answer:
    return await conn.send("POST", "/shop/orders", BODY, Idempotency_Key="k", Content_Type="application/json")


async def test_agents_restoring_at_once_across_workers_all_get_the_one_stored_answer(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """Many agents retry a purged effect at once on two workers: one answer, the stored one, for all."""
    upstream.serve_search()
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"json_field": "client_reference"}}}
    headers = {"Idempotency-Key": "k", "Content-Type": "application/json"}
    # The order is placed through a gateway of its own, so that no worker below holds it in memory.
    async with (
        gateway_server(dsn, upstreams=cfg, replay_cache_bytes=0) as first,
        aiohttp.ClientSession() as http,
        http.post(f"{first.url}/shop/orders", data=BODY, headers=headers) as resp,
    ):
        assert resp.status == 201
    async with opened(dsn) as store:
        await purge(dsn, store)
    searches = changing_search(upstream)
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}workers = 2\nlog_format = "json"\n' + shop(upstream)
    )
    gateway = start_gateway_process(config)
    conns: list[Pinned] = []
    try:
        conns = await pinned_to_each_worker(gateway, AGENTS // 2)
        burst = await asyncio.gather(*(retry(conn) for conn in conns))
        later = [await retry(conn) for conn in conns]  # from each worker's memory, or Postgres
    finally:
        for conn in conns:
            conn.close()
        gateway.stop()
    (row,) = await effect_rows(dsn)
    stored = row["response_body"]
    assert len(searches) > 1, "the agents did not restore at once"
    answers = set(burst + later)
    assert len(answers) == 1, f"{len(answers)} different answers to {2 * AGENTS} requests"
    assert answers == {(201, "true", stored)}
    assert json.loads(stored)["reference"] == row["derived_key"]  # the probe's answer
    assert [e["event"] for e in row["history"]].count("restored") == 1
    assert len(upstream.effects()) == 1


async def test_two_restores_that_race_on_the_row_store_one_answer_and_both_return_it(dsn: str) -> None:
    """Two restores of one purged response, the second waiting on the first's row lock: the first's
    answer is stored once, and both return it."""
    json_type = (("Content-Type", "application/json"),)
    later = [StoredResponse(201, json_type, b'{"search": %d}' % n) for n in (1, 2)]
    async with opened(dsn) as store:
        record = await completed(store)
        await purge(dsn, store)
        purged = await store.reread(record)
        assert purged.purged
        holder = await asyncpg.connect(dsn)
        try:
            lock = holder.transaction()
            await lock.start()
            # Both restores wait for this lock, each having read the record before either is stored.
            await holder.execute("select from effects where id = $1 for update", record.id)
            racing = [asyncio.create_task(store.restore(purged, restore(purged), answer)) for answer in later]
            for _ in range(200):
                waiting = await holder.fetchval("select count(*) from pg_locks where not granted")
                if waiting == 2:
                    break
                await asyncio.sleep(0.01)
            assert waiting == 2, "the restores did not both wait for the row"
            await lock.rollback()
            returned = await asyncio.gather(*racing)
        finally:
            await holder.close()
        now = await store.get(record.id)
    assert now is not None
    assert [e["event"] for e in now.history].count("restored") == 1
    assert now.response in later
    assert [r.response for r, _ in returned] == [now.response] * 2
    assert sorted(restored for _, restored in returned) == [False, True]
