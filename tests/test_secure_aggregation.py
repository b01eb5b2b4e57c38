"""SecAgg+'s protocol math (tasks/secure_aggregation.py) and each rule's sums (strategies/secure/).

Hand-worked small cases, and independent computations: the PRG against pycryptodome's own
AES-CTR, masked sums against the plain sum, each rule's step from sums against its math function
over the individual replies.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from Crypto.Cipher import AES

from beyond_averaging.strategies import aggregate_elastic, aggregate_fedavg
from beyond_averaging.strategies.fedgma import fedgma_step
from beyond_averaging.strategies.secure import fedgma_from_sums
from beyond_averaging.tasks.secure_aggregation import (
    SecAggOptions,
    check_unmask_request,
    client_vector,
    dequantise_sum,
    join_secret,
    mask_vector,
    neighbours,
    new_key_pair,
    new_seed,
    prg,
    quantise,
    seal,
    shared_key,
    shared_seed,
    split_secret,
    split_sum,
    threshold,
    unmask_sum,
    unseal,
)

#: Flower's SecAgg+ quantisation: 2^22 levels modulo 2^32.
FLOWER = SecAggOptions(quantization_bits=22, modulus_bits=32)


@pytest.mark.parametrize(("modulus", "dtype"), [(32, np.uint32), (64, np.uint64)])
def test_quantise_clips_to_the_range_and_rounds_to_the_nearest_of_two_to_the_bits_levels(
    modulus: int, dtype: Any
) -> None:
    # R = 1, b = 2: the levels 0..4 stand for -1, -0.5, 0, 0.5, 1 (step 0.5).
    options = SecAggOptions(clipping_range=1.0, quantization_bits=2, modulus_bits=modulus)
    q = quantise([-1.0, 0.0, 0.5, 0.3, 0.2, 2.0, -7.0, 0.25, -0.25], options)
    # 0.3 -> 0.6 + 2 -> 3; 0.2 -> 0.4 + 2 -> 2; 2.0 and -7.0 clipped to 1 and -1; halves up.
    assert q.tolist() == [0, 2, 3, 3, 2, 4, 0, 3, 2]
    assert q.dtype == dtype
    # The sum of three values back: (3 + 3 + 2) * 0.5 - 3 * 1 = 1.0 for 0.5 + 0.3 + 0.2.
    assert float(dequantise_sum(np.array([8], dtype), 3, options)[0]) == 1.0
    # A sum below the offsets (-2.5 for five values at -0.5) is read back through the wrap.
    assert float(dequantise_sum(np.array([5], dtype), 5, options)[0]) == -2.5


def test_quantisation_error_of_a_sum_stays_within_half_a_step_per_client_and_is_measured() -> None:
    rng = np.random.default_rng(0)
    values = rng.uniform(-1, 1, size=(10, 20_000))
    total = np.zeros(values.shape[1], np.uint32)
    for row in values:
        total += quantise(row, FLOWER)
    error = np.abs(dequantise_sum(total, 10, FLOWER) - values.sum(axis=0))
    step = FLOWER.quantum  # 16 / 2^22 = 3.8e-6
    assert step == pytest.approx(16 / 2**22)
    assert error.max() <= 10 * step / 2 + 1e-12
    # Rounding errors are spread evenly: their sum over 10 clients has a standard deviation of
    # step * sqrt(10 / 12), about 3.5e-6 here, far below any digits update's coordinates.
    assert error.mean() == pytest.approx(step * np.sqrt(10 / 12) * np.sqrt(2 / np.pi), rel=0.05)


def test_a_small_value_keeps_its_own_precision_on_the_default_64_bit_levels() -> None:
    # 10 clients modulo 2^64: 60-bit levels of 16 / 2^60 = 1.4e-17. Values of a weighted
    # update's size (1e-7 to 1e-3) come back within n / 2 levels, far finer than float64's
    # spacing at R = 8 (1.8e-15), which a quantiser adding R in floating point would cost.
    options = SecAggOptions().for_cohort(10)
    assert options.quantization_bits == 60
    rng = np.random.default_rng(3)
    values = rng.uniform(-1e-3, 1e-3, size=(10, 5_000)) * rng.choice([1.0, 1e-4], (10, 5_000))
    total = np.zeros(values.shape[1], np.uint64)
    for row in values:
        total += quantise(row, options)
    error = np.abs(dequantise_sum(total, 10, options) - values.sum(axis=0))
    assert options.quantum == 16 / 2**60
    assert error.max() <= 10 * options.quantum / 2 * (1 + 1e-9) + 1e-18


def test_a_cohort_that_could_wrap_the_modulus_is_refused_with_the_bits_that_fit() -> None:
    options = SecAggOptions(quantization_bits=22, modulus_bits=32)  # 2^10 - 1 = 1023 clients
    assert options.max_clients == 1023
    dequantise_sum(np.zeros(1, np.uint32), 1023, options)
    with pytest.raises(ValueError, match="lower quantization-bits to 21"):
        dequantise_sum(np.zeros(1, np.uint32), 1024, options)
    with pytest.raises(ValueError, match="lower quantization-bits to 57"):
        SecAggOptions(quantization_bits=58).for_cohort(100)  # 2^6 - 1 = 63 fit at 58 bits


def test_the_default_levels_are_the_finest_the_rounds_cohort_fits_with_headroom() -> None:
    # b = m - bit_length(n): 10 clients (4 bits) -> 60, 100 and 127 (7) -> 57, 128 (8) -> 56,
    # 1,000 (10) -> 54; one or two clients -> m - 2 = 62 (bit_length 1 and 2).
    default = SecAggOptions()
    bits = {n: default.for_cohort(n).quantization_bits for n in (1, 2, 10, 100, 127, 128, 1000)}
    assert bits == {1: 62, 2: 62, 10: 60, 100: 57, 127: 57, 128: 56, 1000: 54}
    assert SecAggOptions(modulus_bits=32).for_cohort(10).quantization_bits == 28
    assert SecAggOptions(quantization_bits=40).for_cohort(100).quantization_bits == 40
    for n in (10, 100, 127, 128, 1000):
        options = default.for_cohort(n)
        # n values at the top level 2^b (every value at +R, the weight folded in: r <= 1)
        # sum below 2^64, and so would 2^(m - b) - 1 of them; one more could wrap.
        assert n * 2**options.quantization_bits < 2**64
        assert options.max_clients == 2 ** (64 - options.quantization_bits) - 1 >= n
        assert (options.max_clients + 1) * 2**options.quantization_bits == 2**64
        top = np.zeros(1, np.uint64)
        for _ in range(n):
            top += quantise([8.0], options)
        assert float(dequantise_sum(top, n, options)[0]) == 8.0 * n
    with pytest.raises(ValueError, match="resolved per round"):
        _ = default.quantum  # the levels are the round's: unresolved options cannot quantise


def test_the_mean_is_off_by_at_most_its_bound_below_float32_spacing_modulo_2_to_the_64() -> None:
    # (W q / 2)(1 + |mean|), W = 10,000 (the run's secure-max-weight), q = 16 / 2^b.
    wide = SecAggOptions(max_weight=10_000.0).for_cohort(100)  # b = 57
    assert wide.mean_error_bound() == pytest.approx(10_000 * 16 / 2**57 / 2)  # 5.6e-13
    # Below half of float32's spacing for any model value of size 1e-4 or more (2^-14: 2^-38).
    assert wide.mean_error_bound(1.0) < np.spacing(np.float32(1e-4)) / 2
    narrow = SecAggOptions(max_weight=10_000.0, modulus_bits=32).for_cohort(10)  # b = 28
    assert narrow.mean_error_bound() == pytest.approx(10_000 * 16 / 2**28 / 2)  # 3.0e-4
    assert narrow.mean_error_bound() > np.spacing(np.float32(1000.0))


@pytest.mark.parametrize(
    ("field", "value"),
    [("modulus_bits", 16), ("quantization_bits", 63), ("threshold", 0.4), ("max_weight", 0.0)],
)
def test_options_refuse_values_outside_their_range_naming_them(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SecAggOptions(**{field: value})


def test_options_travel_through_a_config_record_unchanged() -> None:
    options = SecAggOptions(clip_norm=2.0, max_weight=500.0, neighbours=4, modulus_bits=64)
    assert SecAggOptions.from_config(options.to_config()) == options


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
def test_the_prg_is_aes_256_ctr_as_an_independent_implementation_computes_it(dtype: Any) -> None:
    seed = bytes(range(32))
    stream = AES.new(seed, AES.MODE_CTR, nonce=b"", initial_value=0).encrypt(bytes(8 * 5))
    expected = np.frombuffer(
        stream[: 5 * np.dtype(dtype).itemsize], dtype="<" + np.dtype(dtype).str[1:]
    )
    assert prg(seed, 5, dtype).tolist() == expected.tolist()
    assert prg(seed, 5, dtype).tolist() != prg(bytes(32), 5, dtype).tolist()
    with pytest.raises(ValueError, match="32 bytes"):
        prg(b"short", 5, dtype)


def test_pairwise_and_self_masks_cancel_in_the_sum_once_the_self_masks_are_removed() -> None:
    nodes = [3, 7, 11, 20]
    rng = np.random.default_rng(1)
    vectors = {n: rng.integers(0, 2**22, size=64).astype(np.uint32) for n in nodes}
    pair = {(a, b): new_seed() for a in nodes for b in nodes if a < b}
    selves = {n: new_seed() for n in nodes}
    masked = {
        n: mask_vector(
            vectors[n], selves[n], {o: pair[min(n, o), max(n, o)] for o in nodes if o != n}, n
        )
        for n in nodes
    }
    assert all((masked[n] != vectors[n]).any() for n in nodes)  # each vector hidden
    total = np.zeros(64, np.uint32)
    for vector in masked.values():
        total += vector
    plain = np.zeros(64, np.uint32)
    for vector in vectors.values():
        plain += vector
    assert unmask_sum(total, selves, {}).tolist() == plain.tolist()


def test_a_dropped_nodes_pairwise_masks_are_removed_from_the_survivors_sum() -> None:
    nodes = [1, 2, 3, 4]
    gone = 3
    vectors = {n: np.full(8, 10 * n, np.uint32) for n in nodes}
    pair = {(a, b): new_seed() for a in nodes for b in nodes if a < b}
    selves = {n: new_seed() for n in nodes}
    survivors = [n for n in nodes if n != gone]
    total = np.zeros(8, np.uint32)
    for n in survivors:  # node 3 masked with everyone but never sent its vector
        total += mask_vector(
            vectors[n], selves[n], {o: pair[min(n, o), max(n, o)] for o in nodes if o != n}, n
        )
    leftover = {(n, gone): pair[min(n, gone), max(n, gone)] for n in survivors}
    result = unmask_sum(total, {n: selves[n] for n in survivors}, leftover)
    assert result.tolist() == [10 * (1 + 2 + 4)] * 8


def test_the_neighbourhood_is_a_symmetric_ring_or_the_complete_graph() -> None:
    ring = neighbours([6, 1, 2, 3, 4, 5], 2)
    assert ring[1] == [2, 6]
    assert ring[3] == [2, 4]
    assert all(a in ring[b] for a in ring for b in ring[a])  # symmetric
    assert neighbours([1, 2, 3], 0) == {1: [2, 3], 2: [1, 3], 3: [1, 2]}
    assert neighbours([1, 2, 3, 4], 8) == neighbours([1, 2, 3, 4], 0)


def test_threshold_is_a_strict_majority_of_the_share_holders_by_default() -> None:
    assert [threshold(h, 0.5) for h in (2, 3, 4, 10, 11)] == [2, 2, 3, 6, 6]
    assert threshold(10, 0.9) == 10


def test_any_threshold_of_shamir_shares_rebuild_a_secret_and_fewer_do_not() -> None:
    secret = new_seed()
    shares = split_secret(secret, 3, 5)
    assert join_secret([shares[4], shares[0], shares[2]]) == secret
    assert join_secret(shares[1:4]) == secret
    try:
        fewer = join_secret(shares[:2])
    except ValueError:  # the padding of a wrong secret may not even parse
        fewer = b""
    assert fewer != secret


def test_shares_sealed_for_a_neighbour_open_only_there_and_only_as_sent() -> None:
    a_private, a_public = new_key_pair()
    b_private, b_public = new_key_pair()
    key = shared_key(a_private, b_public)
    assert key == shared_key(b_private, a_public)  # ECDH: both derive the same key
    assert len(shared_seed(a_private, b_public)) == 32
    sealed = seal(key, 1, 2, b"seed-share", b"key-share")
    assert unseal(shared_key(b_private, a_public), sealed, 1, 2) == (b"seed-share", b"key-share")
    with pytest.raises(ValueError, match="mixed up"):
        unseal(key, sealed, 1, 3)


def test_a_client_refuses_to_reveal_both_shares_of_one_node() -> None:
    check_unmask_request([1, 2], [3])
    with pytest.raises(ValueError, match="both"):
        check_unmask_request([1, 2], [2, 3])


def test_the_client_vector_folds_the_capped_weight_into_the_clipped_update_and_counts_signs() -> (
    None
):
    options = SecAggOptions(
        clip_norm=1.0, max_weight=100.0, clipping_range=4.0, quantization_bits=20
    )
    layout = [
        "weight||",
        "metric||train-loss",
        "update||w",
        "signs|gradient|w",
        "weighted|gradient|w",
    ]
    w = np.zeros(2)
    theta = np.array([3.0, 4.0])  # update norm 5 -> clipped to (0.6, 0.8)
    gradient = np.array([-2.0, 0.0])

    def sums_of_one_client(num_examples: int) -> dict[str, np.ndarray]:
        vector = client_vector(
            layout,
            {"w": w},
            {"w": theta},
            {"gradient": {"w": gradient}},
            {"train-loss": 0.5},
            num_examples,
            options,
        )
        return split_sum(vector, layout, {"w": (2,)}, 1, options)

    # n = 250 claims more than W = 100: r = min(250, 100) / 100 = 1 (the claim bound).
    sums = sums_of_one_client(250)
    assert float(sums["weight||"]) == pytest.approx(1.0, abs=options.quantum)
    assert float(sums["metric||train-loss"]) == pytest.approx(0.5, abs=options.quantum)
    assert sums["update||w"] == pytest.approx([0.6, 0.8], abs=options.quantum)
    assert sums["signs|gradient|w"].tolist() == [-1.0, 0.0]
    # n = 25: r = 0.25 scales every weighted value.
    sums = sums_of_one_client(25)
    assert float(sums["weight||"]) == pytest.approx(0.25, abs=options.quantum)
    assert sums["update||w"] == pytest.approx([0.15, 0.2], abs=options.quantum)
    assert sums["weighted|gradient|w"] == pytest.approx([-0.5, 0.0], abs=options.quantum)
    assert sums["signs|gradient|w"].tolist() == [-1.0, 0.0]  # a vote is not weighted
    with pytest.raises(ValueError, match="no finite metric"):
        client_vector(
            layout, {"w": w}, {"w": theta}, {"gradient": {"w": gradient}}, {}, 25, options
        )


# ------------------------------------------------------------------ each rule from its sums
def _clients(
    seed: int = 0, count: int = 5
) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]], np.ndarray]:
    rng = np.random.default_rng(seed)
    global_arrays = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=4)}
    models = [
        {k: v + rng.normal(scale=0.1, size=v.shape) for k, v in global_arrays.items()}
        for _ in range(count)
    ]
    weights = rng.integers(20, 200, size=count).astype(np.float64)
    return global_arrays, models, weights


def _exact_sums(
    global_arrays: dict[str, np.ndarray],
    models: list[dict[str, np.ndarray]],
    weights: np.ndarray,
    records: dict[str, list[dict[str, np.ndarray]]] | None = None,
    signs: dict[str, list[dict[str, np.ndarray]]] | None = None,
    update_signs: bool = False,
) -> dict[str, Any]:
    """The sums secure aggregation delivers, computed in the clear (r = n / 1000)."""
    r = weights / 1000.0
    sums: dict[str, Any] = {"weight||": np.array(r.sum()), "metric||train-loss": np.array(0.0)}
    for key in global_arrays:
        sums[f"update||{key}"] = sum(
            rk * (m[key] - global_arrays[key]) for rk, m in zip(r, models, strict=True)
        )
        if update_signs:
            sums[f"update-signs||{key}"] = sum(
                rk * np.sign(global_arrays[key] - m[key]) for rk, m in zip(r, models, strict=True)
            )
    for name, per_client in (records or {}).items():
        for key in per_client[0]:
            sums[f"weighted|{name}|{key}"] = sum(
                rk * c[key] for rk, c in zip(r, per_client, strict=True)
            )
    for name, per_client in (signs or {}).items():
        for key in per_client[0]:
            sums[f"signs|{name}|{key}"] = sum(np.sign(c[key]) for c in per_client)
    return sums


def test_fedavg_from_the_weighted_sum_is_the_weighted_mean_of_the_models() -> None:
    from beyond_averaging.strategies.secure.sums import mean_reply

    global_arrays, models, weights = _clients()
    reply = mean_reply(global_arrays, _exact_sums(global_arrays, models, weights))
    expected = aggregate_fedavg(global_arrays, models, weights)
    from_sums = aggregate_fedavg(global_arrays, [reply.arrays], [1.0])
    for key in expected:
        np.testing.assert_allclose(from_sums[key], expected[key], rtol=1e-12, atol=1e-12)


def test_elastic_from_the_sums_of_updates_and_sensitivities_is_elastic_over_the_replies() -> None:
    from beyond_averaging.strategies.secure.sums import mean_reply

    global_arrays, models, weights = _clients(1)
    rng = np.random.default_rng(2)
    sensitivities = [
        {k: rng.uniform(0, 3, size=v.shape) for k, v in global_arrays.items()} for _ in models
    ]
    sums = _exact_sums(global_arrays, models, weights, records={"sensitivity": sensitivities})
    reply = mean_reply(global_arrays, sums)
    expected = aggregate_elastic(global_arrays, models, sensitivities, weights, tau=0.5)
    from_sums = aggregate_elastic(
        global_arrays, [reply.arrays], [reply.records["sensitivity"]], [1.0], tau=0.5
    )
    for key in expected:
        np.testing.assert_allclose(from_sums[key], expected[key], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mask", ["hard", "soft"])
def test_fedgma_from_summed_signs_and_weighted_sums_is_fedgma_over_the_replies(mask: str) -> None:
    global_arrays, models, weights = _clients(3, count=7)
    rng = np.random.default_rng(4)
    # Gradients that agree in sign on some coordinates and not on others.
    gradients = [
        {k: rng.normal(loc=0.3, size=v.shape) for k, v in global_arrays.items()} for _ in models
    ]
    if mask == "hard":
        sums = _exact_sums(
            global_arrays,
            models,
            weights,
            records={"gradient": gradients},
            signs={"gradient": gradients},
        )
    else:
        sums = _exact_sums(global_arrays, models, weights, update_signs=True)
    expected = fedgma_step(
        global_arrays,
        models,
        gradients if mask == "hard" else None,
        weights,
        threshold=0.6,
        server_lr=0.7,
        mask=mask,  # type: ignore[arg-type]
    )
    result = fedgma_from_sums(
        global_arrays, sums, len(models), threshold=0.6, server_lr=0.7, mask=mask
    )
    assert result.mask_mean == pytest.approx(expected.mask_mean, abs=1e-12)
    assert 0.0 < result.mask_mean < 1.0  # the mask kept some coordinates, not all
    for key in expected.arrays:
        np.testing.assert_allclose(result.arrays[key], expected.arrays[key], rtol=1e-10, atol=1e-12)
