"""A supervised loop through the Tinker SDK: `cross_entropy` on one sentence falls, and the
weights saved for a sampler continue the sentence's prefix.

Prints one JSON line: the loss per target token before and after, what the server sent
back (each datum's logprobs and elementwise loss, `loss:sum`), the saved weights' path and
a greedy sample from them."""

import json

import numpy as np
import tinker
from tinker import types

service = tinker.ServiceClient()
training = service.create_lora_training_client(base_model="demo", rank=4, seed=7).result()
info = training.get_info()
tokenizer = training.get_tokenizer()
tokens = tokenizer.encode("what is the weather today sunny and warm", add_special_tokens=False)
weights = np.array([0.0] * 3 + [1.0] * (len(tokens) - 4), dtype=np.float32)
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64), "weights": weights},
)
losses = []
for _ in range(8):
    result = training.forward_backward([datum, datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    losses.append(result.metrics["loss:sum"] / float(2 * weights.sum()))
forward = training.forward([datum], "cross_entropy").result()  # no gradient
outputs = forward.loss_fn_outputs[0]
path = training.save_weights_for_sampler(name="final").result().path
sampler = service.create_sampling_client(model_path=path).result()
prompt = types.ModelInput.from_ints(tokens[:4])
greedy = types.SamplingParams(max_tokens=len(tokens) - 4, temperature=0.0)
sampled = sampler.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
rest = tinker.RestClient()  # the run and its checkpoints, as the registry has them
run = rest.get_training_run(info.model_id).result()
listed = rest.list_checkpoints(run.training_run_id).result().checkpoints
runs = rest.list_training_runs(limit=50).result()
print(
    json.dumps(
        {
            "model_id": info.model_id,
            "lora_rank": info.lora_rank,
            "tokenizer_id": info.model_data.tokenizer_id,
            "losses": losses,
            "after": forward.metrics["loss:sum"] / float(weights.sum()),
            "logprobs": outputs["logprobs"].tolist(),
            "compute_logprobs": scored,
            "elementwise_loss": outputs["elementwise_loss"].tolist(),
            "targets": len(tokens) - 1,
            "path": path,
            "run": [run.training_run_id, run.lora_rank, run.last_sampler_checkpoint.tinker_path],
            "checkpoints": [[c.checkpoint_id, c.checkpoint_type, c.tinker_path] for c in listed],
            "runs": [r.training_run_id for r in runs.training_runs],
            "runs_total": runs.cursor.total_count,
            "sentence": tokens[4:],
            "sampled": sampled.tokens,
            "sampled_logprobs": len(sampled.logprobs),
        }
    )
)
