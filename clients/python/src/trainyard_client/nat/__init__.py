"""NeMo Agent Toolkit (NAT) plugin: a trainer adapter that trains on Trainyard.

Install with `pip install 'trainyard-client[nat]'`; NAT finds it through the
`nat.components` entry point, and a NAT config selects it in its `trainer_adapters`
block with `_type: trainyard_trainer_adapter` (see `TrainyardTrainerAdapterConfig`).
"""

from trainyard_client.nat.adapter import TrainyardTrainerAdapter
from trainyard_client.nat.config import TrainyardTrainerAdapterConfig

__all__ = ["TrainyardTrainerAdapter", "TrainyardTrainerAdapterConfig"]
