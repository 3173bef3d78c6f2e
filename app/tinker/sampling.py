"""What an `asample` request asks for, read and checked before anything runs: no torch here
(the API process reads requests; `trainer` computes them).

Besides the samples: the prompt's logprobs (`prompt_logprobs`, the last N with
`prompt_logprobs_last_n`), the k likeliest tokens at each prompt position
(`topk_prompt_logprobs`) and at each sampled one (`topk_sample_logprobs`), the logprobs of
chosen ids at chosen prompt positions (`target_prompt_logprobs`, a dense or CSR int64 tensor
`[len(prompt) - 1, K]`, -1 for a cell that asks nothing), and `prompt_alt_tokens_k` draws
from the model's distribution at each prompt position after the first. All the prompt's come
from one forward pass over it. A request that asks for something unsupported, or out of
range, is a `UserError` naming the field (the SDK's `BadRequestError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from app.tinker import wire
from app.tinker.spec import CONTEXT, UserError

MAX_SAMPLES = 128
MAX_TOKENS = CONTEXT  # the context the capabilities announce
MAX_TOPK = 100  # a top-k width (prompt or sampled positions) and `prompt_alt_tokens_k`


@dataclass(frozen=True)
class Targets:
    """`target_prompt_logprobs`: each asked cell's token id (-1: none) and row (the prompt
    position less one), in the request's order and layout: dense `[rows, K]`, or CSR
    (`crow`, `cols`), which the answer keeps."""

    ids: np.ndarray  # int64, a cell each
    rows: np.ndarray  # int64, a cell each
    shape: tuple[int, int]
    crow: np.ndarray | None = None
    cols: np.ndarray | None = None

    def answer(self, logprobs: np.ndarray) -> wire.OutTensor:
        """The answer's float32 tensor: `logprobs` (a cell each) in the request's layout."""
        return wire.OutTensor(
            np.asarray(logprobs, dtype=np.float32), list(self.shape), self.crow, self.cols
        )


@dataclass(frozen=True)
class Asked:
    """A sample request, checked (but for the vocabulary and the stop strings, which need
    the model: `check_vocabulary`, and the tokenizer)."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # 0: every token
    seed: int | None
    stop: list[Any]
    stop_at_eos: bool  # False: `stop` given as [] (the SDK's "no stop tokens, not even EOS")
    prompt_logprobs: bool
    last_n: int | None
    topk_prompt: int
    topk_sample: int
    targets: Targets | None
    alt_k: int

    @property
    def scores_prompt(self) -> bool:
        """Whether anything of the prompt is asked (one forward pass over it)."""
        return bool(self.prompt_logprobs or self.topk_prompt or self.targets or self.alt_k)


def _count(value: Any, field: str, low: int, high: int, default: int = 0) -> int:
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UserError(f"{field}: an integer from {low} to {high}")
    return value


def _prompt(body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list):
        raise UserError("prompt.chunks: a list of token chunks")
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        given = chunk.get("tokens") if isinstance(chunk, dict) else None
        if not isinstance(given, list):
            raise UserError(f"prompt.chunks[{i}]: only token chunks are supported (no images)")
        tokens += given
    if not tokens:
        raise UserError("prompt.chunks: no tokens")
    return tokens


def _number(params: dict[str, Any], key: str, high: float, *, zero: bool = True) -> float:
    """A number from 0 (above it where `zero` is False) to `high`; 1 where not given."""
    value = params.get(key, 1.0)
    value = 1.0 if value is None else value
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not (value >= 0 if zero else value > 0) or not value <= high:
        low = "from 0" if zero else "above 0,"
        raise UserError(f"sampling_params.{key}: a number {low} to {high:g}")
    return float(value)


