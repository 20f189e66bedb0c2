"""Settings for every test and every notebook run by pytest: fast mode, and never any network.

This file sits at the repository root so that it also applies to `pytest notebooks/NN.ipynb`.
"""

import os

import pytest

# Set before anything imports llmedu (llmedu.runtime reads it once) and before nbval starts
# notebook kernels, which inherit this environment.
os.environ.setdefault("LLMEDU_FAST", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of many tiny ops: on a busy 2-core CPU, two threads wait on
    each other. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch  # here, so that the environment above is set before anything heavy is imported

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
