"""Settings: the TOML file, EFFECT_GATEWAY_* variables, durations, and one clear line for a bad one."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from gateway.cli import describe_database
from gateway.errors import ConfigError
from gateway.settings import load_settings, parse_duration

GOOD = """
listen = "127.0.0.1:8787"
retention = "7d"
[upstreams.shop]
base_url = "http://127.0.0.1:9001"
timeout = "10s"
stamp = { json_field = "client_reference" }
[upstreams.shop.probe]
method = "GET"
path = "/orders?client_reference={key}"
found = "items.0"
status = 201
routes = ["POST /orders"]
[upstreams.payments]
base_url = "http://127.0.0.1:9003"
native_key = { header = "Idempotency-Key", ttl = "24h" }
"""


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("24h", 86400), ("7d", 604800), ("500ms", 0.5), ("10m", 600), ("1.5s", 1.5), (3, 3)],
)
def test_durations(text: str | int, seconds: float) -> None:
    """Durations read as "90s", "24h", "7d" (and friends)."""
    assert parse_duration(text) == timedelta(seconds=seconds)


def test_a_config_file_and_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file gives the upstreams; EFFECT_GATEWAY_* variables override it."""
    config = tmp_path / "gw.toml"
    config.write_text(GOOD)
    monkeypatch.setenv("EFFECT_GATEWAY_RETENTION", "2d")
    monkeypatch.setenv("EFFECT_GATEWAY_DATABASE_URL", "postgresql://db/x")
    settings = load_settings(config)
    assert settings.retention == timedelta(days=2)
    assert settings.database_url is not None
    assert settings.database_url.get_secret_value() == "postgresql://db/x"
    assert settings.upstreams["shop"].timeout == timedelta(seconds=10)
    assert settings.upstreams["payments"].native_key is not None
    assert settings.upstreams["payments"].native_key.ttl == timedelta(hours=24)
    # a probe's "not found" waits a minute after the latest attempt unless told otherwise
    assert settings.upstreams["shop"].probe is not None
    assert settings.upstreams["shop"].probe.lag == timedelta(minutes=1)


