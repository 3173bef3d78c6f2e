"""Custom losses through the Tinker SDK: `forward_backward_custom` with a Python callable and
with a `LossHandle` from `create_custom_loss`, both the SDK runs on the client (a `forward`,
the loss and its gradient in torch, then a `forward_backward` of `cross_entropy` weighted by
that gradient), beside a run of the same seed trained with the built-in `cross_entropy`.

The custom loss is cross-entropy written by hand, so the three runs take the same step.
Prints one JSON line: each run's loss after the step (a `forward`), and what each
`forward_backward` reported."""

import json

import numpy as np
import tinker
import torch
from tinker import types

service = tinker.ServiceClient()


def start():
    return service.create_lora_training_client(base_model="demo", rank=4, seed=11).result()


builtin, by_callable, by_handle = start(), start(), start()
tokens = builtin.get_tokenizer().encode("custom losses run on the client", add_special_tokens=False)
weights = np.array([0.0] + [1.0] * (len(tokens) - 2), dtype=np.float32)
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64), "weights": weights},
)


def by_hand(data, logprobs_list):
    loss = sum(
        -(lp * d.loss_fn_inputs["weights"].to_torch()).sum()
        for d, lp in zip(data, logprobs_list, strict=True)
    )
    return loss, {"by_hand": float(loss.detach())}


def neg_ll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


handle = service.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result()
adam = types.AdamParams(learning_rate=1e-2)
reported = {}
for name, client, step in (
    ("builtin", builtin, lambda c: c.forward_backward([datum], "cross_entropy")),
    ("callable", by_callable, lambda c: c.forward_backward_custom([datum], by_hand)),
    ("handle", by_handle, lambda c: c.forward_backward_custom([datum], handle)),
):
    backward = step(client)
    stepped = client.optim_step(adam)  # submitted before the custom loss's backward is sent
    reported[name] = backward.result().metrics
    stepped.result()
after = {
    name: client.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    for name, client in (("builtin", builtin), ("callable", by_callable), ("handle", by_handle))
}
print(json.dumps({"reported": reported, "after": after, "torch": torch.__version__}))
