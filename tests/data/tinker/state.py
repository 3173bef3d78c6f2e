"""save_state, load_state and create_training_client_from_state through the Tinker SDK.

`save`: train two steps, save the state as `mid`, train two more, load `mid` back, and print
the logprobs at `mid`, after loading, and after one more step from the loaded state. `resume
PATH` (run after the server restarted): a new training client from PATH with its optimizer,
its logprobs, and the same one more step. Prints one JSON line."""

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
    step(training)
    print(
        json.dumps(
            {
                "path": path,
                "at_mid": at_mid,
                "moved": moved,
                "loaded": loaded,
                "next": logprobs(training),
            }
        )
    )
else:
    path = sys.argv[2]
    training = service.create_training_client_from_state_with_optimizer(path).result()
    loaded = logprobs(training)
    step(training)
    print(
        json.dumps(
            {"model_id": training.get_info().model_id, "loaded": loaded, "next": logprobs(training)}
        )
    )
