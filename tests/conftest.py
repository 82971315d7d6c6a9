"""Shared fixtures: one tiny model per test session, and helpers to run real nodes on loopback."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The README's test command runs one worker per core (`-n auto --dist loadfile --no-loadscope-reorder`: xdist
# would otherwise hand out the modules with the most tests first): a module is a worker's unit (its
# module-scoped fixtures are built once). (`--dist loadgroup` would let modules share a worker, but pytest-xdist 3.8
# renames node ids through an attribute pytest 9.2 no longer reads: its groups are silently ignored.) The
# network-namespace labs may run side by side: each names its namespaces with its own random tag. The modules of
# the longest tests go first, so that the other worker runs the many short ones beside them instead of waiting at
# the end (longest-first scheduling).
LONGEST_FIRST = ("test_wan_faults", "test_nat_swarm")
# Then the modules whose tests mostly wait on timers and the network (0.2-1.0 of the 2 cores busy while they ran, in a
# per-test timeline of an idle run): beside the WAN scenario, whose niced samplers take whatever CPU is left idle. The
# modules that keep the cores busy (model builds, training, separate processes) run last, two at a time (idle run 14
# ended with 90 s of these waiting modules at 0.5 cores busy).
WAITING = (
    "test_weights_swarm.py", "test_weights_hostile.py", "test_swarm_discovery.py", "test_push.py",
    "test_conn_cooldown.py", "test_connmgr.py", "test_private_swarm.py", "test_libp2p_patches.py", "test_stream_cap.py",
)  # fmt: skip


def _rank(item) -> int:
    for i, prefix in enumerate(LONGEST_FIRST):
        if item.name.startswith(prefix):
            return i
    if item.path.name in WAITING:
        return len(LONGEST_FIRST)
    return len(LONGEST_FIRST) + (1 if item.get_closest_marker("slow") else 2)


def pytest_collection_modifyitems(config, items) -> None:
    """Modules holding the longest tests first, and those tests first in them; collection order otherwise."""
    rank = {item.nodeid: _rank(item) for item in items}
    first: dict[str, int] = {}  # module -> the rank of its longest test
    for item in items:
        module = item.nodeid.split("::")[0]
        first[module] = min(first.get(module, 99), rank[item.nodeid])
    # the longest tests first within their modules too: a lab test that asserts timing bounds stretched by the load
    # average then never runs in a session's first seconds, when the average lags the load (burner run b5: the
    # first test to finish, beside the NAT lab's setup and two burners, failed at once)
    items.sort(key=lambda item: (first[item.nodeid.split("::")[0]], rank[item.nodeid] >= len(LONGEST_FIRST)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure inside hosts' nurseries (one exception group per host it passed: nine idle identities in an
    AsyncExitStack wrap an assertion nine times) prints past Python's depth of 10 as "... (max_group_depth is 10)",
    without the assertion: the innermost exceptions go in a section of their own."""
    outcome = yield
    excinfo = call.excinfo
    if excinfo is None or not isinstance(excinfo.value, BaseExceptionGroup):
        return
    from tests.helpers import leaf_exceptions  # here: the helpers import the node, which pure tests need not load

    leaves = [leaf for leaf in leaf_exceptions(excinfo.value) if not isinstance(leaf, GeneratorExit)]
    text = "\n".join("".join(traceback.format_exception(leaf)) for leaf in leaves[:5])
    outcome.get_result().sections.append(("innermost exceptions of the group (first 5)", text))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from trainer.tiny_qwen2 import build_random_model

    return build_random_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def realistic_model_dir() -> Path:
    """The trained Llama of trainer/realistic_model.py (peaked distributions), built once per checkout (~30 s)."""
    from trainer.realistic_model import cached_realistic_model

    return cached_realistic_model(cache_dir=Path(__file__).resolve().parents[1] / "runs" / ".fixtures")


@pytest.fixture
async def trainer_and_client(tmp_path, tiny_model_dir, nursery):
    """A trainer on loopback and a bare client swarm connected to it (tests of what a peer may send)."""
    from node.host import open_swarm
    from node.identity import load_or_create_key
    from tests.helpers import LOOPBACK, start_bootstrap, start_trainer

    boot = await start_bootstrap(nursery, tmp_path)
    trainer = await start_trainer(nursery, tmp_path, boot, tiny_model_dir, group_size=4, max_tokens=6)
    async with open_swarm(load_or_create_key(tmp_path / "client.key"), LOOPBACK) as client:
        from libp2p.peer.peerinfo import info_from_p2p_addr

        await client.connect(info_from_p2p_addr(trainer.swarm.addrs()[0]))
        yield trainer, client
