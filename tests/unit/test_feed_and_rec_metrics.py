"""The rank's batch feed (read-ahead thread, errors before a chunk) and the job-wide AUC / NE."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from raytrec.data.feed import BatchFeed, DataExhausted
from raytrec.data.generate import auc as reference_auc
from raytrec.observability.rec_metrics import RankMetrics, merge_metric_states


def counting(n: int, *, fail_at: int | None = None) -> Iterator[int]:
    for i in range(n):
        if i == fail_at:
            raise ValueError(f"bad row in batch {i}")
        yield i


@pytest.mark.parametrize("background", [True, False])
def test_feed_yields_every_batch_in_order(background: bool) -> None:
    feed = BatchFeed(counting(10), prefetch=2, background=background)
    got = []
    for chunk in (3, 3, 4):
        feed.prepare(chunk, timeout_s=10)
        got += [feed.take() for _ in range(chunk)]
    assert got == list(range(10))
    with pytest.raises(DataExhausted, match="ended after 10 batches"):
        feed.prepare(1, timeout_s=10)


@pytest.mark.parametrize("background", [True, False])
def test_feed_raises_the_sources_error_before_the_chunk_that_holds_it(background: bool) -> None:
    feed = BatchFeed(counting(10, fail_at=5), prefetch=0, background=background)
    feed.prepare(5, timeout_s=10)
    assert [feed.take() for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="bad row in batch 5"):
        feed.prepare(2, timeout_s=10)
    with pytest.raises(ValueError, match="bad row in batch 5"):  # and again: the source is done
        feed.prepare(1, timeout_s=10)


class Closable:
    """A source that says when it was closed and how far it was read."""

    def __init__(self, items: list[int]) -> None:
        self.items, self.read, self.closed = items, 0, False

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if self.closed or self.read == len(self.items):
            raise StopIteration
        self.read += 1
        return self.items[self.read - 1]

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("background", [True, False])
def test_a_continued_feed_keeps_what_comes_before_the_point_then_reads_the_new_source(
    background: bool,
) -> None:
    """Items before the point (10 here) stay, replays pushed to the front included; those read
    ahead past it are dropped; the old source is closed where the feed reaches the point, and
    the new one follows. Twice, the second time after the first continuation ended."""
    old = Closable(list(range(20)))
    feed = BatchFeed(old, prefetch=4, background=background)
    feed.prepare(6, timeout_s=10)
    assert [feed.take() for _ in range(3)] == [0, 1, 2]
    feed.push_front([-1, -2])
    feed.prepare(8, timeout_s=10)  # reads ahead to 10 or beyond (the thread: up to 12)
    then = Closable([100, 101, 102])
    started: list[int] = []  # how many items of the old source were read when then() was called

    def start() -> Iterator[int]:
        started.append(old.read)
        return then

    feed.continue_with(lambda i: i < 10, start, soon=lambda i: i >= 9)
    if not background:  # it holds 8 at most: not before the source reaches item 9
        assert started == []
    got = []
    for chunk in (4, 4, 4):
        feed.prepare(chunk, timeout_s=10)
        got += [feed.take() for _ in range(chunk)]
    assert got == [-1, -2, 3, 4, 5, 6, 7, 8, 9, 100, 101, 102]
    assert old.closed and old.read <= 13
    # Once, when item 9 was read (the thread may have read it before the continuation).
    assert started == [10] if not background else len(started) == 1 and started[0] <= 10
    with pytest.raises(DataExhausted):
        feed.prepare(1, timeout_s=10)
    again = Closable([200, 201])
    feed.continue_with(lambda i: True, lambda: again, soon=lambda i: False)  # it had ended
    feed.prepare(2, timeout_s=10)
    assert [feed.take(), feed.take()] == [200, 201]
    feed.close()
    if background:  # the thread closes the source when it stops
        for _ in range(100):
            if again.closed:
                break
            threading.Event().wait(0.05)
    assert again.closed


def test_a_failed_feed_stays_failed_when_continued() -> None:
    feed = BatchFeed(counting(10, fail_at=2), prefetch=0, background=False)
    with pytest.raises(ValueError, match="bad row in batch 2"):
        feed.prepare(3)
    feed.continue_with(lambda i: i < 1, lambda: iter([7]))
    with pytest.raises(ValueError, match="bad row in batch 2"):
        feed.prepare(1)


def test_inline_feed_pulls_only_when_prepared_and_replays_first() -> None:
    pulled: list[int] = []

    def source() -> Iterator[int]:
        for i in range(100):
            pulled.append(i)
            yield i

    feed = BatchFeed(source(), prefetch=3, background=False)
    assert not feed.background and pulled == []  # no thread: nothing read until asked
    feed.prepare(2)
    assert pulled == [0, 1]  # exactly the chunk: reading ahead would only delay training
    feed.push_front([-2, -1])  # batches handed over for replay go first
    feed.prepare(3)
    assert [feed.take() for _ in range(3)] == [-2, -1, 0]
    assert pulled == [0, 1]
    feed.prepare(2)
    assert [feed.take() for _ in range(2)] == [1, 2] and pulled == [0, 1, 2]


def test_feed_reads_ahead_one_chunk_while_training() -> None:
    produced = threading.Semaphore(0)

    def source() -> Iterator[int]:
        for i in range(100):
            produced.release()
            yield i

    feed = BatchFeed(source(), prefetch=1)
    feed.prepare(4, timeout_s=10)
    for _ in range(4):
        feed.take()
    # Without another prepare(), the thread refills up to chunk + prefetch = 5 batches.
    for _ in range(4 + 5):
        assert produced.acquire(timeout=10)
    assert not produced.acquire(timeout=0.2)  # and not beyond
    assert feed.buffered() == 5
    feed.close()


def test_take_without_prepare_is_an_error() -> None:
    feed = BatchFeed(counting(0), prefetch=0)
    with pytest.raises(RuntimeError, match="call prepare"):
        feed.take()


def ne_reference(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p.astype(np.float64), 1e-12, 1 - 1e-12)
    ce = -(y * np.log2(p) + (1 - y) * np.log2(1 - p)).sum()
    mean = y.mean()
    base = -(y.sum() * np.log2(mean) + (1 - y).sum() * np.log2(1 - mean))
    return float(ce / base)


def test_merged_states_give_the_metrics_of_the_union_of_rows() -> None:
    rng = np.random.default_rng(0)
    ranks = []
    all_logits, all_labels = [], []
    for _ in range(3):  # 3 ranks, 4 steps each, batches of 64
        m = RankMetrics()
        for _ in range(4):
            logits = rng.normal(size=64).astype(np.float32)
            labels = (rng.random(64) < 1 / (1 + np.exp(-2 * logits))).astype(np.float32)
            m.update(torch.from_numpy(logits), torch.from_numpy(labels))
            all_logits.append(logits)
            all_labels.append(labels)
        ranks.append(m.state())
    merged = merge_metric_states(ranks)
    p = 1 / (1 + np.exp(-np.concatenate(all_logits).astype(np.float64)))
    y = np.concatenate(all_labels)
    assert merged.rows == 3 * 4 * 64
    assert merged.auc == pytest.approx(reference_auc(p, y), abs=1e-6)
    assert merged.ne == pytest.approx(ne_reference(p, y), rel=1e-6)
    assert 0.6 < merged.auc < 0.95  # informative logits: the check above is not vacuous


def test_auc_window_keeps_the_newest_rows_and_one_class_gives_none() -> None:
    m = RankMetrics(auc_window=100)
    for i in range(5):
        m.update(torch.full((60,), float(i)), torch.ones(60))
    state = m.state()
    assert state["rows"] == 300
    assert 100 <= len(state["preds"]) < 160 and state["preds"].min() > 1 / (1 + np.exp(-3.0)) - 1e-6
    merged = merge_metric_states([state])
    assert merged.auc is None and merged.ne is None  # labels all 1: undefined
    assert merge_metric_states([RankMetrics().state()]).rows == 0


def test_rows_leaving_the_auc_window_still_count_in_ne() -> None:
    rng = np.random.default_rng(1)
    m = RankMetrics(auc_window=100)
    logits = rng.normal(size=(5, 60)).astype(np.float32)
    labels = (rng.random((5, 60)) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    for x, y in zip(logits, labels, strict=True):
        m.update(torch.from_numpy(x), torch.from_numpy(y))
    state = m.state()
    assert len(state["preds"]) == 120  # the window: the newest 2 steps (>= 100 rows)
    np.testing.assert_array_equal(state["labels"], labels[3:].reshape(-1))
    p = 1 / (1 + np.exp(-logits.astype(np.float64)))
    merged = merge_metric_states([state])
    assert merged.ne == pytest.approx(ne_reference(p.reshape(-1), labels.reshape(-1)), rel=1e-6)
    assert merged.auc == pytest.approx(reference_auc(p[3:].reshape(-1), labels[3:].reshape(-1)))
    again = m.state()  # reading the state changes nothing
    assert merge_metric_states([again]).ne == merged.ne and again["rows"] == 300
