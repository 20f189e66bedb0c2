"""Settings for every test and every notebook run by pytest: fast mode, and never any network.

This file sits at the repository root so that it also applies to `pytest notebooks/NN.ipynb`.
"""

import os

# Set before anything imports llmedu (llmedu.runtime reads it once) and before nbval starts
# notebook kernels, which inherit this environment.
os.environ.setdefault("LLMEDU_FAST", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
