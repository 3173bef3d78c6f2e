"""Registers the Trainyard trainer adapter with NAT (the `nat.components` entry point)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from nat.builder.builder import Builder
from nat.cli.register_workflow import register_trainer_adapter

from trainyard_client.nat.adapter import TrainyardTrainerAdapter
from trainyard_client.nat.config import TrainyardTrainerAdapterConfig


@register_trainer_adapter(config_type=TrainyardTrainerAdapterConfig)
async def trainyard_trainer_adapter(
    config: TrainyardTrainerAdapterConfig, builder: Builder
) -> AsyncIterator[TrainyardTrainerAdapter]:
    # Nothing to close after the yield: NAT leaves this context before it trains, so the
    # adapter opens a client per operation rather than holding one.
    yield TrainyardTrainerAdapter(adapter_config=config)
