"""What the SDK raises for requests Trainyard refuses. Prints one JSON line of outcomes."""

import json
import sys

import numpy as np
import tinker
from tinker import types

outcomes = {}


def attempt(name, call):
    try:
        call()
        outcomes[name] = "ok"
    except Exception as exc:  # the class the SDK raised, and the message
        outcomes[name] = f"{type(exc).__name__}: {exc}"


service = tinker.ServiceClient()
attempt(
    "unknown base", lambda: service.create_lora_training_client(base_model="no-such-model").result()
)
attempt(
    "art-local base", lambda: service.create_lora_training_client(base_model=sys.argv[1]).result()
)
training = service.create_lora_training_client(base_model="demo", rank=2).result()


def datum(tokens, **inputs):
    arrays = {
        k: np.array(v, dtype=np.int64 if k == "target_tokens" else np.float32)
        for k, v in inputs.items()
    }
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=arrays)


attempt(
    "token outside vocabulary",
    lambda: training.forward_backward(
        [datum([1, 99999], target_tokens=[2, 3], weights=[1, 1])], "cross_entropy"
    ).result(),
)
attempt(
    "missing advantages",
    lambda: training.forward_backward(
        [datum([1, 2], target_tokens=[2, 3], logprobs=[0, 0])], "importance_sampling"
    ).result(),
)
attempt(
    "unknown loss",
    lambda: training.forward_backward(
        [datum([1, 2], target_tokens=[2, 3], weights=[1, 1])], "dpo"
    ).result(),
)
attempt(
    "non-finite advantages",
    lambda: training.forward_backward(
        [datum([1, 2], target_tokens=[2, 3], logprobs=[0, 0], advantages=[float("nan"), 1])],
        "importance_sampling",
    ).result(),
)
attempt(
    "past the context",
    lambda: training.forward(
        [datum([1] * 2049, target_tokens=[2] * 2049, weights=[1] * 2049)], "cross_entropy"
    ).result(),
)
attempt(
    "beta1 of one",
    lambda: training.optim_step(types.AdamParams(learning_rate=1e-3, beta1=1.0)).result(),
)
attempt(
    "unknown sampler",
    lambda: (
        service.create_sampling_client(model_path="tinker://nothing/sampler_weights/x")
        .result()
        .sample(
            types.ModelInput.from_ints([1]),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=1),
        )
        .result()
    ),
)
base = service.create_sampling_client(base_model="demo").result()
attempt(
    "prompt outside vocabulary",
    lambda: base.sample(
        types.ModelInput.from_ints([99999]),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1),
    ).result(),
)
attempt(
    "negative top_k",
    lambda: base.sample(
        types.ModelInput.from_ints([1, 2]),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1, top_k=-2),
    ).result(),
)
attempt(
    "top_p of zero",
    lambda: base.sample(
        types.ModelInput.from_ints([1, 2]),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1, top_p=0.0),
    ).result(),
)
# top_k 1 at temperature 1 is the greedy choice, token after token.
greedy, top_one = (
    base.sample(
        types.ModelInput.from_ints([1, 2]),
        num_samples=6,
        sampling_params=types.SamplingParams(max_tokens=4, seed=5, **params),
    ).result()
    for params in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 1})
)
free = base.sample(
    types.ModelInput.from_ints([1, 2]),
    num_samples=6,
    sampling_params=types.SamplingParams(max_tokens=4, seed=5, temperature=1.0),
).result()
outcomes["top_k"] = {
    "greedy": [s.tokens for s in greedy.sequences],
    "top_one": [s.tokens for s in top_one.sequences],
    "free": [s.tokens for s in free.sequences],
}
sample = base.sample(
    types.ModelInput.from_ints([1, 2]),
    num_samples=3,
    sampling_params=types.SamplingParams(max_tokens=4, seed=3),
).result()
outcomes["base sample"] = [len(s.tokens) == len(s.logprobs) for s in sample.sequences]
print(json.dumps(outcomes))
