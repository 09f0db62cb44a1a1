"""The culprit of a stall across nodes: every node's verdict on its own ranks, gathered on every node.

A collective that stalls stalls every node's ranks: the node whose watchdog trips first may hold only ranks that wait
for another node's. So a stall on any node makes every node read its own ranks' evidence (stacks, flight records;
`HangWatchdog.dump_all`) and send its verdict over the control channel: whether its evidence names a rank of its own
(one in its own code, or frozen, while the others wait), and its headline. Every node then says the same headline:

* the first node (by node rank) whose verdict names a rank: ``node 1: CPU0 (rank 1) stalled at step 9 in ...``;
* else a node that sent no verdict within `VERDICT_WAIT` seconds of the stall is the culprit by silence (its
  supervisor frozen, cut off, or its host gone): ``node 2 sent no stall verdict within 5 s: ...``;
* else (every node answered and none names a rank) each node's own headline stands.

Every node's report then lists what each node said of its own ranks (`NodeVerdicts.lines`), so the evidence of the
other nodes is read where the run's end is read, not only in their own logs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

VERDICT_WAIT = 5.0  # seconds after the stall for every node's verdict (each node dumps for DUMP_WAIT first)


@dataclass
class NodeVerdicts:
    """The verdicts heard so far, and until when the watcher waits for the rest."""

    nnodes: int
    deadline: float = math.inf  # set when this node's stall stop begins
    verdicts: dict[int, tuple[bool, str]] = field(default_factory=dict)  # node → (names a rank, headline)

    def expect(self, now: float) -> None:
        self.deadline = min(self.deadline, now + VERDICT_WAIT)

    def add(self, node: int, named: bool, headline: str) -> None:
        self.verdicts.setdefault(node, (named, headline))

    def waiting(self, now: float) -> bool:
        """A stall is being explained and some node's verdict is still due."""
        return self.deadline != math.inf and len(self.verdicts) < self.nnodes and now < self.deadline

    def headline(self) -> str | None:
        """The headline every node says, or None where this node's own stands."""
        for node in sorted(self.verdicts):
            named, headline = self.verdicts[node]
            if named:
                return f"node {node}: {headline}"
        silent = [n for n in range(self.nnodes) if n not in self.verdicts]
        if not silent or self.deadline == math.inf:
            return None
        names = f"node{'s' * (len(silent) > 1)} {', '.join(map(str, silent))}"
        return (f"{names} sent no stall verdict within {VERDICT_WAIT:g} s while the other nodes' ranks name no "
                f"culprit of their own: {names} {'are' if len(silent) > 1 else 'is'} the culprit by silence "
                f"(a supervisor frozen or cut off, or its host gone)")

    def lines(self, own: int) -> list[str]:
        """What each node said of its own ranks, for the report (`own`: this node); none before a stall."""
        if self.deadline == math.inf:
            return []
        return [f"node {node}{' (this node)' if node == own else ''}: "
                + (self.verdicts[node][1] if node in self.verdicts else f"no verdict within {VERDICT_WAIT:g} s")
                for node in range(self.nnodes)]
