"""A site's ranks in lockstep: rank 0 runs the loop and talks to the PS; the other ranks follow its commands."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from geofed_hpc.client.distributed import holders, wait_released
from geofed_hpc.client.fsdp import (
    check_arrays,
    full_optimizer_state,
    full_state,
    load_full_optimizer_state,
    load_full_state,
    param_names,
)
from geofed_hpc.client.sharded import (
    Gathered,
    PendingShards,
    gather_param,
    load_shards,
    save_shards,
    start_save_shards,
)
from geofed_hpc.client.statecopy import StateCopy
from geofed_hpc.client.steps import Stepper
from geofed_hpc.data import BatchSampler
from geofed_hpc.data.squad import QAExample, QASampler, greedy_answers, score
from geofed_hpc.errors import ProtocolError
from geofed_hpc.paradigms.exchange import Params
from geofed_hpc.paradigms.site import SiteParadigm

_ARGS = 4


class Cmd(IntEnum):
    STOP = 0
    STEP = 1
    EVAL = 2
    GATHER_MODEL = 3
    GATHER_OPTIM = 4
    LOAD_MODEL = 5
    LOAD_OPTIM = 6
    SET_RNG = 7
    SET_SCALER = 8
    QA = 9
    GATHER_PARAM = 10
    SAVE_SHARDS = 11
    LOAD_SHARDS = 12


class SiteGroup:
    """Every operation that touches model state goes through here. On rank 0 each one first broadcasts a command
    so that the followers (`follow`) join the same collectives; in a one-process site they are plain calls.

    `in_collective` is True from a command's broadcast to the end of its collectives: a stop signal arriving then
    must wait (the trainer checks it), at any other moment the followers are waiting for the next command."""

    def __init__(
        self,
        stepper: Stepper,
        sampler: BatchSampler | QASampler,
        val: list[tuple[torch.Tensor, torch.Tensor]],
        rank: int,
        world_size: int,
        paradigm: SiteParadigm | None = None,
        questions: list[QAExample] | None = None,
    ) -> None:
        self.questions = questions or []
        self.stepper, self.sampler, self.val = stepper, sampler, val
        self.paradigm = paradigm
        self.model: nn.Module = stepper.model
        self.optimizer = stepper.optimizer
        self.rank, self.world_size = rank, world_size
        self.multi = world_size > 1
        self.in_collective = False
        self.broken = False  # an error inside a collective: the ranks are out of step, send nothing more
        self.stopped = False
        self.signal = 0  # a stop signal this rank received (followers report it with each step)
        self.shard_root: Path | None = None  # where a multi-rank site's DCP checkpoints go (every rank)
        self.pending_shards: PendingShards | None = None  # this rank's shards being written in the background
        self.state_copy: StateCopy | None = None  # a restored optimizer state being copied out of its checkpoint
        self._comm = stepper.device if stepper.device.type == "cuda" else torch.device("cpu")

    # ------------------------------------------------------------------ command channel
    def _send(self, cmd: Cmd, *args: float) -> None:
        if self.multi:
            packet = torch.zeros(1 + _ARGS, dtype=torch.float64, device=self._comm)
            packet[0] = int(cmd)
            packet[1 : 1 + len(args)] = torch.tensor(args, dtype=torch.float64)
            before = holders(packet)
            dist.broadcast(packet, src=0)
            if cmd == Cmd.STOP:  # the last collective of this rank: let gloo free it before the exit
                wait_released(packet, before)

    def barrier(self) -> None:
        """Every rank of a multi-rank site waits here for the others (at start: what rank 0 prepared is in place)."""
        if self.multi:
            dist.barrier()

    def _recv(self) -> tuple[Cmd, list[float]]:
        packet = torch.zeros(1 + _ARGS, dtype=torch.float64, device=self._comm)
        before = holders(packet)
        dist.broadcast(packet, src=0)
        values = packet.tolist()
        cmd = Cmd(int(values[0]))
        if cmd == Cmd.STOP:
            wait_released(packet, before)
        return cmd, values[1:]

    @contextlib.contextmanager
    def _collective(self, cmd: Cmd, *args: float) -> Iterator[None]:
        self.in_collective = True
        try:
            self._send(cmd, *args)
            yield
        except BaseException:
            self.broken = True
            raise
        finally:
            self.in_collective = False

    def _any_signal(self) -> int:
        if not self.multi:
            return self.signal
        flag = torch.tensor([self.signal], dtype=torch.int64, device=self._comm)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    # ------------------------------------------------------------------ rank 0 (and one-process) API
    def step(self, phase: int = 0) -> tuple[float, int, int]:
        """One local step on the next site batch, training the paradigm's `phase` parameters: (site-mean loss,
        tokens, largest stop signal any rank got)."""
        with self._collective(Cmd.STEP, self.sampler.draws, phase):
            x, y = self.sampler.next_batch()
            loss = self._step(x, y, phase)
            return loss, x.numel(), self._any_signal()

    def _step(self, x: torch.Tensor, y: torch.Tensor, phase: int) -> float:
        p = self.paradigm
        count = self.sampler.draws  # the site's lifetime step count, this step included (its batch is drawn)
        if p is None:
            return self.stepper.step(x, y, count)
        p.set_phase(self.model, phase)
        p.before_step(self.model, count)
        if p.custom_step:  # one process (build_runtime refuses more): the paradigm's own step, no optimizer
            return p.step(self.model, self.stepper.loss, x, y)
        return self.stepper.step(x, y, count)

    @property
    def lr(self) -> float | None:
        """The AdamW learning rate of the last step (warmup included); None for a paradigm's own step (zo)."""
        if self.paradigm is not None and self.paradigm.custom_step:
            return None
        return float(self.optimizer.param_groups[0]["lr"])

    def evaluate(self) -> float:
        with self._collective(Cmd.EVAL):
            return self.stepper.evaluate(self.val)

    def qa_metrics(self) -> dict[str, float]:
        """Exact match and F1 of greedy answers to the validation questions ({} for a language-model task)."""
        if not self.questions:
            return {}
        with self._collective(Cmd.QA):
            return score(self._answers(), self.questions)

    def _answers(self) -> list[str]:
        return greedy_answers(self.model, self.questions, self.sampler.context, self.stepper.device)

    def model_arrays(self) -> Mapping[str, np.ndarray]:
        """Full float32 parameters by name (tied once), on rank 0. In a one-process site on CPU these are views of
        the parameters: use them before the next step (encode, subtract, write), never keep them. In a multi-rank
        site each is gathered from the shards when it is read (sharded.Gathered): one full parameter at a time."""
        if self.multi:
            return Gathered(param_names(self.model), self._gather_param)
        with self._collective(Cmd.GATHER_MODEL):
            state = full_state(self.model)
        return {k: v.numpy() for k, v in state.items()}

    def _gather_param(self, name: str) -> np.ndarray:
        with self._collective(Cmd.GATHER_PARAM, param_names(self.model).index(name)):
            return gather_param(self.model, name)

    def save_shards(self, stamp: int, weights_only: bool = False, background: bool = False) -> Path:
        """Every rank writes its shard of the model and optimizer (`weights_only`: the model's alone) into
        shard_root/shards-<stamp> (DCP). `background`: staged now and written while training goes on; the folder
        is in place once `finish_shards()` returned (a save or load waits for the one before it on every rank)."""
        assert self.shard_root is not None
        with self._collective(Cmd.SAVE_SHARDS, float(stamp), float(weights_only), float(background)):
            return self._save_shards(stamp, weights_only, background)

    def _save_shards(self, stamp: int, weights_only: bool, background: bool) -> Path:
        assert self.shard_root is not None
        self.finish_shards()
        if background:
            self.pending_shards = start_save_shards(self.model, self.optimizer, self.shard_root, stamp)
            return self.pending_shards.final
        return save_shards(self.model, self.optimizer, self.shard_root, stamp, weights_only)

    def finish_shards(self) -> Path | None:
        """Wait for this rank's background save of shards, if any (rank 0: then its folder is in place)."""
        pending, self.pending_shards = self.pending_shards, None
        return pending.finish() if pending is not None else None

    def load_shards(self, stamp: int) -> None:
        """Every rank reads its shard of the model and optimizer from shard_root/shards-<stamp>."""
        assert self.shard_root is not None
        with self._collective(Cmd.LOAD_SHARDS, float(stamp)):
            self.finish_shards()
            load_shards(self.model, self.optimizer, self.shard_root, stamp)

    def optimizer_arrays(self) -> Params:
        """The optimizer state as `optim/<param>/<key>` float32 arrays, on rank 0 (views, as model_arrays)."""
        if not self.multi:  # no collective needed: read the state where it is
            names = {id(p): n for n, p in self.model.named_parameters()}
            return {
                f"optim/{names[id(p)]}/{key}": value.detach().to("cpu", torch.float32).numpy()
                for p, entries in self.optimizer.state.items()
                for key, value in entries.items()
                if isinstance(value, torch.Tensor)
            }
        with self._collective(Cmd.GATHER_OPTIM):
            state = full_optimizer_state(self.model, self.optimizer)
        return {
            f"optim/{name}/{key}": value.detach().cpu().to(torch.float32).numpy().copy()
            for name, entries in state.get("state", {}).items()
            for key, value in entries.items()
            if isinstance(value, torch.Tensor)
        }

    def load_model(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Set every rank's parameters from full arrays given on rank 0 (checked before anything is sent)."""
        check_arrays(self.model, arrays)
        with self._collective(Cmd.LOAD_MODEL):
            load_full_state(self.model, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()})

    def load_optimizer(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Load `optim/<param>/<key>` arrays (what optimizer_arrays returned) into every rank."""
        names = set(param_names(self.model))
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in arrays.items():
            name, field = key[len("optim/") :].rsplit("/", 1)
            if name not in names:
                raise ProtocolError(f"optimizer state for {name!r}, which this model does not have")
            state.setdefault(name, {})[field] = torch.from_numpy(np.asarray(value, dtype=np.float32))
        self.finish_state_copy()
        if not self.multi:  # set the state in place (DCP's generic path costs ~0.1 s per million parameters)
            params = dict(self.model.named_parameters())
            self.optimizer.state.clear()
            for name, entries in state.items():
                device = params[name].device
                # AdamW keeps `step` on the CPU unless capturable; the moments live with their parameter
                self.optimizer.state[params[name]] = {k: v if k == "step" else v.to(device) for k, v in entries.items()}
            if self.stepper.device.type == "cpu":  # the moments are views of `arrays`: copied out on a thread
                self.state_copy = StateCopy(self.optimizer)
            return
        with self._collective(Cmd.LOAD_OPTIM):
            load_full_optimizer_state(self.model, self.optimizer, {"state": state, "param_groups": self._groups()})

    def finish_state_copy(self) -> None:
        """The optimizer state restored last holds memory of its own (see StateCopy); before it is replaced."""
        if self.state_copy is not None:
            self.state_copy.finish()
            self.state_copy = None

    def _groups(self) -> list[dict[str, Any]]:
        by_id = {id(p): n for n, p in self.model.named_parameters()}
        groups = []
        for group in self.optimizer.param_groups:
            entry = {k: v for k, v in group.items() if k != "params"}
            entry["params"] = [by_id[id(p)] for p in group["params"]]
            groups.append(entry)
        return groups

    def rng_state(self) -> Params:
        """Torch RNG states (CPU, and this GPU's) as uint8 arrays."""
        out = {"rng/cpu": torch.get_rng_state().numpy().copy()}
        if self.stepper.device.type == "cuda":
            out["rng/cuda"] = torch.cuda.get_rng_state(self.stepper.device).numpy().copy()
        return out

    def set_rng_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Every rank takes rank 0's saved RNG state (ranks start from the same seed, so this is where they were)."""
        cpu = arrays.get("rng/cpu")
        if cpu is None:
            return
        with self._collective(Cmd.SET_RNG, float(len(cpu))):
            self._set_rng(torch.from_numpy(np.array(cpu, dtype=np.uint8)), arrays.get("rng/cuda"))

    def _set_rng(self, cpu: torch.Tensor, cuda: np.ndarray | None) -> None:
        if self.multi:
            buf = cpu.to(self._comm)
            dist.broadcast(buf, src=0)
            cpu = buf.cpu()
        torch.set_rng_state(cpu)
        if cuda is not None and self.stepper.device.type == "cuda" and self.rank == 0:
            torch.cuda.set_rng_state(torch.from_numpy(np.array(cuda, dtype=np.uint8)), self.stepper.device)

    def set_scaler_state(self, state: Mapping[str, float]) -> None:
        """Restore the fp16 loss scale on every rank."""
        if not self.stepper.scaler or not state:
            return
        with self._collective(Cmd.SET_SCALER, float(state["scale"]), float(state.get("_growth_tracker", 0))):
            self.stepper.load_scaler_state(dict(state))

    def stop(self, signum: int = 0) -> None:
        """Tell the followers to leave (`signum`: the stop signal, 0 at the end of training, -1 rank 0 failed)."""
        if self.multi and self.rank == 0 and not (self.in_collective or self.broken or self.stopped):
            self.stopped = True
            self._send(Cmd.STOP, float(signum))

    # ------------------------------------------------------------------ followers
    def follow(self) -> int:
        """Ranks > 0: run rank 0's commands until it says stop; return the stop signal (0: training ended)."""
        while True:
            cmd, args = self._recv()
            if cmd == Cmd.STOP:
                self.finish_shards()  # rank 0 waited for its background save: this rank's ends with it
                return int(args[0])
            if cmd == Cmd.STEP:
                self.sampler.draws = int(args[0])
                self._step(*self.sampler.next_batch(), int(args[1]))
                self._any_signal()
            elif cmd == Cmd.EVAL:
                self.stepper.evaluate(self.val)
            elif cmd == Cmd.QA:
                self._answers()
            elif cmd == Cmd.GATHER_MODEL:
                full_state(self.model)
            elif cmd == Cmd.GATHER_PARAM:
                gather_param(self.model, param_names(self.model)[int(args[0])])
            elif cmd == Cmd.SAVE_SHARDS:
                self._save_shards(int(args[0]), bool(args[1]), bool(args[2]))
            elif cmd == Cmd.LOAD_SHARDS:
                assert self.shard_root is not None
                self.finish_shards()
                load_shards(self.model, self.optimizer, self.shard_root, int(args[0]))
            elif cmd == Cmd.GATHER_OPTIM:
                full_optimizer_state(self.model, self.optimizer)
            elif cmd == Cmd.LOAD_MODEL:
                load_full_state(self.model, {})
            elif cmd == Cmd.LOAD_OPTIM:
                load_full_optimizer_state(self.model, self.optimizer, {})
            elif cmd == Cmd.SET_RNG:
                self._set_rng(torch.zeros(int(args[0]), dtype=torch.uint8), None)
            elif cmd == Cmd.SET_SCALER:
                self.stepper.load_scaler_state({"scale": args[0], "_growth_tracker": int(args[1])})
