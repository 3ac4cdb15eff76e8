"""The demo upstreams behind a real gateway: the Stripe-like payments service and the mail service."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlencode

import aiohttp
import pytest
from aiohttp import web

from agent_example.upstreams import mail, payments
from tests.database import effect_rows, runtime_url
from tests.gateways import start_gateway_process
from tests.support import PORT_ZERO


@pytest.fixture
async def payments_url() -> AsyncIterator[str]:
    runner = web.AppRunner(payments.make_app(key_ttl=1.0), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def test_a_charge_whose_key_the_upstream_forgot_is_found_by_metadata_search(
    dsn: str, payments_url: str, tmp_path: Path
) -> None:
    """Gateway killed after the payments API answered; the key is past its TTL; search finds the charge."""
    config = tmp_path / "gw.toml"
    config.write_text(
        f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}workers = 1\nlease_grace = "300ms"\n'
        f'[upstreams.payments]\nbase_url = "{payments_url}"\ntimeout = "1s"\n'
        'native_key = { header = "Idempotency-Key", ttl = "1s" }\n'
        'stamp = { form_field = "metadata[idempotency_key]" }\n'
        "[upstreams.payments.probe]\n"
        "path = \"/v1/charges/search?query=metadata['idempotency_key']:'{key}'\"\n"
        'found = "data.0"\n'
        'routes = ["POST /v1/charges"]\n'
    )
    form = urlencode({"amount": "4200", "currency": "inr"}).encode()
    headers = {"Idempotency-Key": "run-3:4", "Content-Type": "application/x-www-form-urlencoded"}
    doomed = start_gateway_process(config, env={"EFFECT_GATEWAY_FAULT": "after-upstream:payments"})
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientError):
            await http.post(f"{doomed.url}/payments/v1/charges", data=form, headers=headers)
        assert doomed.proc.wait(10) == -signal.SIGKILL
        gateway = start_gateway_process(config)
        try:
            async with http.post(
                f"{gateway.url}/payments/v1/charges", data=form, headers={**headers, "Prefer": "wait=5"}
            ) as resp:
                assert resp.status == 200
                charge = await resp.json()
        finally:
            gateway.stop()
        async with http.get(
            f"{payments_url}/v1/charges/search", params={"query": "metadata['idempotency_key']:'x'"}
        ) as resp:
            assert (await resp.json())["data"] == []
    (row,) = await effect_rows(dsn)
    assert row["recovered_by"] == "probe"
    assert charge["id"] == "ch_1"
    assert charge["metadata"]["idempotency_key"] == row["derived_key"]


async def test_the_mail_service_honours_keys_until_it_forgets_them() -> None:
    """The mail service sends once per key while it remembers the key, and again once it has forgotten."""
    runner = web.AppRunner(mail.make_app(key_ttl=0.2), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as http:
            ids = []
            for pause in (0, 0, 0.3):
                await asyncio.sleep(pause)
                async with http.post(
                    f"{url}/messages", json={"to": "me"}, headers={"Idempotency-Key": "k"}
                ) as r:
                    ids.append((await r.json())["message_id"])
    finally:
        await runner.cleanup()
    assert ids == ["msg_1", "msg_1", "msg_2"]
