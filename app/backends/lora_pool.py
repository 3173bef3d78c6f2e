"""A serving pool of the cpu backend: one base model and any number of LoRA adapters loaded
by name at runtime, as a vLLM server started with `--enable-lora` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` holds them (`trainyard serve-pool`).

An adapter is loaded from where the checkpoint storage keeps its step (a directory under
the local checkpoint root, or `s3://bucket/prefix/...` under the configured object store,
fetched into this process's cache); no other path is read. Adapters of different ranks are
served side by side: one policy per (rank, alpha), the adapter in it swapped per request
under its lock.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.backends.admission import Admission
from app.backends.storage import Shelf, Storage

ADAPTER_FILE = "adapter_model.safetensors"


class AdapterRefused(Exception):
    """A load refused: `status` 400 (bad request) or 404 (no adapter there), as vLLM."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path  # its directory on this machine
    source: str  # the `lora_path` it was loaded from
    rank: int
    alpha: int


class AdapterPool:
    def __init__(
        self,
        base_model: str,
        storage: Storage,
        admission: Admission,
        threads: int | None = None,
    ) -> None:
        self.base_model = base_model
        self.threads = threads  # torch's threads (None: `cpu_policy.default_threads`)
        self.storage = storage
        self.admission = admission
        self.adapters: dict[str, Adapter] = {}
        self._policies: dict[tuple[int, int] | None, Any] = {}
        self._made = threading.Lock()
        self._serving: dict[int, Adapter | None] = {}  # id(policy) -> the adapter in it

    def locate(self, lora_path: str) -> Path:
        """The adapter directory `lora_path` names, on this machine; AdapterRefused unless
        it is a complete step of the checkpoint storage."""
        store = self.storage.store
        if lora_path.startswith("s3://"):
            if store is None or self.storage.cache is None:
                raise AdapterRefused(
                    400,
                    f"`lora_path` {lora_path!r}: this pool reads checkpoints from a local "
                    "directory, not an object store (TRAINYARD_CHECKPOINT_URL)",
                )
            prefix = store.url + "/"
            key = lora_path.removeprefix(prefix)
            backend, _, rest = key.partition("/")
            relative, _, step = rest.rpartition("/")
            if not lora_path.startswith(prefix) or not relative or not step.isdigit():
                raise AdapterRefused(
                    400, f"`lora_path` {lora_path!r} is not a checkpoint step under {store.url}"
                )
            local = self.storage.root / backend / relative / step
            fetched = Shelf(store, backend, self.storage.cache).fetch(relative, int(step), local)
            if fetched is None:
                raise AdapterRefused(404, f"No adapter found at {lora_path!r}.")
            return fetched
        if store is not None:
            raise AdapterRefused(
                400, f"`lora_path` {lora_path!r}: this pool reads checkpoints from {store.url}"
            )
        path = Path(lora_path)
        root = self.storage.root.resolve()
        if not path.is_absolute() or ".." in path.parts or not path.resolve().is_relative_to(root):
            raise AdapterRefused(
                400, f"`lora_path` {lora_path!r} is not an absolute path under {root}"
            )
        if not (path / ADAPTER_FILE).is_file():
            raise AdapterRefused(404, f"No adapter found at {lora_path!r}.")
        return path

    def load(self, name: str, lora_path: str, *, inplace: bool = False) -> Adapter:
        if name == self.base_model:
            raise AdapterRefused(400, f"The lora adapter '{name}' is the base model's name.")
        if name in self.adapters and not inplace:
            raise AdapterRefused(400, f"The lora adapter '{name}' has already been loaded.")
        path = self.locate(lora_path)
        try:
            config = json.loads((path / "adapter_config.json").read_text())
            rank, alpha = int(config["r"]), int(config["lora_alpha"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise AdapterRefused(400, f"`lora_path` {lora_path!r}: no adapter config") from exc
        adapter = Adapter(name, path, lora_path, rank, alpha)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise AdapterRefused(404, f"The lora adapter '{name}' cannot be found.")

    def policy(self, adapter: Adapter | None) -> Any:
        """The policy that serves `adapter` (None: the base model alone), made on first use."""
        key = None if adapter is None else (adapter.rank, adapter.alpha)
        with self._made:
            policy = self._policies.get(key)
            if policy is None:
                from app.backends.cpu_policy import Policy

                rank, alpha = key or (8, 16)
                # A fresh adapter is the base model (LoRA's B starts at zero).
                policy = Policy(
                    self.base_model, rank=rank, alpha=alpha, seed=0, threads=self.threads
                )
                self._policies[key] = policy
            return policy

    def ready(self, policy: Any, adapter: Adapter | None) -> None:
        """Put `adapter`'s weights in `policy` (its lock held). Its files gone since it
        loaded (evicted from the cache: fetched again; deleted from storage: the adapter is
        dropped, AdapterRefused 404, as an unknown model)."""
        if adapter is None or self._serving.get(id(policy)) == adapter:
            return
        try:
            policy.load(adapter.path, 0)
        except FileNotFoundError:
            try:
                path = self.locate(adapter.source)
            except AdapterRefused:
                if self.adapters.get(adapter.name) == adapter:
                    del self.adapters[adapter.name]
                raise AdapterRefused(
                    404, f"The model `{adapter.name}` does not exist: its adapter is gone."
                ) from None
            policy.load(path, 0)
        self._serving[id(policy)] = adapter
