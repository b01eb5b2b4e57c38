"""FedGMA against the papers and declearn: the tie rule and what happens to BatchNorm buffers."""

from __future__ import annotations

import numpy as np
import pytest

from beyond_averaging.strategies.fedgma import fedgma_step, hard_mask, soft_mask


@pytest.mark.parametrize(
    ("threshold", "expected"),
    [(0.5, 1.0), (0.5 + 1e-6, 0.5), (0.5 - 1e-6, 1.0)],
)
def test_soft_mask_keeps_the_full_update_at_a_tie_with_the_threshold(
    threshold: float, expected: float
) -> None:
    # Four equal clients, three move the coordinate down and one up: A = |3/4 - 1/4| = 0.5.
    updates = [{"w": np.array([1.0])}] * 3 + [{"w": np.array([-1.0])}]
    mask = soft_mask(updates, [1, 1, 1, 1], threshold=threshold)["w"]
    # A >= threshold keeps 1 (the papers' rule); declearn's code (A > threshold) would give 0.5.
    assert mask[0] == pytest.approx(expected, abs=1e-12)


def test_hard_mask_keeps_a_coordinate_whose_vote_equals_threshold_times_k() -> None:
    # K = 10, threshold 0.8: |#pos - #neg| >= 8 is kept; 9 vs 1 gives 8 (kept), 8 vs 2 gives 6.
    signs = [[1.0, 1.0]] * 8 + [[1.0, -1.0], [-1.0, -1.0]]
    gradients = [{"g": np.array(s)} for s in signs]
    np.testing.assert_array_equal(hard_mask(gradients, 0.8)["g"], [True, False])


def bn_state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "conv.weight": rng.normal(size=(3, 2)).astype(np.float32),
        "bn.weight": rng.normal(size=3).astype(np.float32),
        "bn.running_mean": rng.normal(size=3).astype(np.float32),
        "bn.running_var": rng.uniform(0.5, 2.0, size=3).astype(np.float32),
        "bn.num_batches_tracked": np.array(int(rng.integers(1, 50)), dtype=np.int64),
    }


@pytest.mark.parametrize("mask", ["soft", "hard"])
def test_batchnorm_buffers_are_the_weighted_client_average_never_stepped(mask: str) -> None:
    global_state = bn_state(0)
    clients = [bn_state(s) for s in (1, 2, 3)]
    counts = [10.0, 30.0, 60.0]
    p = np.array(counts) / sum(counts)
    # Positive gradients: every coordinate agrees, so the hard mask keeps it and steps it.
    gradients = [
        {k: np.abs(v) for k, v in bn_state(10 + i).items() if k in ("conv.weight", "bn.weight")}
        for i in range(3)
    ]
    step = fedgma_step(
        global_state,
        clients,
        gradients if mask == "hard" else None,
        counts,
        threshold=0.4,
        server_lr=0.5,
        mask=mask,  # type: ignore[arg-type]
    )
    for key in ("bn.running_mean", "bn.running_var"):
        expected = sum(w * c[key].astype(np.float64) for w, c in zip(p, clients, strict=True))
        np.testing.assert_allclose(step.arrays[key], expected, rtol=1e-6)
    counters = [int(c["bn.num_batches_tracked"]) for c in clients]
    expected_count = round(sum(w * n for w, n in zip(p, counters, strict=True)))
    assert int(step.arrays["bn.num_batches_tracked"]) == expected_count
    # A parameter is stepped, not averaged (server_lr 0.5 from w for soft; a masked step for hard).
    average = sum(w * c["bn.weight"].astype(np.float64) for w, c in zip(p, clients, strict=True))
    assert not np.allclose(step.arrays["bn.weight"], average)
