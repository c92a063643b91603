"""``qerl.hub_offline``: an unreachable hub turns on offline mode once, so cached Hugging Face ids load
from the cache at once instead of after five retries per file."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

import huggingface_hub.constants as hub
import pytest

import qerl.hub_offline as hub_offline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeProbe:
    """Stands in for ``_reachable``: answers ``answer`` and records what it was asked."""

    def __init__(self):
        self.answer, self.asked = True, []

    def __call__(self, host: str, port: int, seconds: float) -> bool:
        self.asked.append((host, port))
        return self.answer


@pytest.fixture
def probe(monkeypatch) -> FakeProbe:
    """No offline mode, no earlier probe, no proxy; every flag the probe may set restored afterwards."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", *hub_offline._PROXY_VARIABLES):
        monkeypatch.setenv(name, "")  # (so monkeypatch restores the variable's absence too: the probe may set it)
        monkeypatch.delenv(name)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_offline, "_probed", None)
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_HUB_OFFLINE)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", datasets.config.HF_DATASETS_OFFLINE)
    fake = FakeProbe()
    monkeypatch.setattr(hub_offline, "_reachable", fake)
    return fake


def test_unreachable_hub_turns_on_offline_mode_once(probe, caplog):
    import datasets

    probe.answer = False
    with caplog.at_level(logging.WARNING, logger="qerl.hub_offline"):
        assert hub_offline.go_offline_if_hub_unreachable() is True
        assert hub_offline.go_offline_if_hub_unreachable() is True
    assert probe.asked == [("huggingface.co", 443)]  # asked once per process
    assert hub.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1" == os.environ["HF_DATASETS_OFFLINE"]
    assert datasets.config.HF_HUB_OFFLINE and datasets.config.HF_DATASETS_OFFLINE
    assert caplog.text.count("does not answer") == 1 and "HF_HUB_OFFLINE=0" in caplog.text


def test_the_fixture_restores_what_the_probe_set():
    """(Runs after the test above: the flags it set are gone again.)"""
    assert "HF_DATASETS_OFFLINE" not in os.environ and not hub.HF_HUB_OFFLINE


def test_reachable_hub_changes_nothing(probe):
    probe.answer = True
    assert hub_offline.go_offline_if_hub_unreachable() is False
    assert hub_offline.go_offline_if_hub_unreachable() is False
    assert len(probe.asked) == 1 and not hub.HF_HUB_OFFLINE and "HF_HUB_OFFLINE" not in os.environ


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "0"}, {"HTTPS_PROXY": "http://proxy:3128"}])
def test_no_probe_when_the_user_chose_or_a_proxy_is_set(probe, monkeypatch, env):
    probe.answer = False
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hub_offline.go_offline_if_hub_unreachable() is False
    assert probe.asked == [] and not hub.HF_HUB_OFFLINE


def test_an_endpoint_of_ones_own_is_probed(probe, monkeypatch):
    probe.answer = True
    monkeypatch.setattr(hub, "ENDPOINT", "http://mirror.example:8080")
    hub_offline.go_offline_if_hub_unreachable()
    assert probe.asked == [("mirror.example", 8080)]


def test_reachable_by_a_real_socket():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        assert hub_offline._reachable("127.0.0.1", port, 2.0) is True
    finally:
        server.close()
    assert hub_offline._reachable("127.0.0.1", port, 2.0) is False  # closed: refused at once


def test_a_cached_hub_id_loads_without_retries(tmp_path):
    """A model in the Hugging Face cache, the hub unreachable (a local port nobody listens on): it
    loads from the cache with one warning, and no lookup is retried (each would be five, with backoff)."""
    from qerl.tiny import build_tiny_model, build_tiny_tokenizer

    snapshot = tmp_path / "hub" / "models--someone--tiny" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    build_tiny_model("qwen2").save_pretrained(snapshot)
    build_tiny_tokenizer().save_pretrained(snapshot)
    (tmp_path / "hub" / "models--someone--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny" / "refs" / "main").write_text("0123abc")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", *hub_offline._PROXY_VARIABLES)}
    env.update(HF_HOME=str(tmp_path), HF_ENDPOINT=f"http://127.0.0.1:{port}", PYTHONPATH=ROOT)
    code = "from qerl.model import load_base_model; m, t = load_base_model('someone/tiny'); print('loaded', len(t))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded" in out.stdout and "does not answer" in out.stderr
    assert "Retrying" not in out.stderr
