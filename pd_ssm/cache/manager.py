"""Cache bookkeeping: which state slot and which KV blocks belong to which request.

Pure Python, no tensors (the tensors are in `pool.py`).  A request holds exactly one state slot
(shared by all its SSM layers: slot `s` indexes every SSM layer's pool) and a block table of KV
blocks (shared by all its attention layers) covering its tokens.  Allocation is all-or-nothing:
a call that cannot be satisfied changes nothing.

NOTE: for both pools `num_free + num_used == total` after every call; `check()` asserts it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class CacheFullError(RuntimeError):
    """Not enough free slots or blocks; the caller waits, preempts or refuses."""


@dataclass(slots=True)
class _Allocation:
    slot: int
    blocks: list[int] = field(default_factory=list)


class CacheManager:
    def __init__(self, num_slots: int, num_blocks: int, block_size: int, uses_kv: bool) -> None:
        if num_slots <= 0:
            raise ValueError("num_slots must be > 0")
        self.num_slots = num_slots
        self.num_blocks = num_blocks if uses_kv else 0
        self.block_size = block_size
        self.uses_kv = uses_kv
        self._free_slots: deque[int] = deque(range(num_slots))
        self._free_blocks: deque[int] = deque(range(self.num_blocks))
        self._by_request: dict[str, _Allocation] = {}

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_used_slots(self) -> int:
        return len(self._by_request)

    @property
    def num_used_blocks(self) -> int:
        return sum(len(a.blocks) for a in self._by_request.values())

    def holds(self, req_id: str) -> bool:
        return req_id in self._by_request

    def slot(self, req_id: str) -> int:
        return self._by_request[req_id].slot

    def block_table(self, req_id: str) -> list[int]:
        return self._by_request[req_id].blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) if self.uses_kv else 0

    def can_admit(self, num_tokens: int) -> bool:
        """Would a new request covering `num_tokens` tokens fit right now?"""
        return bool(self._free_slots) and self.blocks_needed(num_tokens) <= len(self._free_blocks)

    def can_grow(self, req_id: str, num_tokens: int) -> bool:
        return self.blocks_to_grow(req_id, num_tokens) <= len(self._free_blocks)

    def blocks_to_grow(self, req_id: str, num_tokens: int) -> int:
        """Blocks the request would take to cover `num_tokens` tokens (0 when it already does)."""
        return max(0, self.blocks_needed(num_tokens) - len(self._by_request[req_id].blocks))

    # --- changes -------------------------------------------------------------------------
    def allocate(self, req_id: str, num_tokens: int) -> int:
        """Give a new request a slot and blocks for `num_tokens` tokens; return the slot."""
        if req_id in self._by_request:
            raise ValueError(f"request {req_id!r} already holds cache")
        if not self.can_admit(num_tokens):
            raise CacheFullError(
                f"no room for {req_id!r}: {self.num_free_slots} free slots, "
                f"{self.num_free_blocks} free blocks, {self.blocks_needed(num_tokens)} needed"
            )
        alloc = _Allocation(self._free_slots.popleft())
        self._by_request[req_id] = alloc
        self._take_blocks(alloc, self.blocks_needed(num_tokens))
        return alloc.slot

    def try_grow(self, req_id: str, num_tokens: int) -> bool:
        """`grow` if the blocks are there (True), else change nothing (False): one lookup, and no
        block arithmetic at all while the table already covers `num_tokens` (most decode steps)."""
        alloc = self._by_request[req_id]
        if not self.uses_kv or num_tokens <= len(alloc.blocks) * self.block_size:
            return True
        extra = self.blocks_needed(num_tokens) - len(alloc.blocks)
        if extra > len(self._free_blocks):
            return False
        self._take_blocks(alloc, extra)
        return True

    def grow(self, req_id: str, num_tokens: int) -> None:
        """Extend the request's block table to cover `num_tokens` tokens (all or nothing)."""
        alloc = self._by_request[req_id]
        extra = self.blocks_needed(num_tokens) - len(alloc.blocks)
        if extra > len(self._free_blocks):
            raise CacheFullError(f"{req_id!r} needs {extra} more blocks, {self.num_free_blocks} free")
        self._take_blocks(alloc, extra)

    def free(self, req_id: str) -> None:
        """Release everything the request holds; a request holding nothing is a no-op."""
        alloc = self._by_request.pop(req_id, None)
        if alloc is None:
            return
        self._free_slots.append(alloc.slot)
        self._free_blocks.extend(alloc.blocks)

    def check(self) -> None:
        """Assert the pool invariants (cheap enough for tests after every step)."""
        used_slots = [a.slot for a in self._by_request.values()]
        used_blocks = [b for a in self._by_request.values() for b in a.blocks]
        assert len(self._free_slots) + len(used_slots) == self.num_slots, "slot leak"
        assert len(self._free_blocks) + len(used_blocks) == self.num_blocks, "block leak"
        assert len(set(used_slots) | set(self._free_slots)) == self.num_slots, "slot double-booked"
        assert len(set(used_blocks) | set(self._free_blocks)) == self.num_blocks, "block double-booked"

    def _take_blocks(self, alloc: _Allocation, n: int) -> None:
        for _ in range(max(n, 0)):
            alloc.blocks.append(self._free_blocks.popleft())
