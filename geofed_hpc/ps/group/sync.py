"""What each peer shows at a sync point, and the one decision every peer draws from all of them alike."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

from geofed_hpc.errors import ProtocolError

Action = Literal["wait", "reform", "seed", "adopt", "mismatch", "close"]


@dataclass
class SyncPoint:
    """One PS's state at a sync point: its model (initialized, version, digest), its open round (deltas, whether
    every active site pushed, whether its deadline passed) and whether a site offered it an initial model."""

    initialized: bool
    version: int
    digest: str
    count: int
    complete: bool
    timed_out: bool
    seeds: bool = False
    joiners: list[int] = field(default_factory=list)  # the store's server: peers of ps.peers waiting to be taken back
    tokens: str = ""  # the digest of its enrollment token records ("": it keeps none, having no state directory)
    active: int = 0  # sites active on this PS
    expect: int = 0  # sites the group had before it lost a peer: a sync round waits for them to come back
    min_sites: int = 0  # sync: ps.min_sites, the sites of the group (all peers) that must push before a round closes

    def pack(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def unpack(cls, data: bytes) -> SyncPoint:
        """What `pack` wrote on a peer; ProtocolError when it is not what this build packs (another version)."""
        raw = json.loads(data)
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        try:
            if unknown:
                raise TypeError(f"unknown fields {unknown}")
            return cls(**raw)
        except TypeError as exc:
            raise ProtocolError(
                f"a peer's sync point does not read as this PS's ({exc}): every peer must run the same geofed-hpc"
            ) from None


@dataclass
class Decision:
    """What the group does at this sync point: `source` is the peer whose model the others take (seed, adopt, and
    mismatch: the majority's lowest peer, -1 without a majority); `peers` the ones that take it (mismatch: that
    differ from the majority, or all of them without one); `majority` the majority's digest ("" without one)."""

    action: Action
    source: int = -1
    peers: list[int] = field(default_factory=list)
    majority: str = ""


def decide(points: list[SyncPoint]) -> Decision:
    """The same decision on every peer, from every peer's SyncPoint in rank order:

    peers asked to come back: the group re-forms with them (reform); no model anywhere: the lowest peer a site
    offered a model seeds the group (seed); a peer without the newest version takes the model of the lowest peer
    that has it (adopt); the same version under different digests: the peers outside the majority take the model
    of the majority's lowest peer (mismatch; without a majority all of them stop); else the group's round closes
    once it holds a delta and every peer's sites pushed, with as many sites active as any peer expects (the sites
    of a peer the group lost, failing over) and as many deltas as ps.min_sites (sites that start late join the first
    round), or once any peer's deadline passed (close)."""
    joiners = sorted({j for p in points for j in p.joiners})
    if joiners:
        return Decision("reform", peers=joiners)
    ready = [i for i, p in enumerate(points) if p.initialized]
    if not ready:
        seeders = [i for i, p in enumerate(points) if p.seeds]
        if not seeders:
            return Decision("wait")
        return Decision("seed", seeders[0], [i for i in range(len(points)) if i != seeders[0]])
    top = max(points[i].version for i in ready)
    source = min(i for i in ready if points[i].version == top)
    behind = [i for i, p in enumerate(points) if not p.initialized or p.version != top]
    if behind:
        return Decision("adopt", source, behind)
    digests = Counter(p.digest for p in points)
    if len(digests) > 1:
        digest, votes = digests.most_common(1)[0]
        majority = digest if 2 * votes > len(points) else ""
        good = min((i for i, p in enumerate(points) if majority and p.digest == majority), default=-1)
        return Decision("mismatch", good, [i for i, p in enumerate(points) if p.digest != majority], majority)
    everyone = all(p.complete for p in points) and sum(p.active for p in points) >= max(p.expect for p in points)
    everyone = everyone and sum(p.count for p in points) >= max(p.min_sites for p in points)
    if sum(p.count for p in points) and (everyone or any(p.timed_out for p in points)):
        return Decision("close")
    return Decision("wait")
