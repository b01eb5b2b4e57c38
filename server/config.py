"""The run configuration: one validated model, the single source of every default.

Flower hands the ServerApp a flat ``run_config`` (``[tool.flwr.app.config]`` in ``pyproject.toml``
plus ``--run-config`` overrides). :func:`parse_run_config` validates all of it before round 1 and
turns every problem into one :class:`ConfigError` that names the key, the value and what is allowed.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class ConfigError(ValueError):
    """The run configuration is invalid; the message names each bad key, its value and the fix.

    ``problems``: one line per bad key (or relation between keys), for a caller that reports
    them in its own words (``ba-run`` on one line).
    """

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems) or (message,)


DatasetChoice = Literal[
    "digits",
    "fashion-mnist",
    "mnist",
    "synthetic",
    # tasks/colored.py: FedGMA's out-of-distribution benchmark (color flips per client).
    "colored-digits",
    "colored-digits-binary",
    "colored-mnist",
    "colored-mnist-binary",
]
PartitionChoice = Literal["iid", "dirichlet", "classes"]
ModelChoice = Literal["logreg", "mlp", "lenet5", "cnn"]
#: The models whose first layer is a convolution (no weight belongs to one input position).
CONVOLUTIONAL = ("lenet5", "cnn")
DeviceChoice = Literal["auto", "cpu", "cuda"]
ClientBackendChoice = Literal["clientapp", "vectorized"]
StrategyChoice = Literal["fedavg", "elastic", "fedlaw", "fedgma"]
ServerOptimizerChoice = Literal["sgd", "momentum", "adam"]
#: ``server-lr = "auto"``: each server optimizer's usual step. sgd 1.0 is plain averaging and
#: FedAvgM's step in Hsu et al.; adam 0.1 is Flower's FedAdam ``eta`` (Adam's steps are normalised
#: per coordinate, so 1.0 moves every weight by about 1.0 a round: a digits run stayed at chance).
SERVER_LR_DEFAULTS: dict[str, float] = {"sgd": 1.0, "momentum": 1.0, "adam": 0.1}


#: ``defence-profile``: the run options each name sets, the combinations the backdoor tables of
#: docs/reliability.md ("Defence profiles") measured for that kind of federation. The library's
#: :func:`strategies.defences.profiles.defence_profile` gives the same as strategy keywords (a
#: test keeps the two identical).
DEFENCE_PROFILES: dict[str, dict[str, Any]] = {
    "none": {},
    "iid": {"robust-aggregation": "fltrust", "backdoor-defence": "trigger-unlearning"},
    "label-skew": {
        "backdoor-defence": "trigger-unlearning",
        "max-claim-factor": 1.0,
        "unlearning-epochs": 6,
        "unlearning-additive": 1.0,
        "unlearning-dormant-inputs": True,
        "unlearning-memory": 1,
        # With the memory about 40 triggers share the stamped part of each unlearning step: at
        # 0.2 the additive pattern survived on FedGMA and FedLAW (docs/reliability.md, "A
        # larger share of stamped inputs").
        "unlearning-patched-share": 0.4,
        # FedLAW's only (set for strategy = "fedlaw"): its learned shrink factor, above 1 in
        # every round of these runs, scaled up what the unlearning left of a backdoor
        # (docs/reliability.md, "A defence aimed at why they pass").
        "fedlaw-learn": "clients",
        # Elastic's only (strategy = "elastic"): zeta up to 1 + tau scaled up by half the
        # update of the weights its clients are least sensitive to, where a backdoor lives
        # (docs/reliability.md, "Remembering what was found").
        "elastic-tau": 0.0,
    },
}


class RunConfig(BaseModel):
    """Every option of a run, with its default and its allowed range.

    Field names are the run-config keys with ``-`` written as ``_``; ``pyproject.toml`` repeats the
    defaults because Flower requires them there, and a test keeps the two identical.
    """

    model_config = ConfigDict(
        alias_generator=_kebab, populate_by_name=True, extra="forbid", frozen=True, strict=True
    )

    # --- run ---------------------------------------------------------------------------------
    run_name: str = Field("", description="folder under output-dir; empty: <strategy>-<time>")
    seed: int = Field(0, ge=0, description="seeds data partitioning, model init and sampling")
    num_server_rounds: int = Field(15, ge=1, le=100_000)
    num_clients: int = Field(
        10, ge=1, le=1_000_000, description="partitions = simulated SuperNodes (synthetic: devices)"
    )
    fraction_train: float = Field(1.0, gt=0.0, le=1.0, description="share of nodes sampled")
    fraction_evaluate: float = Field(0.0, ge=0.0, le=1.0, description="federated evaluation")
    min_train_replies: int = Field(2, ge=1, description="valid replies needed to aggregate")
    output_dir: str = Field("runs", min_length=1)
    round_timeout: float = Field(
        600.0, gt=0.0, description="seconds a round waits for replies; late ones are dropped"
    )
    max_idle_rounds: int = Field(
        5, ge=1, description="the run fails after this many rounds in a row without aggregation"
    )
    resume_from: str = Field("", description="run folder to continue from its checkpoint")
    pack_model: bool = Field(
        True, description="send the model as one array per message (server/packed_grid.py)"
    )
    # --- data --------------------------------------------------------------------------------
    dataset: DatasetChoice = "digits"
    data_dir: str = Field("", description="IDX folder; empty: the dataset's default location")
    partition: PartitionChoice = "dirichlet"
    dirichlet_alpha: float = Field(0.5, gt=0.0)
    classes_per_client: int = Field(2, ge=1)
    proxy_per_class: int = Field(10, ge=0, description="server proxy set, samples per class")
    test_size: int = Field(
        0, ge=0, description="server test set: a seeded subset of this many samples; 0 = all"
    )
    client_holdout: float = Field(
        0.0, ge=0.0, lt=1.0, description="share of each partition held out, not trained on"
    )
    synthetic_alpha: float = Field(1.0, ge=0.0)
    synthetic_beta: float = Field(1.0, ge=0.0)
    # --- model and local training ------------------------------------------------------------
    model: ModelChoice = "mlp"
    device: DeviceChoice = "auto"
    client_backend: ClientBackendChoice = Field(
        "clientapp",
        description="in-process runtime: one ClientApp call per node, or the cohort vectorized",
    )
    vectorized_clients_per_pass: int = Field(
        0, ge=0, description="vectorized backend: clients trained at once; 0 = the whole cohort"
    )
    local_epochs: int = Field(2, ge=1)
    batch_size: int = Field(32, ge=1)
    learning_rate: float = Field(0.05, gt=0.0)
    lr_decay: float = Field(0.99, gt=0.0, le=1.0, description="client lr x this per round")
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    weight_decay: float = Field(5e-4, ge=0.0)
    proximal_mu: float = Field(0.0, ge=0.0, description="FedProx proximal term on clients")
    # --- server update (FedAvg and Elastic feed a server optimizer) ---------------------------
    strategy: StrategyChoice = "fedavg"
    server_lr: Annotated[float, Field(ge=0.0)] | Literal["auto"] = Field(
        "auto",
        description="server step; auto: the optimizer's own (SERVER_LR_DEFAULTS: adam 0.1)",
    )
    server_optimizer: ServerOptimizerChoice = "sgd"
    server_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    server_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    server_beta2: float = Field(0.99, ge=0.0, lt=1.0)
    server_eps: float = Field(1e-3, gt=0.0, description="FedAdam's tau (adaptivity)")
    # --- Elastic aggregation -----------------------------------------------------------------
    elastic_tau: float = Field(0.5, ge=0.0, le=1.0)
    sensitivity_decay: float = Field(0.9, ge=0.0, lt=1.0)
    sensitivity_dtype: Literal["float32", "float16"] = "float32"
    # --- FedLAW ------------------------------------------------------------------------------
    fedlaw_learn: Literal["both", "shrink", "clients"] = "both"
    fedlaw_epochs: int = Field(100, ge=0)
    fedlaw_lr: float = Field(0.005, ge=0.0)
    fedlaw_batch_size: int = Field(
        100, ge=1, description="proxy batch; the proxy set must fill one (paper: 100 samples)"
    )
    fedlaw_lr_step: int = Field(20, ge=1, description="StepLR period, server epochs")
    fedlaw_lr_gamma: float = Field(0.5, gt=0.0, le=1.0)
    fedlaw_swa: bool = False
    fedlaw_bn: Literal["reestimate", "authors"] = "reestimate"
    proxy_dir: str = Field("", description="IDX folder used as proxy set instead of held-out")
    # --- FedGMA ------------------------------------------------------------------------------
    gma_mask: Literal["hard", "soft"] = "hard"
    gma_threshold: float = Field(0.8, ge=0.0, le=1.0)
    gma_server_lr: float = Field(1.0, ge=0.0)
    # --- diagnostics -------------------------------------------------------------------------
    diagnostics: bool = False
    diagnostics_mi_coordinates: int = Field(256, ge=2)
    # --- replies: influence bounds (strategies/replies/bounds.py, docs/reliability.md) --------
    max_client_weight: float = Field(
        1.0, gt=0.0, le=1.0, description="largest weight share of one reply; 1: no cap"
    )
    update_norm_factor: float = Field(
        10.0, ge=0.0, description="drop updates above this x the round's median norm; 0: off"
    )
    update_clip_factor: float = Field(
        2.0, ge=0.0, description="scale updates down to this x the round's median norm; 0: off"
    )
    direction_outlier_factor: float = Field(
        2.0, ge=0.0, description="drop updates pointing against the others' mean; 0: off"
    )
    max_claim_factor: float = Field(
        10.0, ge=0.0, description="no weight above this x the round's median weight; 0: off"
    )
    robust_aggregation: Literal[
        "none", "trimmed-mean", "median", "krum", "multi-krum", "flame", "fltrust", "proxy-weights"
    ] = "none"
    trim_fraction: float = Field(
        0.1, ge=0.0, lt=0.5, description="trimmed-mean cut per end; Krum's Byzantine share"
    )
    pre_aggregation: Literal["none", "nnm", "bucketing", "centered-clipping"] = "none"
    bucket_size: int = Field(2, ge=1, le=1_000_000, description="replies per bucket (bucketing)")
    defence_profile: Literal["none", "iid", "label-skew"] = Field(
        "none", description="one name for a measured defence combination (DEFENCE_PROFILES)"
    )
    backdoor_defence: Literal["none", "trigger-unlearning"] = Field(
        "none", description="after each aggregation: invert and unlearn trigger patches"
    )
    unlearning_l1: float = Field(
        6.4, gt=0.0, description="the patch search's L1 weight on the share of the input it covers"
    )
    unlearning_steps: int = Field(100, ge=1, le=100_000, description="patch search steps/class")
    unlearning_lr: float = Field(0.02, gt=0.0, description="the unlearning's SGD step")
    unlearning_epochs: int = Field(3, ge=1, le=1_000, description="unlearning passes")
    unlearning_patched_share: float = Field(
        0.2, gt=0.0, le=1.0, description="the stamped inputs' share of each unlearning step's loss"
    )
    unlearning_additive: float = Field(
        0.0, ge=0.0, allow_inf_nan=False, description="additive search's weight; 0: no search"
    )
    unlearning_dormant_inputs: bool = Field(
        False, description="keep first-layer weights of inputs blank in the root set unchanged"
    )
    unlearning_input_bound: float = Field(
        0.0,
        ge=0.0,
        allow_inf_nan=False,
        description="bound first-layer column changes by the root set's exercise; 0: off",
    )
    unlearning_memory: int = Field(
        0, ge=0, le=1_000, description="unlearn again the triggers of the last k rounds; 0: none"
    )
    server_noise_std: float = Field(
        0.0, ge=0.0, allow_inf_nan=False, description="Gaussian noise on each new model (weak DP)"
    )
    flame_noise_lambda: float = Field(
        0.001, ge=0.0, allow_inf_nan=False, description="FLAME's noise x the median update norm"
    )
    max_reply_bytes: int = Field(
        0, ge=0, description="larger replies are dropped undecoded; 0: from the model's bytes"
    )
    # --- secure aggregation (strategies/secure/, client/secure.py, docs/reliability.md) -------
    secure_aggregation: Literal["none", "secaggplus"] = Field(
        "none", description="secaggplus: the server sees only the sum of the replies"
    )
    secure_clip_norm: float = Field(
        0.0, ge=0.0, allow_inf_nan=False, description="each client clips its update to it; 0: off"
    )
    secure_max_weight: float = Field(
        10_000.0, gt=0.0, allow_inf_nan=False, description="no client counts for more examples"
    )
    secure_neighbours: int = Field(0, ge=0, description="SecAgg+'s neighbours per node; 0: all")
    secure_threshold: float = Field(
        0.5, ge=0.5, lt=1.0, description="share of a node's share holders that unmask it"
    )
    secure_quantization_bits: int = Field(
        0, ge=0, le=62, description="levels 2^bits in [-8, 8]; 0: the finest the cohort fits"
    )
    secure_modulus_bits: Literal[32, 64] = Field(
        64, description="sums wrap modulo 2^this; 32 halves the upload, coarser levels"
    )
    # --- experiment tracker (strategies/tracking.py; each an optional extra) -----------------
    tracker: Literal["none", "tensorboard", "mlflow", "wandb"] = Field(
        "none", description="sends every round's metrics there; needs its extra installed"
    )
    tracker_uri: str = Field(
        "", description="MLflow tracking URI; empty: sqlite store in <output-dir>/.mlflow"
    )
    tracker_project: str = Field(
        "beyond-averaging", min_length=1, description="MLflow experiment / W&B project"
    )

    @model_validator(mode="before")
    @classmethod
    def _expand_profile(cls, data: Any) -> Any:
        """``defence-profile``'s options (:data:`DEFENCE_PROFILES`) in place of the keys still at
        their defaults: a key the user set to another value keeps it. Flower's run config holds
        every key (pyproject.toml's defaults), so "at its default" is what "not set" means."""
        if not isinstance(data, Mapping):
            return data
        profile = data.get("defence-profile", data.get("defence_profile"))
        if not isinstance(profile, str) or profile not in DEFENCE_PROFILES:
            return data  # an unknown profile is refused, with the closest name, as any value
        expanded = dict(data)
        convolutional = expanded.get("model", cls.model_fields["model"].default) in CONVOLUTIONAL
        strategy = expanded.get("strategy", cls.model_fields["strategy"].default)
        for key, value in DEFENCE_PROFILES[profile].items():
            name = key.replace("-", "_")
            if name == "unlearning_dormant_inputs" and convolutional:
                continue  # no weight belongs to one input position: refused if set by hand
            if name.startswith(("fedlaw_", "elastic_")) and not name.startswith(strategy):
                continue  # a rule's own key: other rules' configs stay as they were
            given = expanded.get(key, expanded.get(name, cls.model_fields[name].default))
            if given == cls.model_fields[name].default and type(given) is type(
                cls.model_fields[name].default
            ):
                expanded.pop(name, None)
                expanded[key] = value
        return expanded

    @model_validator(mode="after")
    def _check_relations(self) -> RunConfig:
        if self.min_train_replies > self.num_clients:
            raise ValueError(
                f"min-train-replies = {self.min_train_replies} exceeds num-clients = "
                f"{self.num_clients}: allowed is 1..num-clients"
            )
        # The defences that train on the server's proxy set (root set), and what each does there
        # (strategies.defences.root_set.root_set_use says the same for the strategies; this
        # module stays free of torch and the strategies, so that a bad value is refused at once).
        root_set_users = {
            "robust-aggregation = 'fltrust' scores updates against the server's own update on "
            "its proxy set": self.robust_aggregation == "fltrust",
            "robust-aggregation = 'proxy-weights' learns the clients' weights on the server's "
            "proxy set": self.robust_aggregation == "proxy-weights",
            "backdoor-defence = 'trigger-unlearning' inverts and unlearns trigger patches on the "
            "server's proxy set": self.backdoor_defence == "trigger-unlearning",
        }
        for use, on in root_set_users.items():
            if on and self.proxy_per_class == 0 and not self.proxy_dir:
                raise ValueError(
                    f"{use}, and proxy-per-class = 0 with no proxy-dir leaves it none: set "
                    "proxy-per-class >= 1 (10 gives a 100-sample root set on 10 classes)"
                )
        if self.secure_aggregation != "none":
            self._check_secure_aggregation()
        if self.unlearning_dormant_inputs and self.model in CONVOLUTIONAL:
            raise ValueError(
                f"unlearning-dormant-inputs = true with model = {self.model!r}: a convolution "
                "reads every input position through shared weights, so no weight belongs to "
                "one position; use model = 'mlp' or 'logreg', or unlearning-dormant-inputs = false"
            )
        if self.unlearning_input_bound > 0 and self.model in CONVOLUTIONAL:
            raise ValueError(
                f"unlearning-input-bound = {self.unlearning_input_bound} with model = "
                f"{self.model!r}: a convolution reads every input position through shared "
                "weights, so no weight column belongs to one position; use model = 'mlp' or "
                "'logreg', or unlearning-input-bound = 0"
            )
        if self.strategy == "fedlaw" and self.proxy_per_class == 0 and not self.proxy_dir:
            raise ValueError(
                "strategy = 'fedlaw' with proxy-per-class = 0 and no proxy-dir leaves FedLAW "
                "without a proxy set: set proxy-per-class >= 1 (the paper uses 10)"
            )
        return self

    def _check_secure_aggregation(self) -> None:
        """Refuse what needs each client's own reply: the server sees only their sum."""
        why = "secure-aggregation = 'secaggplus' shows the server only the sum of the replies"
        if self.strategy == "fedlaw":
            raise ValueError(
                f"{why}, and strategy = 'fedlaw' learns a weight per client on each client's "
                "own model: use fedavg, elastic or fedgma, or secure-aggregation = 'none'"
            )
        # The bounds are on by default: under secure aggregation they are off at their
        # defaults (the app's defaults set every key, so "set" cannot be told from "default");
        # one set to another value but 0 is refused, as the options below.
        bounds = ("update_norm_factor", "update_clip_factor", "direction_outlier_factor")
        needs = [
            f"{_kebab(name)} = {getattr(self, name)!r}"
            for name in (*bounds, "max_claim_factor")
            if getattr(self, name) not in (0.0, type(self).model_fields[name].default)
        ]
        if self.max_client_weight < 1.0:
            needs.append(f"max-client-weight = {self.max_client_weight!r}")
        for name, off in (
            ("robust_aggregation", "none"),
            ("pre_aggregation", "none"),
            ("diagnostics", False),
            ("client_backend", "clientapp"),
        ):
            if getattr(self, name) != off:
                needs.append(f"{_kebab(name)} = {getattr(self, name)!r}")
        if needs:
            verb = "needs" if len(needs) == 1 else "need"
            vectorised = (
                " (the vectorised backend trains without the ClientApp that masks)"
                if self.client_backend != "clientapp"
                else ""
            )
            raise ValueError(
                f"{why}, and {', '.join(needs)} {verb} each reply{vectorised}: set "
                f"{'it' if len(needs) == 1 else 'them'} off; secure-clip-norm and "
                "secure-max-weight bound each client on its own side"
            )
        bits = self.resolved_quantization_bits
        cohort = 2 ** (self.secure_modulus_bits - bits) - 1
        if not 1 <= bits <= self.secure_modulus_bits - 2 or cohort < self.num_clients:
            raise ValueError(
                "secure-aggregation = 'secaggplus' sums quantised values modulo "
                f"2^{self.secure_modulus_bits}: secure-quantization-bits = "
                f"{self.secure_quantization_bits} leaves room for {max(cohort, 0)} clients and "
                f"num-clients = {self.num_clients}: lower it to "
                f"{self.secure_modulus_bits - self.num_clients.bit_length()} or below (0: the "
                "finest that fits)"
            )

    @property
    def resolved_quantization_bits(self) -> int:
        """Secure aggregation's quantisation bits: ``secure-quantization-bits``, or for 0 the
        finest levels whose sum over ``num-clients`` (the most a round samples) cannot wrap,
        modulus - bit_length(clients): 60 for 10 clients modulo 2^64, 57 for 100, 54 for 1,000
        (28, 25 and 22 modulo 2^32)."""
        if self.secure_quantization_bits:
            return self.secure_quantization_bits
        return min(self.secure_modulus_bits - self.num_clients.bit_length(), 62)

    @property
    def resolved_server_lr(self) -> float:
        """The server optimizer's step: ``server-lr``, or its optimizer's default for "auto"."""
        if self.server_lr == "auto":
            return SERVER_LR_DEFAULTS[self.server_optimizer]
        return self.server_lr

    def to_run_config(self) -> dict[str, Any]:
        """The resolved configuration as Flower run-config keys (kebab-case)."""
        return self.model_dump(by_alias=True)


#: pydantic's bound errors: the context key of each and how a user reads the bound.
_BOUNDS = {
    "greater_than_equal": ("ge", ">="),
    "greater_than": ("gt", ">"),
    "less_than_equal": ("le", "<="),
    "less_than": ("lt", "<"),
}


def _allowed(error: Mapping[str, Any]) -> str:
    """What one pydantic error says is allowed, as a user reads it (``>= 1``, not "greater than
    or equal to 1")."""
    context = error.get("ctx") or {}
    bound = _BOUNDS.get(str(error.get("type")))
    if bound is not None and bound[0] in context:
        return f"{bound[1]} {context[bound[0]]!r}"
    return str(error.get("msg", "invalid")).removeprefix("Input should be ")


def _closest(error: Mapping[str, Any]) -> str | None:
    """The allowed value nearest to what was given: the closest choice by spelling (difflib),
    the bound a number crossed, or the given text as the TOML value it was meant to be
    (``"3"`` for ``3``, quotes dropped); None where nothing is near."""
    value = error.get("input")
    context = error.get("ctx") or {}
    kind = str(error.get("type"))
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", str(context.get("expected", "")))
        close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.0)
        return repr(close[0]) if close else None
    bound = _BOUNDS.get(kind)
    if bound is not None and bound[0] in context:
        limit = context[bound[0]]
        return repr(limit) if kind.endswith("_equal") else f"a value just {bound[1]} {limit!r}"
    if isinstance(value, str) and kind in ("int_type", "float_type", "bool_type"):
        try:  # the value was quoted where a number or a boolean was meant
            meant = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            return None
        fits = {
            "int_type": isinstance(meant, int) and not isinstance(meant, bool),
            "float_type": isinstance(meant, int | float) and not isinstance(meant, bool),
            "bool_type": isinstance(meant, bool),
        }
        if fits[kind]:
            return f"{value.strip()} (without quotes)"
    if kind == "int_type" and isinstance(value, float):
        return repr(round(value))
    if kind == "bool_type" and value in (0, 1):
        return "true" if value else "false"
    if kind == "string_type" and not isinstance(value, str):
        return f'"{value}" (in quotes)'
    return None


