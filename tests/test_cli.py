"""The command line: serve on the embedded Postgres, migrate, effects, purge; each stops what it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp

from tests.support import ROOT, Upstream, start_gateway_process


def cli(*args: str, config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def _postmaster_pid(data_dir: Path) -> int:
    return int((data_dir / "postgres" / "postmaster.pid").read_text().split()[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_serve_runs_on_the_embedded_postgres_and_stops_it(tmp_path: Path, upstream: Upstream) -> None:
    """`serve --config FILE` without database_url starts Postgres in data_dir, serves, and stops it."""
    data_dir = tmp_path / "data"
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'listen = "127.0.0.1:0"\ndata_dir = "{data_dir}"\n[upstreams.shop]\nbase_url = "{upstream.url}"\n'
    )
    gateway = start_gateway_process(config, timeout=60)
    try:
        postgres = _postmaster_pid(data_dir)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{gateway.url}/_gateway/health") as resp:
                assert resp.status == 200
            async with http.post(
                f"{gateway.url}/shop/orders", data=b"{}", headers={"Idempotency-Key": "cli-1"}
            ) as resp:
                assert resp.status == 201
    finally:
        gateway.stop()
    assert gateway.proc.returncode == 0
    assert not _alive(postgres), "serve must stop the Postgres it started"

    # The record outlives the server: `effects` starts Postgres again, reads, and stops it.
    listed = cli("effects", "--json", config=config)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["key"], r["state"], r["response_status"]) for r in rows] == [("cli-1", "completed", 201)]
    shown = cli("effects", "1", config=config)
    assert json.loads(shown.stdout)["history"][0]["event"] == "claimed"
    table = cli("effects", config=config)
    assert "completed" in table.stdout
    assert "cli-1" in table.stdout
    assert cli("migrate", config=config).stdout.strip() == "the schema is up to date"
    purged = cli("purge", config=config)
    assert purged.returncode == 0
    assert "dropped about 0 bodies stored more than" in purged.stdout
    assert (
        not _alive(_postmaster_pid(data_dir)) if (data_dir / "postgres" / "postmaster.pid").exists() else True
    )


def test_an_unknown_effect_is_one_line(tmp_path: Path) -> None:
    """Asking for an effect that does not exist says so in one line, exit status 2."""
    config = tmp_path / "gateway.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\n')
    done = cli("effects", "42", config=config)
    assert done.returncode == 2
    assert done.stderr.strip() == "effect-gateway: no effect 42"