def test_the_config_variable_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EFFECT_GATEWAY_CONFIG is read when no --config is given."""
    config = tmp_path / "gw.toml"
    config.write_text(GOOD)
    monkeypatch.setenv("EFFECT_GATEWAY_CONFIG", str(config))
    assert set(load_settings().upstreams) == {"shop", "payments"}


# A gateway listening on 127.0.0.1:9000, with an upstream m.
ON_9000 = 'listen = "127.0.0.1:9000"\n[upstreams.m]\nbase_url = "http://x"\n'


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('retention = "seven days"', "retention"),
        ('[upstreams.shop]\nbase_url = "ftp://x"', "upstreams.shop"),
        ('[upstreams.shop]\nbase_url = "http://x"\ntimeout = "soon"', "upstreams.shop.timeout"),
        ('[upstreams.shop]\nbase_url = "http://x"\nstamp = {}', "upstreams.shop.stamp"),
        (
            '[upstreams.shop]\nbase_url = "http://x"\n'
            'probe = { path = "/orders", routes = ["POST /orders"] }',
            "upstreams.shop.probe: path must be given and contain {key}",
        ),
        ('[upstreams.shop]\nbase_url = "http://x"\nbogus = 1', "upstreams.shop.bogus"),
        (
            '[upstreams.shop]\nbase_url = "http://x"\ninject_headers = { A = "env:NOPE_NOT_SET" }',
            "NOPE_NOT_SET",
        ),
        ('listen = "0.0.0.0:8787"', "beyond loopback"),
        ('listen = "nonsense"', "HOST:PORT"),
        ("this is = = not toml", "not valid TOML"),
        ('[upstreams._gateway]\nbase_url = "http://x"', "_gateway"),
        ('retention = "99999999999d"', "retention"),
        ('[upstreams.shop]\nbase_url = "http://x"\nstamp = { header = "Connection" }', "stamp.header"),
        ('[upstreams.shop]\nbase_url = "http://x"\nnative_key = { header = "X Key" }', "native_key.header"),
        ('[upstreams.shop]\nbase_url = "http://x"\nmax_connections = 0', "max_connections"),
        ('[upstreams.shop]\nbase_url = "http://x"\nconnect_timeout = "0s"', "upstreams.shop"),
        ('request_body_timeout = "0s"', "request_body_timeout"),
        # none at all spins on Postgres; a month lets the partitions made ahead run out between rounds
        ('purge_interval = "0s"', "purge_interval: must be from 1s to 24h"),
        ('purge_interval = "30d"', "purge_interval: must be from 1s to 24h"),
        # no time between the claim and the send: every keyed request was late, and none was ever sent
        ('lease_grace = "0s"', "lease_grace: must be more than 0s"),
        ('[upstreams.m]\nbase_url = "x"\nfingerprint_fields = ["a"]\nfingerprint_ignore = ["b"]', "not both"),
        ('[upstreams.m]\nbase_url = "http://x"\nfingerprint_ignore = []', "at least one field"),
        ('[upstreams.m]\nbase_url = "http://x"\nfingerprint_fields = ["a..b"]', "fingerprint_fields"),
        ('[upstreams.m]\nbase_url = "http://x"\nerror_format = "json"', "upstreams.m.error_format"),
        # a search that lists an effect only after it stopped seeing it would never tell
        (
            '[upstreams.m]\nbase_url = "http://x"\n'
            'probe = { path = "/{key}", lag = "2d", horizon = "1d", routes = ["POST /m"] }',
            "shorter than horizon",
        ),
        # HEAD answers no body, so a search's 2xx would be "found" whether it listed the effect or not
        (
            '[upstreams.m]\nbase_url = "http://x"\nstamp = { json_field = "r" }\n'
            'probe = { method = "HEAD", path = "/o?r={key}", found = "items.0", routes = ["POST /o"] }',
            "upstreams.m.probe: found cannot be used with method HEAD",
        ),
        # a probe that does not say which requests it can find would be asked about every one
        (
            '[upstreams.m]\nbase_url = "http://x"\nstamp = { json_field = "r" }\n'
            'probe = { path = "/o?r={key}" }',
            "upstreams.m.probe: routes must name the requests whose effects this probe can find",
        ),
        (
            '[upstreams.m]\nbase_url = "http://x"\nstamp = { json_field = "r" }\n'
            'probe = { path = "/o?r={key}", routes = [] }',
            "upstreams.m.probe: routes must name at least one request",
        ),
        (
            '[upstreams.m]\nbase_url = "http://x"\nstamp = { json_field = "r" }\n'
            'probe = { path = "/o?r={key}", routes = ["/orders"] }',
            "upstreams.m.probe.routes.0: '/orders' is not a route such as 'POST /orders'",
        ),
        (
            '[upstreams.m]\nbase_url = "http://x"\nstamp = { json_field = "r" }\n'
            'probe = { path = "/o?r={key}", routes = ["POST /orders/ord_*"] }',
            "* stands for one whole segment",
        ),
        # one token for two principals: the requests of one went to the other, or a tenant was the admin
        (
            '[tenants.a]\ntoken = "same"\n[tenants.b]\ntoken = "same"',
            "tenant a and tenant b have the same token",
        ),
        ('[tenants.a]\ntoken = "same"\n[admin]\ntoken = "same"', "tenant a and the admin"),
        # the operators' listener beyond loopback with nobody asked for a token: anyone could resolve
        ('admin_listen = "0.0.0.0:8788"', "admin_listen '0.0.0.0:8788' is beyond loopback"),
        ('admin_listen = "8788"', "admin_listen '8788' must be HOST:PORT"),
        # the audit on the upstreams' origin: a script in an upstream's page would act as the operator
        ('listen = "127.0.0.1:9000"\nadmin_listen = "127.0.0.1:9000"', "admin_listen and listen are both"),
        ('[upstreams.m]\nbase_url = "http://x"\nbrowser_origins = ["null"]', "'null' cannot be listed"),
        ('[upstreams.m]\nbase_url = "http://x"\nbrowser_origins = ["https://a.example/app"]', "no path"),
        ('[upstreams.m]\nbase_url = "http://x"\nbrowser_origins = ["https://A.example"]', "lower case"),
        # the gateway's own origin: every upstream's page served through it would be a listed page
        *[
            (
                f'{ON_9000}browser_origins = ["{own}"]',
                f"m.browser_origins: '{own}' is listen '127.0.0.1:9000', the gateway's own address",
            )
            for own in (
                "http://127.0.0.1:9000",
                "http://localhost:9000",
                "http://[::1]:9000",
                "http://a.localhost:9000",
            )
        ],
        (
            'listen = "[::1]:80"\n[upstreams.m]\nbase_url = "http://x"\nbrowser_origins = ["http://localhost"]',
            "m.browser_origins: 'http://localhost' is listen '[::1]:80'",
        ),
        (
            'listen = "0.0.0.0:9000"\n[tenants.a]\ntoken = "t"\n'
            '[upstreams.m]\nbase_url = "http://x"\nbrowser_origins = ["http://gateway.example.com:9000"]',
            "m.browser_origins: 'http://gateway.example.com:9000' is listen '0.0.0.0:9000'",
        ),
        (
            '[upstreams.m]\nbase_url = "http://x"\nbrowser_origins = ["http://127.0.0.1:8788"]',
            "m.browser_origins: 'http://127.0.0.1:8788' is admin_listen '127.0.0.1:8788', the gateway's",
        ),
        # spellings a browser never sends: listed, they admit nothing, and the person believes they do
        (
            '[upstreams.m]\nbase_url = "http://x"\nbrowser_origins = ["https://a.example:443"]',
            "write https://a.example",
        ),
        (
            '[upstreams.m]\nbase_url = "http://x"\nbrowser_origins = ["http://a.example:80"]',
            "write http://a.example",
        ),
        (
            '[upstreams.m]\nbase_url = "http://x"\nbrowser_origins = ["https://bücher.example"]',
            "ASCII form (xn--",
        ),
        (
            '[upstreams.m]\nbase_url = "http://x"\nbrowser_origins = ["http://a.example:08080"]',
            "no leading zero",
        ),
        ('[upstreams.m]\nbase_url = "http://x"\nbrowser_origins = ["http://[0::1]:9"]', "as [::1]"),
        ('[upstreams.m]\nbase_url = "http://x"\nbrowser_origins = ["http://127.1:9"]', "four numbers"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it(tmp_path: Path, text: str, names: str) -> None:
    """Each kind of mistake stops start-up with one line that names the setting."""
    config = tmp_path / "bad.toml"
    config.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_settings(config)
    message = str(caught.value)
    assert "\n" not in message
    assert names in message


def test_browser_origins_elsewhere_load() -> None:
    """Another port, another host, https on the gateway's port, or a gateway on port 0: all load."""
    origins = [
        "http://127.0.0.1:9001",
        "http://localhost:3000",
        "https://127.0.0.1:8787",
        "https://app.example.com",
        "https://xn--bcher-kva.example",
        "http://[::1]:5173",
    ]
    settings = load_settings(None, upstreams={"m": {"base_url": "http://x", "browser_origins": origins}})
    assert settings.upstreams["m"].browser_origins == origins
    anywhere = load_settings(
        None,
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        upstreams={"m": {"base_url": "http://x", "browser_origins": ["http://127.0.0.1:8787"]}},
    )
    assert anywhere.upstreams["m"].browser_origins == ["http://127.0.0.1:8787"]


