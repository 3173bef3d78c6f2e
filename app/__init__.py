"""Trainyard: training orchestration for agent reinforcement learning on OpenPipe ART."""

import os

# litellm (imported by ART) fetches a model-cost map from the internet at import time
# unless told to use its bundled copy; a service must not depend on that network call.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

__version__ = "0.1.0"
