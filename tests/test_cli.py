"""The `swarmrl` binary: clear errors for bad input, and a real swarm of separate processes on loopback."""

from __future__ import annotations

import json
import time

import pytest

from node.identity import load_or_create_key, peer_id_of
from tests.helpers import free_port, process_swarm, read_status, run_cli, wait_for


def test_bad_multiaddr_is_a_clear_error(tmp_path):
    r = run_cli(
        "node", "--role", "bootstrap", "--bootstrap", "/ip4/not-an-ip/tcp/1", "--data-dir", str(tmp_path), cwd=tmp_path
    )
    assert r.returncode == 2 and "bad multiaddr" in r.stderr and "Traceback" not in r.stderr


def test_bad_config_file_is_a_clear_error(tmp_path):
    cfg = tmp_path / "bootstrap.toml"
    cfg.write_text("[swarm\nname = 'x'")
    r = run_cli("node", "--role", "bootstrap", "--config", str(cfg), "--data-dir", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "not valid TOML" in r.stderr
    cfg.write_text('[swarm]\nname = "x"\ntrainer = "nope"\n')
    r = run_cli("node", "--role", "bootstrap", "--config", str(cfg), "--data-dir", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "bad peer id" in r.stderr


def test_unreachable_bootstrap_is_a_clear_error(tmp_path):
    """For a sampler or a trainer; a bootstrap node starts alone (tests/test_swarm_discovery.py)."""
    other = peer_id_of(load_or_create_key(tmp_path / "other.key"))
    r = run_cli(
        "node",
        "--role",
        "sampler",
        "--trainer",
        str(other),
        "--bootstrap",
        f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{other}",
        "--bootstrap-timeout",
        "2",
        "--data-dir",
        str(tmp_path / "n"),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "could not reach any bootstrap peer" in r.stderr


def test_sampler_without_trusted_trainer_is_refused(tmp_path):
    r = run_cli("node", "--role", "sampler", "--data-dir", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "trusted trainer peer id" in r.stderr


def test_a_flag_of_another_role_is_an_error_naming_the_role(tmp_path):
    """Issue 24: `--model` given to a sampler was silently ignored."""
    r = run_cli("node", "--role", "sampler", "--model", "m", "--task", "add", "--data-dir", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--task (trainer), --model (trainer): flags of other roles, which a --role sampler node" in r.stderr


@pytest.mark.slow
def test_swarm_of_separate_processes(tmp_path, tiny_model_dir):
    port, trainer_id, spawn = process_swarm(tmp_path, "proc", tiny_model_dir)
    procs = [spawn("bootstrap", "boot", "--listen", f"/ip4/127.0.0.1/tcp/{port}")]
    try:
        time.sleep(2)
        procs += [spawn("sampler", f"s{i}", "--listen", "/ip4/127.0.0.1/tcp/0") for i in range(2)]
        procs.append(spawn("trainer", "trainer", "--listen", "/ip4/127.0.0.1/tcp/0", "--max-tokens", "6"))

        def settled() -> bool:
            states = [read_status(tmp_path / f"s{i}") for i in range(2)]
            done = all(s.get("rollouts_accepted", 0) > 0 and s.get("samplers_known") == 1 for s in states)
            return done and read_status(tmp_path / "trainer").get("rollouts_accepted", 0) > 0

        wait_for(
            settled, 120, "both samplers to find each other and get rollouts accepted", procs, tmp_path / "trainer.log"
        )
        states = [read_status(tmp_path / f"s{i}") for i in range(2)]
        for s in states:
            assert s["trainer"] == str(trainer_id)
            assert s["samplers_known"] == 1
        shown = run_cli("status", "--data-dir", str(tmp_path / "trainer"), cwd=tmp_path)
        assert shown.returncode == 0
        trainer_state = json.loads(shown.stdout.split("\n(written")[0])
        assert trainer_state["role"] == "trainer" and trainer_state["rollouts_accepted"] > 0
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=20)
