"""The culprit of a stall across nodes: every node's verdict on its own ranks, gathered on every node.

A collective that stalls stalls every node's ranks: the node whose watchdog trips first may hold only ranks that wait
for another node's. So a stall on any node makes every node read its own ranks' evidence (stacks, flight records;
`HangWatchdog.dump_all`) and send its verdict over the control channel: whether its evidence names a rank of its own
(one in its own code, or frozen, while the others wait), and its headline. Every node then says the same headline:

* every node whose verdict names a rank (one in its own code, or frozen, while the others wait), in node order:
  ``node 1: CPU0 (rank 1) stalled at step 9 in ...``; a node names a rank only from its evidence, never for having
  tripped its watchdog first, and a forced node (another node's stall) only one silent for half its allowance;
* else a node that sent no verdict within `VERDICT_WAIT` seconds of the stall is the culprit by silence (its
  supervisor frozen, cut off, or its host gone): ``node 2 sent no stall verdict within 5 s: ...``;
* else (every node answered and none names a rank) each node's own headline stands.

Every node's report then lists what each node said of its own ranks (`NodeVerdicts.lines`), so the evidence of the
other nodes is read where the run's end is read, not only in their own logs.

Before any of that, a program that reports nothing is stalled only when every node's ranks say so
(`NodeFindings`): when no rank of any node made progress for the hang timeout, each node reads its ranks
(supervisor/diagnosis/quiet.py) and tells the others its finding. A node whose ranks are stopped or stuck stops the
run itself; otherwise a rank quiet in its own code on any node (asleep, reading, waiting on its input) makes the
whole group quiet, said on every node in the same line, and a rank found on the CPU makes it busy; only when every
node's ranks wait for others (or a node says nothing within the wait) is the group stalled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from supervisor.control.wire import BUSY, QUIET, WAITS
from supervisor.diagnosis.quiet import QUIET_WORDS, STALLED

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
        named = [f"node {node}: {headline}" for node, (names, headline) in sorted(self.verdicts.items()) if names]
        if named:
            return "; ".join(named)
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


@dataclass
class NodeFindings:
    """Every node's finding on its own ranks when the group was silent for the hang timeout, as heard (the module's
    docstring): this node's and the others', each with when it came."""

    nnodes: int
    heard: dict[int, tuple[str, str, float]] = field(default_factory=dict)  # node → (kind, text, when heard)
    since: float = -math.inf  # findings heard before then are another decision's

    def add(self, node: int, kind: str, text: str, now: float) -> None:
        self.heard[node] = (kind, text, now)

    def open(self, since: float) -> None:
        """A decision begins: the findings heard since `since` are for it (the nodes look within moments of each
        other, sharing one clock of the group's silence), none heard before the last decision."""
        self.since = max(self.since, since)

    def close(self, now: float) -> None:
        self.since = now

    def current(self) -> dict[int, tuple[str, str]]:
        return {node: (kind, text) for node, (kind, text, when) in self.heard.items() if when >= self.since}

    def outcome(self, due: bool) -> str | None:
        """BUSY or QUIET (not a stall), STALLED (every node's ranks wait, or a node said nothing by the time `due`), or
        None while findings are still awaited. A busy node decides at once; a quiet one once every node is heard (or
        `due`), so that every node says the same line."""
        kinds = {kind for kind, _ in self.current().values()}
        if BUSY in kinds:
            return BUSY
        if len(self.current()) < self.nnodes and not due:
            return None
        return QUIET if QUIET in kinds else STALLED

    def quiet_line(self, waiting_here: bool) -> str:
        """The quiet ranks of every node, and whether the others wait for them (`waiting_here`: a rank of this node
        does; the other nodes' waiting ranks are known from their findings)."""
        found = self.current()
        texts = [text for _, (kind, text) in sorted(found.items()) if kind == QUIET]
        line = "; ".join(texts)
        kinds = {kind for kind, _ in found.values()}
        if kinds <= {QUIET, WAITS} and (waiting_here or WAITS in kinds):
            line += f"; the others wait for {'them' if line.count(QUIET_WORDS) > 1 else 'it'} in a collective"
        return f"{line}; not a stall"