def test_an_injected_header_may_not_replace_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """inject_headers under the native key's or the stamp's header name (any case, _ for -) is refused in
    one line naming inject_headers; under another name it is accepted."""
    monkeypatch.delenv("EFFECT_GATEWAY_CONFIG", raising=False)
    native = {"base_url": "http://x", "native_key": {"header": "Idempotency-Key"}}
    stamped = {"base_url": "http://x", "stamp": {"header": "X-Client-Reference"}}
    for cfg, injected, replaced in [
        (native, "idempotency_key", "native_key.header"),
        (stamped, "x-client-reference", "stamp.header"),
    ]:
        with pytest.raises(ConfigError) as caught:
            load_settings(None, upstreams={"shop": {**cfg, "inject_headers": {injected: "secret"}}})
        assert str(caught.value).startswith(
            f"bad setting upstreams.shop.inject_headers: {injected} replaces the key "
        )
        assert replaced in str(caught.value)
        load_settings(None, upstreams={"shop": {**cfg, "inject_headers": {"Authorization": "secret"}}})


def test_listening_beyond_loopback_is_allowed_with_tenants(monkeypatch: pytest.MonkeyPatch) -> None:
    """With tenants (each with a token) the gateway may listen on every interface."""
    monkeypatch.setenv("T", "s3cr3t-grocer")
    settings = load_settings(None, listen="0.0.0.0:8787", tenants={"grocer": {"token": "env:T"}})
    assert settings.tenants["grocer"].token.get_secret_value() == "s3cr3t-grocer"
    assert "s3cr3t-grocer" not in repr(settings)


