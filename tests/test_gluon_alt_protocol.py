"""A model of fwd.py's barrier protocol, run under random interleavings (CPU only).

The Gluon kernel cannot run here; this checks the protocol it implements, transcribed from
fwd.py (the alternating consumer warpgroups, "pv_first" step order) step by step (which barrier each partition waits on with which parity, what it reads
and writes): no deadlock, no ring stage / P tile / stats row overwritten before its last reader
is done, every read sees the tile it expects. mbarrier semantics: a barrier completes a phase
after `count` arrivals; wait(parity) returns once the phase of that parity has completed (a
fresh barrier's "previous phase", parity 1, counts as completed). Each stage is one unit,
released after both column halves' PV.
"""
from __future__ import annotations

import random

import pytest


class Barrier:
    def __init__(self, count):
        self.count, self.pending, self.phase = count, 0, 0

    def arrive(self):
        self.pending += 1
        assert self.pending <= self.count
        if self.pending == self.count:
            self.pending, self.phase = 0, self.phase + 1

    def done(self, parity):
        # phase k (0-based) has completed iff self.phase > k; parity p asks for the latest
        # phase k with k % 2 == p below the current one (or the virtual phase -1).
        return (self.phase - 1) % 2 == parity if self.phase else parity == 1


class Buffers:
    """What each buffer holds and who still reads it."""

    def __init__(self):
        self.val, self.readers, self.reads = {}, {}, {}

    def write(self, key, tile, need):
        """Overwrite key with tile: nobody may be reading it and the previous contents must have
        had all `need` reads."""
        assert not self.readers.get(key), (key, tile, self.readers.get(key))
        old = self.val.get(key)
        if old is not None:
            assert self.reads.get((key, old), 0) >= need, (key, old, tile, self.reads)
        self.val[key] = tile

    def begin(self, key, tile):
        assert self.val.get(key) == tile, (key, tile, self.val.get(key))
        self.readers.setdefault(key, set()).add(tile)

    def end(self, key, tile):
        self.readers[key].discard(tile)
        self.reads[(key, tile)] = self.reads.get((key, tile), 0) + 1


def producer(n, st):
    for i in range(n):
        s = i % st
        if i >= st:
            yield ("wait", ("consumed", s), ((i // st) - 1) & 1)
        yield ("write", ("ring", s), i, 3)        # S by its owner + one PV per warpgroup
        yield ("arrive", ("full", s))


def _pv_prev_issue(o, i, st):
    yield ("wait", ("ex", o), ((i - 1) // 2) & 1)
    yield ("wait", ("full", (i - 1) % st), ((i - 1) // st) & 1)
    yield ("begin", ("p", o), i - 1)
    yield ("begin", ("ring", (i - 1) % st), i - 1)             # PV_{i-1} issued


def _pv_prev_done(w, o, i, st):
    yield ("end", ("p", o), i - 1)
    yield ("end", ("ring", (i - 1) % st), i - 1)
    yield ("arrive", ("consumed", (i - 1) % st))
    yield ("arrive", ("exfree", o))


def consumer(w, n, st):
    """Warpgroup w's steps, transcribed from fwd._own_tile and fwd._consumer."""
    o = 1 - w
    for i in range(w, n, 2):
        s = i % st
        if i >= 1:                                                 # the other's PV_{i-1} first
            yield from _pv_prev_issue(o, i, st)
            yield ("read", ("st", o), i - 1)
        yield ("wait", ("full", s), (i // st) & 1)
        yield ("begin", ("ring", s), i)                            # S_i issued
        yield ("end", ("ring", s), i)                              # both waited
        if i >= 1:
            yield from _pv_prev_done(w, o, i, st)
        if i >= 2:
            yield ("wait", ("exfree", w), ((i // 2) - 1) & 1)
        yield ("write", ("p", w), i, 1)
        yield ("write", ("st", w), i, 1)
        yield ("arrive", ("ex", w))
        yield ("begin", ("ring", s), i)                            # PV_i (synchronous)
        yield ("end", ("ring", s), i)
        yield ("arrive", ("consumed", s))
    last = n - 1
    if last >= 0 and last % 2 == o:
        yield ("wait", ("ex", o), (last // 2) & 1)
        yield ("read", ("st", o), last)
        yield ("wait", ("full", last % st), (last // st) & 1)
        yield ("begin", ("ring", last % st), last)
        yield ("end", ("ring", last % st), last)
        yield ("arrive", ("consumed", last % st))


def run(n, st, rng, cons=consumer):
    bars = {}
    for s in range(st):
        bars[("full", s)] = Barrier(1)
        bars[("consumed", s)] = Barrier(2)
    for w in range(2):
        for name in ("ex", "exfree"):
            bars[(name, w)] = Barrier(1)
    buf = Buffers()
    threads = [producer(n, st), cons(0, n, st), cons(1, n, st)]
    nxt = [next(t, None) for t in threads]
    while any(op is not None for op in nxt):
        ready = [k for k, op in enumerate(nxt) if op is not None and
                 (op[0] != "wait" or bars[op[1]].done(op[2]))]
        assert ready, f"deadlock at n={n}, stages={st}: {nxt}"
        k = rng.choice(ready)
        op = nxt[k]
        if op[0] == "arrive":
            bars[op[1]].arrive()
        elif op[0] == "write":
            buf.write(op[1], op[2], op[3])
        elif op[0] == "begin":
            buf.begin(op[1], op[2])
        elif op[0] == "end":
            buf.end(op[1], op[2])
        elif op[0] == "read":
            buf.begin(op[1], op[2])
            buf.end(op[1], op[2])
        nxt[k] = next(threads[k], None)
    # every tile was read by its S and both PV halves
    for i in range(n):
        assert buf.reads.get((("ring", i % st), i), 0) == 3, (i, buf.reads)


@pytest.mark.parametrize("st", [2, 4])
def test_alt_protocol_random_interleavings(st):
    rng = random.Random(1234 + st)
    for n in range(0, 13):
        for _ in range(30):
            run(n, st, rng)


def test_model_catches_a_wrong_parity():
    """The model can fail: waiting on the P barrier with the wrong parity lets a warpgroup read
    a P tile before it is written."""
    rng = random.Random(0)

    def bad(w, n, st):
        for op in consumer(w, n, st):
            if op[0] == "wait" and op[1][0] == "ex":
                op = ("wait", op[1], op[2] ^ 1)
            yield op

    with pytest.raises(AssertionError):
        for _ in range(50):
            run(6, 2, rng, cons=bad)
