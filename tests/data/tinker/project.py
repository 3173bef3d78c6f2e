"""The Tinker SDK with a project key (`TINKER_API_KEY`: the key's `tinker_api_key`). Prints
one JSON line of what each step gave: a value, or the class of the SDK's error and its
message.

`python project.py train BASE`: a training run on BASE (one `cross_entropy` step), its
weights saved as `mine`, a greedy sample from them; the runs the key lists.
`python project.py other BASE PATH RUN`: what a key reaches of PATH and RUN (a run's saved
weights and the run), and whether it trains and samples BASE."""

import json
import sys

import numpy as np
import tinker
from tinker import types

outcomes = {}


def attempt(name, call):
    try:
        outcomes[name] = call()
    except Exception as exc:  # the class the SDK raised, and the message
        outcomes[name] = f"{type(exc).__name__}: {exc}"


PROMPT = [3, 5, 7, 9]
GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0)


def sample(sampler):
    prompt = types.ModelInput.from_ints(PROMPT)
    return (
        sampler.sample(prompt, num_samples=1, sampling_params=GREEDY).result().sequences[0].tokens
    )


def train(base):
    training = service.create_lora_training_client(base_model=base, rank=2, seed=3).result()
    tokens = [*PROMPT, 11, 13, 15, 17]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )
    loss = training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = training.save_weights_for_sampler(name="mine").result().path
    return {
        "model_id": training.get_info().model_id,
        "loss": loss,
        "path": path,
        "said": sample(service.create_sampling_client(model_path=path).result()),
    }


def runs():
    return [r.training_run_id for r in rest.list_training_runs(limit=50).result().training_runs]


service = tinker.ServiceClient()
rest = tinker.RestClient()
mode, base = sys.argv[1], sys.argv[2]
if mode == "train":
    attempt("trained", lambda: train(base))
    attempt("runs", runs)
else:
    path, run = sys.argv[3], sys.argv[4]
    attempt("runs", runs)
    attempt("run", lambda: rest.get_training_run(run).result().training_run_id)
    attempt("checkpoints", lambda: len(rest.list_checkpoints(run).result().checkpoints))
    attempt("sample path", lambda: sample(service.create_sampling_client(model_path=path).result()))
    attempt("sample base", lambda: sample(service.create_sampling_client(base_model=base).result()))
    attempt(
        "train base",
        lambda: service.create_lora_training_client(base_model=base, rank=2).result().model_id,
    )
print(json.dumps(outcomes))
