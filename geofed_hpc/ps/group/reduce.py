"""A group round's weighted sums reduced over the peers (int8 frames all-gathered, or a float32 ring all-reduce)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from geofed_hpc import codec
from geofed_hpc.config import CodecConfig
from geofed_hpc.ps.aggregate import Lazy, Params, WeightedSum, dense_of
from geofed_hpc.ps.group.collectives import Group, Traffic, allgather_bytes, allreduce_f32
from geofed_hpc.ps.persist import PSState
from geofed_hpc.ps.rounds import RoundTotals

_LEN = struct.Struct("<I")


def _frame(meta: dict[str, object], payload: bytes) -> bytes:
    head = json.dumps(meta).encode()
    return _LEN.pack(len(head)) + head + payload


def _unframe(blob: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = _LEN.unpack_from(blob)
    return json.loads(blob[_LEN.size : _LEN.size + n]), blob[_LEN.size + n :]


@dataclass
class Reduced:
    """What the peers' round sums came to: the total (identical on every peer) and the push ids each one applied."""

    total: WeightedSum
    push_ids: list[str]


def reduce_round(
    pg: Group, totals: RoundTotals, spec: dict[str, tuple[int, ...]], wire: CodecConfig, traffic: Traffic
) -> Reduced:
    """Sum every peer's weighted round sum, weights, weighted steps and counts, and gather their push ids. With the
    int8 codec each peer's sum is encoded once and every peer decodes all of them (its own too) and adds them in
    rank order, so all get the same bits; with fp32, gloo's ring all-reduce sums them exactly as sent."""
    folded = totals.folded
    meta: dict[str, object] = {
        "weight": folded.weight if folded else 0.0,
        "weighted_steps": folded.weighted_steps if folded else 0.0,
        "count": totals.count,
        "push_ids": totals.push_ids,
    }
    if wire.name == "fp32":
        metas: list[dict[str, Any]] = [
            _unframe(b)[0] for b in allgather_bytes(pg, _frame(meta, b""), "exchange of round counts")
        ]
        flat = np.concatenate(
            [(dense_of(folded.total[k]) if folded else np.zeros(s, np.float32)).reshape(-1) for k, s in spec.items()]
        )
        summed = allreduce_f32(pg, flat, traffic)
        total: Lazy = {}
        offset = 0
        for k, s in spec.items():
            n = int(np.prod(s))
            total[k] = summed[offset : offset + n].reshape(s).copy()
            offset += n
    else:
        payload = codec.encode(folded.total, wire) if folded else b""
        blobs = allgather_bytes(pg, _frame(meta, payload), "all-gather of round sums", traffic)
        sums = {k: np.zeros(s, np.float32) for k, s in spec.items()}
        metas = []
        for blob in blobs:
            theirs, data = _unframe(blob)
            metas.append(theirs)
            if data:
                for k, v in codec.decode(data, {k: (s, "float32") for k, s in spec.items()}).items():
                    sums[k] += v
        total = dict(sums)
    weight = sum(float(x["weight"]) for x in metas)
    steps = sum(float(x["weighted_steps"]) for x in metas)
    count = sum(int(x["count"]) for x in metas)
    ids = [str(p) for x in metas for p in x["push_ids"]]
    return Reduced(WeightedSum(total, weight, steps, count), ids)


def merged(totals: RoundTotals, reduced: Reduced) -> RoundTotals:
    """This peer's taken round with the group's sum in place of its own (its source stays, to be put back)."""
    return replace(totals, folded=reduced.total, count=reduced.total.count)


def pack_state(state: PSState) -> bytes:
    """A PS's whole model state in one blob (fp32 frames and JSON): model, optimizer state, residual, push ids."""
    tensors = {f"param/{k}": v for k, v in state.params.items()}
    tensors.update({f"momentum/{k}": v for k, v in state.momentum.items()})
    tensors.update({f"residual/{k}": v for k, v in state.residual.items()})
    meta = {"version": state.version, "push_ids": state.push_ids, "strategy": state.strategy}
    return _frame(meta, codec.encode(tensors, CodecConfig(name="fp32")))


def unpack_state(blob: bytes) -> PSState:
    meta, payload = _unframe(blob)
    groups: dict[str, Params] = {"param": {}, "momentum": {}, "residual": {}}
    for name, arr in codec.decode(payload).items():
        group, _, key = name.partition("/")
        groups[group][key] = arr
    state = PSState(int(meta["version"]), groups["param"], groups["momentum"], groups["residual"])
    state.push_ids, state.strategy = list(meta["push_ids"]), dict(meta["strategy"])
    return state
