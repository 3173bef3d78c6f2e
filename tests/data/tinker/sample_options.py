"""The sampling options beyond the samples, through the Tinker SDK, from the base model (no
adapter): `topk_sample_logprobs`, `target_prompt_logprobs` (dense and CSR) and
`prompt_alt_tokens_k`, and what the server refuses. Prints one JSON line with what the SDK
returned, and the model's local directory for the test to compute the same in-process."""

import json
import math
import sys

import numpy as np
import tinker
from tinker import types

k = int(sys.argv[1])
service = tinker.ServiceClient()
sampler = service.create_sampling_client(base_model="demo").result()
training = service.create_lora_training_client(base_model="demo", rank=1).result()
directory = training.get_info().model_data.tokenizer_id
tokens = training.get_tokenizer().encode(
    "score the tokens of this prompt", add_special_tokens=False
)
prompt = types.ModelInput.from_ints(tokens)
rows = len(tokens) - 1


def sample(**options):
    params = options.pop("params", types.SamplingParams(max_tokens=1, temperature=1.0))
    return sampler.sample(
        prompt, num_samples=options.pop("n", 1), sampling_params=params, **options
    )


def tensor(t):
    data = np.asarray(t.data).tolist()
    return {
        "shape": t.shape,
        "data": data,
        "crow": t.sparse_crow_indices,
        "cols": t.sparse_col_indices,
    }


# topk_sample_logprobs: two sampled sequences at temperature 1, and a greedy one.
free = sample(
    n=2,
    params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=11),
    topk_sample_logprobs=k,
).result()
greedy = sample(
    params=types.SamplingParams(max_tokens=5, temperature=0.0), topk_sample_logprobs=k
).result()
# target_prompt_logprobs, dense: row i asks two ids at prompt position i + 1 (the prompt's own
# token and token 3), but for row 0, which asks nothing (-1).
dense_ids = np.array([[tokens[i + 1], 3] for i in range(rows)], dtype=np.int64)
dense_ids[0] = -1
dense = sample(
    include_prompt_logprobs=True, target_prompt_logprobs=types.TensorData.from_numpy(dense_ids)
).result()
# The same as CSR: only rows 1 and the last list cells (column 2 and 0 of a width of 3).
sparse = types.TensorData(
    data=np.array([5, 7, 9], dtype=np.int64),
    dtype="int64",
    shape=[rows, 3],
    sparse_crow_indices=[0] + [0] + [2] * (rows - 2) + [3],
    sparse_col_indices=[2, 0, 0],
)
csr = sample(target_prompt_logprobs=sparse).result()
# prompt_alt_tokens_k: greedy (every draw the likeliest), and seeded draws at temperature 1.
alt_greedy = sample(
    params=types.SamplingParams(max_tokens=1, temperature=0.0), prompt_alt_tokens_k=3
).result()
drawn = [
    sample(
        params=types.SamplingParams(max_tokens=1, temperature=1.0, seed=seed), prompt_alt_tokens_k=k
    ).result()
    for seed in (7, 7, 8)
]
outcomes = {}
for name, options in {
    "topk_sample_logprobs": {"topk_sample_logprobs": 101},
    "prompt_alt_tokens_k": {"prompt_alt_tokens_k": 1000},
    "target shape": {
        "target_prompt_logprobs": types.TensorData.from_numpy(np.zeros((rows + 1, 1), np.int64))
    },
    "target vocabulary": {
        "target_prompt_logprobs": types.TensorData.from_numpy(np.full((rows, 1), 10**6))
    },
    "target nothing": {
        "target_prompt_logprobs": types.TensorData.from_numpy(np.full((rows, 2), -1))
    },
}.items():
    try:
        sample(**options).result()
        outcomes[name] = "accepted"
    except tinker.BadRequestError as exc:
        outcomes[name] = f"BadRequestError: {exc}"
try:
    stable = service.create_sampling_client(base_model="demo", record_stability_info=True).result()
    stable.sample(
        prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=1)
    ).result()
    outcomes["record_stability_info"] = "accepted"
except tinker.BadRequestError as exc:
    outcomes["record_stability_info"] = f"BadRequestError: {exc}"
print(
    json.dumps(
        {
            "directory": directory,
            "tokens": tokens,
            "free": [[s.tokens, s.logprobs, s.topk_logprobs] for s in free.sequences],
            "greedy": [greedy.sequences[0].tokens, greedy.sequences[0].topk_logprobs],
            "dense_ids": dense_ids.tolist(),
            "dense": tensor(dense.target_prompt_logprobs),
            "prompt_logprobs": [
                None if x is None or math.isnan(x) else x for x in dense.prompt_logprobs
            ],
            "csr": tensor(csr.target_prompt_logprobs),
            "csr_prompt_logprobs": csr.prompt_logprobs,
            "alt_greedy": [
                tensor(alt_greedy.prompt_alt_tokens.tokens),
                tensor(alt_greedy.prompt_alt_tokens.logprobs),
            ],
            "drawn": [
                [tensor(d.prompt_alt_tokens.tokens), tensor(d.prompt_alt_tokens.logprobs)]
                for d in drawn
            ],
            "refused": outcomes,
        }
    )
)
