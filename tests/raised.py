"""One helper for the bad-input tests that run inside worker processes, where pytest.raises cannot reach."""

from collections.abc import Callable


def raised(*calls: Callable[[], object], kind: type[Exception] = ValueError) -> list[str]:
    """The message of each ``kind`` error that ``calls`` raise, in order (a call that raises nothing adds none)."""
    messages = []
    for call in calls:
        try:
            call()
        except kind as err:
            messages.append(str(err))
    return messages
