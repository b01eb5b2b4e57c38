"""The strategies' keyword arguments, and argument errors that name the strategy the user called.

:class:`FlowerOptions` (Flower's ``FedAvg``'s ten), :class:`ProjectOptions` (this project's
extras) and :class:`StrategyOptions` (both) type the keyword arguments every rule takes.

Every rule's ``__init__`` takes Flower's arguments, its own, and this project's extras through
``**options: Unpack[ProjectOptions]``, which it hands on to the base class. Python reports an
argument that no function takes from the function that finally refuses it, so
``FedGMASoft(thresold=0.8)`` raised ``ContractStrategy.__init__() got an unexpected keyword
argument 'thresold'``: a class the user never called, and no hint. :class:`NamedArgumentErrors`,
the first base of :class:`~strategies.base.ContractStrategy`, checks a call against what the
called class takes before any ``__init__`` runs (:func:`check_arguments`) and raises a
``TypeError`` that names the class, the argument and the closest name it does take.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from functools import cache
from inspect import Parameter
from typing import Any, Self, TypedDict, Unpack, get_args, get_origin, is_typeddict

from beyond_averaging.strategies.defences.robust import RobustAggregation
from beyond_averaging.strategies.replies.metrics import MetricsAggregationFn

#: Parameter kinds a caller can pass by name.
_BY_NAME = (Parameter.POSITIONAL_OR_KEYWORD, Parameter.KEYWORD_ONLY)
_BY_POSITION = (Parameter.POSITIONAL_ONLY, Parameter.POSITIONAL_OR_KEYWORD)


def _parameters(init: Any) -> list[Parameter]:
    """``init``'s parameters after ``self``, annotations evaluated where they can be."""
    try:
        signature = inspect.signature(init, eval_str=True)
    except (NameError, SyntaxError, TypeError):  # an annotation only a type checker can read
        signature = inspect.signature(init)
    return list(signature.parameters.values())[1:]


def _typed_keywords(parameter: Parameter) -> frozenset[str] | None:
    """The keys of ``**options: Unpack[SomeTypedDict]``; None for any other ``**kwargs``."""
    annotation = parameter.annotation
    if get_origin(annotation) is Unpack:
        (typed,) = get_args(annotation)
        if is_typeddict(typed):
            return frozenset(typed.__required_keys__ | typed.__optional_keys__)
    return None


@cache
def accepted_keywords(cls: type) -> frozenset[str]:
    """Every keyword argument ``cls(...)`` takes.

    The named parameters of the first ``__init__`` up ``cls``'s MRO; where it ends in
    ``**options: Unpack[T]``, the keys of the TypedDict ``T``; where it ends in untyped
    ``**kwargs``, whatever the next ``__init__`` up the MRO takes (a subclass's ``**kwargs``
    goes to its base).
    """
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        parameters = _parameters(vars(klass)["__init__"])
        names |= {p.name for p in parameters if p.kind in _BY_NAME}
        var_keyword = next((p for p in parameters if p.kind is Parameter.VAR_KEYWORD), None)
        if var_keyword is None:
            break
        typed = _typed_keywords(var_keyword)
        if typed is not None:
            names |= typed
            break
    return frozenset(names)


@cache
def _positional_names(cls: type) -> tuple[list[str], bool]:
    """The names ``cls(...)`` takes by position, and whether it takes ``*args`` besides."""
    init = next(vars(k)["__init__"] for k in cls.__mro__ if "__init__" in vars(k))
    parameters = _parameters(init)
    return (
        [p.name for p in parameters if p.kind in _BY_POSITION],
        any(p.kind is Parameter.VAR_POSITIONAL for p in parameters),
    )


def check_arguments(cls: type, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Refuse a call ``cls(*args, **kwargs)`` that ``cls`` cannot take, naming ``cls``.

    Checks the keywords (each one ``cls`` takes) and the number of positional arguments; a
    missing required argument is left to Python, whose message names the ``__init__`` that
    declares it.

    Raises
    ------
    TypeError
        An unknown keyword (with the closest accepted name, if one is close), or more
        positional arguments than ``cls`` takes.
    """
    accepted = accepted_keywords(cls)
    name = cls.__name__
    for keyword in kwargs:
        if keyword in accepted:
            continue
        close = difflib.get_close_matches(keyword, sorted(accepted), n=1)
        hint = (
            f"; did you mean {close[0]!r}?"
            if close
            else f"; it takes {', '.join(sorted(accepted))}"
        )
        raise TypeError(f"{name}() got an unexpected keyword argument {keyword!r}{hint}")
    positional, takes_more = _positional_names(cls)
    if len(args) > len(positional) and not takes_more:
        raise TypeError(
            f"{name}() takes {len(positional)} positional arguments "
            f"({', '.join(positional)}) but {len(args)} were given: the others are "
            "keyword-only, pass them by name"
        )
    for keyword in kwargs:
        if keyword in positional[: len(args)]:
            raise TypeError(f"{name}() got multiple values for argument {keyword!r}")


class NamedArgumentErrors:
    """Base class whose construction refuses bad arguments in the called class's name.

    ``__new__`` sees the arguments of ``cls(...)`` before any ``__init__``; it is the only
    place that knows which class the user called. Placed before the class that defines
    ``__init__``, it leaves ``inspect.signature`` (and ``help``) showing that ``__init__``.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        """Check the call (:func:`check_arguments`), then create the object as usual."""
        check_arguments(cls, args, kwargs)
        return super().__new__(cls)


class FlowerOptions(TypedDict, total=False):
    """The arguments of ``flwr.serverapp.strategy.FedAvg``, with its defaults and meanings.

    Every strategy of this project takes them first, positionally or by name, in Flower's order.
    """

    fraction_train: float
    fraction_evaluate: float
    min_train_nodes: int
    min_evaluate_nodes: int
    min_available_nodes: int
    weighted_by_key: str
    arrayrecord_key: str
    configrecord_key: str
    train_metrics_aggr_fn: MetricsAggregationFn | None
    evaluate_metrics_aggr_fn: MetricsAggregationFn | None


class ProjectOptions(TypedDict, total=False):
    """This project's extras, keyword-only after Flower's arguments (:class:`ContractStrategy`)."""

    min_train_replies: int | None
    seed: int
    max_client_weight: float
    update_norm_factor: float
    update_clip_factor: float
    direction_outlier_factor: float
    max_claim_factor: float
    robust_aggregation: RobustAggregation
    trim_fraction: float
    max_reply_bytes: int
    log_rounds: bool


class StrategyOptions(FlowerOptions, ProjectOptions, total=False):
    """Every keyword argument that every strategy of this project accepts.

    :class:`FlowerOptions` (Flower's ``FedAvg``'s ten) and :class:`ProjectOptions` in one dict,
    e.g. to build several strategies from one ``options: StrategyOptions = {...}``.
    """
