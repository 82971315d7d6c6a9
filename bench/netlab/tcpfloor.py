"""Raw TCP through the lab: what the kernel alone takes to move a version's bytes on the same paths (a baseline).

The floor a weight protocol is held to in bench/wan: one sender (the origin's namespace) writes ``size`` bytes on
plain TCP connections to every receiver at once, or to one receiver alone, over connections opened beforehand and
then left idle as the product's are between versions (so each round starts where TCP's slow start after idle puts
it). No libp2p, no Noise, no hashing: what remains is the links, TCP and the emulator.

Wire (both ends here): per round the sender writes an 8-byte big-endian length and that many bytes; a receiver
prints one JSON line per round, ``{"round": k, "t": <time.time() at its last byte>}``; the sender prints
``{"round": k, "t0": <time.time() before its first byte>, "to": [receiver indexes]}``. One clock: every namespace
is this box.

    python bench/netlab/tcpfloor.py recv --port 4100
    python bench/netlab/tcpfloor.py send --to 10.77.2.2:4100 10.77.3.2:4100 --rounds all:3200000 one1:3200000 --gap 2
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import threading
import time

HEADER = struct.Struct(">Q")
BLOCK = 1 << 20


def recv_exact(sock: socket.socket, n: int, buf: memoryview) -> None:
    while n:
        got = sock.recv_into(buf, min(n, len(buf)))
        if not got:
            raise ConnectionError("sender closed mid-round")
        n -= got


def serve(port: int) -> None:
    """Accept one sender and time each round's last byte."""
    with socket.create_server(("0.0.0.0", port)) as srv:
        conn, _ = srv.accept()
        with conn:
            k, buf = 0, memoryview(bytearray(BLOCK))
            while True:
                head = conn.recv(HEADER.size, socket.MSG_WAITALL)
                if len(head) < HEADER.size:
                    return
                recv_exact(conn, HEADER.unpack(head)[0], buf)
                print(json.dumps({"round": k, "t": time.time()}), flush=True)
                k += 1


def send(targets: list[str], rounds: list[str], gap: float) -> None:
    """Connect to every target, then per round wait ``gap`` s idle and write the round's bytes to its receivers.

    A round is ``all:SIZE`` (every target at once) or ``oneI:SIZE`` (target I alone)."""
    socks = []
    for target in targets:
        host, port = target.rsplit(":", 1)
        for _ in range(600):  # the receiver may still be starting
            try:
                socks.append(socket.create_connection((host, int(port)), timeout=5))
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise ConnectionError(f"cannot reach {target}")
    for k, spec in enumerate(rounds):
        who, size = spec.split(":")
        to = list(range(len(socks))) if who == "all" else [int(who.removeprefix("one"))]
        payload = HEADER.pack(int(size)) + bytes(int(size))
        time.sleep(gap)
        t0 = time.time()
        writers = [threading.Thread(target=socks[i].sendall, args=(payload,)) for i in to]
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        print(json.dumps({"round": k, "t0": t0, "to": to}), flush=True)
    for s in socks:
        s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--port", type=int, required=True)
    s = sub.add_parser("send")
    s.add_argument("--to", nargs="+", required=True, help="HOST:PORT of each receiver")
    s.add_argument("--rounds", nargs="+", required=True, help="all:SIZE or oneI:SIZE per round")
    s.add_argument("--gap", type=float, default=2.0, help="idle seconds before each round")
    args = ap.parse_args()
    if args.cmd == "recv":
        serve(args.port)
    else:
        send(args.to, args.rounds, args.gap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
