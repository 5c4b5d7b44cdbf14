"""A model of fwd.py's (and small_heads.py's) barrier protocol, run under random interleavings
(CPU only).

The Gluon kernel cannot run here; this checks the protocol it implements, transcribed from
fwd.py (the alternating consumer warpgroups, "pv_first" step order; one program walking
several rows, as a persistent program does) step by step (which barrier each partition waits on
with which parity, what it reads and writes): no deadlock, no ring stage / P tile / stats row overwritten before its last reader
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


def producer(rows, st, reads=3, pre=1):
    """ring._produce_row (fwd.py's producer): per row, the row's first `pre` tiles
    (fwd.PRE_TILES), then q once the consumers released the previous row's (q_free), then the
    other tiles; stages and phases count the program's whole tile stream. `reads`: the reads a
    tile has before its stage may be refilled (S by its owner + one PV per warpgroup)."""
    base = 0
    for n, nt in enumerate(rows):
        first = min(nt, pre)
        yield from _tiles(base, 0, first, st, reads)
        if n >= 1:
            yield ("wait", ("q_free",), (n - 1) & 1)
        yield ("write", ("q",), n, rows[n - 1] if n else 0)    # the last row's every S
        yield ("arrive", ("q_bar",))
        yield from _tiles(base, first, nt, st, reads)
        base += nt


def _tiles(base, lo, hi, st, reads):
    """ring._gather_tiles: tiles lo..hi-1 of a row whose first tile is `base` in the stream."""
    for i in range(lo, hi):
        g = base + i
        s = g % st
        if g >= st:
            yield ("wait", ("consumed", s), ((g // st) - 1) & 1)
        yield ("write", ("ring", s), g, reads)
        yield ("arrive", ("full", s))


def small_heads_producer(rows, st):
    """small_heads._producer: ring._produce_row with all `st` first tiles before q, each tile
    read twice (S^T and O^T)."""
    return producer(rows, st, reads=2, pre=st)


def _pv_prev_issue(o, g, st):
    yield ("wait", ("ex", o), ((g - 1) // 2) & 1)
    yield ("wait", ("full", (g - 1) % st), ((g - 1) // st) & 1)
    yield ("begin", ("p", o), g - 1)
    yield ("begin", ("ring", (g - 1) % st), g - 1)             # PV_{g-1} issued


def _pv_prev_done(o, g, st):
    yield ("end", ("p", o), g - 1)
    yield ("end", ("ring", (g - 1) % st), g - 1)
    yield ("arrive", ("consumed", (g - 1) % st))
    yield ("arrive", ("exfree", o))


def consumer(w, rows, st):
    """Warpgroup w's steps, transcribed from fwd._own_tile and fwd._consumer: it owns the
    tiles g of the program's tile stream with g % 2 == w and releases q (q_free) at the end of
    each row."""
    o = 1 - w
    base = 0
    for n, nt in enumerate(rows):
        yield ("wait", ("q_bar",), n & 1)
        for i in range((w + base) % 2, nt, 2):
            g = base + i
            s = g % st
            if i >= 1:                                             # the other's PV_{g-1} first
                yield from _pv_prev_issue(o, g, st)
                yield ("read", ("st", o), g - 1)
            yield ("wait", ("full", s), (g // st) & 1)
            yield ("begin", ("ring", s), g)                        # S_g issued (reads q)
            yield ("begin", ("q",), n)
            yield ("end", ("ring", s), g)                          # both waited
            yield ("end", ("q",), n)
            if i >= 1:
                yield from _pv_prev_done(o, g, st)
            if g >= 2:
                yield ("wait", ("exfree", w), ((g // 2) - 1) & 1)
            yield ("write", ("p", w), g, 1)
            yield ("write", ("st", w), g, 1)
            yield ("arrive", ("ex", w))
            yield ("begin", ("ring", s), g)                        # PV_g (synchronous)
            yield ("end", ("ring", s), g)
            yield ("arrive", ("consumed", s))
        last = base + nt - 1
        if nt > 0 and last % 2 == o:
            yield ("wait", ("ex", o), (last // 2) & 1)
            yield ("read", ("st", o), last)
            yield ("wait", ("full", last % st), (last // st) & 1)
            yield ("begin", ("p", o), last)
            yield ("begin", ("ring", last % st), last)
            yield ("end", ("p", o), last)
            yield ("end", ("ring", last % st), last)
            yield ("arrive", ("consumed", last % st))
            yield ("arrive", ("exfree", o))
        yield ("arrive", ("q_free",))
        base += nt


def small_heads_consumer(rows, st):
    """small_heads._consumer: one warpgroup; per tile S^T (reads the tile and q), then P^T (its
    own buffer) and O^T (reads the tile), then the stage's release; q_free after the row."""
    base = 0
    for n, nt in enumerate(rows):
        yield ("wait", ("q_bar",), n & 1)
        for i in range(nt):
            g = base + i
            s = g % st
            yield ("wait", ("full", s), (g // st) & 1)
            yield ("begin", ("ring", s), g)
            yield ("begin", ("q",), n)
            yield ("end", ("ring", s), g)
            yield ("end", ("q",), n)
            yield ("read", ("ring", s), g)                         # O^T (synchronous)
            yield ("arrive", ("consumed", s))
        yield ("arrive", ("q_free",))
        base += nt


def run(rows, st, rng, cons=consumer, prod=producer, small=False):
    """small: the few-heads kernel (one consumer: q_free and consumed count 1, each tile read
    twice) instead of fwd.py's two alternating warpgroups."""
    if isinstance(rows, int):
        rows = [rows]
    nc = 1 if small else 2
    bars = {("q_bar",): Barrier(1), ("q_free",): Barrier(nc)}
    for s in range(st):
        bars[("full", s)] = Barrier(1)
        bars[("consumed", s)] = Barrier(nc)
    for w in range(2):
        for name in ("ex", "exfree"):
            bars[(name, w)] = Barrier(1)
    buf = Buffers()
    if small:
        prod = small_heads_producer if prod is producer else prod
        threads = [prod(rows, st), small_heads_consumer(rows, st)]
    else:
        threads = [prod(rows, st), cons(0, rows, st), cons(1, rows, st)]
    nxt = [next(t, None) for t in threads]
    while any(op is not None for op in nxt):
        ready = [k for k, op in enumerate(nxt) if op is not None and
                 (op[0] != "wait" or bars[op[1]].done(op[2]))]
        assert ready, f"deadlock at rows={rows}, stages={st}: {nxt}"
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
    # every tile was read by its S and both PV halves (small: S^T and O^T), every P tile by
    # the other warpgroup
    total = sum(rows)
    for g in range(total):
        assert buf.reads.get((("ring", g % st), g), 0) == (2 if small else 3), (g, buf.reads)
        if not small:
            assert buf.reads.get((("p", g % 2), g), 0) == 1, (g, buf.reads)


@pytest.mark.parametrize("st", [2, 4])
def test_alt_protocol_random_interleavings(st):
    rng = random.Random(1234 + st)
    for n in range(0, 13):
        for _ in range(30):
            run(n, st, rng)


@pytest.mark.parametrize("st", [2, 4])
def test_persistent_rows_random_interleavings(st):
    """A persistent program: several rows (head blocks) in one tile stream, odd and even tile
    counts and empty rows, so rows start on either warpgroup and the producer runs ahead into
    the next row's q and tiles."""
    rng = random.Random(99 + st)
    for _ in range(300):
        rows = [rng.choice([0, 1, 2, 3, 4, 5, 7]) for _ in range(rng.randint(1, 5))]
        run(rows, st, rng)


@pytest.mark.parametrize("st", [2, 3, 4])
def test_small_heads_rows_random_interleavings(st):
    """small_heads.py: one consumer warpgroup, any ring depth, several rows (tokens) per
    program with empty rows; the producer runs ahead into the next row's first tiles and q."""
    rng = random.Random(7 + st)
    for _ in range(300):
        rows = [rng.choice([0, 1, 2, 3, 5, 18]) for _ in range(rng.randint(1, 5))]
        run(rows, st, rng, small=True)


def test_model_catches_a_missing_q_free():
    """The model can fail: a producer that loads the next row's q without waiting on q_free
    overwrites q while a consumer's S still reads it (rows shorter than the ring: with longer
    rows the stage waits of the first tiles already imply q_free); the same for the few-heads
    kernel."""
    rng = random.Random(0)

    def eager(rows, st, reads=3):
        return (op for op in producer(rows, st, reads) if op[:2] != ("wait", ("q_free",)))

    def eager_small(rows, st):
        return (op for op in small_heads_producer(rows, st) if op[:2] != ("wait", ("q_free",)))

    for prod, small in ((eager, False), (eager_small, True)):
        with pytest.raises(AssertionError):
            for _ in range(200):
                run([1, 1, 1, 1, 1], 2, rng, prod=prod, small=small)


def test_model_catches_a_stage_refilled_early():
    """The model can fail: a producer that refills a stage without waiting for its release
    overwrites a tile the consumer still reads (the few-heads kernel, 3 stages)."""
    rng = random.Random(0)

    def eager(rows, st):
        return (op for op in small_heads_producer(rows, st) if op[1][0] != "consumed")

    with pytest.raises(AssertionError):
        for _ in range(200):
            run([5, 4], 3, rng, prod=eager, small=True)


@pytest.mark.parametrize("pre", [0, 2])
def test_other_pre_tile_counts_are_safe(pre):
    """fwd.PRE_TILES 0 (q first) and 2 (= the ring depth at D = 512) keep the protocol: the
    values timed against the default 1."""
    rng = random.Random(pre)
    for _ in range(200):
        rows = [rng.choice([0, 1, 2, 3, 5]) for _ in range(rng.randint(1, 5))]
        run(rows, 2, rng, prod=lambda r, st, reads=3: producer(r, st, reads, pre))


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
