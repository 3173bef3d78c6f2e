"""The client's hyper-parameter check (what the NAT adapter runs before any rollout) agrees
with the server's own models, on the schemas `GET /v1/backends` publishes."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from app.backends import SPECS
from trainyard_client.hyperparameters import check_hyperparameters

PROBES: list[dict[str, Any]] = [
    {},
    {"learning_rate": 0.02},
    {"learning_rate": 1},
    {"learning_rate": 0},
    {"learning_rate": -1e-5},
    {"learning_rate": 2.0},
    {"learning_rate": "0.1"},
    {"learning_rate": "1e-5"},  # YAML reads `1e-5` (no dot) as this string
    {"learning_rate": "fast"},
    {"learning_rate": True},
    {"learning_rate": None},
    {"beta": 0.1},
    {"learning_rate": 1e-5, "beta": 0.1},
    {"kl_penalty_coef": 0.1},
    {"kl_penalty_coef": -0.1},
    {"scale_rewards": False},
    {"scale_rewards": 1},
    {"scale_rewards": 2},
    {"scale_rewards": "yes"},
    {"scale_rewards": "maybe"},
    {"epsilon": None},
    {"epsilon": 0.3},
    {"epsilon": 11},
    {"loss_fn": "ppo"},
    {"loss_fn": "dpo"},
    {"importance_sampling_level": "sequence"},
    {"importance_sampling_level": "tokens"},
    {"kl_penalty_reference_step": 3},
    {"kl_penalty_reference_step": 1.5},
    {"kl_penalty_reference_step": 2.0},
    {"kl_penalty_reference_step": "4"},
    {"loss_fn_config": None},
    {"loss_fn_config": {"x": 1}},
]


@pytest.mark.parametrize("backend", sorted(SPECS))
def test_the_check_agrees_with_the_servers_models(backend: str) -> None:
    model = SPECS[backend].hyperparameters
    schema = model.model_json_schema()
    for values in PROBES:
        problems = check_hyperparameters(schema, values)
        try:
            model.model_validate(values)  # as the server reads a job's
            accepted = True
        except ValidationError:
            accepted = False
        assert accepted == (not problems), (backend, values, problems)


def test_problems_name_the_keyword_and_what_it_must_be() -> None:
    schema = SPECS["cpu"].hyperparameters.model_json_schema()
    assert check_hyperparameters(schema, {"learning_rate": 0, "beta": 0.1}) == [
        "learning_rate: must be greater than 0, got 0",
        "beta: not a keyword this backend accepts (it accepts allow_training_without_logprobs, "
        "epsilon, kl_penalty_coef, learning_rate, max_grad_norm, scale_rewards)",
    ]
