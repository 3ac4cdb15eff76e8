"""Fixtures: one real Postgres per test session (TEST_DATABASE_URL, or the embedded server)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, settings
from playwright.async_api import Browser, async_playwright

from gateway.embedded import EmbeddedPostgres
from gateway.schema import migrate
from tests.commands import Done, in_process
from tests.database import empty_effects, grant_runtime, worker_database
from tests.poolers import pgbouncer
from tests.support import CRASH_MATRIX, FUZZ_COUNTS, SCREENSHOTS
from tests.upstreams import Upstream, upstream_server

# Property tests: a few examples each in `make test` (the whole suite stays fast), many in `make fuzz`.
# Choose with HYPOTHESIS_PROFILE; tests that start servers take their count from the profile as well.
# Function-scoped fixtures (a gateway, an upstream) are shared by a test's examples on purpose.
settings.register_profile(
    "ci", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.register_profile(
    "fuzz", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The browser tests (tests/test_audit_browser.py, tests/test_browsers.py) drive Debian's Chromium with
# Playwright; one browser per module.
CHROMIUM = Path("/usr/bin/chromium")
# Chromium as root needs --no-sandbox; the rest keep it off the network this machine does not have
# (without them it stalls on lookups of Google's hosts). Playwright adds --headless and a fresh
# --user-data-dir of its own for every launch.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def chromium() -> Path:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: `make test` installs Debian's chromium when run as root with apt-get; "
            "elsewhere install it (apt-get install chromium) and run the tests again"
        )
    return CHROMIUM


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def browser(chromium: Path) -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=str(chromium), args=FLAGS)
        yield launched
        await launched.close()


@pytest.fixture(scope="session")
def postgres_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A migrated database, as its owner; the embedded server is stopped (by its pid) when the session ends.

    The owner is the embedded server's superuser, or TEST_DATABASE_URL's user. The gateways of the suite
    run as a runtime role granted exactly what docs/operations.md says serve needs (tests.database
    runtime_url): the suite makes it, which takes a superuser or CREATEROLE; a TEST_DATABASE_URL user
    without either names a role made beforehand (login, password) in TEST_RUNTIME_DATABASE_URL instead,
    and the suite grants it. Fixtures that empty tables or write rows by hand use the owner's URL.
    """
    given = os.environ.get("TEST_DATABASE_URL")
    # Under pytest-xdist each worker (gw0, gw1, ...) has a session of its own: an embedded server of its
    # own, or a database of its own beside TEST_DATABASE_URL's (its user needs CREATEDB for that).
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    embedded = None
    if given:
        dsn = asyncio.run(worker_database(given, worker)) if worker else given
    else:
        embedded = EmbeddedPostgres(tmp_path_factory.mktemp("pg"))
        dsn = embedded.start()
    try:
        asyncio.run(migrate(dsn))
        asyncio.run(grant_runtime(dsn))
        yield dsn
    finally:
        if embedded is not None:
            embedded.stop()
        elif given and worker:
            asyncio.run(worker_database(given, worker, drop=True))


@pytest.fixture(scope="session", autouse=True)
def suite_pooler(request: pytest.FixtureRequest) -> Iterator[None]:
    """With TEST_POOLER=pgbouncer (``make test-pgbouncer``), every gateway of tests.gateways on the
    test server goes through PgBouncer in transaction mode (tests.poolers.suite_pooler_for)."""
    wanted = os.environ.get("TEST_POOLER")
    if not wanted:
        yield
        return
    if wanted != "pgbouncer":
        raise pytest.UsageError(f"TEST_POOLER={wanted!r}: the one pooler the suite knows is pgbouncer")
    behind = request.getfixturevalue("postgres_dsn")
    with pgbouncer(behind) as url:
        os.environ["TEST_POOLER_URL"], os.environ["TEST_POOLER_BEHIND"] = url, behind
        try:
            yield
        finally:
            del os.environ["TEST_POOLER_URL"], os.environ["TEST_POOLER_BEHIND"]


@pytest.fixture
async def dsn(postgres_dsn: str) -> str:
    """The test database with an empty effects table."""
    await empty_effects(postgres_dsn)
    return postgres_dsn


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., Done]:
    """The command line's ``main()`` in this process: ``run("effects", "--json", config=...)``."""
    return in_process(capsys, monkeypatch)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client for the test's requests to the gateway and the upstreams."""
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    async with upstream_server() as server:
        yield server


# The files that take longest on this machine (seconds of the two workers' time, measured with
# --junitxml), handed out first: pytest-xdist gives each worker a whole file at a time, in the order
# collected, so a long file collected last would leave one worker running it while the other idles.
# The rest follow in their usual order. A file not listed, or one that got slower, only costs balance.
LONGEST_FIRST = (
    "test_crash.py",  # 30 s: twelve gateways killed and restarted
    "test_audit_volume.py",  # 25 s: a million rows written by SQL
    "test_proxy.py",
    "test_cli.py",
    "test_demo.py",
    "test_doc_blocks.py",
    "test_store_stalls.py",
    "test_audit_browser.py",
    "test_schemathesis.py",
    "test_roles.py",
    "test_deploy.py",
    "test_peers.py",
    "test_recovery.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the longest files first, each file's tests in their order (see LONGEST_FIRST)."""
    rank = {name: at for at, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort: order kept within


# What tests leave for the summary at the end of the run. Under pytest-xdist the tests run in worker
# processes and only their reports reach the one that prints the summary, so each test's rows travel on
# its teardown report (as plain values) and are gathered back from the reports.
_SUMMARY: dict[str, list[Any]] = {
    "crash_matrix": CRASH_MATRIX,
    "fuzz_counts": FUZZ_COUNTS,
    "screenshots": SCREENSHOTS,
}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report: pytest.TestReport = yield
    if call.when == "teardown":
        for name, rows in _SUMMARY.items():
            report.user_properties.extend((name, str(row) if isinstance(row, Path) else row) for row in rows)
            rows.clear()
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a worker: its reports go on to the process that prints the summary
    for name, row in report.user_properties:
        if name == "screenshots":
            SCREENSHOTS.append(Path(row))
        elif name in _SUMMARY:
            _SUMMARY[name].append(tuple(row))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print where the browser tests' screenshots are, the cases schemathesis tried, and the crash matrix."""
    write = terminalreporter.write_line
    if FUZZ_COUNTS:
        write("")
        write("schemathesis against a real gateway: cases tried per operation")
        for label, mode, tried in FUZZ_COUNTS:
            write(f"  {label:<40} {mode:<9} {tried:>6}")
        write(f"  {'all':<40} {'':<9} {sum(n for _, _, n in FUZZ_COUNTS):>6}")
    if SCREENSHOTS:
        write("")
        write("screenshots of the audit page, to look at:")
        for path in SCREENSHOTS:
            write(f"  {path}")
    if not CRASH_MATRIX:
        return
    write("")
    write("crash matrix: gateway SIGKILLed at a fault point, restarted, agent retried with the same key")
    header = f"{'fault point':<15} {'upstream kind':<28} {'effects':>7} {'agent got':>9}  {'record':<13}"
    write(f"{header} recovered_by")
    for point, kind, _, effects, status, state, how in sorted(CRASH_MATRIX):
        write(f"{point:<15} {kind:<28} {effects:>7} {status:>9}  {state:<13} {how or '-'}")
