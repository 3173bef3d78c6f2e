"""Top-k prompt logprobs through the Tinker SDK, from the base model (no adapter): prints one
JSON line with the prompt, the SDK's `topk_prompt_logprobs` (whole prompt, and the last 3
positions only) and its `prompt_logprobs`, and the model's local directory."""

import json
import math
import sys

import tinker
from tinker import types

k = int(sys.argv[1])
service = tinker.ServiceClient()
sampler = service.create_sampling_client(base_model="demo")
training = service.create_lora_training_client(base_model="demo", rank=1).result()
directory = training.get_info().model_data.tokenizer_id
tokens = training.get_tokenizer().encode(
    "top tokens of every prompt position", add_special_tokens=False
)
prompt = types.ModelInput.from_ints(tokens)
params = types.SamplingParams(max_tokens=1, temperature=1.0)
whole = sampler.sample(
    prompt,
    num_samples=1,
    sampling_params=params,
    include_prompt_logprobs=True,
    topk_prompt_logprobs=k,
).result()
last = sampler.sample(
    prompt,
    num_samples=1,
    sampling_params=params,
    include_prompt_logprobs=True,
    topk_prompt_logprobs=k,
    prompt_logprobs_last_n=3,
).result()
alone = sampler.sample(
    prompt, num_samples=1, sampling_params=params, topk_prompt_logprobs=k
).result()
try:
    sampler.sample(
        prompt, num_samples=1, sampling_params=params, topk_prompt_logprobs=1000
    ).result()
    refused = "accepted"
except tinker.BadRequestError as exc:
    refused = f"BadRequestError: {exc}"
print(
    json.dumps(
        {
            "directory": directory,
            "tokens": tokens,
            "topk": whole.topk_prompt_logprobs,
            "prompt_logprobs": [
                None if x is None or math.isnan(x) else x for x in whole.prompt_logprobs
            ],
            "last": last.topk_prompt_logprobs,
            "alone": alone.topk_prompt_logprobs,
            "alone_prompt_logprobs": alone.prompt_logprobs,
            "refused": refused,
        }
    )
)