def test_the_admin_listener_goes_beyond_loopback_with_an_admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an admin token (a scraper or an operator elsewhere presents it), admin_listen may be anywhere."""
    monkeypatch.setenv("ADMIN", "adm-1")
    settings = load_settings(None, admin_listen="0.0.0.0:8788", admin={"token": "env:ADMIN"})
    assert (settings.listen, settings.admin_listen) == ("127.0.0.1:8787", "0.0.0.0:8788")
    assert not settings.admin_open


def test_the_cli_reports_a_bad_config_in_one_line_and_exit_2(tmp_path: Path) -> None:
    """`effect-gateway serve` with a malformed file prints one line on stderr, no traceback."""
    config = tmp_path / "bad.toml"
    config.write_text('[upstreams.shop]\nbase_url = "http://x"\ntimeout = "later"\n')
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--config", str(config), "serve"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert done.stderr.startswith("effect-gateway: bad setting upstreams.shop.timeout:")


def test_a_relative_data_dir_in_a_file_is_relative_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """data_dir in a file means the file's folder, wherever the command runs; from a variable, the cwd."""
    (tmp_path / "etc").mkdir()
    config = tmp_path / "etc" / "gw.toml"
    config.write_text('data_dir = "state"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_settings(config).data_dir == tmp_path / "etc" / "state"
    monkeypatch.setenv("EFFECT_GATEWAY_DATA_DIR", "mine")
    assert load_settings(config).data_dir.resolve() == elsewhere / "mine"


def test_every_bad_setting_is_named_on_the_one_line(tmp_path: Path) -> None:
    """Several mistakes at once: the line names each of them, not "(and 2 more)"."""
    config = tmp_path / "bad.toml"
    config.write_text(
        'retention = "soon"\n[tenants.grocer]\ntoken = "env:NOPE_GROCER"\n'
        '[upstreams.shop]\nbase_url = "http://x"\ninject_headers = { Authorization = "env:NOPE_SECRET" }\n'
    )
    with pytest.raises(ConfigError) as caught:
        load_settings(config)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("bad setting retention: ")
    assert "(and 2 more: " in message
    for name in ("tenants.grocer.token", "NOPE_GROCER", "upstreams.shop.inject_headers.Authorization"):
        assert name in message


def test_commands_that_need_only_the_database_need_no_secrets(tmp_path: Path) -> None:
    """need_secrets=False loads a file whose secrets' variables are unset, and still checks the rest."""
    config = tmp_path / "gw.toml"
    config.write_text(
        '[tenants.grocer]\ntoken = "env:NOPE_GROCER"\n[upstreams.shop]\nbase_url = "http://x"\n'
        'inject_headers = { Authorization = "env:NOPE_SECRET" }\n'
    )
    settings = load_settings(config, need_secrets=False)
    assert set(settings.upstreams) == {"shop"}
    with pytest.raises(ConfigError, match="NOPE_GROCER"):
        load_settings(config)
    config.write_text('retention = "soon"\n[tenants.grocer]\ntoken = "env:NOPE_GROCER"\n')
    with pytest.raises(ConfigError, match="retention"):
        load_settings(config, need_secrets=False)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("postgres://u@db:port/x", "a host's port is not a number"),
        ("postgres://u@a:5432,b:x/x", "a host's port is not a number"),
        ("postgres://u@a:99999/x", "from 1 to 65535"),
        ("postgres://u@a,,b/x", "a host of the list is empty"),
        ("db.example:5432", "postgresql://"),
    ],
)
def test_a_malformed_database_url_is_a_bad_setting(url: str, why: str) -> None:
    """A database_url asyncpg cannot use is refused at load, naming the setting, not at the first connect."""
    with pytest.raises(ConfigError, match=f"bad setting database_url: .*{why}"):
        load_settings(None, database_url=url)


