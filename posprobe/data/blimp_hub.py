"""BLiMP from the Hugging Face hub (nyu-mll/blimp), for users who are online; cached by huggingface_hub."""

from __future__ import annotations

import json
from pathlib import Path

from posprobe.data import DataError
from posprobe.places import cache_dir, hub_offline

REPO = "nyu-mll/blimp"


def download_blimp() -> Path:
    """Return a folder of per-paradigm .jsonl files converted from the hub dataset (downloaded once)."""
    out = cache_dir() / "blimp-hub"
    if out.is_dir() and any(out.glob("*.jsonl")):
        return out
    if hub_offline():
        raise DataError("BLiMP cannot be downloaded: the Hugging Face hub is unreachable. Pass --blimp DIR with the "
                        "official .jsonl files (github.com/alexwarstadt/blimp, data/), or omit --blimp to use "
                        "posprobe's built-in template pairs.")
    import pandas as pd
    from huggingface_hub import snapshot_download

    snap = Path(snapshot_download(REPO, repo_type="dataset", allow_patterns=["*.parquet", "*.jsonl"]))
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    found = 0
    for f in sorted(snap.rglob("*.parquet")) + sorted(snap.rglob("*.jsonl")):
        rows = pd.read_parquet(f) if f.suffix == ".parquet" else pd.read_json(f, lines=True)
        if not {"sentence_good", "sentence_bad", "UID"} <= set(rows.columns):
            continue
        for uid, g in rows.groupby("UID"):
            with (tmp / f"{uid}.jsonl").open("w") as fh:
                for rec in g.to_dict("records"):
                    fh.write(json.dumps({k: (str(v) if k == "pairID" else v) for k, v in rec.items()}) + "\n")
            found += 1
    if not found:
        raise DataError(f"No BLiMP files with sentence_good/sentence_bad/UID found in the hub dataset {REPO}")
    tmp.replace(out)
    return out
