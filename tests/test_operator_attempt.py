"""The attempt an operator judges: one number on every surface, and a 409 hint that runs as given.

An effect that nothing can tell about waits for an operator, who resolves it naming the attempt they
looked at (a verdict on an effect that changed since is refused). That number is the latest attempt
at the effect: the one whose outcome is unknown. Sending the effect to review or resolving it is no
new attempt, so the audit page, `effect-gateway effects ID`, the admin API, the history, the 409's
hint and `resolve` all say the same number.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.database import effect_rows
from tests.gateways import gateway_server
from tests.support import ROOT
from tests.test_recovery import flaky_first
from tests.upstreams import Upstream

BODY = b'{"items":["atta"]}'


async def order(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    headers = {"Idempotency-Key": "k", "Content-Type": "application/json"}
    async with http.post(f"{url}/shop/orders", data=BODY, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def in_review(http: aiohttp.ClientSession, url: str) -> str:
    """The order is lost in a 500 and the retry finds nothing can tell: the 409's detail."""
    assert (await order(http, url))[0] == 500
    status, problem = await order(http, url)
    assert (status, problem["type"].rsplit("/", 1)[1]) == (409, "outcome-unknown")
    return str(problem["detail"])


def hinted(detail: str, verdict: str) -> list[str]:
    """The command the 409's detail gives for ``verdict``, as an operator would copy it."""
    commands = [shlex.split(quoted) for quoted in re.findall(r"`([^`]+)`", detail)]
    found = [command for command in commands if verdict in command]
    assert len(found) == 1, f"no one command for {verdict} in: {detail}"
    return found[0]


async def run(command: list[str], dsn: str) -> tuple[int, str, str]:
    """``command`` as a shell would run it, with the gateway's database and its programs on PATH."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "EFFECT_GATEWAY_DATABASE_URL": dsn,
    }
    env.pop("EFFECT_GATEWAY_CONFIG", None)
    proc = await asyncio.create_subprocess_exec(
        *command, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.parametrize(
    ("verdict", "blanks", "said", "retry"),
    [
        ("--did-not-happen", {}, "resolved as did not happen", (201, {"order": 2})),
        ("--happened", {"STATUS": "201", "BODY": '{"order": "by hand"}'}, "resolved as happened", None),
    ],
    ids=["did-not-happen", "happened"],
)
async def test_the_command_a_409_outcome_unknown_gives_runs_and_resolves_the_effect(
    dsn: str,
    upstream: Upstream,
    verdict: str,
    blanks: dict[str, str],
    said: str,
    retry: tuple[int, dict[str, Any]] | None,
) -> None:
    """Copied from the 409 (with the response filled in where the effect happened) and run as it is,
    the command resolves the effect, and the agent's next retry gets the verdict's answer."""
    flaky_first(upstream)
    async with (
        gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw,
        aiohttp.ClientSession() as http,
    ):
        detail = await in_review(http, gw.url)
        command = [blanks.get(word, word) for word in hinted(detail, verdict)]
        status, out, err = await run(command, dsn)
        assert status == 0, f"{shlex.join(command)}: {err}"
        answer = await order(http, gw.url)
    assert said in out
    assert answer == (retry or (201, {"order": "by hand"}))
    assert len(upstream.effects()) == (2 if verdict == "--did-not-happen" else 1)


async def test_the_page_the_command_line_the_api_the_history_and_resolve_name_one_attempt(
    dsn: str, upstream: Upstream
) -> None:
    """An effect sent once, then to review: every surface says attempt 1, and resolve takes it."""
    flaky_first(upstream)
    async with (
        gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw,
        aiohttp.ClientSession() as http,
    ):
        detail = await in_review(http, gw.url)
        (row,) = await effect_rows(dsn)
        effect = row["id"]
        async with http.get(f"{gw.admin_url}/_gateway/audit/{effect}") as resp:
            page = await resp.text()
        async with http.get(f"{gw.admin_url}/_gateway/effects/{effect}") as resp:
            api = (await resp.json())["attempt"]
        status, shown, err = await run([sys.executable, "-m", "gateway", "effects", str(effect)], dsn)
        assert status == 0, err
        on_page = re.findall(r"<dt>attempts?</dt><dd>(\d+)</dd>", page)
        in_form = set(re.findall(r'name="attempt" value="(\d+)"', page))
        in_history = {entry["event"]: entry.get("attempt") for entry in row["history"]}
        said = {
            "page": on_page,
            "page's form": sorted(in_form),
            "api": api,
            "effects ID": shown.splitlines()[0],
            "history": in_history.get("needs_review"),
            "409": re.findall(r"`([^`]+)`", detail)[0],
        }
        assert said == {
            "page": ["1"],
            "page's form": ["1"],
            "api": 1,
            "effects ID": f"effect {effect}: needs_review (attempt 1)",
            "history": 1,
            "409": f"effect-gateway resolve {effect} --attempt 1 --did-not-happen",
        }
        resolve = [sys.executable, "-m", "gateway", "resolve", str(effect), "--did-not-happen", "--attempt"]
        status, _, err = await run([*resolve, "2"], dsn)
        assert (status, err) == (
            2,
            f"effect-gateway: effect {effect}: it has had no attempt 2: its latest is attempt 1 "
            "(needs_review), the one to judge\n",
        )
        status, _, err = await run([*resolve, "1"], dsn)
        assert status == 0, err
        # A second operator who judged the same attempt is told that another verdict came first.
        status, _, err = await run([*resolve, "1"], dsn)
        assert (status, err) == (
            2,
            f"effect-gateway: effect {effect}: it changed since it was judged: another verdict said it did "
            "not happen (now retryable, and the next retry sends it); look at it again\n",
        )
        assert (await order(http, gw.url))[0] == 201
        async with http.get(f"{gw.admin_url}/_gateway/effects/{effect}") as resp:
            after = await resp.json()
    events = [(entry["event"], entry.get("attempt")) for entry in after["history"]]
    assert events == [
        ("claimed", 1),
        ("settled", 1),
        ("needs_review", 1),
        ("resolved", 1),
        ("reclaimed", 2),
        ("settled", 2),
    ]
    assert (after["state"], after["attempt"]) == ("completed", 2)
