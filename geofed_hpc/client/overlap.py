"""Overlapped syncs (train.overlap): a sync's push and pull run on a sender thread while the site trains on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from geofed_hpc.client.group import SiteGroup
from geofed_hpc.client.replica import Replica
from geofed_hpc.client.sync import SiteSync, Synced
from geofed_hpc.paradigms.exchange import Params

# How often the training thread looks whether a flight it waits for is back (a stop signal is checked as often).
POLL_S = 0.05


class _Anchor:
    """The site's ranks as the sender thread sees them: the model is the anchor (a copy of the local model taken at
    the push) and a pulled model is kept, not loaded: only the training thread touches the live model."""

    def __init__(self, anchor: Params) -> None:
        self.anchor = anchor
        self.loaded: Params | None = None  # the global model the pull brought (with the anchor's private tensors)

    def model_arrays(self) -> Params:
        return self.anchor

    def load_model(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.loaded = dict(arrays)


class _Moves:
    """The sync's safe points as the sender thread reaches them (sync.SafePoints): recorded here; the training thread
    acts on them when the flight lands or a stop comes (phases, checkpoints, stops are its own)."""

    def __init__(self) -> None:
        self.applied = threading.Event()  # the PS confirmed the push (its work is in the global model)
        self.deferred = False  # the PS stayed unreachable: the work stays relative to the base

    def busy(self) -> None:
        pass

    def pushed(self) -> None:
        self.applied.set()

    def checkpointed(self) -> None:
        pass

    def save(self, pending: dict[str, Any] | None = None) -> object:
        self.deferred = True
        return None


@dataclass
class Flight:
    """One overlapped sync: the interval it pushes (`steps` since the base, its mean `loss`, `train_s` seconds), the
    anchor, what the push record holds (`at_push`: draws, tokens seen, syncs after it, fixed at the push) and the
    sender's own view of the sync (`sync`, with its replica and timer). `synced` is exchange()'s answer (None:
    deferred), `error` what the sender raised."""

    steps: int
    loss: float
    train_s: float
    at_push: tuple[int, int, int]
    sync: SiteSync
    group: _Anchor
    moves: _Moves
    started: float = field(default_factory=time.monotonic)
    finished: threading.Event = field(default_factory=threading.Event)
    synced: Synced | None = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.finished.is_set()

    @property
    def version(self) -> int:
        return self.sync.replica.version


class Overlap:
    """The site's overlapped syncs over its SiteSync `main`: at most one `flight` at a time. The training thread
    calls `start` at a sync, `land` at a step boundary once the flight is `done` (or when it must wait for it), and
    `adopt_anchor` when a stop comes after the PS confirmed the push but before its version arrived."""

    def __init__(self, main: SiteSync) -> None:
        self.main = main
        self.flight: Flight | None = None

    def start(self, steps: int, loss: float, train_s: float, at_push: tuple[int, int, int]) -> Flight:
        """Hand the interval's work to the sender thread and return at once; the local model, copied now, is the
        anchor its delta is taken from (the training thread trains on meanwhile)."""
        assert self.flight is None, "one push in flight at a time"
        main = self.main
        anchor = {k: np.array(v, copy=True) for k, v in main.group.model_arrays().items()}
        group = _Anchor(anchor)
        ranks = cast(SiteGroup, group)  # the sender's replica and sync reach the model only through these two calls
        replica = Replica(main.replica.name, ranks, main.replica.exchange, main.replica.private, main.replica.events)
        replica.version, replica.exact = main.replica.version, main.replica.exact
        moves = _Moves()
        sender = SiteSync(main.cfg, main.link, replica, main.uplink, ranks, main.paradigm, safe=moves)
        flight = Flight(steps, loss, train_s, at_push, sender, group, moves)
        base = main.replica.base  # not changed by the training thread while the flight is out

        def run() -> None:
            try:
                replica.base = {k: np.array(v, copy=True) for k, v in base.items()}  # pulls update it in place
                flight.synced = sender.exchange(steps, loss)
            except BaseException as exc:  # noqa: BLE001 - raised in the training thread when the flight lands
                flight.error = exc
            finally:
                flight.finished.set()

        self.flight = flight  # before the sender starts: its push record reads `at_push` from here
        # a daemon: a job that stops with the pull still out does not wait for it (the checkpoint says where it was)
        threading.Thread(target=run, name=f"{main.name}-sync-sender", daemon=True).start()
        return flight

    def push_known(self) -> bool:
        """Wait until the flight's push has an outcome: True when the whole flight is back (land it), False when the
        PS confirmed the push and its pull is still out."""
        flight = self.flight
        assert flight is not None
        while not flight.finished.wait(POLL_S):
            if flight.moves.applied.is_set():
                return False
        return True

    def land(self, trained_since: int, before: Callable[[int], None] | None = None) -> Flight:
        """Take the finished flight (its error raised here). Pushed and pulled: the site moves onto the version its push
        made, keeping the `trained_since` steps since the push, local <- new global + (local now - anchor); the
        base becomes that global model bit for bit. `before(version)` runs on the global model itself, before the
        steps since the push are put back (an evaluation). Deferred: nothing moves (the work stays against the
        base); the uplink holds it."""
        flight = self.flight
        assert flight is not None and flight.done
        self.flight = None
        if flight.error is not None:
            raise flight.error
        if flight.synced is None:
            return flight
        main, sent = self.main, flight.sync.replica
        pulled = flight.group.loaded
        if pulled is not None:
            self._move_onto(pulled, flight.group.anchor, set(sent.base), trained_since, before, sent.version)
        main.replica.base, main.replica.version, main.replica.exact = sent.base, sent.version, sent.exact
        main.timer = flight.sync.timer
        return flight

    def _move_onto(
        self,
        pulled: Params,
        anchor: Params,
        public: set[str],
        trained_since: int,
        before: Callable[[int], None] | None,
        version: int,
    ) -> None:
        group = self.main.group
        if trained_since == 0:  # nothing trained since the push: the global model as it came, bit for bit
            group.load_model(pulled)
            if before is not None:
                before(version)
            return
        local = group.model_arrays()
        since = {k: (local[k] - anchor[k]) if k in public else np.array(local[k], copy=True) for k in local}
        if before is not None:
            group.load_model(pulled)
            before(version)
        group.load_model({k: pulled[k] + v if k in public else v for k, v in since.items()})

    def adopt_anchor(self) -> None:
        """A stop after the PS confirmed the flight's push, before its version came: the anchor becomes the base at
        the version the push made (not the PS's model bit for bit, as after a lost pull); the steps since the push
        are the work since it. The sender is left behind (it changes nothing the training thread reads)."""
        flight = self.flight
        assert flight is not None and flight.moves.applied.is_set()
        self.flight = None
        replica = self.main.replica
        replica.base = {k: np.array(v, copy=True) for k, v in flight.group.anchor.items()}
        replica.version, replica.exact = self.main.uplink.push_version, False
