"""A new stream's first rows read in process while its pipeline starts (raytrec.data.handover)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pyarrow as pa
import pytest

from raytrec.data.handover import read_while_starting

ROWS = list(range(100))


def tables(sizes: list[int]) -> list[pa.Table]:
    """ROWS cut into tables of ``sizes`` rows."""
    out, at = [], 0
    for n in sizes:
        out.append(pa.table({"x": ROWS[at : at + n]}))
        at += n
    assert at == len(ROWS)
    return out


def rows(it: Iterator[pa.Table]) -> list[int]:
    return [x for t in it for x in t.column("x").to_pylist()]


class Gate:
    """A pipeline that delivers nothing until opened, then ``blocks``; ``handed`` is set once
    its first block is in the reader's queue (the thread asked for the next one)."""

    def __init__(self, blocks: list[pa.Table]) -> None:
        self.blocks = blocks
        self.open = threading.Event()
        self.handed = threading.Event()
        self.closed = threading.Event()

    def start(self) -> Iterator[pa.Table]:
        def gen() -> Iterator[pa.Table]:
            try:
                self.open.wait(timeout=10)
                for i, block in enumerate(self.blocks):
                    yield block
                    if i == 0:
                        self.handed.set()
            finally:
                self.closed.set()

        return gen()


def test_rows_come_in_process_until_the_pipeline_delivers_then_from_it_without_repeats() -> None:
    gate = Gate(tables([7, 30, 13, 50]))
    taken: list[pa.Table] = []

    def in_process() -> Iterator[pa.Table]:
        for i, t in enumerate(tables([10] * 10)):
            if i == 3:  # the pipeline delivers while the 4th table is read here
                gate.open.set()
                assert gate.handed.wait(timeout=10)
            taken.append(t)
            yield t

    got = list(read_while_starting(in_process(), gate.start))
    assert rows(iter(got)) == ROWS  # every row once, in order
    assert len(taken) == 4  # 40 rows here; the pipeline's first 37 and 3 more are skipped
    assert [t.num_rows for t in got] == [10, 10, 10, 10, 10, 50]
    assert gate.closed.wait(timeout=5)


def test_a_pipeline_that_never_delivers_leaves_every_row_to_the_in_process_read() -> None:
    gate = Gate(tables([100]))
    assert rows(read_while_starting(iter(tables([25, 25, 25, 25])), gate.start)) == ROWS
    gate.open.set()
    assert gate.closed.wait(timeout=5)  # its thread stopped and closed it


def test_a_ready_pipeline_is_taken_at_once_and_its_failure_reaches_the_reader() -> None:
    handed = threading.Event()

    def failing() -> Iterator[pa.Table]:
        yield pa.table({"x": ROWS[:10]})
        handed.set()
        raise ValueError("bad row 12 in part-0.parquet")

    it = read_while_starting(iter(tables([100])), failing)
    assert handed.wait(timeout=10)  # the pipeline's first block is ready before the first read
    first = next(it)
    assert first.column("x").to_pylist() == ROWS[:10]  # from the pipeline, not in process
    with pytest.raises(ValueError, match="bad row 12"):
        next(it)


def test_a_pipeline_that_ends_before_the_rows_read_in_process_is_an_error() -> None:
    gate = Gate(
        [pa.table({"x": ROWS[:5]}), pa.table({"x": []}, schema=pa.schema([("x", pa.int64())]))]
    )
    # 5 rows, where the 100 read in process are due (the empty block lets `handed` be set)

    def in_process() -> Iterator[pa.Table]:
        yield from tables([50, 50])[:1]
        gate.open.set()
        assert gate.handed.wait(timeout=10)
        yield pa.table({"x": ROWS[50:]})

    with pytest.raises(RuntimeError, match="ended 95 rows before"):
        rows(read_while_starting(in_process(), gate.start))


def test_the_head_is_read_in_process_while_the_pipeline_of_the_rest_starts() -> None:
    """A pipeline that delivers while the head is read takes over right after it: none of the
    rest is read in process, and the pipeline skips nothing."""
    gate = Gate(tables([20, 80])[1:])  # the pipeline reads rows 20.. only
    read_here: list[int] = []

    def head() -> Iterator[pa.Table]:
        yield pa.table({"x": ROWS[:10]})
        gate.open.set()
        assert gate.handed.wait(timeout=10)
        yield pa.table({"x": ROWS[10:20]})

    def rest_in_process() -> Iterator[pa.Table]:
        for t in tables([20, 40, 40])[1:]:
            read_here.append(t.num_rows)
            yield t

    got = rows(read_while_starting(rest_in_process(), gate.start, head=head()))
    assert got == ROWS and read_here == []
    assert gate.closed.wait(timeout=5)


def test_closing_before_any_row_was_asked_for_stops_the_pipeline() -> None:
    """A stream read ahead (its pipeline started, nothing asked for yet) that is closed, say
    because the rank's stream changed again, shuts its pipeline down."""
    gate = Gate(tables([10] * 10))
    reading = read_while_starting(iter(tables([10] * 10)), gate.start)
    gate.open.set()
    assert gate.handed.wait(timeout=10)  # it runs ahead of the reader
    reading.close()
    assert gate.closed.wait(timeout=10)
