"""`app.tinker.sampling.read`: an `asample` body as the SDK sends it, checked before anything
runs; each bad field is a `UserError` whose message starts with the field's path (the route
answers it as a 400 problem, the SDK's `BadRequestError`). Through the SDK and the model:
`tests/test_tinker_sdk.py`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from app.tinker import sampling
from app.tinker.spec import UserError

PROMPT = [5, 6, 7, 8]  # three rows of prompt positions after the first


def body(**fields: Any) -> dict[str, Any]:
    return {
        "sampling_session_id": "sampler-x",
        "seq_id": 0,
        "num_samples": 1,
        "prompt": {"chunks": [{"tokens": PROMPT[:2]}, {"tokens": PROMPT[2:]}]},
        "sampling_params": {"max_tokens": 3, "temperature": 0.5},
        **fields,
    }


def targets(data: list[int], shape: list[int], **extra: Any) -> dict[str, Any]:
    return {"target_prompt_logprobs": {"data": data, "dtype": "int64", "shape": shape, **extra}}


def test_a_request_of_every_option_reads_whole() -> None:
    asked = sampling.read(
        body(
            prompt_logprobs=True,
            prompt_logprobs_last_n=2,
            topk_prompt_logprobs=3,
            topk_sample_logprobs=5,
            prompt_alt_tokens_k=2,
            **targets(
                [9, 4, 2], [3, 2], sparse_crow_indices=[0, 2, 2, 3], sparse_col_indices=[1, 0, 1]
            ),
        )
    )
    assert asked.prompt == PROMPT and asked.temperature == 0.5 and asked.max_tokens == 3
    assert (asked.last_n, asked.topk_prompt, asked.topk_sample, asked.alt_k) == (2, 3, 5, 2)
    cells = asked.targets
    assert cells is not None and cells.shape == (3, 2)
    assert cells.ids.tolist() == [9, 4, 2] and cells.rows.tolist() == [0, 0, 2]
    # The answer keeps the request's CSR layout.
    answer = cells.answer(np.array([-1.0, -2.0, -3.0]))
    assert answer.crow is not None and answer.crow.tolist() == [0, 2, 2, 3]
    assert answer.shape == [3, 2] and answer.values.dtype == np.float32
    dense = sampling.read(body(**targets([-1, 3, 4, -1, -1, 6], [3, 2]))).targets
    assert dense is not None and dense.rows.tolist() == [0, 0, 1, 1, 2, 2]
    plain = sampling.read(body())
    assert not plain.scores_prompt and plain.targets is None and plain.top_k == 0
    # `stop`: absent, end-of-sequence stops; [] (the SDK's "no stop tokens"), nothing does.
    assert (plain.stop, plain.stop_at_eos) == ([], True)
    nothing = sampling.read(body(sampling_params={"stop": []}))
    assert (nothing.stop, nothing.stop_at_eos) == ([], False)
    one = sampling.read(body(sampling_params={"stop": "\n"}))
    assert (one.stop, one.stop_at_eos) == (["\n"], True)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": [1, 2]}, "prompt.chunks: a list"),
        ({"prompt": {"chunks": [{"data": "image"}]}}, "prompt.chunks[0]: only token chunks"),
        ({"prompt": {"chunks": [{"tokens": []}]}}, "prompt.chunks: no tokens"),
        ({"num_samples": 0}, "num_samples: an integer from 1 to 128"),
        ({"sampling_params": []}, "sampling_params: an object"),
        ({"sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens: an integer"),
        ({"sampling_params": {"temperature": -1}}, "sampling_params.temperature: a number"),
        ({"sampling_params": {"top_p": 1.5}}, "sampling_params.top_p: a number above 0, to 1"),
        ({"sampling_params": {"top_p": 0}}, "sampling_params.top_p: a number above 0, to 1"),
        (
            {"sampling_params": {"max_tokens": 2047}},
            "prompt: its 4 tokens and sampling_params.max_tokens (2047) pass the context of 2048",
        ),
        ({"sampling_params": {"top_k": -2}}, "sampling_params.top_k: -1 (every token)"),
        ({"sampling_params": {"seed": "x"}}, "sampling_params.seed: an integer"),
        ({"sampling_params": {"stop": 3}}, "sampling_params.stop: a string, or a list"),
        ({"record_stability_info": True}, "record_stability_info: not supported here"),
        ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n: needs prompt_logprobs"),
        ({"topk_prompt_logprobs": 101}, "topk_prompt_logprobs: an integer from 0 to 100"),
        ({"topk_sample_logprobs": True}, "topk_sample_logprobs: an integer from 0 to 100"),
        ({"prompt_alt_tokens_k": -1}, "prompt_alt_tokens_k: an integer from 0 to 100"),
        ({"target_prompt_logprobs": [1, 2, 3]}, "target_prompt_logprobs: a tensor"),
        (targets([1, 2, 3], [3, 1]), None),  # valid: the next ones are not
        (
            {"target_prompt_logprobs": {"data": [1.5], "dtype": "float32", "shape": [3, 1]}},
            "target_prompt_logprobs.dtype: must be int64",
        ),
        (
            targets([1, 2, 3, 4], [4, 1]),
            "target_prompt_logprobs.shape: must be [len(prompt) - 1, K], here [3, K]",
        ),
        (targets([], [3, 0]), "target_prompt_logprobs.shape: K"),
        (targets([1, 2], [3, 1]), "target_prompt_logprobs.data: 2 ids for the shape's 3 cells"),
        (targets([1, 2.5, 3], [3, 1]), "target_prompt_logprobs.data: a list of integers"),
        (targets([1, -2, 3], [3, 1]), "target_prompt_logprobs.data: a token id, or -1"),
        (targets([-1, -1, -1], [3, 1]), "target_prompt_logprobs.data: no token id"),
        (
            targets([1], [3, 2], sparse_crow_indices=[0, 1, 1, 1]),
            "target_prompt_logprobs: sparse_crow_indices and sparse_col_indices go together",
        ),
        (
            targets([1], [3, 2], sparse_crow_indices=[0, 1, 1], sparse_col_indices=[0]),
            "target_prompt_logprobs.sparse_crow_indices: 4 row offsets",
        ),
        (
            targets([1], [3, 2], sparse_crow_indices=[0, 1, 0, 1], sparse_col_indices=[0]),
            "target_prompt_logprobs.sparse_crow_indices: 4 row offsets",
        ),
        (
            targets([1], [3, 2], sparse_crow_indices=[0, 1, 1, 1], sparse_col_indices=[2]),
            "target_prompt_logprobs.sparse_col_indices: a column outside 0..1",
        ),
    ],
)
def test_a_bad_field_is_refused_by_its_path(fields: dict[str, Any], message: str | None) -> None:
    if message is None:
        assert sampling.read(body(**fields)).targets is not None
        return
    with pytest.raises(UserError) as refused:
        sampling.read(body(**fields))
    assert str(refused.value).startswith(message), str(refused.value)


def test_ids_outside_the_vocabulary_are_refused_once_the_model_is_known() -> None:
    with pytest.raises(UserError, match=r"^prompt: token 8 is outside the vocabulary \(0..7\)"):
        sampling.check_vocabulary(sampling.read(body()), 8)
    asked = sampling.read(body(**targets([-1, 3, 12], [3, 1])))
    sampling.check_vocabulary(asked, 13)
    with pytest.raises(UserError, match=r"^target_prompt_logprobs.data: token 12 is outside"):
        sampling.check_vocabulary(asked, 12)
