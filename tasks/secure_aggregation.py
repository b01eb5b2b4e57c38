"""SecAgg+'s protocol math, shared by the ServerApp's driver and the ClientApp's mod.

Secure aggregation (Bonawitz et al., CCS 2017; SecAgg+, Bell et al., CCS 2020) lets the server
learn the sum of the clients' vectors and nothing about any one of them. Each client k

1. **folds its weight in** (:func:`client_vector`): r_k = min(n_k, W) / W, W the server's
   ``max_weight`` (the claim bound, applied by the client), and the vector holds r_k times its
   update (clipped first to ``clip_norm``), r_k times each requested record and metric, and r_k
   itself; sign votes are integers (sign + 1 in {0, 1, 2}). The server divides the sums by
   sum_k r_k: a weighted mean in which no client's example count or metric is sent in the clear;
2. **quantises** (:func:`quantise`): each value clipped to [-R, R] (``clipping_range``), scaled to
   [0, 2^b] (``quantization_bits``) and rounded to the nearest integer, an integer of
   ``modulus_bits`` (64 by default; 32 as Flower's SecAgg+, half the upload), where sums wrap
   modulo 2^m. The levels are the finest the round's cohort fits (:meth:`SecAggOptions.for_cohort`):
   b = m - bit_length(n) for n clients, so that n values of at most 2^b sum below 2^m. Modulo
   2^64 a level is then 2R / 2^b <= 16 / 2^54 (up to 1,023 clients), below float32's resolution
   of the mean even for a client weighted 1 / W: the secure mean is the plain mean to float32
   rounding (:meth:`SecAggOptions.mean_error_bound`). Modulo 2^32 (b <= 28 for 10 clients) it
   is not: the bound is 3e-4 at the default W, coarser than float32 for any model value below
   about 5,000, and one test sample of the README's FedGMA run moved;
3. **masks** (:func:`mask_vector`): adds a self mask PRG(b_k) and, for every neighbour j, +PRG(s_kj)
   when k < j and -PRG(s_kj) otherwise, s_kj the key both derive by ECDH (:func:`shared_seed`).
   The PRG is AES-256 in counter mode keyed by the 32-byte seed (:func:`prg`), a cryptographic
   generator; Flower's ``pseudo_rand_gen`` seeds ``np.random.RandomState`` with 32 bits of it
   (Flower issue 7522), which this module does not use.

Pairwise masks cancel in the sum of all clients. For the clients that dropped after sharing
their keys, the survivors return Shamir shares of the dropped client's mask key (the server
rebuilds the masks it had with each survivor); for every survivor, shares of its self-mask seed
b_k. A client never returns both shares of one node (:func:`check_unmask_request`), so the
server never holds both what unmasks a vector and the vector. Shamir sharing, the ECDH key
derivation (HKDF-SHA256) and the authenticated encryption of the shares (Fernet) are Flower's
own primitives (``flwr.common.secure_aggregation``); key pairs come from ``cryptography``.

The neighbourhood (:func:`neighbours`) is SecAgg+'s ring: the nodes in sorted order, each with
the ``neighbours // 2`` on either side; ``neighbours = 0`` (or at least the cohort less one) is
the complete graph, plain SecAgg. A node's secrets are shared among itself and its neighbours,
and any ``threshold(holders)`` shares rebuild them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

#: The ConfigRecord of every stage message and of every stage reply but the masked vector.
SECURE_RECORD = "secure-aggregation"
#: The ArrayRecord of a collect-stage reply: the masked vector, the reply's only content.
MASKED_RECORD = "secure-masked"
MASKED_KEY = "vector"
STAGE_KEY = "stage"
Stage = Literal["setup", "share-keys", "collect", "unmask"]
STAGES: tuple[Stage, ...] = ("setup", "share-keys", "collect", "unmask")

#: Layout entries (:func:`layout_sizes`): ``kind|record|key``. ``update``: r (theta - w) of
#: tensor ``key`` (clipped as a whole, every tensor of the update together); ``weighted``: r
#: times the tensor ``key`` of the reply's record ``record``; ``update-signs``: r sign(w - theta);
#: ``signs``: sign(record[key]) + 1 as an integer; ``metric``: r times the reply's metric
#: ``key``; ``weight``: r.
EntryKind = Literal["update", "weighted", "update-signs", "signs", "metric", "weight"]
ENTRY_KINDS: tuple[EntryKind, ...] = (
    "update",
    "weighted",
    "update-signs",
    "signs",
    "metric",
    "weight",
)
#: Kinds whose values are integers summed as they are, never quantised.
INTEGER_KINDS = frozenset({"signs"})
WEIGHT_ENTRY = "weight||"

#: Seeds and keys: 32 bytes (AES-256).
SEED_BYTES = 32
CURVE = ec.SECP384R1()

NDArrayDict = dict[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class SecAggOptions:
    """What the server tells every client of a secure round, and how it reads the sums.

    Attributes
    ----------
    clip_norm : float
        Each client scales its update theta - w down to at most this L2 norm before masking
        (as Flower's client-side DP clipping does); 0: no clip.
    max_weight : float
        W: a client's weight is r = min(n, W) / W, so no client counts for more than W examples
        (the claim bound, applied by the client); the weight scales every value it sends.
    clipping_range : float
        R: every weighted value is clipped to [-R, R] before quantisation (Flower's default 8).
    quantization_bits : int
        b: [-R, R] maps onto the integers 0..2^b; 0 (the default): the finest levels each
        round's cohort of n clients fits, m - bit_length(n) (:meth:`for_cohort`; 60 for 10
        clients modulo 2^64). Flower's quantisation range is 2^22.
    modulus_bits : {64, 32}
        m: sums wrap modulo 2^m; a cohort may have at most 2^(m - b) - 1 clients. 64 (the
        default) gives levels finer than float32's resolution of the mean (the secure mean
        is the plain one to float32 rounding); 32, Flower's modulus, halves the upload at a
        measured cost in accuracy (docs/results/secure-aggregation.md).
    neighbours : int
        SecAgg+'s k, the neighbours of each node on the ring; 0: every other node (SecAgg).
    threshold : float
        Share of a node's share holders (itself and its neighbours) needed to rebuild its
        secrets, in [0.5, 1): a node's secrets need floor(threshold x holders) + 1 shares, and
        a round needs that many survivors among each node's holders.
    """

    clip_norm: float = 0.0
    max_weight: float = 1000.0
    clipping_range: float = 8.0
    quantization_bits: int = 0
    modulus_bits: int = 64
    neighbours: int = 0
    threshold: float = 0.5

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip_norm) and self.clip_norm >= 0.0):
            raise ValueError(f"clip_norm = {self.clip_norm}: allowed is a finite value >= 0")
        if not (math.isfinite(self.max_weight) and self.max_weight > 0.0):
            raise ValueError(f"max_weight = {self.max_weight}: allowed is a finite value > 0")
        if not (math.isfinite(self.clipping_range) and self.clipping_range > 0.0):
            raise ValueError(
                f"clipping_range = {self.clipping_range}: allowed is a finite value > 0"
            )
        if self.modulus_bits not in (32, 64):
            raise ValueError(f"modulus_bits = {self.modulus_bits}: allowed is 32 or 64")
        if not 0 <= self.quantization_bits <= self.modulus_bits - 2:
            raise ValueError(
                f"quantization_bits = {self.quantization_bits}: allowed is 1.."
                f"{self.modulus_bits - 2} with modulus_bits = {self.modulus_bits}, or 0 (the "
                "finest the cohort fits)"
            )
        if self.neighbours < 0:
            raise ValueError(f"neighbours = {self.neighbours}: allowed is an integer >= 0")
        if not 0.5 <= self.threshold < 1.0:
            raise ValueError(f"threshold = {self.threshold}: allowed is [0.5, 1)")

    @property
    def dtype(self) -> type[np.unsignedinteger[Any]]:
        """The vector's integer type: sums wrap modulo 2^modulus_bits in it."""
        return np.uint32 if self.modulus_bits == 32 else np.uint64

    @property
    def max_clients(self) -> int:
        """The most vectors whose quantised sum cannot wrap: 2^(m - b) - 1 (each is at most
        2^b, the weight folded in included, so n of them sum to at most 2^m - 2^b)."""
        return int(2 ** (self.modulus_bits - self._bits()) - 1)

    @property
    def quantum(self) -> float:
        """The quantisation step 2R / 2^b: a value is sent within half of it."""
        return float(2.0 * self.clipping_range / 2 ** self._bits())

    def mean_error_bound(self, mean: float = 0.0) -> float:
        """The most a weighted mean sum r x / sum r read from the sums can be off, for a mean
        of size ``mean``: (W q / 2)(1 + |mean|), q the step. Each of the n clients' values and
        weights is within q / 2, and sum r >= n / W when every client claims at least one
        example; 6.9e-14 x (1 + |mean|) for 10 clients at the defaults (W = 10,000, 2^64)."""
        return self.max_weight * self.quantum / 2.0 * (1.0 + abs(mean))

    def for_cohort(self, count: int) -> SecAggOptions:
        """These options for a round of ``count`` clients: with ``quantization_bits`` 0, the
        finest levels whose sum cannot wrap, m - bit_length(count) (at most m - 2).

        Raises
        ------
        ValueError
            When ``count`` quantised vectors could wrap modulo 2^m (:func:`check_cohort`).
        """
        resolved = self
        if not self.quantization_bits:
            bits = min(self.modulus_bits - int(count).bit_length(), self.modulus_bits - 2)
            resolved = replace(self, quantization_bits=max(bits, 1))
        check_cohort(count, resolved)
        return resolved

    def _bits(self) -> int:
        if not self.quantization_bits:
            raise ValueError(
                "quantization_bits = 0 is resolved per round (SecAggOptions.for_cohort): give "
                "the round's options, or quantization_bits >= 1"
            )
        return self.quantization_bits

    def to_config(self) -> dict[str, float | int]:
        """Flat kebab-case entries for the setup stage's ConfigRecord."""
        return {
            "clip-norm": self.clip_norm,
            "max-weight": self.max_weight,
            "clipping-range": self.clipping_range,
            "quantization-bits": self.quantization_bits,
            "modulus-bits": self.modulus_bits,
            "neighbours": self.neighbours,
            "threshold": self.threshold,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SecAggOptions:
        """The options :meth:`to_config` wrote."""
        return cls(
            clip_norm=float(config["clip-norm"]),
            max_weight=float(config["max-weight"]),
            clipping_range=float(config["clipping-range"]),
            quantization_bits=int(config["quantization-bits"]),
            modulus_bits=int(config["modulus-bits"]),
            neighbours=int(config["neighbours"]),
            threshold=float(config["threshold"]),
        )


# --------------------------------------------------------------------------- quantisation
def quantise(values: npt.ArrayLike, options: SecAggOptions) -> npt.NDArray[np.unsignedinteger]:
    """Each value clipped to [-R, R] and mapped to round(x 2^b / 2R) + 2^(b-1), an integer in
    0..2^b of the options' dtype (rounded to nearest, halves up: the same run gives the same
    model). The offset 2^(b-1) is added as an integer, so a small x keeps its own float64
    precision (x + R in float64 would round x to R's spacing, 1.8e-15, coarser than a level
    at b > 53)."""
    bits = options._bits()
    scale = 2**bits / (2.0 * options.clipping_range)
    x = np.clip(
        np.asarray(values, dtype=np.float64), -options.clipping_range, options.clipping_range
    )
    centred = np.floor(x * scale + 0.5).astype(np.int64)  # |x scale| <= 2^61: exact in int64
    levels: npt.NDArray[np.unsignedinteger] = (centred + (1 << (bits - 1))).astype(options.dtype)
    return levels


def dequantise_sum(
    total: npt.NDArray[np.unsignedinteger], count: int, options: SecAggOptions
) -> npt.NDArray[np.float64]:
    """The sum of ``count`` values from the sum of their :func:`quantise` d integers:
    (S - count 2^(b-1)) 2R / 2^b. The offsets come off in integers (modulo 2^m, read as
    signed: the centred sum lies within +-count 2^(b-1) < 2^(m-1)), so the float64 it becomes
    is the sum's own, not S's rounded near count R (which would cost float64's spacing there)."""
    check_cohort(count, options)
    width = np.dtype(options.dtype).itemsize * 8
    offset = options.dtype((count << (options.quantization_bits - 1)) % (1 << width))
    signed = np.int32 if width == 32 else np.int64
    centred = (np.asarray(total, dtype=options.dtype) - offset).view(signed)
    result: npt.NDArray[np.float64] = centred.astype(np.float64) * options.quantum
    return result


def check_cohort(count: int, options: SecAggOptions) -> None:
    """Raise when ``count`` quantised vectors could wrap modulo 2^m."""
    if count > options.max_clients:
        wider = "" if options.modulus_bits == 64 else ", or use modulus-bits = 64"
        raise ValueError(
            f"{count} clients' quantised sums can exceed 2^{options.modulus_bits}: with "
            f"quantization-bits = {options.quantization_bits} at most {options.max_clients} "
            "clients fit; lower quantization-bits to "
            f"{options.modulus_bits - count.bit_length()} or below (0: the finest that "
            f"fits{wider})"
        )


# --------------------------------------------------------------------------- the vector
def layout_sizes(layout: Sequence[str], shapes: Mapping[str, tuple[int, ...]]) -> list[int]:
    """Element count of each layout entry ``kind|record|key``: the tensor ``key``'s size for
    the tensor kinds, 1 for ``metric`` and ``weight``.

    Raises
    ------
    ValueError
        For an unknown kind or a key the model lacks.
    """
    sizes = []
    for entry in layout:
        kind, _, key = parse_entry(entry)
        if kind in ("metric", "weight"):
            sizes.append(1)
            continue
        if key not in shapes:
            raise ValueError(f"layout entry {entry!r} names a tensor the model lacks")
        sizes.append(math.prod(shapes[key]))
    return sizes


def parse_entry(entry: str) -> tuple[EntryKind, str, str]:
    """``kind|record|key`` -> its three parts, the kind checked."""
    parts = entry.split("|")
    if len(parts) != 3 or parts[0] not in ENTRY_KINDS:
        raise ValueError(
            f"layout entry {entry!r}: allowed is 'kind|record|key' with kind one of {ENTRY_KINDS}"
        )
    return parts[0], parts[1], parts[2]


def clip_scale(update: Mapping[str, npt.NDArray[Any]], clip_norm: float) -> float:
    """The factor min(1, C / ||update||) that brings the whole update to L2 norm <= C (1 when
    C is 0, off)."""
    if clip_norm <= 0.0:
        return 1.0
    norm = math.sqrt(sum(float(np.vdot(v, v)) for v in update.values()))
    return 1.0 if norm <= clip_norm else clip_norm / norm


def client_vector(
    layout: Sequence[str],
    global_arrays: Mapping[str, npt.NDArray[Any]],
    trained: Mapping[str, npt.NDArray[Any]],
    records: Mapping[str, Mapping[str, npt.NDArray[Any]]],
    metrics: Mapping[str, float],
    num_examples: float,
    options: SecAggOptions,
) -> npt.NDArray[np.unsignedinteger]:
    """A client's quantised, not yet masked, vector in the layout's order.

    Parameters
    ----------
    layout : sequence of str
        The entries ``kind|record|key`` the server asked for (:data:`ENTRY_KINDS`).
    global_arrays, trained : mapping of arrays
        The model w received and the model theta trained from it.
    records : mapping of str to arrays
        The reply's extra records (``sensitivity``, ``gradient``) by name.
    metrics : mapping of str to float
        The reply's metrics (``train-loss``).
    num_examples : float
        n, this client's weight claim; r = min(n, W) / W is what it counts for.

    Raises
    ------
    ValueError
        For a weight that is not > 0, a layout entry naming a record, tensor or metric the
        reply lacks, or a non-finite value.
    """
    if not (math.isfinite(num_examples) and num_examples > 0):
        raise ValueError(f"the reply's weight {num_examples!r} is not a number > 0")
    weight = min(float(num_examples), options.max_weight) / options.max_weight
    float_keys = {parse_entry(e)[2] for e in layout if parse_entry(e)[0] == "update"}
    update = {
        key: np.asarray(trained[key], dtype=np.float64) - np.asarray(global_arrays[key], np.float64)
        for key in float_keys
    }
    scale = clip_scale(update, options.clip_norm) * weight
    parts: list[npt.NDArray[np.unsignedinteger]] = []
    for entry in layout:
        kind, record, key = parse_entry(entry)
        if kind == "weight":
            parts.append(quantise([weight], options))
        elif kind == "metric":
            if key not in metrics or not math.isfinite(metrics[key]):
                raise ValueError(f"the reply has no finite metric {key!r} the server asked for")
            parts.append(quantise([weight * metrics[key]], options))
        elif kind == "update":
            parts.append(quantise(update[key].ravel() * scale, options))
        elif kind == "update-signs":
            delta = np.asarray(global_arrays[key], np.float64) - np.asarray(
                trained[key], np.float64
            )
            parts.append(quantise(np.sign(delta).ravel() * weight, options))
        else:
            if record not in records or key not in records[record]:
                raise ValueError(f"the reply's record {record!r} has no tensor {key!r}")
            values = np.asarray(records[record][key], dtype=np.float64).ravel()
            if not np.isfinite(values).all():
                raise ValueError(f"the reply's record {record!r} tensor {key!r} is not finite")
            if kind == "signs":
                parts.append((np.sign(values) + 1).astype(options.dtype))
            else:
                parts.append(quantise(values * weight, options))
    vector = np.concatenate(parts) if parts else np.zeros(0, options.dtype)
    return vector


def split_sum(
    total: npt.NDArray[np.unsignedinteger],
    layout: Sequence[str],
    shapes: Mapping[str, tuple[int, ...]],
    count: int,
    options: SecAggOptions,
) -> dict[str, npt.NDArray[np.float64]]:
    """The unmasked sum of ``count`` client vectors, entry by entry, back in real terms.

    Returns
    -------
    dict
        Layout entry -> the sum over the clients, shaped like the tensor (a 0-d array for
        ``metric`` and ``weight``): sum_k r_k x_k for the weighted kinds, sum_k sign for
        ``signs``.
    """
    sizes = layout_sizes(layout, shapes)
    if total.size != sum(sizes):
        raise ValueError(f"the summed vector has {total.size} values, the layout {sum(sizes)}")
    sums: dict[str, npt.NDArray[np.float64]] = {}
    start = 0
    for entry, size in zip(layout, sizes, strict=True):
        kind, _, key = parse_entry(entry)
        block = total[start : start + size]
        start += size
        if kind in INTEGER_KINDS:
            values = block.astype(np.float64) - count
        else:
            values = dequantise_sum(block, count, options)
        shape = () if kind in ("metric", "weight") else shapes[key]
        sums[entry] = values.reshape(shape)
    return sums


# --------------------------------------------------------------------------- masks
def prg(seed: bytes, size: int, dtype: type[np.unsignedinteger[Any]]) -> npt.NDArray[Any]:
    """``size`` pseudo-random integers of ``dtype`` from AES-256-CTR keyed by ``seed`` (32
    bytes): a cryptographic generator, the same stream for the same seed on every machine."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed has {SEED_BYTES} bytes, got {len(seed)}")
    width = np.dtype(dtype).itemsize
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    stream = encryptor.update(bytes(size * width)) + encryptor.finalize()
    return np.frombuffer(stream, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)


def mask_vector(
    vector: npt.NDArray[np.unsignedinteger],
    self_seed: bytes,
    pair_seeds: Mapping[int, bytes],
    node_id: int,
) -> npt.NDArray[np.unsignedinteger]:
    """vector + PRG(b) + sum_j (+-) PRG(s_j), modulo 2^m (the dtype wraps): + for a neighbour
    j > ``node_id``, - for j < it, so each pair's masks cancel in the sum."""
    masked: npt.NDArray[np.unsignedinteger] = vector + prg(
        self_seed, vector.size, vector.dtype.type
    )
    for other, seed in pair_seeds.items():
        if other == node_id:
            raise ValueError(f"node {node_id} cannot mask with itself")
        pad = prg(seed, vector.size, vector.dtype.type)
        masked = masked + pad if other > node_id else masked - pad
    return masked


def unmask_sum(
    masked_sum: npt.NDArray[np.unsignedinteger],
    self_seeds: Mapping[int, bytes],
    dropped_pair_seeds: Mapping[tuple[int, int], bytes],
) -> npt.NDArray[np.unsignedinteger]:
    """The sum of the survivors' vectors from the sum of their masked ones.

    Parameters
    ----------
    masked_sum : array
        sum over the survivors of their masked vectors (modulo 2^m).
    self_seeds : mapping
        Survivor -> its self-mask seed b (rebuilt from shares).
    dropped_pair_seeds : mapping
        (survivor, dropped neighbour) -> their pairwise seed (rebuilt from the dropped node's
        mask key): the survivor's mask with that neighbour, which no partner cancels.
    """
    total = masked_sum.copy()
    kind = total.dtype.type
    for seed in self_seeds.values():
        total = total - prg(seed, total.size, kind)
    for (survivor, dropped), seed in dropped_pair_seeds.items():
        pad = prg(seed, total.size, kind)
        # The survivor added +pad for a larger neighbour id, -pad for a smaller one.
        total = total - pad if dropped > survivor else total + pad
    return total


# --------------------------------------------------------------------------- the graph
def neighbours(nodes: Sequence[int], count: int) -> dict[int, list[int]]:
    """SecAgg+'s ring: the nodes in sorted order, each with ``count // 2`` neighbours on each
    side (``count`` rounded up to even); 0 or at least ``len(nodes) - 1``: every other node."""
    ordered = sorted(set(nodes))
    n = len(ordered)
    if count <= 0 or count >= n - 1:
        return {node: [o for o in ordered if o != node] for node in ordered}
    half = (count + 1) // 2
    graph: dict[int, list[int]] = {}
    for index, node in enumerate(ordered):
        around = {ordered[(index + step) % n] for step in range(-half, half + 1) if step}
        graph[node] = sorted(around - {node})
    return graph


def threshold(holders: int, fraction: float) -> int:
    """Shares that rebuild a secret shared among ``holders``: floor(fraction x holders) + 1
    (a strict majority at 0.5), at least 2 and at most ``holders``."""
    return min(holders, max(2, math.floor(fraction * holders) + 1))


# --------------------------------------------------------------------------- keys and shares
def new_key_pair() -> tuple[bytes, bytes]:
    """A fresh ECDH key pair (private PEM bytes, public PEM bytes) on :data:`CURVE`."""
    private = ec.generate_private_key(CURVE)
    return (
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    )


def shared_key(private_pem: bytes, public_pem: bytes) -> bytes:
    """Flower's ECDH + HKDF-SHA256 key of two parties, url-safe base64 (a Fernet key)."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key

    private = serialization.load_pem_private_key(private_pem, password=None)
    public = serialization.load_pem_public_key(public_pem)
    if not isinstance(private, ec.EllipticCurvePrivateKey) or not isinstance(
        public, ec.EllipticCurvePublicKey
    ):
        raise ValueError("secure aggregation keys must be elliptic-curve keys")
    return generate_shared_key(private, public)


def shared_seed(private_pem: bytes, public_pem: bytes) -> bytes:
    """The 32-byte mask seed two parties derive from their mask keys (:func:`shared_key`)."""
    import base64

    return base64.urlsafe_b64decode(shared_key(private_pem, public_pem))


def new_seed() -> bytes:
    """A self-mask seed b: 32 bytes from the operating system's generator."""
    return os.urandom(SEED_BYTES)


def split_secret(secret: bytes, needed: int, holders: int) -> list[bytes]:
    """Flower's Shamir sharing: ``holders`` shares, any ``needed`` of which rebuild ``secret``."""
    from flwr.common.secure_aggregation.crypto.shamir import create_shares

    return create_shares(secret, needed, holders)


def join_secret(shares: Sequence[bytes]) -> bytes:
    """The secret from at least the needed number of :func:`split_secret` shares."""
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares

    return combine_shares(list(shares))


def seal(key: bytes, src: int, dst: int, seed_share: bytes, key_share: bytes) -> bytes:
    """The pair of shares ``src`` gives ``dst``, encrypted with their :func:`shared_key` so that
    the server, which relays it, cannot read it (Flower's plaintext layout and Fernet)."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat

    return encrypt(key, share_keys_plaintext_concat(src, dst, seed_share, key_share))


def unseal(key: bytes, ciphertext: bytes, src: int, dst: int) -> tuple[bytes, bytes]:
    """(seed share, key share) of :func:`seal`, checked to be from ``src`` for ``dst``."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate

    sent_src, sent_dst, seed_share, key_share = share_keys_plaintext_separate(
        decrypt(key, ciphertext)
    )
    if (sent_src, sent_dst) != (src, dst):
        raise ValueError(
            f"a share relayed as from node {src} to node {dst} was sealed by node {sent_src} "
            f"for node {sent_dst}: the server mixed up the shares"
        )
    return seed_share, key_share


def check_unmask_request(alive: Sequence[int], dropped: Sequence[int]) -> None:
    """Refuse to reveal both shares of a node: a node the server calls both alive (its self-mask
    seed) and dropped (its mask key) would have its vector unmasked alone."""
    both = sorted(set(alive) & set(dropped))
    if both:
        raise ValueError(
            f"the server asks for both the self-mask share and the mask-key share of node(s) "
            f"{both[:5]}: that would unmask their vectors alone; no share is sent"
        )
