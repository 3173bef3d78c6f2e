"""Trainyard's benchmarks (`python -m bench`)."""

import os

# litellm (imported by ART) fetches a model-cost map from the internet at import time
# unless told to use its bundled copy; set before any benchmark imports ART.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
