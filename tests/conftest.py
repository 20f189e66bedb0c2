"""Test-wide settings: the fast mode for every lesson, and never any network."""

import os

# Set before anything imports llmedu (llmedu.runtime reads it once) and before nbval starts
# notebook kernels, which inherit this environment.
os.environ.setdefault("LLMEDU_FAST", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
