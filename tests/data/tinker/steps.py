"""A short supervised run through the Tinker SDK for the dashboard: four optimizer steps
(the second applies two `forward_backward` calls, each step its own learning rate), then a
`forward_backward` not yet stepped. With the argument `pause`, it prints the model id after the
second step and waits for a line on stdin before the third.

Prints one JSON line: the run's model id, and per step the summed `loss:sum` of its
`forward_backward` results as the SDK got them, and the learning rate asked."""

import json
import sys

import numpy as np
import tinker
from tinker import types

service = tinker.ServiceClient()
training = service.create_lora_training_client(base_model="demo", rank=4, seed=3).result()
tokenizer = training.get_tokenizer()
tokens = tokenizer.encode("the dashboard draws what the journal holds", add_special_tokens=False)
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={
        "target_tokens": np.array(tokens[1:], dtype=np.int64),
        "weights": np.ones(len(tokens) - 1, dtype=np.float32),
    },
)
losses, rates = [], [1e-2, 5e-3, 2e-3, 1e-3]
for step, rate in enumerate(rates):
    calls = 2 if step == 1 else 1
    total = 0.0
    for _ in range(calls):
        total += training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    training.optim_step(types.AdamParams(learning_rate=rate)).result()
    losses.append(total)
    if step == 1 and sys.argv[1:] == ["pause"]:
        print(json.dumps({"model_id": training.get_info().model_id, "losses": losses}), flush=True)
        sys.stdin.readline()
training.forward_backward([datum], "cross_entropy").result()  # not stepped: no point yet
print(json.dumps({"model_id": training.get_info().model_id, "losses": losses, "rates": rates}))
