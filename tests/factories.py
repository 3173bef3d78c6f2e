"""Plain builders of request payloads, shaped exactly like NAT and ART send them."""

from __future__ import annotations

from typing import Any


def logprobs(token_ids: list[int], logprob: float = -0.5) -> dict[str, Any]:
    """OpenAI ChoiceLogprobs as vLLM returns them with return_tokens_as_token_ids."""
    return {
        "content": [
            {
                "token": f"token_id:{t}",
                "bytes": [104],
                "logprob": logprob,
                "top_logprobs": [{"token": f"token_id:{t}", "bytes": [104], "logprob": logprob}],
            }
            for t in token_ids
        ],
        "refusal": None,
    }


def nat_item(role: str, content: str, lp: Any = None, metadata: Any = None) -> dict[str, Any]:
    return {"role": role, "content": content, "logprobs": lp, "metadata": metadata}


def nat_trajectory(reward: float, *, answer: str = "4", generation: int = 0) -> dict[str, Any]:
    return {
        "episode": [
            nat_item("system", "You are a calculator."),
            nat_item("user", "2+2?"),
            nat_item("assistant", answer, logprobs([19, 220 + generation])),
        ],
        "reward": reward,
        "shaped_rewards": None,
        "metadata": {
            "id": 1,
            "reasoning": None,
            "run_id": "art_run_1a2b3c4d",
            "generation": generation,
        },
    }


def nat_collection(
    rewards: list[list[float]] | None = None, run_id: str = "art_run_1a2b3c4d"
) -> dict[str, Any]:
    rewards = rewards if rewards is not None else [[1.0, 0.0], [0.5, 0.25]]
    return {
        "trajectories": [
            [nat_trajectory(r, generation=g) for g, r in enumerate(group)] for group in rewards
        ],
        "run_id": run_id,
    }


def art_choice(content: str, token_ids: list[int], **message: Any) -> dict[str, Any]:
    return {
        "finish_reason": "stop",
        "index": 0,
        "message": {"role": "assistant", "content": content, **message},
        "logprobs": logprobs(token_ids),
    }


def art_groups(rewards: list[list[float]] | None = None) -> list[dict[str, Any]]:
    rewards = rewards if rewards is not None else [[1.0, 0.0]]
    return [
        {
            "trajectories": [
                {
                    "messages_and_choices": [
                        {"role": "user", "content": "Say hi"},
                        art_choice("hi", [5, 6 + i]),
                    ],
                    "reward": r,
                }
                for i, r in enumerate(group)
            ]
        }
        for group in rewards
    ]


def model_body(name: str = "agent", backend: str = "dry-run", **config: Any) -> dict[str, Any]:
    return {
        "name": name,
        "project": "tests",
        "base_model": "tiny/base",
        "backend": backend,
        "config": config,
    }


async def create_model(client: Any, name: str = "agent", **config: Any) -> dict[str, Any]:
    response = await client.post("/v1/models", json=model_body(name, **config))
    assert response.status_code in (200, 201), response.text
    return response.json()


async def submit(client: Any, model: str = "agent", **body: Any) -> Any:
    payload = {"model": model, **body}
    if "collection" not in body and "groups" not in body:
        payload["collection"] = nat_collection()
    return await client.post("/v1/training-jobs", json=payload)
