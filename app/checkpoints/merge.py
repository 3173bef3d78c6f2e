"""A checkpoint's LoRA adapter merged into its base model: a Hugging Face directory (the
base's config, tokenizer and other small files, its safetensors with `W += scale * B @ A`
applied to every LoRA'd weight) streamed as an uncompressed tar. Synchronous: the caller
iterates it in a thread.

Two phases. `plan` reads headers only (adapter_config.json, the safetensors headers of
the adapter and of the base's shards) and checks everything a merge needs, so that each
refusal is an answer (`Refusal`) before the first byte is sent; it opens every file it
will read (an open file survives the checkpoint's deletion meanwhile). `MergedExport`
then yields the tar: a merged shard is the base shard byte for byte (its header too: a
merge keeps each tensor's dtype and shape, hence every offset) with each LoRA'd weight's
bytes replaced, computed a block of rows at a time. Memory stays at about `CHUNK` plus the
current module's A and B, whatever the model's size; every size is known up front, so
the answer carries a Content-Length.
"""

from __future__ import annotations

import json
import math
import os
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CHUNK = 1 << 20
BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PREFIX = "base_model.model."
# Weights in other formats than the safetensors the merge writes: never copied (a stale,
# unmerged copy of the weights a loader could pick instead, and the bulk of the bytes).
OTHER_WEIGHTS = (
    ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".ot", ".npz",
    ".safetensors", ".tflite",
)  # fmt: skip
FLOATS = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
MAX_HEADER = 100 << 20  # safetensors' own limit


class Refusal(Exception):
    """Why this checkpoint cannot be exported merged; `kind` is the problem's slug."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _unmergeable(message: str) -> Refusal:
    return Refusal("not-mergeable", message)


# -- safetensors headers -----------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int


@dataclass
class Safetensors:
    """An open safetensors file and its header's tensors."""

    name: str
    handle: IO[bytes]
    size: int
    tensors: dict[str, Tensor]