def test_a_database_url_may_name_a_primary_and_its_standbys(monkeypatch: pytest.MonkeyPatch) -> None:
    """A URL of several hosts, as Patroni's and managed services' failover setups give it, is accepted,
    and the command line names every host (never the password)."""
    monkeypatch.delenv("EFFECT_GATEWAY_CONFIG", raising=False)
    url = "postgresql://gw:secret@pg1:5432,pg2:5433/effects?target_session_attrs=read-write"
    settings = load_settings(None, database_url=url)
    assert describe_database(settings) == "Postgres database effects on pg1:5432, pg2:5433"


MCP_PROBE = {
    "path": "/mcp",
    "tool": "find_orders",
    "arguments": {"reference": "{key}"},
    "found": "structuredContent.orders.0",
    "tools": ["place_order"],
}


@pytest.mark.parametrize(
    ("upstream", "why"),
    [
        ({"protocol": "mcp", "fingerprint_fields": ["a"]}, "fingerprint is its tool's name and arguments"),
        ({"protocol": "mcp", "keyless": {"POST": "audit"}}, "needs a key"),
        ({"protocol": "mcp", "stamp": {"header": "X-Ref"}}, "params.arguments.client_reference"),
        (
            {
                "protocol": "mcp",
                "stamp": {"json_field": "params.arguments.r"},
                "probe": {"path": "/o?r={key}", "routes": ["POST /o"]},
            },
            "probed with a read-only tool call",
        ),
        (
            {
                "protocol": "mcp",
                "stamp": {"json_field": "params.arguments.r"},
                "probe": {**MCP_PROBE, "tools": None},
            },
            "tools must name the tools whose effects this probe finds",
        ),
        (
            {
                "protocol": "mcp",
                "stamp": {"json_field": "params.arguments.r"},
                "probe": {**MCP_PROBE, "arguments": {}},
            },
            'arguments must carry "{key}"',
        ),
        ({"protocol": "mcp", "probe": MCP_PROBE}, "no stamp or native_key sends it"),
        (
            {"protocol": "mcp", "native_key": {"header": "Idempotency-Key"}, "probe": MCP_PROBE},
            "finds a call by the key stamped into its arguments",
        ),
        ({"tools": {"find": "read_only"}}, 'set protocol = "mcp"'),
        ({"stamp": {"json_field": "r"}, "probe": MCP_PROBE}, 'set protocol = "mcp"'),
    ],
)
def test_an_mcp_upstream_that_could_not_keep_the_promise_is_refused(
    monkeypatch: pytest.MonkeyPatch, upstream: dict[str, object], why: str
) -> None:
    """An MCP upstream's settings are checked as an HTTP one's are: each refusal one line saying why."""
    monkeypatch.delenv("EFFECT_GATEWAY_CONFIG", raising=False)
    with pytest.raises(ConfigError) as caught:
        load_settings(None, upstreams={"tools": {"base_url": "http://x", **upstream}})
    assert why in str(caught.value)
    assert "\n" not in str(caught.value)


def test_an_mcp_upstream_with_a_stamp_and_a_tool_probe_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The configuration docs/mcp.md shows is accepted as it is."""
    monkeypatch.delenv("EFFECT_GATEWAY_CONFIG", raising=False)
    stamp = {"json_field": "params.arguments.client_reference"}
    settings = load_settings(
        None,
        upstreams={"tools": {"base_url": "http://x", "protocol": "mcp", "stamp": stamp, "probe": MCP_PROBE}},
    )
    assert settings.upstreams["tools"].probe is not None
    assert settings.upstreams["tools"].probe.tools == ["place_order"]
