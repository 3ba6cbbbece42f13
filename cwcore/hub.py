"""Whether the Hugging Face hub may and can be used: one answer for models and data sets alike.

:func:`offline` reads ``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE`` and ``HF_DATASETS_OFFLINE`` when
asked; :func:`reachable` opens one TCP connection to the endpoint, or to the proxy the environment names
for it (``HTTPS_PROXY``, ``NO_PROXY``, ... as urllib reads them), with a timeout (remembered a minute)."""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request
from urllib.parse import urlparse

__all__ = ["OFFLINE_VARIABLES", "endpoint", "offline", "reachable", "usable"]

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
_TRUE = {"1", "ON", "YES", "TRUE"}
_REMEMBER_SECONDS = 60.0
_remembered: dict[str, tuple[float, bool]] = {}


def offline() -> bool:
    """True when the user asked for offline mode (any of :data:`OFFLINE_VARIABLES`, or huggingface_hub's)."""
    if any(os.environ.get(v, "").strip().upper() in _TRUE for v in OFFLINE_VARIABLES):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def endpoint() -> str:
    """The hub endpoint in use (``HF_ENDPOINT`` through huggingface_hub), e.g. ``https://huggingface.co``."""
    try:
        from huggingface_hub import constants

        return constants.ENDPOINT
    except ImportError:
        return "https://huggingface.co"


def _first_hop(url: str) -> tuple[str, int]:
    """``(host, port)`` a request for ``url`` connects to first: the proxy the environment names for its
    scheme unless ``NO_PROXY`` bypasses the host, else the host itself."""
    parsed = urlparse(url)
    host = parsed.hostname or "huggingface.co"
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parsed.scheme or "https") or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(host):
        proxied = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        if proxied.hostname:
            return proxied.hostname, proxied.port or (443 if proxied.scheme == "https" else 80)
    return host, port


def reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub endpoint, or to the proxy that carries it, opens within ``timeout``
    seconds (a dead proxy made transformers and datasets retry for about 25 s, then say "not found")."""
    url = endpoint()
    host, port = _first_hop(url)
    remembered = _remembered.get(f"{url} {host}:{port}")
    if remembered is not None and time.monotonic() - remembered[0] < _REMEMBER_SECONDS:
        return remembered[1]
    ok: list[bool] = []

    def probe():  # in a thread: getaddrinfo has no timeout of its own
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    _remembered[f"{url} {host}:{port}"] = (time.monotonic(), bool(ok))
    return bool(ok)


def usable(timeout: float = 3.0) -> bool:
    """Not offline and reachable: worth handing a hub id to transformers or datasets."""
    return not offline() and reachable(timeout)
