"""Every knob a node has, declared once: dataclasses whose fields carry their help text.

From these come the command-line flags (``add_flags``) and the bootstrap.toml tables ``[swarm]`` (the node's
own settings, ``SwarmSettings`` in node/config.py), ``[trainer]``, ``[sampler]`` and ``[weights]``. Precedence: a
flag given on the command line, else the file's value, else the default. ``[trainer]`` holds both the trainer
role's knobs and the learner's (trainer/settings.py), as a user thinks of them as one thing.

Each table knows the roles that use it (``TABLE_ROLES``), and a knob may say when its value is moot (``moot``: a
function of its table's values giving the reason, or None); ``check_role`` turns both into errors, so that a flag a
node would ignore is never silently ignored.
"""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import Field, dataclass, fields, replace
from pathlib import Path
from typing import Any

from node.config import ROLES, SwarmSettings
from node.engines import GRID_ENCODINGS, received_encoding
from trainer.errors import UserError
from trainer.settings import LearnerSettings, knob

GRID_BITS_FLAG = {encoding: bits for bits, encoding in GRID_ENCODINGS.items()}  # "int4-grid" -> "4"


@dataclass
class TrainerSettings:
    task: str = knob("reverse", "built-in task (reverse, add), jsonl:PATH (prompt/answer lines), or module:factory")
    reward: str = knob(
        "exact",
        "how a jsonl task scores: exact, numeric, or module:function(completion, answer)",
        moot=lambda s: (
            None
            if s.task.startswith("jsonl:")
            else f"task {s.task!r} scores its own completions (a reward applies to jsonl: tasks only)"
        ),
    )
    group_size: int = knob(8, "samples per GRPO group")
    groups_per_lease: int = knob(4, "most groups one lease hands out")
    temperature: float = knob(1.0, "sampling temperature")
    top_p: float = knob(1.0, "sampling top-p")
    max_tokens: int = knob(8, "most new tokens per completion")
    lease_ttl: float = knob(120.0, "seconds a lease stays valid")
    max_staleness: int = knob(4, "groups sampled more than this many versions back are refused")
    batch_groups: int = knob(16, "groups per GRPO step")
    publish_every: int = knob(1, "publish a new version every N steps")
    max_steps: int | None = knob(None, "stop after this many steps (default: never)", type=int)
    checkpoint_every: int = knob(10, "save the trainer's checkpoint every N steps")
    eval_every: int = knob(5, "greedy evaluation on held-out prompts every N steps")
    eval_size: int = knob(64, "held-out prompts per evaluation")
    rollout_rate: float = knob(8.0, "groups/s one peer may submit (token bucket)")
    rollout_burst: float = knob(32.0, "rollout token bucket size")
    work_rate: float = knob(2.0, "leases/s one peer may ask for")
    work_burst: float = knob(8.0, "lease token bucket size")
    max_strikes: int = knob(3, "forged groups before a peer is banned")
    accept_quant: str = knob(
        "none,q8",
        "sampler weight quantizations trained on, comma-separated (none, q8, q4): int4 noise is too wide to verify "
        "tightly, so q4 is off unless named",
    )
    noise_scale_cap: float = knob(
        1.0,
        "widen a group's verification limits with the noise its logprobs show, up to this factor (for models "
        "noisier than the calibration one; a cheater faking noise gains the same factor)",
    )
    max_open_leases: int = knob(4, "leases one peer may hold before it must return groups")
    newcomer_rate: float = knob(4.0, "groups/s shared by all peers without an accepted record (Sybil bound)")
    trusted_after: int = knob(4, "accepted groups after which a peer stops drawing from the newcomer budget")
    durable_acks: bool = knob(True, "fsync the rollout journal (group commit) before acknowledging a group")
    max_buffered: int = knob(4096, "most verified groups waiting for a step (the oldest fall off as stale)")
    linger: float = knob(2.0, "seconds to keep serving weights after --max-steps")
    dashboard: str = knob("127.0.0.1:8470", "host:port of the trainer's read-only web dashboard, or 'off'")