def read(body: dict[str, Any]) -> Asked:
    """The request's fields, each checked; a `UserError` names the first bad one."""
    params = body.get("sampling_params")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise UserError("sampling_params: an object")
    prompt = _prompt(body)
    n = _count(body.get("num_samples"), "num_samples", 1, MAX_SAMPLES, default=1)
    max_tokens = _count(params.get("max_tokens"), "sampling_params.max_tokens", 1, MAX_TOKENS, 16)
    if len(prompt) + max_tokens > CONTEXT:
        raise UserError(
            f"prompt: its {len(prompt)} tokens and sampling_params.max_tokens ({max_tokens}) "
            f"pass the context of {CONTEXT} tokens"
        )
    top_k = params.get("top_k", -1)
    top_k = -1 if top_k is None else top_k
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise UserError("sampling_params.top_k: -1 (every token) or a count from 1")
    seed = params.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise UserError("sampling_params.seed: an integer from 0")
    if body.get("record_stability_info"):
        raise UserError(
            "record_stability_info: not supported here (no stability records for "
            "StableReinforce); leave it off"
        )
    with_prompt = bool(body.get("prompt_logprobs"))
    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None and (
        not with_prompt
        or isinstance(last_n, bool)
        or not isinstance(last_n, int)
        or not 1 <= last_n < len(prompt)
    ):
        raise UserError(
            "prompt_logprobs_last_n: needs prompt_logprobs, from 1 to the prompt's length - 1"
        )
    stop = params.get("stop")
    if stop is not None and not isinstance(stop, str | list):
        raise UserError("sampling_params.stop: a string, or a list of strings or token ids")
    return Asked(
        prompt=prompt,
        num_samples=n,
        max_tokens=max_tokens,
        temperature=_number(params, "temperature", 100),
        top_p=_number(params, "top_p", 1, zero=False),  # 0 would keep no token
        top_k=max(top_k, 0),
        seed=seed,
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_at_eos=stop != [],
        prompt_logprobs=with_prompt,
        last_n=last_n,
        topk_prompt=_count(body.get("topk_prompt_logprobs"), "topk_prompt_logprobs", 0, MAX_TOPK),
        topk_sample=_count(body.get("topk_sample_logprobs"), "topk_sample_logprobs", 0, MAX_TOPK),
        targets=read_targets(body.get("target_prompt_logprobs"), len(prompt)),
        alt_k=_count(body.get("prompt_alt_tokens_k"), "prompt_alt_tokens_k", 0, MAX_TOPK),
    )


def _ints(value: Any, field: str) -> np.ndarray:
    if not isinstance(value, list) or any(
        isinstance(v, bool) or not isinstance(v, int) for v in value
    ):
        raise UserError(f"{field}: a list of integers")
    return np.array(value, dtype=np.int64)


def read_targets(given: Any, prompt_length: int) -> Targets | None:
    """`target_prompt_logprobs` as the SDK sends it (its `TensorData`: `data`, `dtype`,
    `shape`, and for CSR `sparse_crow_indices`, `sparse_col_indices`)."""
    if given is None:
        return None
    field = "target_prompt_logprobs"
    if not isinstance(given, dict):
        raise UserError(f"{field}: a tensor (data, dtype, shape)")
    if given.get("dtype") != "int64":
        raise UserError(f"{field}.dtype: must be int64 (token ids)")
    shape = given.get("shape")
    rows = prompt_length - 1
    if not isinstance(shape, list) or len(shape) != 2 or shape[0] != rows:
        raise UserError(f"{field}.shape: must be [len(prompt) - 1, K], here [{rows}, K]")
    width = shape[1]
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise UserError(f"{field}.shape: K, the cells of a row, must be 1 or more")
    ids = _ints(given.get("data"), f"{field}.data")
    crow, cols = given.get("sparse_crow_indices"), given.get("sparse_col_indices")
    if (crow is None) != (cols is None):
        raise UserError(f"{field}: sparse_crow_indices and sparse_col_indices go together")
    if crow is None:
        if ids.size != rows * width:
            raise UserError(f"{field}.data: {ids.size} ids for the shape's {rows * width} cells")
        cell_rows = np.repeat(np.arange(rows, dtype=np.int64), width)
        crow_array = cols_array = None
    else:
        crow_array = _ints(crow, f"{field}.sparse_crow_indices")
        cols_array = _ints(cols, f"{field}.sparse_col_indices")
        counts = np.diff(crow_array) if crow_array.size else crow_array
        if (
            crow_array.size != rows + 1
            or crow_array[0] != 0
            or (counts < 0).any()
            or crow_array[-1] != ids.size
            or cols_array.size != ids.size
        ):
            raise UserError(
                f"{field}.sparse_crow_indices: {rows + 1} row offsets from 0 to the number "
                "of ids, never decreasing, a column index for each id"
            )
        if ((cols_array < 0) | (cols_array >= width)).any():
            raise UserError(f"{field}.sparse_col_indices: a column outside 0..{width - 1}")
        cell_rows = np.repeat(np.arange(rows, dtype=np.int64), counts)
    if (ids < -1).any():
        raise UserError(f"{field}.data: a token id, or -1 for a cell that asks nothing")
    if not (ids >= 0).any():
        raise UserError(f"{field}.data: no token id (every cell is -1)")
    return Targets(ids, cell_rows, (rows, width), crow_array, cols_array)


def check_vocabulary(asked: Asked, vocab: int) -> None:
    """Every token id of the request within the model's vocabulary."""
    bad = [t for t in asked.prompt if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise UserError(f"prompt: token {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    if asked.targets is not None and (asked.targets.ids >= vocab).any():
        first = int(asked.targets.ids[asked.targets.ids >= vocab][0])
        raise UserError(
            f"target_prompt_logprobs.data: token {first} is outside the vocabulary (0..{vocab - 1})"
        )
