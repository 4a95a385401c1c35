"""Turn-taking on one node's CPUs: a model actor with nothing to do lends its threads to the other.

With one micro-batch the draft actor and the target actor never compute at once: while the target
verifies (or decodes a plain run, Proposed.steps), the draft actor waits for the next call. On a
machine of few cores the target then runs faster with the draft actor's threads as well as its
own (raysd.actors.model_actors.borrowed_threads), but only if the draft actor truly sleeps: Ray
2.60's compiled-graph channel read spins (sched_yield in PlasmaObjectHeader::ReadAcquire), and on
a machine with as many cores as threads a spinning process beside a two-thread product makes it
slower than one thread alone (docs/history/benchmarks.md, Benchmark 11). So the draft actor
blocks on a `Doorbell` (a datagram socket: no spinning, no polling) until the target `ring`s it
at the call's end, and only then goes back to the channel. The target likewise
sleeps on its own through the draft's proposing, until the draft rings that its proposal is ready.

The replica's coordinator waits the same way for each call's result (`Doorbell.wait_for`): the
target rings it with the call's ticket when the call ends, so the coordinator's process sleeps
through the call rather than spin in the channel read beside the target's threads.

The doorbell's address is in Linux's abstract socket namespace: no file to create or remove, and
it vanishes with its process (a restarted actor binds a new one). Elsewhere there is no doorbell
and no lending.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time
import uuid


class Doorbell:
    """A socket another process on this node rings (`ring(address)`) to end a `wait`."""

    # A waiter sleeps at most TIMEOUT_FACTOR x the call's expected seconds, at least MIN_TIMEOUT_S
    # (`timeout_s`), then goes back to the channel read: a target lost mid-call never rings.
    TIMEOUT_FACTOR = 4.0
    MIN_TIMEOUT_S = 1.0

    def __init__(self):
        self.address = f"\0raysd-doorbell-{os.getpid()}-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.address)
        self.sock.setblocking(False)

    @classmethod
    def timeout_s(cls, expected_s: float) -> float:
        """How long to sleep for the ring of a call expected to take `expected_s`."""
        return max(cls.MIN_TIMEOUT_S, cls.TIMEOUT_FACTOR * expected_s)

    @staticmethod
    def available() -> bool:
        return sys.platform.startswith("linux")

    def clear(self) -> None:
        """Drop rings left from before (a run that ended after its `wait` timed out)."""
        try:
            while self.sock.recv(64):
                pass
        except BlockingIOError:
            pass

    def wait(self, timeout_s: float) -> bool:
        """Sleep until rung (True) or `timeout_s` passed (False)."""
        ready, _, _ = select.select([self.sock], [], [], timeout_s)
        self.clear()
        return bool(ready)

    def wait_for(self, ticket: int, timeout_s: float) -> bool:
        """Sleep until a ring carrying `ticket` or a later one arrives (True) or `timeout_s` passed
        (False). Calls end in the order they were made, so a later ticket's ring means this one's
        call ended too; an earlier ticket's (a call abandoned after a failure) is dropped."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                while True:
                    if int.from_bytes(self.sock.recv(64), "little") >= ticket:
                        return True
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return False

    def close(self) -> None:
        self.sock.close()


class Ringer:
    """Rings doorbells; a doorbell that is gone (its process died) is not an error."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)

    def ring(self, address: str, ticket: int = 1) -> None:
        """`ticket`: which call ended (`Doorbell.wait_for`); a plain `wait` reads none."""
        try:
            self.sock.sendto(ticket.to_bytes(8, "little"), address)
        except OSError:  # ConnectionRefused / FileNotFound: nobody waits there any more; full: rung already
            pass
