"""Control calls on the job's ranks: one method on many ranks, waiting for every answer.

Control calls (build, join, sync, prepare, recover) are not what hang detection watches (that is
:meth:`actors.recovery.FailureRecovery.collect`'s job): each waits up to a timeout for every
rank's answer, and a rank whose answer does not come counts as hung.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

from raytrec.elastic.rank_protocol import RankProtocol
from raytrec.elastic.workers import (
    Answer,
    Clock,
    RankCallError,
    RankFailed,
    RankLost,
    RankTimedOut,
    WorkerGroup,
)

__all__ = ["ControlCalls"]

R = TypeVar("R")


class ControlCalls:
    """Calls on ranks through ``group`` that wait up to ``timeout_s`` for every answer;
    ``on_lost(rank, pending)``: a rank died while the ranks ``pending`` had not answered."""

    def __init__(
        self,
        group: WorkerGroup,
        clock: Clock,
        *,
        timeout_s: float,
        on_lost: Callable[[int, Collection[int]], None],
    ) -> None:
        self.group = group
        self.clock = clock
        self.timeout_s = timeout_s
        self.on_lost = on_lost

    def call(self, ranks: list[int], invoke: Callable[[RankProtocol, int], R]) -> list[R]:
        """Calls one method on ``ranks`` (``invoke``, as in :meth:`WorkerGroup.call`) and
        returns their answers in order; raises :class:`RankLost` or :class:`RankFailed` for
        the first rank whose call failed."""
        futures = self.group.call(ranks, invoke)
        self.wait_all(futures)
        return [self.group.result(futures[r]) for r in ranks]

    def answers(
        self, ranks: list[int], invoke: Callable[[RankProtocol, int], R]
    ) -> tuple[dict[int, R], RankCallError | None]:
        """Calls ``method`` on ``ranks``; returns the answers of those whose call returned, and
        the first error (a timeout, naming the ranks stuck, before any other), so a caller
        keeps what came back when some did not."""
        futures = self.group.call(ranks, invoke)
        error: RankCallError | None = None
        try:
            self.wait_all(futures)
        except RankTimedOut as e:
            error = e
        stuck = set(error.ranks) if isinstance(error, RankTimedOut) else set()
        answers: dict[int, R] = {}
        for r in ranks:
            if r in stuck:
                continue
            try:
                answers[r] = self.group.result(futures[r])
            except RankCallError as e:
                error = error or e
        return answers, error

    def wait_all(self, futures: Mapping[int, Answer[Any]]) -> None:
        """Waits for every answer of a control call; raises :class:`RankTimedOut` naming the
        ranks whose answer did not come (recovery counts them as hung)."""
        timeout = self.timeout_s
        deadline = self.clock.monotonic() + timeout
        pending = dict(futures)
        rank_of = {id(f): r for r, f in futures.items()}
        while pending:
            left = max(0.0, deadline - self.clock.monotonic())
            ready = self.group.wait(list(pending.values()), num_returns=1, timeout=left)
            if not ready:
                stuck = sorted(pending)
                method = next(iter(futures.values())).method
                raise RankTimedOut(
                    stuck,
                    f"{method} did not return on ranks {stuck} of {sorted(futures)} "
                    f"within {timeout:g}s",
                )
            for future in ready:
                rank = rank_of[id(future)]
                pending.pop(rank, None)
                try:
                    self.group.result(future)
                except RankLost:
                    # Its gang peers and the other gangs' replica collectives are released
                    # now; their calls then end at once (failed), not at the timeout.
                    self.on_lost(rank, set(pending))
                except RankFailed:
                    pass  # raised to the caller below, with the others' answers in
