"""`swarmrl demo`: a local swarm on loopback as separate processes: bootstrap + trainer + N samplers."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from node.config import write_config_file
from node.identity import load_or_create_key, peer_id_of


def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samplers", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--port", type=int, default=4101, help="bootstrap node's TCP port on 127.0.0.1")
    p.add_argument("--seconds", type=float, default=60.0, help="how long to run")
    p.add_argument("--engine", default="auto")


def node_cmd(role: str, data_dir: Path, config: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "node.cli",
        "node",
        "--role",
        role,
        "--config",
        str(config),
        "--data-dir",
        str(data_dir),
        *extra,
    ]


def cmd_demo(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    boot_id = peer_id_of(load_or_create_key(out / "bootstrap" / "identity.key"))
    trainer_id = peer_id_of(load_or_create_key(out / "trainer" / "identity.key"))
    config = out / "bootstrap.toml"
    write_config_file(config, "demo", [f"/ip4/127.0.0.1/tcp/{args.port}/p2p/{boot_id}"], str(trainer_id))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = []
    try:
        procs.append(
            subprocess.Popen(
                node_cmd("bootstrap", out / "bootstrap", config, "--listen", f"/ip4/127.0.0.1/tcp/{args.port}"),
                env=env,
                stdout=open(out / "bootstrap.log", "w"),
                stderr=subprocess.STDOUT,
            )
        )
        procs.append(
            subprocess.Popen(
                node_cmd("trainer", out / "trainer", config, "--listen", "/ip4/127.0.0.1/tcp/0"),
                env=env,
                stdout=open(out / "trainer.log", "w"),
                stderr=subprocess.STDOUT,
            )
        )
        for i in range(args.samplers):
            d = out / f"sampler{i}"
            procs.append(
                subprocess.Popen(
                    node_cmd("sampler", d, config, "--listen", "/ip4/127.0.0.1/tcp/0", "--engine", args.engine),
                    env=env,
                    stdout=open(out / f"sampler{i}.log", "w"),
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.time() + args.seconds
        while time.time() < deadline:
            time.sleep(2)
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                print(f"a node exited early (code {dead[0].returncode}); see logs in {out}", file=sys.stderr)
                return 1
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0