def _read_safetensors(name: str, handle: IO[bytes]) -> Safetensors:
    size = os.fstat(handle.fileno()).st_size
    head = os.pread(handle.fileno(), 8, 0)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < length <= min(MAX_HEADER, size - 8):
        raise _unmergeable(f"{name} is not a safetensors file (its header length is wrong)")
    try:
        header = json.loads(os.pread(handle.fileno(), length, 8))
    except ValueError as exc:
        raise _unmergeable(f"{name}: its safetensors header is not JSON") from exc
    if not isinstance(header, dict):
        raise _unmergeable(f"{name}: its safetensors header is not an object")
    base = 8 + length
    tensors: dict[str, Tensor] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            start, end = (int(x) for x in entry["data_offsets"])
            tensor = Tensor(
                str(entry["dtype"]), tuple(int(x) for x in entry["shape"]), base + start, base + end
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise _unmergeable(f"{name}: tensor {key!r} has a malformed header entry") from exc
        if not base <= tensor.start <= tensor.end <= size:
            raise _unmergeable(f"{name}: tensor {key!r} lies outside the file")
        tensors[key] = tensor
    return Safetensors(name, handle, size, tensors)


def _itemsize(file: Safetensors, key: str) -> int:
    tensor = file.tensors[key]
    itemsize = FLOATS.get(tensor.dtype)
    if itemsize is None:
        raise _unmergeable(
            f"{file.name}: tensor {key!r} is {tensor.dtype}; a merge needs floating point "
            f"({', '.join(FLOATS)}): a quantized base cannot take a merge"
        )
    if tensor.end - tensor.start != math.prod(tensor.shape) * itemsize:
        raise _unmergeable(f"{file.name}: tensor {key!r}'s bytes do not match its shape")
    return itemsize


def _load(file: Safetensors, key: str) -> torch.Tensor:
    import torch

    _itemsize(file, key)
    tensor = file.tensors[key]
    raw = bytearray(_pread(file.handle, tensor.start, tensor.end - tensor.start))
    if not raw:
        return torch.zeros(tensor.shape, dtype=_dtype(tensor.dtype))
    return torch.frombuffer(raw, dtype=_dtype(tensor.dtype)).reshape(tensor.shape)


def _dtype(name: str) -> torch.dtype:
    import torch

    return {
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F32": torch.float32,
        "F64": torch.float64,
    }[name]


def _pread(handle: IO[bytes], offset: int, length: int) -> bytes:
    data = os.pread(handle.fileno(), length, offset)
    if len(data) != length:
        raise OSError(f"{handle.name}: changed while it was exported (short read)")
    return data


# -- the adapter -------------------------------------------------------------------------


@dataclass(frozen=True)
class Lora:
    """`W += scale * B @ A` (transposed when the module is `fan_in_fan_out`)."""

    a: str
    b: str
    scale: float


@dataclass(frozen=True)
class Replace:
    """A tensor the adapter holds whole (`modules_to_save`, a trained bias)."""

    key: str


def _config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _unmergeable(f"the checkpoint's adapter_config.json cannot be read: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise _unmergeable("the checkpoint's adapter is not a PEFT LoRA adapter")
    for flag, what in (
        ("use_dora", "DoRA"),
        ("lora_bias", "a LoRA bias"),
        ("layer_replication", "layer replication"),
        ("target_parameters", "LoRA on parameters"),
        ("trainable_token_indices", "trainable tokens"),
    ):
        if config.get(flag):
            raise _unmergeable(f"the adapter uses {what} (`{flag}`), which this merge does not")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise _unmergeable("the adapter's config has no rank `r`")
    return config


def _pattern(patterns: Any, module: str) -> Any:
    """PEFT's `get_pattern_key`: the first key of `rank_pattern` / `alpha_pattern` that
    matches the module's name, or its end at a dot (with re2: a pattern from a file
    cannot stall the thread)."""
    import re2

    for key, value in (patterns or {}).items():
        try:
            if re2.match(rf"(.*\.)?({key})$", module):
                return value
        except re2.error as exc:
            raise _unmergeable(f"the adapter's pattern {key!r} is no regular expression") from exc
    return None


def _scale(config: dict[str, Any], module: str, rank: int) -> float:
    r = _pattern(config.get("rank_pattern"), module) or config["r"]
    alpha = _pattern(config.get("alpha_pattern"), module) or config.get("lora_alpha", 8)
    if r != rank:
        raise _unmergeable(f"the adapter's {module} has rank {rank}; its config says {r}")
    return float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)


def _operations(
    adapter: Safetensors, config: dict[str, Any], base: dict[str, Safetensors]
) -> dict[str, Lora | Replace]:
    """What to do to each base tensor (by name), from the adapter's tensors."""
    ops: dict[str, Lora | Replace] = {}
    loras: dict[str, dict[str, str]] = {}
    for key in adapter.tensors:
        name = key.removeprefix(PREFIX)
        for part in ("lora_A", "lora_B"):
            if name.endswith(f".{part}.weight"):
                loras.setdefault(name.removesuffix(f".{part}.weight"), {})[part] = key
                break
        else:
            if name not in base:
                raise _unmergeable(
                    f"the adapter's tensor {key!r} is neither a LoRA pair nor a base weight"
                )
            ops[name] = Replace(key)
    for module, pair in sorted(loras.items()):
        target = f"{module}.weight"
        if len(pair) != 2:
            raise _unmergeable(f"the adapter's {module} lacks its lora_A or lora_B")
        if target not in base:
            raise _unmergeable(f"the base model has no weight {target!r} for the adapter")
        if target in ops:
            raise _unmergeable(f"the adapter changes {target!r} twice")
        a, b = adapter.tensors[pair["lora_A"]], adapter.tensors[pair["lora_B"]]
        _itemsize(adapter, pair["lora_A"])
        _itemsize(adapter, pair["lora_B"])
        weight = base[target].tensors[target]
        rows, cols = weight.shape if len(weight.shape) == 2 else (-1, -1)
        if config.get("fan_in_fan_out"):
            rows, cols = cols, rows
        if len(a.shape) != 2 or len(b.shape) != 2 or (b.shape[0], a.shape[1]) != (rows, cols):
            raise _unmergeable(
                f"the adapter's {module} (A {list(a.shape)}, B {list(b.shape)}) does not fit "
                f"the base weight {list(weight.shape)}"
            )
        if a.shape[0] != b.shape[1]:
            raise _unmergeable(f"the adapter's {module} has A and B of different ranks")
        ops[target] = Lora(pair["lora_A"], pair["lora_B"], _scale(config, module, a.shape[0]))
    for target, op in ops.items():
        file = base[target]
        _itemsize(file, target)
        if isinstance(op, Replace):
            _itemsize(adapter, op.key)
            if adapter.tensors[op.key].shape != file.tensors[target].shape:
                raise _unmergeable(f"the adapter's {op.key!r} does not have {target!r}'s shape")
    return ops


# -- the base model ----------------------------------------------------------------------


def _inside(path: Path, roots: Sequence[Path]) -> Path:
    """`path` with its symlinks resolved, which must stay under a model root (a Hugging
    Face cache's snapshot links into its blobs, under the same root)."""
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root.resolve()) for root in roots):
        raise Refusal("base-not-local", f"{path.name} of the base model leads outside the roots")
    return resolved


