"""`swarmrl`: the one binary. `swarmrl node --role trainer|sampler|bootstrap`, plus keygen, status, demo."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import trio

from node.config import ROLES, NodeConfig, SwarmSettings
from node.errors import UserError, require_torch
from node.identity import load_or_create_key, peer_id_of
from node.private import write_swarm_key
from node.settings import (
    Settings,
    add_flags,
    build_settings,
    check_role,
    parse_tables,
    read_config_file,
    table_values,
)
from trainer.memory import apply_trainer_malloc_policy

log = logging.getLogger("swarmrl")
DATA_DIR = Path(".swarmrl")


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("libp2p", "multiaddr", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL if not verbose else logging.INFO)
    # SWARMRL_DEBUG=libp2p.relay.circuit_v2.dcutr,node.weights: debug output from just these loggers (lab runs)
    # (libp2p's own logger does not propagate, so these get the root's handlers directly)
    for name in filter(None, os.environ.get("SWARMRL_DEBUG", "").split(",")):
        chosen = logging.getLogger(name.strip())
        chosen.setLevel(logging.DEBUG)
        chosen.handlers, chosen.propagate = list(logging.getLogger().handlers), False


def add_node_args(p: argparse.ArgumentParser) -> None:
    """What is this process's own (role, config file, key, data directory); every setting after these is a knob
    (node/settings.py), also settable in bootstrap.toml."""
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--config", type=Path, help="bootstrap.toml (default: ./bootstrap.toml if present)")
    p.add_argument("--key", type=Path, help="identity key file (default: <data-dir>/identity.key)")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR, help=f"this node's files (default: {DATA_DIR})")
    p.add_argument("-v", "--verbose", action="store_true")
    add_flags(p)


def config_path(args: argparse.Namespace) -> Path | None:
    return args.config or (Path("bootstrap.toml") if Path("bootstrap.toml").exists() else None)


def read_tables(args: argparse.Namespace) -> tuple[dict[str, dict[str, Any]] | None, Path | None]:
    """The config file's tables, checked (None without a file), and its path."""
    path = config_path(args)
    return (parse_tables(read_config_file(path), path) if path is not None else None), path


def build_config(args: argparse.Namespace) -> NodeConfig:
    """Flags > bootstrap.toml's [swarm] table > NodeConfig's defaults."""
    tables, _ = read_tables(args)
    values = table_values(SwarmSettings, tables, args)
    return NodeConfig(role=args.role, data_dir=args.data_dir, key_path=args.key, **values)


def load_settings(args: argparse.Namespace) -> Settings:
    """Flags > bootstrap.toml's [trainer]/[sampler]/[weights] tables > defaults; a knob this role would ignore
    is an error (node/settings.py check_role)."""
    tables, path = read_tables(args)
    settings = build_settings(tables, args)
    check_role(args.role, settings, args, tables, path)
    return settings


def build_role(config: NodeConfig, settings: Settings):
    me = peer_id_of(load_or_create_key(config.identity_path))
    if config.role == "bootstrap":
        from node.roles.bootstrap import BootstrapRole

        return BootstrapRole()
    if config.role == "trainer":
        require_torch("the trainer")
        from node.roles.trainer import TrainerRole

        if config.trainer_id is not None and config.trainer_id != me:
            raise UserError(
                f"this node's peer id is {me}, but the config trusts trainer {config.trainer_id}; "
                "use the trainer's key (--key) or fix swarm.trainer"
            )
        return TrainerRole(config, settings)
    from node.engines import auto_engine, engine_factory, received_encoding
    from node.roles.sampler import SamplerRole

    if config.trainer_id is None:
        raise UserError("a sampler needs the trusted trainer peer id: set swarm.trainer in bootstrap.toml or --trainer")
    if settings.sampler.engine == "torch" or (settings.sampler.engine == "auto" and auto_engine() == "torch"):
        require_torch(f"the torch sampling engine (--engine {settings.sampler.engine})", ", or use --engine mlx")
    sampler = settings.sampler
    encoding = received_encoding(sampler.engine, sampler.bits, sampler.compute, sampler.encoding)
    return SamplerRole(config, settings, engine_factory(sampler.engine, sampler.bits, sampler.compute), encoding)