@dataclass
class SamplerSettings:
    engine: str = knob("auto", "sampling engine", choices=("auto", "mlx", "torch"))
    bits: str = knob(
        "8",
        "MLX quantization bits",
        choices=("8", "4", "none"),
        moot=lambda s: (
            "the torch engine does not quantize (use --engine mlx, or drop --bits)"
            if s.engine == "torch" and s.bits != "none"
            else None
        ),
    )
    compute: str = knob(
        "auto",
        "dtype the engine computes in (auto: MLX keeps the version's dtype, as Metal's fast path does; torch fp32)",
        choices=("auto", "fp32", "bf16", "fp16"),
        moot=lambda s: (
            "the torch engine computes in fp32 or bf16 (use --engine mlx for fp16)"
            if s.engine == "torch" and s.compute == "fp16"
            else None
        ),
    )
    encoding: str = knob(
        "native",
        "weights encoding this sampler downloads: native (the version as published), int8-grid or int4-grid (MLX's "
        "own 8-bit or 4-bit group codes, patched code by code: ~7x smaller patches at 8 bits; the trainer then "
        "publishes a second chain), or auto (the grid of an MLX 8- or 4-bit engine computing in bf16 or fp32, native "
        "otherwise)",
        flag="receive-encoding",
        choices=("auto", "native", *GRID_BITS_FLAG),
        moot=lambda s: (
            f"{s.encoding} runs only on an MLX engine with {GRID_BITS_FLAG[s.encoding]}-bit weights computing in bf16 "
            f"or fp32 (--engine mlx --bits {GRID_BITS_FLAG[s.encoding]})"
            if s.encoding in GRID_BITS_FLAG and received_encoding(s.engine, s.bits, s.compute, "auto") != s.encoding
            else None
        ),
    )
    groups_per_request: int = knob(
        4,
        "most groups asked for in one work request (fewer while this sampler's pace would not finish them in half "
        "a lease's life)",
    )
    submit_attempts: int = knob(5, "tries to deliver a group when the trainer cannot be reached")
    rate_limit_patience: float = knob(120.0, "seconds a group may wait on rate-limit refusals before it is dropped")


@dataclass
class WeightSettings:
    encoding: str = knob(
        "native",
        "how versions travel: as published (bf16/fp32) or int8 rowwise",
        flag="weights-encoding",
        choices=("native", "int8"),
    )
    chunk_size: int = knob(1 << 20, "largest chunk in bytes")
    anchor_every: int = knob(10, "a full anchor version at least every K versions; those between travel as patches")
    patch_max_fraction: float = knob(
        0.3, "publish an anchor instead of a patch larger than this fraction of the weights (0: never patch)"
    )
    announce_interval: float = knob(2.0, "seconds between the trainer's re-announcements of its newest version")
    poll_interval: float = knob(5.0, "seconds between a node's manifest polls of the trainer")
    keep_versions: int = knob(3, "complete versions a sampler keeps on disk")
    finish_fraction: float = knob(0.5, "a download this far along is finished before switching to a newer one")
    stall_timeout: float = knob(10.0, "seconds without progress before a download being finished is abandoned")
    have_interval: float = knob(0.5, "seconds between polls of peers' have-bitfields during a download")
    request_timeout: float = knob(20.0, "most seconds for one chunk request (less for small ones: see min_rate)")
    min_rate: float = knob(256 << 10, "bytes/s below which a peer's chunk reply counts as slow (timeout scales)")
    manifest_timeout: float = knob(5.0, "seconds to fetch an announced manifest before giving up on that peer")
    upload_per_peer: float = knob(16 << 20, "bytes/s this node serves to any one peer (token bucket, 2 s burst)")
    workers_per_peer: int = knob(1, "concurrent chunk requests per peer")
    reserve_after: float = knob(3.0, "seconds before the trainer serves a chunk again that it already sent out")
    origin_uplink_mbps: float = knob(
        0.0,
        "the trainer's uplink, Mbit/s: with it a small version's pieces are pushed to several samplers each, so "
        "slow home uplinks relay less (0: unknown, one copy each)",
    )


