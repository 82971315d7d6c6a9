"""Settings in one place: every knob has a flag and a bootstrap.toml key; flags > file > defaults."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from node.cli import add_node_args, build_config, load_settings
from node.identity import load_or_create_key, peer_id_of
from node.private import write_swarm_key
from node.reachability import ReachOptions
from node.settings import TABLES, parse_tables, read_config_file, swarm_values
from trainer.errors import UserError
from trainer.settings import LearnerSettings


def parse(*argv: str, role: str = "trainer") -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_node_args(p)
    return p.parse_args(["--role", role, *argv])


def test_flags_override_the_file_which_overrides_defaults(tmp_path):
    cfg = tmp_path / "bootstrap.toml"
    cfg.write_text(
        '[swarm]\nname = "x"\n'
        '[trainer]\nlr = 0.1\nbatch_groups = 4\nmodel_dir = "models/base"\n'
        '[sampler]\nengine = "torch"\n'
        "[weights]\nchunk_size = 4096\nannounce_interval = 1\n"
    )
    s = load_settings(parse("--config", str(cfg), "--lr", "0.2", "--weights-encoding", "int8"))
    assert s.learner.lr == 0.2  # flag beats file
    assert s.trainer.batch_groups == 4 and s.sampler.engine == "torch" and s.weights.chunk_size == 4096  # file
    assert s.weights.encoding == "int8"  # flag
    assert s.weights.announce_interval == 1.0 and isinstance(s.weights.announce_interval, float)
    assert s.learner.model_dir == tmp_path / "models" / "base"  # relative to the file
    assert s.trainer.max_staleness == 4 and s.sampler.groups_per_request == 4  # defaults
    (tmp_path / "empty.toml").write_text("")
    plain = load_settings(parse("--config", str(tmp_path / "empty.toml")))
    assert plain.learner.lr == LearnerSettings().lr and plain.weights.encoding == "native"


def test_every_knob_has_a_flag(tmp_path):
    for classes in TABLES.values():
        for cls in classes:
            for f in fields(cls):
                flag = "--" + f.metadata.get("flag", f.name.replace("_", "-"))
                choices = f.metadata.get("choices")
                text = choices[0] if choices else ("x" if f.metadata.get("type") is Path else "3")
                args = parse(flag) if f.metadata.get("type", type(f.default)) is bool else parse(flag, text)
                assert getattr(args, f"{cls.__name__}.{f.name}") is not None, flag
                assert f.metadata["help"], f"{cls.__name__}.{f.name} has no help text"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[trainer]\nlearning_rate = 1\n", "unknown keys in \\[trainer\\]: learning_rate"),
        ('[trainer]\nlr = "fast"\n', "trainer.lr: expected float"),
        ('[sampler]\nengine = "cuda-magic"\n', "not one of auto, mlx, torch"),
        ("[trainers]\nlr = 1\n", "unknown tables or keys trainers"),
        ("[weights]\nchunk_size = true\n", "expected int"),
    ],
)
def test_bad_values_in_the_file_are_clear_errors(tmp_path, text, message):
    cfg = tmp_path / "bootstrap.toml"
    cfg.write_text(text)
    with pytest.raises(UserError, match=message):
        load_settings(parse("--config", str(cfg)))


@pytest.mark.parametrize(
    ("role", "argv", "message"),
    [
        ("sampler", ["--model", "m"], r"--model \(trainer\): a flag of another role, which a --role sampler node"),
        ("sampler", ["--task", "add", "--reward", "numeric"], r"--task \(trainer\), --reward \(trainer\)"),
        ("trainer", ["--engine", "torch"], r"--engine \(sampler\).*--role trainer"),
        ("trainer", ["--bits", "4"], r"--bits \(sampler\)"),
        ("bootstrap", ["--chunk-size", "4096"], r"--chunk-size \(trainer and sampler\).*--role bootstrap"),
        ("bootstrap", ["--lr", "0.1", "--engine", "mlx"], r"--lr \(trainer\), --engine \(sampler\)"),
        ("sampler", ["--bits", "4", "--engine", "torch"], "--bits 4 has no effect: the torch engine does not quantize"),
        ("trainer", ["--reward", "numeric"], "--reward numeric has no effect: task 'reverse' scores its own"),
        ("trainer", ["--task", "add", "--reward", "exact"], "--reward exact has no effect: task 'add'"),
    ],
)
def test_a_flag_the_role_would_ignore_is_an_error(role, argv, message):
    """Issue 24: flags of another role, and knobs other values make moot, were silently ignored."""
    with pytest.raises(UserError, match=message):
        load_settings(parse(*argv, role=role))


@pytest.mark.parametrize(
    ("role", "argv"),
    [
        ("sampler", []),
        ("trainer", []),
        ("bootstrap", []),
        ("sampler", ["--engine", "torch"]),  # the default bits do not count
        ("sampler", ["--engine", "torch", "--bits", "none"]),
        ("sampler", ["--engine", "mlx", "--bits", "4", "--chunk-size", "4096"]),
        ("trainer", ["--task", "jsonl:data.jsonl", "--reward", "numeric", "--weights-encoding", "int8"]),
    ],
)
def test_flags_the_role_uses_are_fine(role, argv):
    load_settings(parse(*argv, role=role))


def test_the_file_counts_only_for_its_own_role(tmp_path):
    """One bootstrap.toml serves the whole swarm: a sampler ignores [trainer], but its own [sampler] table is
    checked like flags."""
    cfg = tmp_path / "bootstrap.toml"
    cfg.write_text('[trainer]\nmodel_dir = "m"\nreward = "numeric"\ntask = "jsonl:d.jsonl"\n[sampler]\nbits = "4"\n')
    assert load_settings(parse("--config", str(cfg), role="sampler")).sampler.bits == "4"
    assert load_settings(parse("--config", str(cfg))).trainer.reward == "numeric"
    load_settings(parse("--config", str(cfg), role="bootstrap"))
    with pytest.raises(UserError, match=r"bootstrap.toml \[sampler\] bits has no effect: the torch engine"):
        load_settings(parse("--config", str(cfg), "--engine", "torch", role="sampler"))
    with pytest.raises(UserError, match=r"\[trainer\] reward has no effect: task 'add'"):
        load_settings(parse("--config", str(cfg), "--task", "add"))


def test_the_shipped_bootstrap_toml_and_its_examples_are_valid(tmp_path):
    """Issue 24: its commented-out `encoding = "fp32"` failed with "'fp32' is not one of native, int8". The file as
    shipped loads, and so does every example line in it once uncommented (placeholder peer ids filled in)."""
    shipped = Path(__file__).resolve().parents[1] / "bootstrap.toml"
    data = read_config_file(shipped)
    swarm_values(data, shipped)
    parse_tables(data, shipped)
    peer = str(peer_id_of(load_or_create_key(tmp_path / "peer.key")))
    text = re.sub(r"(?m)^# (\[\w+\]|\w+ = .*)$", r"\1", shipped.read_text()).replace("12D3KooW...", peer)
    write_swarm_key(tmp_path / "swarm.key")
    cfg = tmp_path / "bootstrap.toml"
    cfg.write_text(text)
    data = read_config_file(cfg)
    assert set(data) == {"swarm", "trainer", "sampler", "weights"} and all(data.values()), text
    values = swarm_values(data, cfg)
    assert values["trainer_id"] and values["psk"] and values["allow"]
    for role in ("trainer", "sampler"):  # each knob in the role's own tables is checked as if given on purpose
        assert load_settings(parse("--config", str(cfg), role=role)).weights.encoding == data["weights"]["encoding"]


def test_the_swarm_table_is_knobs_too(tmp_path):
    """Issue 25: [swarm] was parsed by hand and its flags written out with their defaults again; now every node
    setting is a NodeConfig knob: one default, one help, a flag and a file key (discover_interval included)."""
    me = str(peer_id_of(load_or_create_key(tmp_path / "me.key")))
    boot = f"/ip4/127.0.0.1/tcp/4001/p2p/{me}"
    cfg = tmp_path / "bootstrap.toml"
    cfg.write_text(
        f'[swarm]\nname = "x"\nbootstrap = ["{boot}"]\ntrainer = "{me}"\ndiscover_interval = 1\n'
        "relay = false\nrelay_slots = 7\n"
    )
    config = build_config(parse("--config", str(cfg), "--discover-interval", "0.25", "--swarm", "y", role="sampler"))
    assert config.swarm == "y" and config.discover_interval == 0.25  # flags beat the file
    assert [str(a) for a in config.bootstrap] == [boot] and str(config.trainer_id) == me  # the file, parsed
    assert config.relay is False and config.relay_slots == 7
    assert config.provide_interval == 30.0 and config.allow is None and config.psk is None  # defaults
    assert not hasattr(config, "extra")
    plain = build_config(parse(role="bootstrap"))
    assert str(plain.listen) == "/ip4/0.0.0.0/tcp/0" and plain.bootstrap == () and plain.relay is None
    # what reachability does by default is what the knobs say
    reach = ReachOptions()
    assert (reach.relay_slots, reach.relay_circuit_bytes, reach.relay_circuit_seconds) == (64, 4 << 20, 300)
    assert (reach.check_interval, reach.provide_interval) == (plain.reachability_interval, plain.provide_interval)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[swarm]\nname = "a b"\n', "swarm.name: a swarm name is a string of letters"),
        ('[swarm]\nbootstrap = "/ip4/1.2.3.4/tcp/1"\n', "swarm.bootstrap: expected a list"),
        ('[swarm]\nbootstrap = ["/ip4/1.2.3.4/tcp/1"]\n', "must end with /p2p/<peer id>"),
        ('[swarm]\nallow = ["nope"]\n', "bad peer id 'nope' in .* swarm.allow"),
        ("[swarm]\nrelay_slots = -1\n", "swarm.relay_slots must be a non-negative integer"),
        ('[swarm]\nrelay = "yes"\n', "swarm.relay: expected bool"),
        ("[swarm]\nnames = 1\n", "unknown keys in \\[swarm\\]: names"),
    ],
)
def test_bad_swarm_values_are_clear_errors(tmp_path, text, message):
    cfg = tmp_path / "bootstrap.toml"
    cfg.write_text(text)
    with pytest.raises(UserError, match=message):
        build_config(parse("--config", str(cfg)))


def test_swarm_flags_are_checked_like_the_file():
    with pytest.raises(UserError, match="bad multiaddr 'nope' in --listen"):
        build_config(parse("--listen", "nope"))
    with pytest.raises(UserError, match="bad peer id 'x' in --allow"):
        build_config(parse("--allow", "x"))
