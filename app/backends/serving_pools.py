"""Serving pools apart from the trainers (`TRAINYARD_SERVING_POOLS`): per base model, the
replicas of an OpenAI-compatible server that loads LoRA adapters at runtime by vLLM's
protocol (vLLM itself, or `trainyard serve-pool`).

The gateway serves step N of a model on such a base as the adapter `name@N`:
- Affinity: the replicas a name goes to are ranked by rendezvous hashing (highest
  `sha256(replica | name)` first), so the same `name@N` lands on the same replica while it
  lives, and only the names of a replica that dies move.
- A replica whose connection fails is skipped for `DEAD_FOR_S` seconds (the next one in the
  name's ranking serves it); then tried again.
- On a miss (this gateway has not loaded the name on that replica) the adapter is loaded
  with `POST /v1/load_lora_adapter {lora_name, lora_path}` (`lora_path`: where the checkpoint
  storage keeps the step); a replica that answers 404 for a name (it restarted, losing what
  it held) has it loaded again once.
- Unloading is lazy: each time this gateway loads a new step of a model on a replica, it
  unloads that model's steps that retention (or a delete) has since removed from storage.
  The latest step and the aliased ones (`best` too) are never removed by retention, so they
  stay loaded: pinned.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable, Iterable

import httpx

DEAD_FOR_S = 5.0


class PoolRefused(Exception):
    """A replica refused to load an adapter (`status`, its error message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def rank(replicas: Iterable[str], name: str) -> list[str]:
    """`replicas` by rendezvous weight for `name`, highest first."""
    return sorted(
        replicas,
        key=lambda url: hashlib.sha256(f"{url}|{name}".encode()).digest(),
        reverse=True,
    )


class PoolRouter:
    def __init__(self, pools: dict[str, list[str]]) -> None:
        self.pools = pools
        self.loaded: dict[str, set[str]] = {}  # replica -> names this gateway loaded there
        self._dead_until: dict[str, float] = {}

    def pool_of(self, base_model: str) -> list[str] | None:
        return self.pools.get(base_model)

    def order(self, base_model: str, name: str) -> list[str]:
        """The replicas to try for `name`: live ones by affinity, then those marked dead
        (a request still reaches a pool whose replicas all failed a moment ago)."""
        now = time.monotonic()
        ranked = rank(self.pools[base_model], name)
        live = [url for url in ranked if self._dead_until.get(url, 0.0) <= now]
        return live + [url for url in ranked if url not in live]

    def dead(self, replica: str) -> None:
        self._dead_until[replica] = time.monotonic() + DEAD_FOR_S
        self.loaded.pop(replica, None)  # a replica that comes back may have restarted

    def alive(self, replica: str) -> None:
        self._dead_until.pop(replica, None)

    def forget(self, replica: str, name: str) -> None:
        self.loaded.get(replica, set()).discard(name)

    async def ensure(
        self,
        client: httpx.AsyncClient,
        replica: str,
        name: str,
        lora_path: str,
        *,
        gone: Callable[[str], Awaitable[set[str]]] | None = None,
    ) -> bool:
        """Load `name` on `replica` unless this gateway did; True when it loaded it now.
        `gone(prefix)`: the names of the model (`prefix` is `model@`) whose steps storage no
        longer has, unloaded after a load. Raises httpx.HTTPError (unreachable) or
        PoolRefused."""
        held = self.loaded.setdefault(replica, set())
        if name in held:
            return False
        response = await client.post(
            f"{replica}/load_lora_adapter", json={"lora_name": name, "lora_path": lora_path}
        )
        message = _message(response)
        if response.status_code != 200 and "already been loaded" not in message:
            raise PoolRefused(response.status_code, message)
        held.add(name)
        if gone is not None:
            model = name.rpartition("@")[0] + "@"
            doomed = await gone(model)
            for old in sorted(n for n in held if n.startswith(model) and n in doomed):
                unloaded = await client.post(
                    f"{replica}/unload_lora_adapter", json={"lora_name": old}
                )
                if unloaded.status_code in (200, 404):  # 404: it was gone already
                    held.discard(old)
        return True


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
    return response.text[:300]
