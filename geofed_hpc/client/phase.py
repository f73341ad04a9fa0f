"""Where a site is in its sync cycle, the moves allowed between phases, and when a stop request may be honoured."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """What a stop signal arriving now would find."""

    IDLE = "idle"  # the checkpoint is current (on disk, or being written in the background: a stop waits for it)
    TRAIN = "train"  # mid-interval: a stop waits for the step to end, then checkpoints the part-interval
    BUSY = "busy"  # pushing (or asking the PS about an unanswered push): a stop waits for the outcome
    WAIT = "wait"  # the delta is in, the checkpoint after it is not written yet: a stop records "pushed"


# The one table of allowed moves: an interval starts from a current checkpoint and ends in a push; a push ends
# applied (WAIT, then the checkpoint after the pull) or not (deferred, stale: checkpointed, IDLE again).
ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.IDLE, Phase.TRAIN, Phase.BUSY}),
    Phase.TRAIN: frozenset({Phase.BUSY}),
    Phase.BUSY: frozenset({Phase.WAIT, Phase.IDLE}),
    Phase.WAIT: frozenset({Phase.IDLE}),
}


class StopAction(enum.Enum):
    """What a signal handler does with a stop request, given the phase."""

    NOW = "now"  # leave now: the checkpoint on disk is current
    SAVE_PUSHED = "save_pushed"  # checkpoint that the delta is in (else a resume would push it again), then leave
    LATER = "later"  # the loop stops at its next safe point (end of the step or of the push)
    ALREADY = "already"  # a stop was requested before: the next safe point handles it


class IllegalPhase(RuntimeError):
    """A move the table does not allow: a bug in the site loop, never the user's input."""


class Lifecycle:
    """The site's phase and its pending stop request (the signal number). Signal handlers call `request`; the loop
    calls `enter` at every move, which says whether a stop is pending there (a safe point: the caller stops)."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE
        self.stop_signal: int | None = None

    def enter(self, phase: Phase) -> bool:
        """Move to `phase`; True when a stop is pending (the caller is at a safe point and must stop)."""
        if phase not in ALLOWED[self.phase]:
            raise IllegalPhase(f"site phase {self.phase.value} -> {phase.value} is not an allowed move")
        self.phase = phase
        return self.stop_signal is not None

    @property
    def stopping(self) -> bool:
        return self.stop_signal is not None

    def request(self, signum: int) -> StopAction:
        """A stop signal arrived: remember it (the first one wins) and say what may be done now."""
        if self.stop_signal is not None:
            return StopAction.ALREADY
        self.stop_signal = signum
        if self.phase is Phase.IDLE:
            return StopAction.NOW
        if self.phase is Phase.WAIT:
            return StopAction.SAVE_PUSHED
        return StopAction.LATER