TABLES: dict[str, tuple[type, ...]] = {
    "swarm": (SwarmSettings,),
    "trainer": (TrainerSettings, LearnerSettings),
    "sampler": (SamplerSettings,),
    "weights": (WeightSettings,),
}
TABLE_ROLES: dict[str, tuple[str, ...]] = {
    "swarm": ROLES,
    "trainer": ("trainer",),
    "sampler": ("sampler",),
    "weights": ("trainer", "sampler"),
}


@dataclass
class Settings:
    trainer: TrainerSettings
    learner: LearnerSettings
    sampler: SamplerSettings
    weights: WeightSettings


def _flag(f: Field[Any]) -> str:
    return "--" + f.metadata.get("flag", f.name.replace("_", "-"))


def _key(f: Field[Any]) -> str:
    return f.metadata.get("key", f.name)


def _type(f: Field[Any]) -> type:
    return f.metadata.get("type") or type(f.default)


def _dest(cls: type, f: Field[Any]) -> str:
    return f"{cls.__name__}.{f.name}"


def _help(f: Field[Any]) -> str:
    """The knob's help with its default, escaped for argparse (which %-formats help: "30%" broke --help)."""
    text = f.metadata["help"]
    if "default:" not in text:
        text += f" (default: {f.default})"
    return text.replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per knob; each defaults to None so that an unset flag lets the file's value through."""
    for table, classes in TABLES.items():
        roles = "every role" if TABLE_ROLES[table] == ROLES else "the " + " and ".join(TABLE_ROLES[table])
        group = parser.add_argument_group(f"[{table}] settings, for {roles} (also settable in bootstrap.toml)")
        for cls in classes:
            for f in fields(cls):
                dest, choices = _dest(cls, f), f.metadata.get("choices")
                if _type(f) is bool:
                    group.add_argument(
                        _flag(f), dest=dest, action=argparse.BooleanOptionalAction, default=None, help=_help(f)
                    )
                    continue
                group.add_argument(
                    _flag(f),
                    dest=dest,
                    type=_type(f),
                    choices=choices,
                    action="append" if f.metadata.get("many") else "store",
                    default=None,
                    help=_help(f),
                    metavar=None if choices else f.metadata.get("metavar", f.name.upper()),
                )


