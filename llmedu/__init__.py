"""llmedu: how large language models are trained efficiently, from scratch in readable PyTorch.

The library is the curriculum: each folder is one arc of the course, each file one concept.

    runtime      device choice (cuda > mps > cpu), seeding, fast mode (LLMEDU_FAST), timers
    hardware     measured FLOP/s and bandwidth of this machine; accelerator spec sheets; roofline
    memory       where the bytes of a training step go: measured, estimated, simulated
    viz          live plots for training loops (a static figure when run headless)
    checks       graders for the exercises: check_x(your_function) says pass or fail, and why

Rooms still to be built are listed in the README's syllabus. ``llmedu.show(obj)`` prints the
source of anything in here, so a notebook can show the code it runs instead of pasting it.
"""

from __future__ import annotations

import inspect

__version__ = "0.1.0"
__all__ = ["show", "__version__"]


def show(obj) -> None:
    """Print the source code of a function, class, method or module.

    In Jupyter the code is rendered with syntax highlighting; elsewhere it is printed as text.
    """
    try:
        source = inspect.getsource(obj)
    except (TypeError, OSError) as err:
        raise TypeError(f"cannot show the source of {obj!r}: {err}") from None
    try:
        from IPython import get_ipython
        from IPython.display import Code, display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(Code(source, language="python"))
    else:
        print(source)
