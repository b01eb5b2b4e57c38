"""What a call allocates on torch's CPU allocator (client/memory.py): the peak above the start and
the blocks alive at the peak, by the operator that allocated them, against sizes known from the
tensors' shapes."""

from __future__ import annotations

import torch

from beyond_averaging.client.memory import (
    Allocation,
    alive_at_peak,
    peak_above_start,
    torch_allocations,
)

FLOATS = 4  # bytes of a float32


def test_the_peak_is_the_most_live_bytes_above_the_start_and_who_holds_them() -> None:
    kept: list[torch.Tensor] = []

    def work() -> None:
        first = torch.zeros(100_000)  # 400,000 bytes
        second = torch.ones(50_000)  # 200,000 bytes: both alive, the peak
        del first
        kept.append(torch.empty(25_000))  # 100,000 bytes, after first's are freed
        del second

    allocations = torch_allocations(work)
    sizes = [event.size for event in allocations]
    assert 100_000 * FLOATS in sizes
    assert -100_000 * FLOATS in sizes  # first freed inside the call
    assert peak_above_start(allocations) == 150_000 * FLOATS
    alive = alive_at_peak(allocations)
    assert sum(alive.values()) == 150_000 * FLOATS
    assert {size for size in alive.values()} <= {
        100_000 * FLOATS,
        50_000 * FLOATS,
        150_000 * FLOATS,
    }
    assert all(operator.startswith("aten::") for operator in alive)


def test_no_allocation_has_no_peak_and_nothing_alive() -> None:
    assert peak_above_start([]) == 0
    assert not alive_at_peak([])
    # Counted from the total before the first event, a free of an older block lowers nothing.
    events = [Allocation(-64, 936, 1, "aten::x"), Allocation(32, 968, 2, "aten::y")]
    assert peak_above_start(events) == 0
    assert alive_at_peak(events) == {"aten::y": 32}
