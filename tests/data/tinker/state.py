"""save_state, load_state and create_training_client_from_state through the Tinker SDK.

`save`: train two steps, save the state as `mid`, train two more, load `mid` back, save the
loaded weights for a sampler (`frozen`) and sample greedily from them, and print the
logprobs at `mid`, after loading, and after one more step from the loaded state. `resume
PATH SAMPLER_PATH` (run after the server restarted): the same greedy sample from
SAMPLER_PATH, a new training client from PATH with its optimizer, its logprobs, and the same
one more step. Prints one JSON line."""

import json
import sys

import numpy as np
import tinker
from tinker import types

service = tinker.ServiceClient()
tokens = [5, 6, 7, 8, 9, 10]
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={
        "target_tokens": np.array(tokens[1:], dtype=np.int64),
        "weights": np.ones(len(tokens) - 1, dtype=np.float32),
    },
)
adam = types.AdamParams(learning_rate=1e-2)


def logprobs(training):
    return (
        training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    )


greedy = types.SamplingParams(max_tokens=6, temperature=0.0)


def continuation(sampler):
    prompt = types.ModelInput.from_ints(tokens[:2])
    return (
        sampler.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0].tokens
    )


def step(training):
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(adam).result()


if sys.argv[1] == "save":
    training = service.create_lora_training_client(base_model="demo", rank=4, seed=5).result()
    step(training), step(training)
    path = training.save_state("mid").result().path
    at_mid = logprobs(training)
    step(training), step(training)
    moved = logprobs(training)
    training.load_state_with_optimizer(path).result()
    loaded = logprobs(training)
    sampler_path = training.save_weights_for_sampler("frozen").result().path
    said = continuation(service.create_sampling_client(model_path=sampler_path).result())
    step(training)
    print(
        json.dumps(
            {
                "path": path,
                "at_mid": at_mid,
                "moved": moved,
                "loaded": loaded,
                "next": logprobs(training),
                "sampler_path": sampler_path,
                "said": said,
            }
        )
    )
else:
    path, sampler_path = sys.argv[2], sys.argv[3]
    said = continuation(service.create_sampling_client(model_path=sampler_path).result())
    training = service.create_training_client_from_state_with_optimizer(path).result()
    loaded = logprobs(training)
    step(training)
    model_id = training.get_info().model_id
    after = {"model_id": model_id, "loaded": loaded, "next": logprobs(training), "said": said}
    print(json.dumps(after))