def _base_files(base: Path, roots: Sequence[Path]) -> tuple[list[Path], list[str]]:
    """The base directory's small files to copy, and its safetensors shards' names."""
    try:
        config = json.loads((base / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise _unmergeable(f"the base model has no readable config.json: {exc}") from exc
    if isinstance(config, dict) and config.get("quantization_config"):
        raise _unmergeable("the base model is quantized: a LoRA merges into full weights only")
    if (base / INDEX).is_file():
        try:
            weight_map = json.loads(_inside(base / INDEX, roots).read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _unmergeable(f"the base model's {INDEX} cannot be read") from exc
        if not all(isinstance(s, str) and s and s == Path(s).name != ".." for s in shards):
            raise _unmergeable(f"the base model's {INDEX} names a shard outside its directory")
    elif (base / SINGLE).is_file():
        shards = [SINGLE]
    else:
        raise _unmergeable(
            "the base model holds no safetensors weights (model.safetensors or an index)"
        )
    small = sorted(
        entry
        for entry in base.iterdir()
        if not entry.name.startswith(".")
        and not entry.name.endswith(OTHER_WEIGHTS)
        and entry.name not in shards
        and entry.is_file()
    )
    return small, shards


# -- the tar -----------------------------------------------------------------------------


@dataclass
class Member:
    name: str
    size: int
    mtime: float
    handle: IO[bytes]
    ops: list[tuple[Tensor, Lora | Replace]] = field(default_factory=list)


def _header(name: str, size: int, mtime: float) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, int(mtime), 0o644
    return info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")


def _padding(size: int, unit: int) -> int:
    return -size % unit


@dataclass
class MergedExport:
    """The planned tar: its size, and its bytes (`chunks`), read and merged as they go."""

    folder: str
    members: list[Member]
    adapter: Safetensors
    config: dict[str, Any]
    fan_in_fan_out: bool

    @property
    def size(self) -> int:
        total = 0
        for m in self.members:
            total += len(_header(f"{self.folder}/{m.name}", m.size, m.mtime))
            total += m.size + _padding(m.size, BLOCK)
        return total + 2 * BLOCK + _padding(total + 2 * BLOCK, RECORD)

    def close(self) -> None:
        for m in self.members:
            m.handle.close()
        self.adapter.handle.close()

    def chunks(self) -> Iterator[bytes]:
        """The tar's bytes, about `CHUNK` at a time; closes every file at the end."""
        try:
            written = 0
            for member in self.members:
                header = _header(f"{self.folder}/{member.name}", member.size, member.mtime)
                yield header
                yield from self._member(member)
                yield bytes(_padding(member.size, BLOCK))
                written += len(header) + member.size + _padding(member.size, BLOCK)
            end = 2 * BLOCK + _padding(written + 2 * BLOCK, RECORD)
            yield bytes(end)
        finally:
            self.close()

    def _member(self, member: Member) -> Iterator[bytes]:
        at = 0
        for tensor, op in member.ops:  # in the file's order
            yield from _copy(member.handle, at, tensor.start)
            if isinstance(op, Replace):
                yield from self._replace(tensor, op)
            else:
                yield from self._merge(member, tensor, op)
            at = tensor.end
        yield from _copy(member.handle, at, member.size)

    def _replace(self, tensor: Tensor, op: Replace) -> Iterator[bytes]:
        """The adapter's tensor in the base's dtype, `CHUNK` bytes of it at a time."""
        import torch

        source = self.adapter.tensors[op.key]
        itemsize = FLOATS[source.dtype]
        step = max(1, CHUNK // itemsize) * itemsize
        for at in range(source.start, source.end, step):
            raw = bytearray(_pread(self.adapter.handle, at, min(step, source.end - at)))
            part = torch.frombuffer(raw, dtype=_dtype(source.dtype)).to(_dtype(tensor.dtype))
            yield part.view(torch.uint8).numpy().tobytes()

    def _merge(self, member: Member, tensor: Tensor, op: Lora) -> Iterator[bytes]:
        import torch

        dtype = _dtype(tensor.dtype)
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        a = _load(self.adapter, op.a).to(compute)
        b = _load(self.adapter, op.b).to(compute)
        if self.fan_in_fan_out:  # the weight is (in, out): its rows i:j are (B @ A).T[i:j]
            a, b = b.T.contiguous(), a.T.contiguous()
        rows, cols = tensor.shape
        row_bytes = cols * FLOATS[tensor.dtype]
        step = max(1, CHUNK // max(1, row_bytes))
        for i in range(0, rows, step):
            j = min(rows, i + step)
            at = tensor.start + i * row_bytes
            raw = bytearray(_pread(member.handle, at, (j - i) * row_bytes))
            weight = torch.frombuffer(raw, dtype=dtype).reshape(j - i, cols)
            if dtype == compute:  # in place, one fused call: no temporaries
                weight.addmm_(b[i:j], a, alpha=op.scale)
            else:  # rounded once, after the sum
                weight.copy_(weight.to(compute).addmm_(b[i:j], a, alpha=op.scale))
            yield bytes(raw)


def _copy(handle: IO[bytes], start: int, end: int) -> Iterator[bytes]:
    while start < end:
        length = min(CHUNK, end - start)
        yield _pread(handle, start, length)
        start += length


def plan(*, base: Path, adapter_dir: Path, folder: str, roots: Sequence[Path]) -> MergedExport:
    """Check that the step's adapter merges into `base` and open what the tar reads
    (raises `Refusal`: why not). `roots`: the model roots the base's files must stay in."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise _unmergeable("the merge needs torch on this server (the `cpu` extra)") from exc
    config = _config(adapter_dir / "adapter_config.json")
    opened: list[IO[bytes]] = []
    try:
        adapter_handle = (adapter_dir / "adapter_model.safetensors").open("rb")
        opened.append(adapter_handle)
        adapter = _read_safetensors("adapter_model.safetensors", adapter_handle)
        small, shard_names = _base_files(base, roots)
        members: list[Member] = []
        for path in small:
            handle = _inside(path, roots).open("rb")
            opened.append(handle)
            stat = os.fstat(handle.fileno())
            members.append(Member(path.name, stat.st_size, stat.st_mtime, handle))
        by_tensor: dict[str, Safetensors] = {}
        shards: dict[str, Member] = {}
        for name in shard_names:
            handle = _inside(base / name, roots).open("rb")
            opened.append(handle)
            shard = _read_safetensors(name, handle)
            stat = os.fstat(handle.fileno())
            shards[name] = Member(name, shard.size, stat.st_mtime, handle)
            by_tensor.update(dict.fromkeys(shard.tensors, shard))
        for target, op in _operations(adapter, config, by_tensor).items():
            shard = by_tensor[target]
            shards[shard.name].ops.append((shard.tensors[target], op))
        for member in shards.values():
            member.ops.sort(key=lambda item: item[0].start)
            for (first, _), (second, _) in zip(member.ops, member.ops[1:], strict=False):
                if first.end > second.start:
                    raise _unmergeable(f"{member.name}: two merged tensors overlap")
        members.extend(shards[name] for name in shard_names)
    except BaseException as exc:
        for each in opened:
            each.close()
        if isinstance(exc, FileNotFoundError):
            raise _unmergeable(f"a file of the base model or the adapter is gone: {exc}") from exc
        raise
    return MergedExport(folder, members, adapter, config, bool(config.get("fan_in_fan_out")))