def _describe(errors: Sequence[Mapping[str, Any]]) -> str:
    """One line for the errors of one key (a union such as ``server-lr``'s gives one error per
    alternative): the key, the value, what is allowed and the closest allowed value."""
    error = errors[0]
    location = _kebab(str(error["loc"][0])) if error.get("loc") else ""
    value = error.get("input")
    if error.get("type") == "extra_forbidden":
        known = [f.alias or n for n, f in RunConfig.model_fields.items()]
        close = difflib.get_close_matches(location, known, n=1, cutoff=0.6)
        hint = f": did you mean '{close[0]}'?" if close else ""
        return f"unknown key '{location}' (value {value!r}): not a run option of this app{hint}"
    if not location:  # a relation between keys, already phrased with names and values
        return str(error.get("msg", "invalid")).removeprefix("Value error, ")
    allowed = " or ".join(dict.fromkeys(_allowed(e) for e in errors))
    closest = next((c for e in errors if (c := _closest(e)) is not None), None)
    line = f"key '{location}' = {value!r} is not allowed: allowed is {allowed}"
    return line + (f"; the closest allowed value is {closest}" if closest else "")


def _problems(err: ValidationError) -> list[str]:
    by_key: dict[str, list[Mapping[str, Any]]] = {}
    for error in err.errors():
        # the relations' errors name no key: each its own line
        where = str(error["loc"][0]) if error.get("loc") else f"relation {len(by_key)}"
        by_key.setdefault(where, []).append(error)
    return [_describe(errors) for errors in by_key.values()]


def config_problems(run_config: Mapping[str, Any]) -> list[str]:
    """Every problem of ``run_config`` as :class:`RunConfig` finds it, one line per key (the
    relations between keys included); empty when the configuration is valid."""
    try:
        RunConfig.model_validate(dict(run_config))
    except ValidationError as err:
        return _problems(err)
    return []


def parse_run_config(run_config: Mapping[str, Any]) -> RunConfig:
    """Validate Flower's flat run config.

    Raises
    ------
    ConfigError
        One message listing every bad key with its value, what is allowed and the closest allowed
        value, and the list of known keys when a key is unknown; its ``problems`` hold the
        lines.
    """
    try:
        return RunConfig.model_validate(dict(run_config))
    except ValidationError as err:
        problems = _problems(err)
    hint = ""
    if any(line.startswith("unknown key '") for line in problems):
        known = ", ".join(sorted(f.alias or n for n, f in RunConfig.model_fields.items()))
        hint = f"\nKnown keys: {known}"
    raise ConfigError(
        "Invalid run configuration:\n  - " + "\n  - ".join(problems) + hint, problems=problems
    )