def _check(value: Any, f: Field[Any], where: str) -> Any:
    """A flag's or the file's value of one item, checked against the knob's type and choices, then parsed."""
    kind = _type(f)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UserError(f"{where}: expected {kind.__name__}, got {value!r}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise UserError(f"{where}: {value!r} is not one of {', '.join(choices)}")
    parse = f.metadata.get("parse")
    return parse(value, where) if parse is not None else value


def _value(value: Any, f: Field[Any], where: str, base: Path | None = None) -> Any:
    """A knob's value from a flag (``base`` None) or the file (a path in it is relative to the file: ``base``)."""
    many = f.metadata.get("many")
    if many is not None and not isinstance(value, list):
        raise UserError(f"{where}: expected a list, got {value!r}")
    items = value if many is not None else [value]
    if base is not None and _type(f) is Path:
        items = [base / item if isinstance(item, str) else item for item in items]
    checked = [_check(item, f, where) for item in items]
    return many(checked) if many is not None else checked[0]


def read_config_file(path: Path) -> dict[str, Any]:
    """bootstrap.toml as parsed TOML; every problem names the file."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = set(data) - set(TABLES)
    if unknown:
        raise UserError(f"{path}: unknown tables or keys {', '.join(sorted(unknown))} (known: {', '.join(TABLES)})")
    return data


def parse_tables(data: dict[str, Any], path: Path) -> dict[str, dict[str, Any]]:
    """The tables of a parsed bootstrap.toml, checked: {class name: {field: value}}."""
    out: dict[str, dict[str, Any]] = {cls.__name__: {} for classes in TABLES.values() for cls in classes}
    for table, classes in TABLES.items():
        values = data.get(table, {})
        if not isinstance(values, dict):
            raise UserError(f"{path}: [{table}] must be a table")
        known = {_key(f): (cls, f) for cls in classes for f in fields(cls)}
        unknown = set(values) - set(known)
        if unknown:
            raise UserError(f"{path}: unknown keys in [{table}]: {', '.join(sorted(unknown))}")
        for key, value in values.items():
            cls, f = known[key]
            out[cls.__name__][f.name] = _value(value, f, f"{path} {table}.{key}", path.parent)
    return out


def swarm_values(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """A parsed bootstrap.toml's [swarm] table as NodeConfig values."""
    return parse_tables({"swarm": data.get("swarm", {})}, path)[SwarmSettings.__name__]


def load_config_file(path: Path) -> dict[str, Any]:
    """bootstrap.toml's [swarm] table as NodeConfig values; every problem names the file and the key."""
    return swarm_values(read_config_file(path), path)


def table_values(
    cls: type, file_tables: dict[str, dict[str, Any]] | None, args: argparse.Namespace | None
) -> dict[str, Any]:
    """The knobs of ``cls`` set on purpose: the file's values, overridden by flags that were given."""
    values = dict((file_tables or {}).get(cls.__name__, {}))
    for f in fields(cls):
        flag_value = getattr(args, _dest(cls, f), None) if args is not None else None
        if flag_value is not None:
            values[f.name] = _value(flag_value, f, _flag(f))
    return values


def build_settings(file_tables: dict[str, dict[str, Any]] | None, args: argparse.Namespace | None) -> Settings:
    """Defaults, overridden by the file's tables, overridden by flags that were given."""

    def make(cls: type) -> Any:
        return replace(cls(), **table_values(cls, file_tables, args))

    return Settings(make(TrainerSettings), make(LearnerSettings), make(SamplerSettings), make(WeightSettings))


def given_knobs(
    file_tables: dict[str, dict[str, Any]] | None, args: argparse.Namespace | None, path: Path | None
) -> dict[tuple[str, str], str]:
    """The knobs set on purpose, by (class name, field name): how each was given, for error messages."""
    out: dict[tuple[str, str], str] = {}
    for table, classes in TABLES.items():
        for cls in classes:
            for f in fields(cls):
                if f.name in (file_tables or {}).get(cls.__name__, {}):
                    out[cls.__name__, f.name] = f"{path} [{table}] {_key(f)}"
                value = getattr(args, _dest(cls, f), None) if args is not None else None
                if value is not None:
                    out[cls.__name__, f.name] = _flag(f) if isinstance(value, bool) else f"{_flag(f)} {value}"
    return out


def check_role(
    role: str,
    settings: Settings,
    args: argparse.Namespace | None,
    file_tables: dict[str, dict[str, Any]] | None,
    path: Path | None = None,
) -> None:
    """A knob the node would ignore is an error: a flag of another role's table (the file's tables for other
    roles are fine: one bootstrap.toml serves the whole swarm), or a knob given on purpose that the values
    around it make moot (``--bits`` with the torch engine). Defaults never count."""
    foreign = []
    for table, classes in TABLES.items():
        if role in TABLE_ROLES[table]:
            continue
        for cls in classes:
            for f in fields(cls):
                if args is not None and getattr(args, _dest(cls, f), None) is not None:
                    foreign.append(f"{_flag(f)} ({' and '.join(TABLE_ROLES[table])})")
    if foreign:
        what = "a flag of another role" if len(foreign) == 1 else "flags of other roles"
        raise UserError(f"{', '.join(foreign)}: {what}, which a --role {role} node would ignore")
    given = given_knobs(file_tables, args, path)
    tables = {type(v): v for v in vars(settings).values()}
    for table, classes in TABLES.items():
        if role not in TABLE_ROLES[table]:
            continue
        for cls in classes:
            for f in fields(cls):
                moot = f.metadata.get("moot")
                why = moot(tables[cls]) if moot is not None and (cls.__name__, f.name) in given else None
                if why:
                    raise UserError(f"{given[cls.__name__, f.name]} has no effect: {why}")
