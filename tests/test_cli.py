"""The `swarmrl` binary: clear errors for bad input, and a real swarm of separate processes on loopback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from node.identity import load_or_create_key, peer_id_of
from tests.helpers import accepts, free_port, process_swarm, read_status, run_cli, wait_for


def test_every_help_renders():
    """Issue 25: `swarmrl node --help` printed argparse's internals for a help text with an unescaped '%'. Every
    subcommand's --help renders, and so does each flag's help on its own, with nothing left unformatted."""
    import argparse

    from node.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == {"node", "keygen", "swarm-key", "status", "build-model", "demo"}
    for name, command in [("swarmrl", parser), *sub.choices.items()]:
        text = command.format_help()
        assert "%(" not in text and "option_strings" not in text, name
        formatter = command._get_formatter()
        for action in command._actions:
            if action.help and action.help is not argparse.SUPPRESS:
                shown = formatter._expand_help(action)
                assert "%(" not in shown and "option_strings" not in shown, (name, action.option_strings)
    assert "~30% slower" in " ".join(sub.choices["node"].format_help().split())


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


NO_TORCH = "import sys; sys.modules['torch'] = None; from node.cli import main; sys.exit(main(sys.argv[1:]))"


def run_without_torch(*args: str, cwd) -> subprocess.CompletedProcess:
    """The CLI in a process where `import torch` fails, as on a sampler-only install."""
    return subprocess.run([sys.executable, "-P", "-c", NO_TORCH, *args], cwd=cwd, capture_output=True, text=True)


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        (["node", "--role", "trainer"], "the trainer needs torch"),
        (["node", "--role", "sampler", "--engine", "torch"], "the torch sampling engine (--engine torch) needs torch"),
        (["demo", "--out", "runs/demo"], "swarmrl demo (it runs a trainer) needs torch"),
        (["build-model", "m"], "build-model needs torch"),
    ],
)
def test_without_torch_the_trainer_says_which_extra_to_install(tmp_path, argv, what):
    """Issue 24: torch is the `trainer` extra; a sampler-only install gets a clear error instead of a traceback."""
    trainer = peer_id_of(load_or_create_key(tmp_path / "t.key"))
    node_args = ["--data-dir", str(tmp_path / "d"), "--trainer", str(trainer)] if argv[0] == "node" else []
    r = run_without_torch(*argv, *node_args, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"{what}, which is not installed: pip install 'swarmrl[trainer]'" in r.stderr


def test_a_sampler_with_mlx_needs_no_torch(tmp_path, tiny_model_dir):
    """What a Mac that only samples installs (`pip install swarmrl`): the sampler role and the MLX engine, no torch."""
    code = f"""
import sys
sys.modules["torch"] = None
import argparse
from pathlib import Path
from node.cli import add_node_args, build_config, build_role, load_settings
from node.engines import make_engine
p = argparse.ArgumentParser()
add_node_args(p)
args = p.parse_args(["--role", "sampler", "--engine", "mlx", "--bits", "4", "--trainer", {str(trainer_of(tmp_path))!r},
                     "--data-dir", {str(tmp_path / "d")!r}])
role = build_role(build_config(args), load_settings(args))
engine = make_engine("mlx", Path({str(tiny_model_dir)!r}), bits=4)
out = engine.generate([[1, 2, 3]], temperature=1.0, top_p=1.0, max_tokens=3, seed=0)
assert len(out) == 1 and out[0].completion_ids, out
assert "torch" not in sys.modules or sys.modules["torch"] is None
"""
    r = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def trainer_of(root) -> str:
    return str(peer_id_of(load_or_create_key(root / "t.key")))


@pytest.mark.slow
def test_swarm_of_separate_processes(tmp_path, tiny_model_dir):
    port, trainer_id, spawn = process_swarm(tmp_path, "proc", tiny_model_dir)
    procs = [spawn("bootstrap", "boot", "--listen", f"/ip4/127.0.0.1/tcp/{port}")]
    try:
        wait_for(lambda: accepts(port), 30, "the bootstrap node to listen", procs)
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


def test_a_node_process_keeps_what_it_built_before_running_out_of_the_collector():
    """``quiet_gc`` (called by `swarmrl node` before its loop): the objects imported and built before the node
    runs leave every later collection's walk, and young collections come every GC_YOUNG allocations."""
    code = (
        "import gc, node.roles.sampler, node.roles.trainer\n"
        "from node.runtime import GC_YOUNG, quiet_gc\n"
        "before = len(gc.get_objects())\n"
        "quiet_gc()\n"
        "print(before, gc.get_freeze_count(), len(gc.get_objects()), gc.get_threshold()[0] == GC_YOUNG)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    before, frozen, walked, young = out.stdout.split()
    assert int(before) > 100_000  # torch, transformers, py-libp2p: what every full collection walked before
    assert int(frozen) > 0.9 * int(before) and int(walked) < 0.05 * int(before)
    assert young == "True"
