"""When a row speculates, and how many ids it guesses: the part that keeps speculation from
losing.

A verify step is synchronous (the host waits for its samples before the next step, instead of
running one step behind the device) and feeds k + 1 tokens a row, so a guess that is rejected
costs time. Four rules bound that cost (with a fifth in the scheduler: a row that gets no guess
does not break the pipelined step, engine.core.speculative_step):
  * Per row, a moving average of the share of its offered guesses that were accepted (a step
    read early for a guess the proposer then did not have counts as none accepted). Below `threshold`
    the row rests:
    it sits out the next `rest_steps` steps (twice as many after each rest that ends in another
    failure, up to `max_rest_steps`), riding in the step without guesses, and then tries again.
    The first rest is short (4 steps): a copying answer misses where it departs from its source
    (a changed name, a reworded line) and copies again a few ids later, and a long rest lost
    those copied tails; a row that keeps missing (chat) soon rests for long anyway.
    A step in which no row speculates is a plain pipelined decode step, so a server whose
    traffic never repeats itself quickly decodes as if speculation were off.
  * Per row, the guesses it is offered follow its recent accepted runs: the smallest power of
    two above a moving average of its accepted guesses a step (a verify step's cost grows with
    the guesses it feeds, and the model compiles powers of two), so a row that copies gets them
    all and a row that mostly misses guesses one, the cheapest check, before it rests.
  * As the batch grows, a step's guesses are shared out: each row gets `guesses // rows` (at
    least 1): a bigger batch is already closer to being bound by compute than by the weights'
    read, where extra tokens stop being free.
  * Above `max_batch` rows there is no speculation at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.speculation.proposer import History


@dataclass(frozen=True)
class SpeculationStats:
    """Counts since start, for the metrics (acceptance rate = accepted / proposed)."""

    proposer: str = ""  # the proposer's name; "" when speculation is off
    proposed: int = 0  # guessed ids sent to `verify`
    accepted: int = 0  # of those, the ids the model accepted (each a token gained)
    steps: int = 0  # verify steps


@dataclass(slots=True)
class RowSpeculation:
    """One request's speculation state, from its first verify step to its end."""

    history: History
    seen: int  # the request's ids (prompt, then output) the history holds
    rate: float  # moving average of accepted / offered guesses
    run: float  # moving average of the guesses accepted a verify step (one more when all were)
    resting: int = 0  # steps left to sit out
    rests: int = 0  # rests in a row that ended in another failure


class SpeculationPolicy:
    def __init__(
        self,
        guesses: int,
        max_batch: int,
        smoothing: float = 0.5,
        threshold: float = 0.25,
        rest_steps: int = 4,
        max_rest_steps: int = 512,
    ) -> None:
        if guesses < 1 or max_batch < 1:
            raise ValueError(f"speculation needs guesses >= 1 and max_batch >= 1, got {guesses}, {max_batch}")
        self.guesses, self.max_batch = guesses, max_batch
        self.smoothing, self.threshold = smoothing, threshold
        self.rest_steps, self.max_rest_steps = rest_steps, max_rest_steps

    def row(self, history: History, seen: int) -> RowSpeculation:
        """A new row's state: it starts by speculating, at twice the threshold, every guess offered."""
        return RowSpeculation(history, seen, 2 * self.threshold, float(self.guesses))

    def guesses_for(self, rows: int) -> int:
        """Guesses per speculating row in a step of `rows` rows (0: no speculation)."""
        return 0 if not 0 < rows <= self.max_batch else max(1, self.guesses // rows)

    def guesses_of(self, row: RowSpeculation, share: int) -> int:
        """Guesses for `row` in a step whose share a row is `share` (`guesses_for`): the smallest
        power of two above its recent accepted run, at most `share`."""
        wanted = 1
        while wanted <= row.run and wanted < share:
            wanted *= 2
        return min(wanted, share)

    def rest(self, row: RowSpeculation) -> bool:
        """Whether `row` sits out this step; a resting row's rest shortens by one step."""
        if row.resting:
            row.resting -= 1
            return True
        return False

    def observe(self, row: RowSpeculation, offered: int, accepted: int) -> None:
        """A verify step offered `row` `offered` guesses (> 0) and the model accepted `accepted`."""
        row.rate += self.smoothing * (accepted / offered - row.rate)
        # all accepted counts one more: the row was held back by its offer, so its offer grows
        row.run += self.smoothing * (accepted + (accepted == offered) - row.run)
        if row.rate < self.threshold:
            row.resting = min(self.max_rest_steps, self.rest_steps << min(row.rests, 16))
            row.rests += 1
            row.rate = 2 * self.threshold  # the retry after the rest starts afresh
        elif accepted:
            row.rests = 0
