"""A train reply's path through the server, from its bytes to the new global model.

This is the one map of that path; each module below names its own stage and points here.
:meth:`strategies.base.ContractStrategy.aggregate_train` runs stages 1-3 and 6-7,
:class:`strategies.defended.DefendedStrategy` stages 4-5 around the rule's own math.

1. **check before decoding** (:mod:`.validation`): an error reply or one over the byte limit
   (``oversized``; a bounded pull, ``server/bounded_pull.py``, drops it while it is pulled) is
   refused; the weight (``num-examples``) must be a finite, positive, whole number.
2. **decode** (:mod:`.wire`): each requested ArrayRecord read only through
   :func:`.wire.decode_record` (``.npy`` header, dtype policy, shapes, no unpickling, a view
   of the received bytes), every value checked once (finite, in range, above a record's
   minimum), its norm kept for stage 3. The result is a :class:`.wire.ClientReply`.
3. **bound influence** (:mod:`.bounds`, math in :mod:`.influence`): against the round's other
   replies, drop records that share no key, norm outliers and direction outliers; the
   selection step (Krum, Multi-Krum, FLAME: :mod:`strategies.defences.robust`); bound each
   claim and clip each update and record; cap each weight share. Returns the kept replies and
   what later stages read (:class:`.bounds.BoundedReplies`).
4. **defend** (:mod:`strategies.defences`): root-set trust (``fltrust``) or proxy weights
   re-weigh the kept replies (:mod:`strategies.defences.root_set`); pre-aggregation mixes them
   (:mod:`strategies.defences.preaggregation`).
5. **aggregate**: the rule's own pure function (:func:`strategies.fedavg.aggregate_fedavg`,
   ``aggregate_elastic``, ``aggregate_fedlaw``, ``aggregate_fedgma``), robust forms by
   coordinate (trimmed mean, median) inside it; then the defences on the new model: FLAME's and
   the server's noise, trigger unlearning (:mod:`strategies.defences.trigger_unlearning`).
6. **guard the model** (:class:`.validation.ModelGuard` through
   :meth:`.bounds.InfluenceBounds.model_rejection`): a non-finite, out-of-range or exploding
   model is never committed; the round keeps the old one.
7. **report** (:mod:`.reporting`, :mod:`.metrics`): the round's line, one record per reply
   (``clients.jsonl``), the clients' metrics aggregated as Flower does.

A reply refused at any stage raises :class:`.wire.ReplyRejected`, whose ``reason`` becomes the
round's ``dropped-<reason>`` count and whose ``detail`` is the logged line; the round goes on
with the rest. Modules here never import a rule, :mod:`strategies.base` or
:mod:`strategies.defended`.
"""
