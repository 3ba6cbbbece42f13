"""Whether the Hugging Face hub may and can be used: one answer for models and data sets alike.

:func:`offline` reads ``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE`` and ``HF_DATASETS_OFFLINE`` when
asked; :func:`reachable` opens one TCP connection to the endpoint with a timeout (remembered a minute;
skipped behind a proxy)."""

from __future__ import annotations

import os
import socket
import threading
import time
from urllib.parse import urlparse

__all__ = ["OFFLINE_VARIABLES", "endpoint", "offline", "reachable", "usable"]

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
_TRUE = {"1", "ON", "YES", "TRUE"}
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
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


def reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub endpoint opens within ``timeout`` seconds."""
    if any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return True
    url = endpoint()
    remembered = _remembered.get(url)
    if remembered is not None and time.monotonic() - remembered[0] < _REMEMBER_SECONDS:
        return remembered[1]
    parsed = urlparse(url)
    host = parsed.hostname or "huggingface.co"
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
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
    _remembered[url] = (time.monotonic(), bool(ok))
    return bool(ok)


def usable(timeout: float = 3.0) -> bool:
    """Not offline and reachable: worth handing a hub id to transformers or datasets."""
    return not offline() and reachable(timeout)
