"""The configurations shipped in examples/ and deploy/ stay valid as the settings evolve."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from gateway.policy import upstream_policies
from gateway.settings import load_settings
from tests.support import ROOT


@pytest.fixture(autouse=True)
def secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROCER_TOKEN", "t0ken")
    monkeypatch.setenv("PAYMENTS_SECRET", "Bearer sk_test_x")
    monkeypatch.delenv("EFFECT_GATEWAY_LISTEN", raising=False)


@pytest.mark.parametrize("path", ["examples/gateway.toml", "deploy/gateway.example.toml"])
def test_shipped_configurations_load(path: str) -> None:
    """Each shipped TOML file is a configuration the gateway starts with."""
    settings = load_settings(ROOT / path)
    assert settings.upstreams
    assert all(policy.lease > policy.timeout for policy in upstream_policies(settings).values())


def test_the_kubernetes_sidecar_configuration_loads(tmp_path: Path) -> None:
    """The gateway.toml inside the sidecar's ConfigMap loads and listens on loopback only."""
    text = (ROOT / "deploy/kubernetes/sidecar.yaml").read_text()
    embedded = text.split("gateway.toml: |\n", 1)[1].split("\n---", 1)[0]
    toml = "\n".join(line.removeprefix("    ") for line in embedded.splitlines())
    tomllib.loads(toml)
    config = tmp_path / "gateway.toml"
    config.write_text(toml)
    settings = load_settings(config)
    assert settings.listen == "127.0.0.1:8787"
    assert settings.upstreams["payments"].native_key is not None
