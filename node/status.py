"""A node's status: logged as one line on an interval and written to <data-dir>/status.json for `swarmrl status`."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("swarmrl.status")


def write_status(data_dir: Path, fields: dict[str, Any]) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = data_dir / "status.json.tmp"
    tmp.write_text(json.dumps({**fields, "updated": time.time()}, indent=2, sort_keys=True))
    os.replace(tmp, data_dir / "status.json")


def read_status(data_dir: Path) -> dict[str, Any]:
    return json.loads((data_dir / "status.json").read_text())


def status_line(fields: dict[str, Any]) -> str:
    order = ["role", "peer_id", "peers", "routing", "trainer", "version"]
    parts = [f"{k}={fields[k]}" for k in order if k in fields]
    parts += [f"{k}={v}" for k, v in sorted(fields.items()) if k not in order and not isinstance(v, (dict, list))]
    return " ".join(parts)
