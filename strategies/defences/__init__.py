"""Defences against Byzantine clients and backdoors, each in its own module, math only.

Where each acts on a reply's path is stage 3-5 of the map in :mod:`strategies.replies`:

- :mod:`.robust`: the robust aggregations (``robust-aggregation``): coordinate-wise trimmed
  mean and median, Krum, Multi-Krum and FLAME's selection (the reply bounds' selection step,
  :func:`.robust.selection_rule`), FLTrust's trust scores, FLAME's noise;
- :mod:`.root_set`: the server's root set, FLTrust's root update, and
  :func:`.root_set.root_set_use`, the one answer to which options need a root set;
- :mod:`.proxy_data`: the forms a root or proxy set may take, read and validated;
- :mod:`.preaggregation`: NNM, bucketing and centered clipping (``pre-aggregation``);
- :mod:`.trigger_unlearning`: Neural Cleanse's trigger search and unlearning on the root set
  (``backdoor-defence``), with an additive search and dormant inputs beside it;
- :mod:`.profiles`: one name for a measured combination of them (``defence-profile``).

:class:`strategies.defended.DefendedStrategy` applies them around each rule;
``server/strategy_factory.py`` builds their options from the run configuration. Modules here
never import :mod:`strategies.base`, :mod:`strategies.defended` or a rule.
"""
