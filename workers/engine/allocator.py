"""PyTorch's CUDA caching allocator, as far as it decides how much GPU memory tensors take.

SGLang measures memory with ``torch.cuda.mem_get_info`` after ``torch.cuda.empty_cache()``
(``srt/utils/common.py::get_available_gpu_memory``), so what a model's weights cost is the size
of the allocator's segments still holding a live tensor, not the tensors' sum. The rules are
``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x, ``expandable_segments`` off, the default):
requests round up to 512 B; up to 1 MiB comes from 2 MiB segments of the small pool; larger
requests come from the large pool, in a new 20 MiB segment below 10 MiB and otherwise one rounded
up to 2 MiB; a free block is chosen best-fit and split when what remains is at least 512 B
(small pool) or more than 1 MiB (large pool); ``empty_cache`` returns the segments with no live
block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def _round_up(size: int, unit: int) -> int:
    return -(-size // unit) * unit


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    live: bool = False


@dataclass
class CachingAllocator:
    """Segments and blocks of one device's allocator; ``reserved`` is what mem_get_info sees."""

    blocks: list[_Block] = field(default_factory=list)
    segments: dict[int, tuple[bool, int]] = field(default_factory=dict)  # id -> (small, size)
    handles: dict[int, _Block] = field(default_factory=dict)

    def malloc(self, handle: int, size: int) -> None:
        """Allocate ``size`` bytes under ``handle``."""
        size = max(MIN_BLOCK, _round_up(size, MIN_BLOCK))
        small = size <= SMALL_SIZE
        free = [b for b in self.blocks
                if not b.live and self.segments[b.segment][0] == small and b.size >= size]
        if free:
            block = min(free, key=lambda b: (b.size, b.segment, b.offset))
        else:
            if small:
                seg_size = SMALL_BUFFER
            elif size < MIN_LARGE_ALLOC:
                seg_size = LARGE_BUFFER
            else:
                seg_size = _round_up(size, ROUND_LARGE)
            seg = len(self.segments)
            self.segments[seg] = (small, seg_size)
            block = _Block(seg, 0, seg_size)
            self.blocks.append(block)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            self.blocks.append(_Block(block.segment, block.offset + size, rest))
            block.size = size
        block.live = True
        self.handles[handle] = block

    def free(self, handle: int) -> None:
        """Free ``handle``'s block and merge it with free neighbours of its segment."""
        block = self.handles.pop(handle)
        block.live = False
        mates = sorted((b for b in self.blocks if b.segment == block.segment),
                       key=lambda b: b.offset)
        merged: list[_Block] = []
        for b in mates:
            if merged and not merged[-1].live and not b.live:
                merged[-1].size += b.size
            else:
                merged.append(b)
        self.blocks = [b for b in self.blocks if b.segment != block.segment] + merged

    def empty_cache(self) -> None:
        """Return every segment that holds no live block."""
        busy = {b.segment for b in self.blocks if b.live}
        self.blocks = [b for b in self.blocks if b.segment in busy]
        self.segments = {k: v for k, v in self.segments.items() if k in busy}

    @property
    def reserved(self) -> int:
        """Bytes of the segments the allocator holds."""
        return sum(size for _, size in self.segments.values())


def reserved_bytes(events: list[tuple[str, int, int]]) -> int:
    """Replay ``("a", handle, bytes)`` / ``("f", handle, 0)`` events, then ``empty_cache``."""
    alloc = CachingAllocator()
    for op, handle, size in events:
        if op == "a":
            alloc.malloc(handle, size)
        else:
            alloc.free(handle)
    alloc.empty_cache()
    return alloc.reserved
