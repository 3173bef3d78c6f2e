"""A training client that outlives its server: `forward_backward`, then (while the test kills
`trainyard serve` with SIGKILL and starts it again on the same port) a wait on stdin, then
`optim_step` and a `forward` through the same client. Then the same steps on a new client of
the same seed whose server never stopped.

A sampler made before the kill samples after it, by its id, as it did before.

Prints one JSON line: the loss before the step, after it through the restart, and after it
without one; the sampler's greedy answer before and after the restart."""

import json
import sys

import numpy as np
import tinker
from tinker import types

service = tinker.ServiceClient()


def client() -> tinker.TrainingClient:
    return service.create_lora_training_client(base_model="demo", rank=4, seed=11).result()


def datum(tokenizer) -> types.Datum:
    tokens = tokenizer.encode("the sky over the harbour was grey", add_special_tokens=False)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )


def step_and_score(training: tinker.TrainingClient, data: types.Datum) -> float:
    training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    return training.forward([data], "cross_entropy").result().metrics["loss:sum"]


def greedy(sampler: tinker.SamplingClient) -> list[int]:
    prompt = types.ModelInput.from_ints(data.model_input.to_ints()[:3])
    params = types.SamplingParams(max_tokens=6, temperature=0.0)
    return (
        sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0].tokens
    )


restarted = client()
data = datum(restarted.get_tokenizer())
sampler = restarted.save_weights_and_get_sampling_client().result()
said = greedy(sampler)
before = restarted.forward_backward([data], "cross_entropy").result().metrics["loss:sum"]
print(json.dumps({"accepted": restarted.get_info().model_id}), flush=True)
sys.stdin.readline()  # the server is killed and started again meanwhile
after_restart = step_and_score(restarted, data)
said_again = greedy(sampler)  # a sampler of the killed process, by its id

steady = client()
steady.forward_backward([data], "cross_entropy").result()
after = step_and_score(steady, data)
print(
    json.dumps(
        {
            "before": before,
            "after_restart": after_restart,
            "after": after,
            "said": said,
            "said_again": said_again,
        }
    )
)
