"""Offline machines: a Hugging Face id loads from the local cache at once, not after minutes of retries.

On a machine without network (the usual GPU cluster node), every file transformers looks up for a hub
id -- config, tokenizer files, generation config, a possible adapter config -- is retried five times
with backoff before the cache is used: a model already in the cache took 3 min 14 s to load here, and
an id that is not there 55 s to fail. :func:`go_offline_if_hub_unreachable` asks once per process
whether the hub's host answers (a TCP connection, a few seconds at most, DNS included); when it does
not, it turns on huggingface_hub's (and datasets') offline mode with one warning, so cached ids load
in seconds and the others fail at once. It does nothing when offline mode is already chosen, when
``HF_HUB_OFFLINE`` is set at all (``HF_HUB_OFFLINE=0`` is how to keep the hub's own behaviour), or
when a proxy is configured (the direct connection says nothing then).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from urllib.parse import urlparse

log = logging.getLogger(__name__)

PROBE_SECONDS = 3.0
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_probed: bool | None = None  # the answer of this process's one probe: hub reachable


def _reachable(host: str, port: int, seconds: float) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``seconds``, name resolution included
    (``create_connection``'s timeout does not cover DNS, which can hang far longer: a daemon thread)."""
    answer: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=seconds).close()
            answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=probe, daemon=True, name="qerl-hub-probe")
    thread.start()
    thread.join(seconds)
    return bool(answer and answer[0])


def go_offline_if_hub_unreachable(seconds: float = PROBE_SECONDS) -> bool:
    """Turn on offline mode when the Hugging Face hub cannot be reached (see the module docstring);
    returns whether offline mode is on afterwards."""
    global _probed
    import huggingface_hub.constants as hub

    if hub.HF_HUB_OFFLINE:
        return True
    if "HF_HUB_OFFLINE" in os.environ or any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return False
    if _probed is None:
        endpoint = urlparse(hub.ENDPOINT)
        host = endpoint.hostname or "huggingface.co"
        port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
        _probed = _reachable(host, port, seconds)
        if not _probed:
            log.warning("%s:%d does not answer: Hugging Face ids load from the local cache only (offline mode; "
                        "set HF_HUB_OFFLINE=0 to keep retrying the hub instead)", host, port)
            _set_offline()
    return not _probed


def _set_offline() -> None:
    """huggingface_hub's and datasets' offline flags, in this process (read at their import) and for
    the processes it starts."""
    import huggingface_hub.constants as hub

    hub.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import datasets.config
    except ImportError:
        return
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
