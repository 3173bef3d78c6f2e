"""`app.tinker.wire` against the Tinker SDK's own protobuf code (tinker 0.38.0, in
`.venv-tinker`): what the SDK encodes, Trainyard reads; what Trainyard writes, the SDK
decodes to the same values. Also: bodies that are not the message are a `WireError`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from app.tinker import wire

pytestmark = [pytest.mark.any_database]

PYTHON = Path(__file__).resolve().parents[1] / ".venv-tinker" / "bin" / "python"

ENCODE = """
import sys, numpy as np
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

def td(values, dtype):
    return types.TensorData.from_numpy(np.array(values, dtype=dtype))

data = [
    types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 70000]),
        loss_fn_inputs={"target_tokens": td([6, 7, 8], np.int64),
                        "weights": td([0.0, 1.0, 0.5], np.float32)}),
    types.Datum(
        model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1]),
                                             types.EncodedTextChunk(tokens=[2, 3])]),
        loss_fn_inputs={"target_tokens": td([2, 3, 4], np.int64),
                        "advantages": td([-1.5, 0.0, 2.25], np.float32),
                        "logprobs": types.TensorData(
                            data=[-0.5, -7.0], dtype="float32", shape=[2, 3],
                            sparse_crow_indices=[0, 1, 2], sparse_col_indices=[2, 0])}),
]
request = types.ForwardBackwardRequest(
    forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}),
    model_id="tinker-s1-0", seq_id=2**31 - 1)
message = forward_backward_request_to_proto(request)
message.forward_only = True
sys.stdout.buffer.write(message.SerializeToString())
"""

DECODE = """
import json, sys
import numpy as np
from tinker.proto import response_conv
fb = response_conv.deserialize_forward_backward_output(open(sys.argv[1], "rb").read())
sample = response_conv.deserialize_sample_response(open(sys.argv[2], "rb").read())
print(json.dumps({
    "type": fb.loss_fn_output_type, "metrics": fb.metrics,
    "outputs": [{k: [v.dtype, v.shape, v.tolist()] for k, v in o.items()}
                for o in fb.loss_fn_outputs],
    "sequences": [[s.stop_reason, s.tokens, s.logprobs] for s in sample.sequences],
    "topk": [s.topk_logprobs for s in sample.sequences],
}))
if len(sys.argv) > 3:  # a sample answer with each of the prompt's fields
    full = response_conv.deserialize_sample_response(open(sys.argv[3], "rb").read())
    target, alt = full.target_prompt_logprobs, full.prompt_alt_tokens

    def tensor(t):
        data = np.asarray(t.data).tolist()
        return [t.dtype, t.shape, data, t.sparse_crow_indices, t.sparse_col_indices]

    print(json.dumps({
        "target": tensor(target),
        "alt": [tensor(alt.tokens), tensor(alt.logprobs)],
        "topk": full.sequences[0].topk_logprobs,
    }))
