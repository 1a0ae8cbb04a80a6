"""Each step's inputs, from rank 0 to the other ranks.

Rank 0 owns the scheduler and its `Sequence`s; the other ranks run the same
`ModelRunner.execute` on a copy of the step. The copy is the `ScheduledBatch` with its
sequences replaced by `WorkerSequence`s: plain records holding exactly what the runner
reads, with values rank 0 computed (so, e.g., which rows need logits is decided once).

Token ids travel as deltas: a worker keeps the sequences of the previous step and gets
only the tokens appended since. A sequence absent from a step (finished, preempted,
left out by the token budget) is dropped on both sides and sent whole when it returns.
Messages are pickled and broadcast over the CPU group, length first: no size cap.
"""

import dataclasses
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from nanovllm.engine.scheduler import ScheduledBatch


@dataclass
class WorkerSequence:
    """A worker's copy of one scheduled sequence: the fields the model runner reads."""

    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    wants_prompt_logprobs: bool = False
    grammar: None = None  # constrained sampling happens on rank 0 alone

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SeqUpdate:
    seq_id: int
    start: int  # the worker holds token_ids[:start]; 0 when it holds nothing of this sequence
    new_token_ids: list[int]  # token_ids[start:]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_table: list[int]
    wants_prompt_logprobs: bool


@dataclass
class StepMessage:
    batch: ScheduledBatch  # the scheduler's record with `seqs` emptied: they travel as `updates`
    updates: list[SeqUpdate]


class StepSender:
    """Rank 0's side: turns a ScheduledBatch into a StepMessage."""

    def __init__(self):
        self.held: dict[int, int] = {}  # seq_id -> number of tokens the workers hold

    def encode(self, batch: ScheduledBatch) -> StepMessage:
        updates = []
        for seq in batch.seqs:
            start = self.held.get(seq.seq_id, 0)
            updates.append(SeqUpdate(seq.seq_id, start, seq.token_ids[start:], seq.num_prompt_tokens,
                                     seq.num_computed_tokens, list(seq.block_table), seq.wants_prompt_logprobs))
        # Workers keep exactly this step's sequences (StepReceiver.decode), so must we.
        self.held = {seq.seq_id: seq.num_tokens for seq in batch.seqs}
        return StepMessage(dataclasses.replace(batch, seqs=[]), updates)


class StepReceiver:
    """A worker's side: turns a StepMessage back into a ScheduledBatch for its runner."""

    def __init__(self):
        self.seqs: dict[int, WorkerSequence] = {}

    def decode(self, message: StepMessage) -> ScheduledBatch:
        seqs = {}
        for u in message.updates:
            seq = self.seqs.get(u.seq_id, WorkerSequence()) if u.start else WorkerSequence()
            if len(seq.token_ids) != u.start:
                raise RuntimeError(f"step out of sync: sequence {u.seq_id} holds {len(seq.token_ids)} tokens "
                                   f"here, rank 0 assumed {u.start}")
            seq.token_ids.extend(u.new_token_ids)
            seq.num_prompt_tokens = u.num_prompt_tokens
            seq.num_computed_tokens = u.num_computed_tokens
            seq.block_table = u.block_table
            seq.wants_prompt_logprobs = u.wants_prompt_logprobs
            seqs[u.seq_id] = seq
        self.seqs = seqs
        return dataclasses.replace(message.batch, seqs=[seqs[u.seq_id] for u in message.updates])


def broadcast(obj: Any, settle: bool = False) -> None:
    """Send `obj` from rank 0 to every other rank over the CPU group: its pickle's length, then
    the pickle. With `settle`, return only once gloo has let go of the message (see below)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    dist.broadcast(size, src=0)
    dist.broadcast(payload, src=0)
    if settle:
        _wait_until_released(size, payload)


def _wait_until_released(*tensors: torch.Tensor, timeout: float = 1.0) -> None:
    """Wait, without the GIL, until gloo's worker thread has dropped its references to `tensors`.

    It drops them a moment after wait() returns, and dropping a reference to a tensor that has a
    Python object takes the GIL. If the interpreter has begun finalizing by then, the thread
    ends inside that destructor and the process aborts ("terminate called without an active
    exception", seen in gdb). Rank 0's last message, the stop, goes out from an atexit hook
    right before finalization, so it waits for this; no other message needs to.
    """
    if not all(hasattr(t, "_use_count") for t in tensors):  # torch's reference count, a private API
        return
    deadline = time.monotonic() + timeout
    while any(t._use_count() > 1 for t in tensors) and time.monotonic() < deadline:
        time.sleep(0.001)


def receive() -> Any:
    """The object rank 0 broadcast next."""
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0)
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, src=0)
    return pickle.loads(payload.numpy().tobytes())
