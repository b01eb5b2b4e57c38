"""FedLAW (Li et al., ICML 2023): aggregation weights learned on a small server-side proxy set.

The new global model is a re-weighted, possibly shrunk, sum of the full client models::

    w_new = gamma * sum_k lambda_k * theta_k,    gamma = exp(g) > 0,    lambda = softmax(a)

re-initialised every round at g = 0 and a = log(p_k) (p_k = n_k / sum_j n_j), which is exactly
FedAvg. g and a are fitted by Adam (betas 0.5, 0.999; step decay of the learning rate every
``lr_step`` epochs) to the cross-entropy of the weighted model on the proxy set (paper Eq. 8,
Algorithm 1, appendix C's exponential base function). gamma < 1 is "global weight shrinking";
lambda re-weights the clients ("client coherence"). Variants: ``learn="shrink"`` (adaptive GWS,
lambda = p), ``learn="clients"`` (attentive LAW, gamma = 1), ``learn="both"`` (FedLAW), and
``swa=True`` (FedLAW (SWA)).

**Server epochs.** The paper trains 100 server epochs (appendix D.6) and the Table 3 numbers were
obtained with that setting; the authors' code defaults to 20. We default to 100: the paper's
appendix B.3 reports that gamma converges in about 30 server epochs and lambda in about 80, so 20
epochs would stop lambda well before convergence. With the paper's 100-sample proxy set an epoch
is a single batch, so 100 epochs cost 100 forward/backward passes per round.

**BatchNorm.** The weighted vector gamma * sum_k lambda_k theta_k covers every *parameter* of the
model, BatchNorm's affine weight and bias included (so gamma shrinks them too), as in the authors'
code. While g and a are learned, every normalisation layer normalises with the statistics of the
current proxy batch (training-mode BatchNorm, as the authors' code runs it), and every other layer
runs in evaluation mode: dropout is off, so the loss is a deterministic function of g and a. The
authors put the whole model in train mode (dropout active); none of the zoo's models
(tasks/models.py: logreg, mlp, lenet5, cnn) has dropout, so for them both choices are the same
computation; they differ only for a user's model with dropout or another train-mode-dependent
layer. The global model's running statistics depend on ``bn`` (``fedlaw-bn``):

- ``"reestimate"`` (default): ``running_mean`` / ``running_var`` are re-estimated from forward
  passes of the *final* weighted model over the proxy set (a cumulative average over its
  batches, i.e. the exact proxy statistics when the proxy set is one batch); integer counters
  (``num_batches_tracked``) and any other buffer are the lambda-weighted mean of the clients'
  values, unscaled (counters rounded back to integers). The default, because these statistics
  describe the model that is sent: gamma rescales every layer's pre-activations, so neither
  the clients' statistics (of their own, unscaled models) nor a moving average over the
  intermediate weights of the learning describe it.
- ``"authors"``: the server model keeps its own buffers, initialised from the initial global
  model, updated in place (momentum 0.1, counter + 1) by every forward pass of the weight
  learning, i.e. by the intermediate weighted models, and carried across rounds; the global
  model carries them. In the authors' code clients receive only the parameters and keep their
  own running statistics; a Flower ClientApp keeps no model between rounds, so here they receive
  the server's (which their training then updates). The statistics never enter the aggregation
  or the server's test; they only matter to a client-side evaluation. A round that falls back to
  FedAvg's weights (non-finite loss) keeps the statistics from before it.

**SWA variant.** Two stages, as in the paper's section 6.1 and the authors' code (server_funct.py,
``whether_swa == 'swa'``): first lambda alone (gamma = 1) for ``epochs // 2`` epochs, then gamma
alone, with lambda fixed at the softmax of the averaged logits, for ``epochs // 2`` epochs (Adam,
the step decay above; an odd epoch count leaves one epoch out, as there). The lambda stage follows
the authors' schedule exactly (:func:`swa_learning_rates`): Adam starts at ``lr`` under cosine
annealing with a period of 100 epochs (a constant of their code), stepped after epochs 0-5; from
the end of epoch 6 on, the logits a are averaged at the end of every epoch (the running mean of
stochastic weight averaging, its first value the logits after epoch 6) and the rate is annealed
(cosine, over 10 epochs) up to 0.05, an absolute value there (10x the default base rate 0.005, 5x
the authors' CIFAR-10 rate 0.01), and held at 0.05. A lambda stage of 6 epochs or fewer averages
nothing and keeps FedAvg's lambda, as their ``AveragedModel`` does. ``learn="clients"`` with SWA
(no gamma stage, not in the authors' code) runs the lambda stage for all ``epochs``. The paper
describes the stages in the other order and notes that both orders work; this order is the
authors' code's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any, ClassVar, Literal, Unpack, get_args

import numpy as np
import numpy.typing as npt
import torch
from flwr.common import log
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from beyond_averaging.strategies.defences.proxy_data import (
    ProxyBatch,
    ProxySetError,
    count_shared_samples,
    make_proxy_batches,
    proxy_arrays,
    to_labeled_data,
    validate_proxy_set,
)
from beyond_averaging.strategies.defences.robust import (
    COORDINATE_WISE,
    GENERIC_METHODS,
    aggregate_robust,
)
from beyond_averaging.strategies.defences.root_set import RootSet, root_set_use
from beyond_averaging.strategies.replies.metrics import MetricsAggregationFn
from beyond_averaging.strategies.replies.reporting import RoundLogFields
from beyond_averaging.strategies.replies.wire import ClientReply
from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.protocol import (
    ARRAYS_RECORD,
    CONFIG_RECORD,
    NUM_EXAMPLES_KEY,
)

from .aggregate import (
    NDArrayDict,
    as_numpy,
    normalise_weights,
    scaled_mean,
    weighted_mean,
)
from .defended import DefenceOptions, DefendedStrategy
from .law_weights import (
    LEARN_CHOICES,
    LearnWhat,
    batch_statistics_mode,
    learn_aggregation_weights,
    norm_modules,
    weights_are_usable,
)

#: BatchNorm running statistics of the global model (``fedlaw-bn``; see the module docstring).
BatchNormMode = Literal["reestimate", "authors"]
BN_CHOICES: tuple[str, ...] = get_args(BatchNormMode)


# ----------------------------------------------------------------------------- aggregation
def _qualified(module_name: str, tensor_name: str) -> str:
    return f"{module_name}.{tensor_name}" if module_name else tensor_name


def proxy_running_statistics(
    model: nn.Module,
    state: Mapping[str, npt.NDArray[Any]],
    proxy_batches: Sequence[ProxyBatch],
    device: torch.device | None = None,
) -> NDArrayDict:
    """BatchNorm running mean/var of the model ``state`` estimated on the proxy batches.

    A copy of ``model`` loads ``state``, resets its running statistics and, with normalisation
    layers in training mode and a cumulative average (``momentum = None``), forwards every proxy
    batch once. Returns only the ``running_mean`` / ``running_var`` entries (empty without
    BatchNorm); ``model`` is not modified.
    """
    tracked = [(name, m) for name, m in norm_modules(model) if m.track_running_stats]
    if not tracked:
        return {}
    target = device if device is not None else next(model.parameters()).device
    scratch = copy.deepcopy(model).to(target)
    scratch.load_state_dict(
        {key: torch.from_numpy(np.array(value)) for key, value in state.items()}
    )
    scratch_modules = dict(scratch.named_modules())
    for name, _ in tracked:
        module = scratch_modules[name]
        assert isinstance(module, _NormBase)
        module.reset_running_stats()
        module.momentum = None  # cumulative average over the proxy batches
    with batch_statistics_mode(scratch), torch.no_grad():
        for features, _ in proxy_batches:
            scratch(features.to(target))
    statistics: NDArrayDict = {}
    for name, _ in tracked:
        module = scratch_modules[name]
        for stat in ("running_mean", "running_var"):
            value = getattr(module, stat)
            key = _qualified(name, stat)
            statistics[key] = value.detach().cpu().numpy().astype(state[key].dtype)
    return statistics


def aggregate_fedlaw(
    model: nn.Module,
    client_params: Sequence[Mapping[str, Any]],
    gamma: float,
    lambdas: Sequence[float],
    proxy_batches: Sequence[ProxyBatch],
    *,
    device: torch.device | None = None,
    server_buffers: Mapping[str, npt.NDArray[Any]] | None = None,
    scales: Sequence[float] | npt.NDArray[Any] | None = None,
    global_params: Mapping[str, Any] | None = None,
) -> NDArrayDict:
    """The FedLAW global model: ``gamma * sum_k lambda_k theta_k`` over the full client models.

    With ``scales`` (and ``global_params`` w) the parameters are gamma * sum_k lambda_k
    theta'_k, theta'_k = w + s_k (theta_k - w) (see :func:`learn_aggregation_weights`).

    Parameters (BatchNorm's affine ones included) are the gamma-scaled lambda-weighted sum.
    Buffers: with ``server_buffers`` (``fedlaw-bn = "authors"``) every buffer is the server's
    own value; otherwise BatchNorm running statistics are re-estimated on the proxy set for the
    final model (see :func:`proxy_running_statistics`) and every other buffer (counters) is the
    lambda-weighted mean, unscaled. With ``gamma = 1`` and ``lambdas = p`` the parameters equal
    FedAvg's bit for bit.

    Returns
    -------
    dict of np.ndarray
        Keyed and ordered like ``model.state_dict()``, in each tensor's dtype.
    """
    weights = np.asarray(lambdas, dtype=np.float64)
    names = list(model.state_dict())
    parameter_names = [name for name, _ in model.named_parameters()]
    buffer_names = [name for name, _ in model.named_buffers()]
    if scales is not None and bool(np.any(np.asarray(scales) != 1.0)):
        if global_params is None:
            raise ValueError("scales need global_params (w), the point the updates are scaled to")
        state = scaled_mean(
            global_params, client_params, gamma * weights, scales, keys=parameter_names
        )
    else:
        state = weighted_mean(client_params, gamma * weights, keys=parameter_names)
    if server_buffers is not None:
        state.update({name: np.asarray(server_buffers[name]) for name in buffer_names})
    else:
        state.update(weighted_mean(client_params, weights, keys=buffer_names))
        state.update(proxy_running_statistics(model, state, proxy_batches, device))
    return {name: state[name] for name in names}


# ----------------------------------------------------------------------------- Flower strategy
def _output_classes(model: nn.Module, sample: npt.NDArray[Any], device: torch.device) -> int:
    """Classes of the model's output, from one forward pass of one proxy sample in eval mode."""
    modes = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            output = model(torch.from_numpy(np.ascontiguousarray(sample)).to(device))
    except RuntimeError as error:
        raise ProxySetError(
            f"the model cannot take a proxy_set= sample of shape {tuple(sample.shape[1:])}: {error}"
        ) from None
    finally:
        for module, training in modes:
            module.training = training
    if output.dim() != 2:
        raise ProxySetError(
            f"FedLAW needs a classifier returning (batch, classes) logits; on a proxy_set= "
            f"sample the model returned shape {tuple(output.shape)}"
        )
    return int(output.shape[1])


def _warn_if_shared(
    proxy_features: npt.NDArray[Any], test_set: Any, transform: Callable[[Any], Any] | None
) -> None:
    """Log a warning when proxy samples also appear in the test set (same input bytes)."""
    hugging_face = hasattr(test_set, "with_transform")
    test_features, _ = proxy_arrays(
        test_set, transform=transform if hugging_face else None, argument="test_set"
    )
    shared = count_shared_samples(proxy_features, test_features)
    if shared:
        log(
            WARNING,
            "FedLAW's proxy set (proxy_set=) shares %d of its %d samples with the test set "
            "(test_set=): the weights are then learned on test data and test accuracy is "
            "optimistic. Draw the proxy set from data held out of the test set",
            shared,
            len(proxy_features),
        )


class FedLAW(DefendedStrategy):
    """FedLAW on the project's strategy base: learns gamma and lambda on a server proxy set.

    Robust forms: see :meth:`aggregate`; ``robust_aggregation = "fltrust"`` is FedLAW's alone
    (it needs the proxy set).

    Needs nothing from clients beyond ``arrays`` and ``num-examples``, so any stock Flower
    ClientApp works with it. Each round writes ``fedlaw-gamma``, ``fedlaw-lambdas`` (in reply
    order), ``fedlaw-data-weights`` (FedAvg's p, same order), ``fedlaw-node-ids`` (the replies'
    node ids, same order) and ``fedlaw-fallback`` (1 when the learned weights were non-finite and
    FedAvg's were used instead, with a logged warning) into the strategy's
    ``aggregation_metrics``.

    Parameters
    ----------
    model : nn.Module
        The global model's architecture; the strategy keeps its own copy on ``device``.
    proxy_set : LabeledData, (inputs, labels), Dataset, DataLoader or Hugging Face Dataset
        Small class-balanced server data, in any form :mod:`strategies.defences.proxy_data` reads
        (for
        all but ``LabeledData`` the class count is the model's output width); validated here,
        before round 1.
    device : torch.device, optional
        Where the weight learning runs; default CUDA when present, else CPU.
    learn : {"both", "shrink", "clients"}
        FedLAW, adaptive GWS (gamma only) or attentive LAW (lambda only).
    epochs : int
        Server epochs per round (paper: 100; see the module docstring).
    lr : float
        Adam's learning rate (authors' code: 0.005, 0.01 for CIFAR-10).
    batch_size : int
        Proxy batch size; the proxy set must hold at least one batch. 100 = the paper's proxy
        set of 10 samples x 10 classes in one batch, which is what the authors' loader (batch
        size 128) made of it.
    lr_step, lr_gamma : int, float
        Step decay: x ``lr_gamma`` every ``lr_step`` epochs (authors' code: 20, 0.5).
    swa : bool
        FedLAW (SWA), with the authors' learning-rate schedule (see the module docstring).
    betas : tuple of float
        Adam's betas (paper: 0.5, 0.999).
    proxy_source : str
        Where the proxy set came from, for error messages.
    proxy_transform : callable, optional
        For a Hugging Face ``proxy_set`` (and ``test_set``): applied as
        ``dataset.with_transform(proxy_transform)``, e.g. the quickstart's ``apply_transforms``.
    test_set : optional
        The data the results are tested on, in any form ``proxy_set`` takes: a warning is logged
        when proxy samples also appear in it (compared by a hash of each input).
    bn : {"reestimate", "authors"}
        The global model's BatchNorm running statistics: re-estimated on the proxy set for the
        final model (default), or the server's own, updated by the weight learning's forward
        passes and carried across rounds (the authors' code). See the module docstring.

    Flower's ``FedAvg`` arguments come first, positionally or by name, in its order
    (:class:`~strategies.arguments.FlowerOptions`); the arguments above and this project's extras
    (:class:`~strategies.arguments.ProjectOptions`) are keyword-only.

    Raises
    ------
    ProxySetError
        The proxy set is empty, lacks a class or is smaller than one batch.
    """

    #: ``fltrust``'s root set is FedLAW's proxy set, and its trusted updates keep FLTrust's own
    #: length, the server update's (docs/reliability.md, "Adaptive attacks").
    builds_root_set: ClassVar[bool] = True
    trusted_length: ClassVar[Literal["median", "root"]] = "root"
    #: No ``proxy-weights``: FedLAW learns its client weights on the proxy set itself.
    robust_methods: ClassVar[tuple[str, ...]] = (*GENERIC_METHODS, "fltrust")
    #: gamma, the client weights (in reply order) and FedAvg's data weights, and whether the
    #: round fell back to FedAvg's weights.
    round_log_fields: ClassVar[RoundLogFields] = {
        "fedlaw-gamma": ("gamma", ".4f"),
        "fedlaw-lambdas": ("lambda", ".3f"),
        "fedlaw-data-weights": ("data weights", ".3f"),
        "fedlaw-fallback": ("unusable weights: FedAvg's used", "flag"),
    }

    def __init__(
        self,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = NUM_EXAMPLES_KEY,
        arrayrecord_key: str = ARRAYS_RECORD,
        configrecord_key: str = CONFIG_RECORD,
        train_metrics_aggr_fn: MetricsAggregationFn | None = None,
        evaluate_metrics_aggr_fn: MetricsAggregationFn | None = None,
        *,
        model: nn.Module,
        proxy_set: Any,
        device: torch.device | None = None,
        learn: LearnWhat = "both",
        epochs: int = 100,
        lr: float = 0.005,
        batch_size: int = 100,
        lr_step: int = 20,
        lr_gamma: float = 0.5,
        swa: bool = False,
        betas: tuple[float, float] = (0.5, 0.999),
        proxy_source: str = "proxy_set=",
        bn: BatchNormMode = "reestimate",
        proxy_transform: Callable[[Any], Any] | None = None,
        test_set: Any = None,
        **options: Unpack[DefenceOptions],
    ) -> None:
        super().__init__(
            fraction_train,
            fraction_evaluate,
            min_train_nodes,
            min_evaluate_nodes,
            min_available_nodes,
            weighted_by_key,
            arrayrecord_key,
            configrecord_key,
            train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn,
            **options,
        )
        if learn not in LEARN_CHOICES:
            raise ValueError(f"learn = {learn!r} is unknown: use one of {LEARN_CHOICES}")
        if bn not in BN_CHOICES:
            raise ValueError(f"bn = {bn!r} (fedlaw-bn) is unknown: use one of {BN_CHOICES}")
        if swa and learn == "shrink":
            raise ValueError(
                "swa = True (run option fedlaw-swa) averages the client weights, which "
                "learn = 'shrink' (fedlaw-learn) keeps fixed: use learn = 'both' or 'clients', "
                "or swa = False"
            )
        if epochs < 0 or lr < 0.0 or batch_size < 1 or lr_step < 1 or not 0.0 < lr_gamma <= 1.0:
            raise ValueError(
                f"epochs = {epochs}, lr = {lr}, batch_size = {batch_size}, lr_step = {lr_step}, "
                f"lr_gamma = {lr_gamma}: allowed are epochs >= 0, lr >= 0, batch_size >= 1, "
                "lr_step >= 1, 0 < lr_gamma <= 1"
            )
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = copy.deepcopy(model).to(self.device)
        if isinstance(proxy_set, LabeledData) and proxy_transform is None:
            output_classes = proxy_set.num_classes
        else:  # a Dataset, DataLoader, (x, y) pair or Hugging Face dataset (defences.proxy_data)
            features, labels = proxy_arrays(proxy_set, transform=proxy_transform)
            output_classes = _output_classes(self.model, features[:1], self.device)
            proxy_set = to_labeled_data((features, labels), output_classes)
        validate_proxy_set(
            proxy_set.features, proxy_set.labels, output_classes, batch_size, source=proxy_source
        )
        if test_set is not None:
            _warn_if_shared(proxy_set.features, test_set, proxy_transform)
        self.proxy_size = len(proxy_set)
        self.proxy_batches = make_proxy_batches(
            proxy_set, batch_size, seed=self.seed, device=self.device
        )
        smallest = min(len(labels) for _, labels in self.proxy_batches)
        if norm_modules(self.model) and smallest < 2:
            raise ProxySetError(
                f"the model has BatchNorm, which needs at least 2 samples per proxy batch, but "
                f"batch_size = {batch_size} (fedlaw-batch-size) gives batches of {smallest}: set "
                "batch_size >= 2"
            )
        self.learn: LearnWhat = learn
        self.epochs, self.lr, self.batch_size = epochs, lr, batch_size
        self.lr_step, self.lr_gamma, self.swa, self.betas = lr_step, lr_gamma, swa, betas
        self.bn: BatchNormMode = bn
        # fedlaw-bn = "authors": the server model's own buffers, carried across rounds.
        self._server_buffers: dict[str, torch.Tensor] | None = None
        self._metrics: dict[str, float | int | list[float]] = {}
        if root_set_use(self.robust_aggregation, self.trigger_unlearning is not None):
            # The proxy set, in its batches' order; a model of its own, which unlearning overwrites.
            self.root_set = RootSet(
                copy.deepcopy(self.model),
                torch.cat([features for features, _ in self.proxy_batches]),
                torch.cat([labels for _, labels in self.proxy_batches]),
            )

    def privacy_noise_gap(self) -> str | None:
        """The weights and gamma are learned from the replies (see :mod:`strategies.privacy`)."""
        gaps = []
        if self.learn != "shrink":
            gaps.append(
                "the clients' weights are learned from the clipped client models themselves, "
                "so one client's model can take most of the weight (a move of up to about "
                "clipping_norm, not clipping_norm / num_sampled_clients)"
            )
        if self.learn != "clients":
            gaps.append(
                "the shrink factor gamma, learned from the client models too, scales the whole "
                "model, so a change in gamma moves it by that change times ||w||, which clipping "
                "does not bound"
            )
        return f"FedLAW (learn = {self.learn!r}): " + "; ".join(gaps)

    def summary(self) -> None:
        """Log the strategy's configuration."""
        super().summary()
        log(
            INFO,
            "\t│\t└── FedLAW: learn %s, %d server epochs, Adam lr %s betas %s, x%s every %d "
            "epochs, SWA %s, BatchNorm statistics %s, proxy set %d samples in %d batch(es) on %s",
            self.learn,
            self.epochs,
            self.lr,
            self.betas,
            self.lr_gamma,
            self.lr_step,
            self.swa,
            self.bn,
            self.proxy_size,
            len(self.proxy_batches),
            self.device,
        )

    def aggregate_rule(
        self, server_round: int, global_arrays: NDArrayDict, replies: Sequence[ClientReply]
    ) -> NDArrayDict:
        """Learn gamma and lambda on the proxy set, then build gamma * sum_k lambda_k theta_k.

        The clients' models are the clipped ones, w + s_k (theta_k - w). Robust forms
        (``robust_aggregation``), each a choice of what FedLAW learns its weights over:

        - "krum" / "multi-krum": the replies Krum keeps (the base left only those);
        - "trimmed-mean" / "median": one model, the coordinate-wise robust mean of the (clipped)
          clients; lambda over a single model is 1, so FedLAW learns gamma for it (its global
          weight shrinking): a lambda over the clients would hand back the say the robust mean
          took from each of them;
        - "fltrust": FLTrust's trust scores against the server's own update on the proxy set
          (:class:`~strategies.defended.DefendedStrategy`): replies of trust 0 are left out, the
          others rescaled to the server update's length and weighted by their trust, FLTrust's
          aggregate, from which FedLAW learns gamma and lambda;
        - "flame": the replies FLAME's clustering kept, clipped at the median norm; noise is
          added to the model FedLAW builds.
        """
        client_params = [reply.arrays for reply in replies]
        counts = [reply.num_examples for reply in replies]
        scales = [reply.update_scale for reply in replies]
        node_ids: list[float] = [reply.node_id for reply in replies]  # ints, typed for metrics
        robust = self.robust_aggregation
        if robust in COORDINATE_WISE:
            robust_model = aggregate_robust(
                global_arrays, client_params, robust, self.trim_fraction, None, scales
            )
            client_params, counts, scales, node_ids = [robust_model], [1.0], [1.0], [-1]
        data_weights = normalise_weights(counts).tolist()
        running = self._running_buffers(global_arrays)
        gamma, lambdas = learn_aggregation_weights(
            self.model,
            client_params,
            counts,
            self.proxy_batches,
            epochs=self.epochs,
            lr=self.lr,
            learn=self.learn,
            swa=self.swa,
            betas=self.betas,
            lr_step=self.lr_step,
            lr_gamma=self.lr_gamma,
            device=self.device,
            running_buffers=running,
            scales=scales,
            global_params=global_arrays,
        )
        fallback = not weights_are_usable(gamma, lambdas)
        if fallback:
            log(
                WARNING,
                "round %d: FedLAW learned unusable weights (gamma = %s, lambdas = %s): keeping "
                "FedAvg's weights (gamma = 1, lambda = data sizes) for this round. If it "
                "recurs, lower lr (fedlaw-lr) or check the proxy set",
                server_round,
                gamma,
                lambdas,
            )
            gamma, lambdas = 1.0, data_weights
        self._metrics = {
            "fedlaw-gamma": gamma,
            "fedlaw-lambdas": [float(value) for value in lambdas],
            "fedlaw-data-weights": data_weights,
            "fedlaw-fallback": int(fallback),
            # One list, aligned with the lambdas, not a key per node: node ids change every run
            # (-1: the robust mean of the replies).
            "fedlaw-node-ids": node_ids,
        }
        server_buffers = None
        if running is not None:
            # A fallback round keeps the statistics from before its (non-finite) forward passes.
            if not fallback:
                self._server_buffers = running
            assert self._server_buffers is not None
            server_buffers = {
                name: value.detach().cpu().numpy() for name, value in self._server_buffers.items()
            }
        return aggregate_fedlaw(
            self.model,
            client_params,
            gamma,
            lambdas,
            self.proxy_batches,
            device=self.device,
            server_buffers=server_buffers,
            scales=scales,
            global_params=global_arrays,
        )

    def _running_buffers(self, global_arrays: NDArrayDict) -> dict[str, torch.Tensor] | None:
        """fedlaw-bn = "authors": a working copy of the server's buffers (first round: the
        global model's, i.e. the initial model's); None in the default mode."""
        if self.bn != "authors":
            return None
        if self._server_buffers is None:
            self._server_buffers = {
                name: torch.from_numpy(np.array(as_numpy(global_arrays[name]))).to(self.device)
                for name, _ in self.model.named_buffers()
            }
        return {name: value.clone() for name, value in self._server_buffers.items()}

    def state_dict(self) -> dict[str, Any]:
        """fedlaw-bn = "authors": the server's own buffers, carried across rounds."""
        if self._server_buffers is None:
            return self._carried_state()
        return {
            "server-buffers": {
                name: value.detach().cpu().numpy() for name, value in self._server_buffers.items()
            },
            **self._carried_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (the server's buffers, if any)."""
        state = self._load_carried_state(state)
        unknown = sorted(set(state) - {"server-buffers"})
        if unknown:
            raise ValueError(f"FedLAW's checkpoint state holds unknown entries {unknown}")
        buffers = state.get("server-buffers")
        self._server_buffers = (
            None
            if buffers is None
            else {
                name: torch.from_numpy(np.array(value)).to(self.device)
                for name, value in buffers.items()
            }
        )

    def round_metrics(self) -> dict[str, float | int | list[float]]:
        """gamma, the lambdas with their node ids, FedAvg's weights and the fallback flag (and
        the defences' figures)."""
        return {**super().round_metrics(), **self._metrics}