"""


def sdk(code: str, *args: str) -> bytes:
    if not PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{PYTHON} is missing: CI builds it (make .venv-tinker/.installed)")
        pytest.skip("no Tinker SDK environment: make .venv-tinker/.installed")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run(
        [str(PYTHON), "-c", code, *args], env=env, capture_output=True, timeout=120, check=False
    )
    assert ran.returncode == 0, ran.stderr.decode()
    return ran.stdout


def test_a_forward_backward_request_the_sdk_encodes_reads_back_whole() -> None:
    request = wire.read_forward_backward(sdk(ENCODE))
    assert (request.model_id, request.seq_id) == ("tinker-s1-0", 2**31 - 1)
    assert (request.loss_fn, request.forward_only) == ("ppo", True)
    assert request.loss_fn_config == pytest.approx({"clip_low_threshold": 0.7})
    first, second = request.data
    assert first.tokens == [5, 6, 70000]
    assert first.inputs["target_tokens"].array.tolist() == [6, 7, 8]
    assert first.inputs["weights"].array.tolist() == [0.0, 1.0, 0.5]
    assert second.tokens == [1, 2, 3]  # chunks joined
    assert second.inputs["advantages"].array.tolist() == [-1.5, 0.0, 2.25]
    # A sparse CSR tensor arrives dense, in its shape's row-major order.
    logprobs = second.inputs["logprobs"]
    assert logprobs.shape == [2, 3]
    assert logprobs.array.tolist() == [0.0, 0.0, -0.5, -7.0, 0.0, 0.0]


def test_what_trainyard_writes_the_sdk_decodes(tmp_path: Path) -> None:
    outputs = [
        {
            "logprobs": np.array([-1.0, -2.5], np.float32),
            "elementwise_loss": np.zeros(2, np.float32),
        },
        {"logprobs": np.array([-0.25], np.float32), "elementwise_loss": np.ones(1, np.float32)},
    ]
    fb = tmp_path / "fb.bin"
    fb.write_bytes(wire.write_forward_backward_output(outputs, {"loss:sum": 3.75}))
    sample = tmp_path / "sample.bin"
    sequences = [
        wire.Sequence([4, 5, 6], [-0.5, -1.0, -1.5], "length"),
        wire.Sequence([7], [-2.0], "stop"),
    ]
    sample.write_bytes(wire.write_sample_response(wire.SampleAnswer(sequences)))
    decoded = json.loads(sdk(DECODE, str(fb), str(sample)))
    assert decoded["type"] == "ArrayRecord" and decoded["metrics"] == {"loss:sum": 3.75}
    # What the journal reads back of it (the dashboard's loss): the metrics alone.
    assert wire.read_output_metrics(fb.read_bytes()) == decoded["metrics"]
    assert decoded["outputs"] == [
        {"logprobs": ["float32", [2], [-1.0, -2.5]], "elementwise_loss": ["float32", [2], [0, 0]]},
        {"logprobs": ["float32", [1], [-0.25]], "elementwise_loss": ["float32", [1], [1.0]]},
    ]
    assert decoded["sequences"] == [
        ["length", [4, 5, 6], [-0.5, -1.0, -1.5]],
        ["stop", [7], [-2.0]],
    ]
    assert decoded["topk"] == [None, None]  # not asked


def test_the_sample_answers_extra_fields_decode_in_the_sdk(tmp_path: Path) -> None:
    """`topk_sample_logprobs` on a sequence, `target_prompt_logprobs` in a CSR layout (the
    request's) and `prompt_alt_tokens`, as the SDK's own decoder reads them."""
    topk = wire.TopK(
        np.array([[4, 9], [5, 0]], np.int32),
        np.array([[-0.5, -2.0], [-0.25, wire.MASK_LOGPROB]], np.float32),
    )
    target = wire.OutTensor(
        np.array([-1.5, 0.0, -3.0], np.float32),
        [3, 4],
        crow=np.array([0, 2, 2, 3]),
        cols=np.array([0, 3, 1]),
    )
    alt = (
        wire.OutTensor(np.array([1, 2, 3, 4], np.int64), [2, 2]),
        wire.OutTensor(np.array([-1.0, -2.0, -3.0, -4.0], np.float32), [2, 2]),
    )
    answer = wire.SampleAnswer(
        [wire.Sequence([4, 5], [-0.5, -0.25], "length", topk)],
        target_prompt_logprobs=target,
        prompt_alt_tokens=alt,
    )
    paths = [tmp_path / name for name in ("fb.bin", "plain.bin", "full.bin")]
    paths[0].write_bytes(wire.write_forward_backward_output([], {}))
    paths[1].write_bytes(wire.write_sample_response(wire.SampleAnswer([])))
    paths[2].write_bytes(wire.write_sample_response(answer))
    decoded = json.loads(sdk(DECODE, *map(str, paths)).splitlines()[-1])
    assert decoded["topk"] == [[[4, -0.5], [9, -2.0]], [[5, -0.25]]]
    assert decoded["target"] == ["float32", [3, 4], [-1.5, 0.0, -3.0], [0, 2, 2, 3], [0, 3, 1]]
    assert decoded["alt"] == [
        ["int64", [2, 2], [1, 2, 3, 4], None, None],
        ["float32", [2, 2], [-1.0, -2.0, -3.0, -4.0], None, None],
    ]


def test_an_empty_message_is_a_request_of_defaults() -> None:
    assert wire.read_forward_backward(b"") == wire.ForwardBackwardRequest()


@pytest.mark.parametrize(
    "body",
    [
        b"\x08",  # a varint cut short
        b"\x1a\x05\x0a",  # a datum longer than the body
        b"\x0b",  # wire type 3 (groups): not in this schema
        b"\x1a\x04\x12\x02\x0a\x00",  # a tensor named "" with no dtype
        b"\x1a\x04\x0a\x02\x12\x00",  # an image chunk
    ],
)
def test_a_body_that_is_not_the_message_is_a_wire_error(body: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.read_forward_backward(body)
