"""Round by round in Python (server/interactive.py): the caller's round loop trains the sampled
nodes with the real ClientApp, the strategy aggregates their replies, and the global model is
scored on the server's test split. Reference values are computed here from the replies."""

from __future__ import annotations

import numpy as np
import torch

from beyond_averaging.server.interactive import federation

#: Three clients, every reply bound off: FedAvg's aggregate is then the plain weighted mean.
SETTINGS = {
    "strategy": "fedavg",
    "num-clients": 3,
    "local-epochs": 1,
    "update-clip-factor": 0.0,
    "direction-outlier-factor": 0.0,
    "max-claim-factor": 0.0,
    "update-norm-factor": 0.0,
    "device": "cpu",
}


def test_a_round_by_hand_makes_the_global_model_the_example_weighted_mean_of_the_replies() -> None:
    fed = federation(SETTINGS)
    before = {key: array.numpy().copy() for key, array in fed.arrays.items()}
    replies = fed.round(1)
    assert sorted(reply.metadata.src_node_id for reply in replies) == [1000, 1001, 1002]
    weights = np.array([float(r.content["metrics"]["num-examples"]) for r in replies])
    for key, array in fed.arrays.items():
        models = np.stack([r.content["arrays"][key].numpy() for r in replies])
        expected = np.tensordot(weights / weights.sum(), models, axes=1)
        np.testing.assert_allclose(array.numpy(), expected, rtol=1e-5, atol=1e-6)
        assert not np.array_equal(array.numpy(), before[key])  # the round moved it


def test_evaluate_scores_the_current_global_model_on_the_server_s_test_split() -> None:
    fed = federation(SETTINGS)
    fed.round(1)
    _, accuracy = fed.evaluate()
    fed.model.load_state_dict(fed.arrays.to_torch_state_dict())
    with torch.no_grad():
        logits = fed.model(torch.from_numpy(fed.test_set.features.copy()))
    by_hand = float((logits.argmax(dim=1).numpy() == fed.test_set.labels).mean())
    assert accuracy == by_hand
    assert by_hand > 0.2  # one round on digits: above chance (0.1)
