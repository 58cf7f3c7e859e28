"""Where posprobe keeps things and whether the hub can be reached: the ground floor every layer may ask (data
readers and the model loaders alike), importing nothing of posprobe."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path


def cache_dir() -> Path:
    """Root of posprobe's cache: $POSPROBE_CACHE, else $XDG_CACHE_HOME/posprobe, else ~/.cache/posprobe."""
    env = os.environ.get("POSPROBE_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "posprobe"


def hub_offline() -> bool:
    """True when the Hugging Face hub cannot be reached (HF_HUB_OFFLINE set, or no route in 3 s)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}:
        return True
    ok: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection(("huggingface.co", 443), timeout=3.0):
                ok.append(True)
        except OSError:
            pass

    # DNS lookups ignore socket timeouts, so bound the whole probe with a thread join.
    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(3.5)
    return not ok