def cmd_node(args: argparse.Namespace) -> int:
    from node.runtime import quiet_gc, run_node

    config = build_config(args)
    settings = load_settings(args)
    if config.role == "trainer":
        require_torch("the trainer")
        from node.roles.ranks import serve_as_worker

        if serve_as_worker(settings.learner):  # torchrun's ranks 1..N-1 run rank 0's learner commands, no node
            return 0
    role = build_role(config, settings)
    quiet_gc()
    trio.run(run_node, config, role)
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    print(peer_id_of(load_or_create_key(args.key)))
    return 0


def cmd_swarm_key(args: argparse.Namespace) -> int:
    write_swarm_key(args.out)
    print(f"wrote {args.out}: give it to every node of the private swarm (swarm.psk_file or --psk-file)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import json
    import time

    from node.status import read_status

    try:
        fields = read_status(args.data_dir)
    except FileNotFoundError:
        raise UserError(f"no status in {args.data_dir}: is a node running with --data-dir {args.data_dir}?") from None
    age = time.time() - fields.get("updated", 0)
    print(json.dumps(fields, indent=2, sort_keys=True))
    if age > 30:
        print(f"(written {age:.0f} s ago: the node may have stopped)")
    return 0


def cmd_build_model(args: argparse.Namespace) -> int:
    require_torch("build-model")
    if args.random_init:
        from trainer.tiny_qwen2 import build_random_model

        print(build_random_model(args.out, seed=args.seed))
    else:
        from trainer.base_model import build_base_model

        print(build_base_model(args.out, seed=args.seed))
    return 0


def first_leaf(exc: BaseException) -> BaseException:
    """Trio nests errors in exception groups; a user wants the one error that matters."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_node_args(sub.add_parser("node", help="run a swarm node"))
    p = sub.add_parser("keygen", help="create (or read) an identity key and print its peer id")
    p.add_argument("--key", type=Path, required=True)
    p = sub.add_parser("swarm-key", help="create a pre-shared key file for a private swarm")
    p.add_argument("out", type=Path)
    p = sub.add_parser("status", help="show a running node's status")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p = sub.add_parser(
        "build-model", help="pretrain the embedded base model (deterministic, ~30-60 s) into a directory"
    )
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-init", action="store_true", help="the untrained tiny model instead (tests, debugging)")
    from node.demo import add_demo_args

    add_demo_args(sub.add_parser("demo", help="run a local swarm on loopback (trainer + samplers)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    from node.demo import cmd_demo

    args = build_parser().parse_args(argv)
    setup_logging(getattr(args, "verbose", False))
    if args.command == "node" and args.role == "trainer":
        apply_trainer_malloc_policy()  # before any thread allocates (trainer/memory.py)
    handlers = {
        "node": cmd_node,
        "keygen": cmd_keygen,
        "swarm-key": cmd_swarm_key,
        "status": cmd_status,
        "build-model": cmd_build_model,
        "demo": cmd_demo,
    }
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        user_errors = exc.split(UserError)[0] if isinstance(exc, BaseExceptionGroup) else exc
        if not isinstance(user_errors, (UserError, BaseExceptionGroup)):
            if isinstance(exc, BaseExceptionGroup):  # a crash: the nested groups hide it (10 levels shown at most)
                leaf = first_leaf(exc)
                traceback.print_exception(leaf, file=sys.stderr)
                print(f"swarmrl: crashed: {type(leaf).__name__}: {leaf}", file=sys.stderr)
                return 1
            raise
        print(f"swarmrl: error: {first_leaf(user_errors)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
