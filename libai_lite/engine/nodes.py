"""tools/train.sh on several nodes: they meet at node 0's ADDR:PORT before torchrun starts, saying so.

torchrun's rendezvous waits for missing nodes without a word and gives up, after 15 minutes, in a traceback.
Here each node says at once which nodes it waits for, where, and for how long, and a node still missing when
the timeout passes ends the wait in one ``error:`` line. Node 0 listens on PORT and answers ``go`` once every
other node has said its rank; the port is free again for torchrun's store when they part.

    python -m libai_lite.engine.nodes NODE NODE_RANK ADDR PORT TIMEOUT_S
"""
from __future__ import annotations

import select
import signal
import socket
import sys
import time

HELLO = "libai_lite node"
RETRY_S = 0.5  # between attempts to reach node 0 that is not listening yet


class NodesMissing(Exception):
    """The wait ended without every node: the message is the ``error:`` line's text."""


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _names(ranks) -> str:
    ranks = sorted(ranks)
    return ("node " if len(ranks) == 1 else "nodes ") + ", ".join(map(str, ranks))


def _read_line(conn: socket.socket, deadline: float) -> str | None:
    """One line from ``conn`` before ``deadline`` (None: closed or too late)."""
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(left)
        try:
            chunk = conn.recv(256)
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace")


def _host(nodes: int, addr: str, port: int, timeout: float) -> None:
    """Node 0: listen until every other node has joined, then answer ``go`` to each."""
    deadline = time.monotonic() + timeout
    missing, joined = set(range(1, nodes)), []
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(where)
        server.listen(max(nodes, 8))
        try:
            while missing:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([server], [], [], left)[0]:
                    raise NodesMissing(
                        f"{_names(missing)} of NODE={nodes} did not join node 0 at {addr}:{port} within "
                        f"RDZV_TIMEOUT={timeout:g} s; start the same command on each with NODE={nodes}, its "
                        f"NODE_RANK, ADDR set to this node's address and PORT={port} (RDZV_TIMEOUT=seconds waits "
                        f"longer; NODE=1 on one machine)")
                conn, _ = server.accept()
                words = (_read_line(conn, min(deadline, time.monotonic() + 5)) or "").split()
                # "libai_lite node RANK of NODES"; anything else is not one of ours and is closed.
                if len(words) == 5 and " ".join(words[:2]) == HELLO and words[3] == "of" and \
                        words[2].isdigit() and words[4].isdigit():
                    rank, theirs = int(words[2]), int(words[4])
                    if theirs != nodes:
                        conn.sendall(f"error: node 0 at {addr}:{port} runs with NODE={nodes}, this node with "
                                     f"NODE={theirs}; start every node with the same NODE\n".encode())
                    elif rank in missing:
                        missing.discard(rank)
                        joined.append(conn)
                        continue
                    else:
                        conn.sendall(f"error: NODE_RANK={rank} has joined node 0 at {addr}:{port} already; "
                                     f"give each node its own NODE_RANK from 1 to {nodes - 1}\n".encode())
                conn.close()
            for conn in joined:
                try:
                    conn.sendall(b"go\n")
                except OSError:
                    pass  # it left: torchrun's rendezvous reports it
        finally:
            for conn in joined:
                conn.close()


def _join(nodes: int, rank: int, addr: str, port: int, timeout: float) -> None:
    """Node ``rank`` > 0: reach node 0 (retrying until it listens), say who we are, wait for ``go``."""
    deadline = time.monotonic() + timeout
    reached = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            conn = socket.create_connection((addr, port), timeout=min(left, 5.0))
        except OSError:
            time.sleep(min(RETRY_S, max(0.0, deadline - time.monotonic())))
            continue
        with conn:
            reached = True
            try:
                conn.sendall(f"{HELLO} {rank} of {nodes}\n".encode())
            except OSError:
                continue
            answer = _read_line(conn, deadline)
        if answer == "go":
            return
        if answer and answer.startswith("error: "):
            raise NodesMissing(answer[len("error: "):])
        # Closed without an answer (node 0 gave up or restarted): try again while there is time.
    if reached:
        raise NodesMissing(f"node 0 at {addr}:{port} answered but not every node of NODE={nodes} joined within "
                           f"RDZV_TIMEOUT={timeout:g} s; start the missing ones (RDZV_TIMEOUT=seconds waits longer)")
    raise NodesMissing(f"node 0 did not answer at {addr}:{port} within RDZV_TIMEOUT={timeout:g} s; start it "
                       f"(NODE_RANK=0) with NODE={nodes} and PORT={port}, or check ADDR and PORT (RDZV_TIMEOUT=seconds "
                       f"waits longer)")


def wait_for_nodes(nodes: int, rank: int, addr: str, port: int, timeout: float) -> None:
    """Say whom this node waits for, then meet every other node or raise ``NodesMissing`` after ``timeout`` s."""
    if nodes <= 1:
        return
    if rank == 0:
        _say(f"node 0 of NODE={nodes}: waiting for {_names(range(1, nodes))} to join at {addr}:{port} "
             f"(RDZV_TIMEOUT={timeout:g} s)")
        _host(nodes, addr, port, timeout)
    else:
        _say(f"node {rank} of NODE={nodes}: waiting for node 0 at {addr}:{port} and the other nodes "
             f"(RDZV_TIMEOUT={timeout:g} s)")
        _join(nodes, rank, addr, port, timeout)
    _say(f"all {nodes} nodes met at {addr}:{port}; starting torchrun")


def main(argv=None) -> int:
    nodes, rank, addr, port, timeout = (sys.argv[1:] if argv is None else argv)
    # Stopped while waiting: nothing started, so no traceback, only the status of the signal.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    try:
        wait_for_nodes(int(nodes), int(rank), addr, int(port), float(timeout))
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except NodesMissing as e:
        _say(f"error: {e}")
        return 1
    except OSError as e:
        _say(f"error: cannot wait for the nodes at {addr}:{port} ({e.strerror or e}); check ADDR and PORT")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
