"""The data cache: where the archives and the files made from them live, and how those files are kept honest.

Where the cache is (``cache_dir()``), first match wins:

1. ``$LLMEDU_DATA`` if it is set;
2. ``<repository>/data/cache`` when llmedu runs from a source checkout (an editable install);
3. ``$XDG_CACHE_HOME/llmedu`` (by default ``~/.cache/llmedu``) for an ordinary install.

The archives themselves are pinned by sha256 in ``fetch.py``. Everything made from them (cleaned
corpora, extracted reference files) is a *derived* file: ``write_derived`` writes it atomically with
its sha256 beside it (``NAME.sha256``), and ``read_derived`` returns it only while the two agree, so a
truncated or altered file is rebuilt from its archive instead of being trusted forever. Files are
written readable by everyone the umask allows, like the archives, so one ``LLMEDU_DATA`` folder can
serve several users.

Left out: locking. Two processes that build the same file at once both write it whole and the
second rename wins, which is harmless because both wrote the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

__all__ = [
    "cache_dir",
    "sha256_of",
    "make_readable",
    "write_atomically",
    "write_derived",
    "read_derived",
    "derived_path",
]


def cache_dir() -> Path:
    """The folder that holds the archives and everything extracted from them (see the docstring)."""
    if os.environ.get("LLMEDU_DATA"):
        folder = Path(os.environ["LLMEDU_DATA"]).expanduser().resolve()
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(
                f"LLMEDU_DATA={os.environ['LLMEDU_DATA']!r} points at {folder}, which is a file, not a folder: "
                f"set LLMEDU_DATA to the folder that holds (or will hold) archives/, or unset it."
            )
        return folder
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file() and (repo / "llmedu" / "__init__.py").is_file():
        return repo / "data" / "cache"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "llmedu"


def sha256_of(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def make_readable(path: Path) -> None:
    """Give ``path`` the mode an ordinary ``open(path, "w")`` would (0644 under the usual umask), not
    the 0600 of a temporary file, so that one cache folder can serve several users."""
    mask = os.umask(0)  # the only way to read the umask is to set it: put it straight back
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader (another process) never sees half a file; its mode
    is an ordinary file's (``make_readable``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        tmp.write(data)
    make_readable(Path(tmp.name))
    os.replace(tmp.name, path)


def _checksum_file(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _recorded_sha256(path: Path) -> str | None:
    """The sha256 written beside ``path`` by ``write_derived``, or None if there is none."""
    checksum = _checksum_file(path)
    return checksum.read_text().strip() if checksum.is_file() else None


_trusted: dict[Path, tuple[int, int]] = {}  # derived files this process has checked: path -> (size, mtime_ns)


def write_derived(path: Path, data: bytes) -> None:
    """Write a file made from an archive, and its sha256 beside it for ``read_derived`` to check."""
    write_atomically(path, data)
    write_atomically(_checksum_file(path), (hashlib.sha256(data).hexdigest() + "\n").encode())


def read_derived(path: Path) -> bytes | None:
    """The bytes of a derived file, or None when it is missing or differs from its recorded sha256.

    None means: rebuild it from its archive (``write_derived``). A file without a recorded sha256
    (written by an older llmedu) counts as missing.
    """
    recorded = _recorded_sha256(path)
    if recorded is None or not path.is_file():
        return None
    data = path.read_bytes()
    return data if hashlib.sha256(data).hexdigest() == recorded else None


def derived_path(path: Path) -> Path | None:
    """``path`` if it holds a derived file that matches its recorded sha256, else None.

    For callers that hand the path to another library (``transformers`` reads the reference files
    itself); a file is hashed once per process while its size and modification time stay the same.
    """
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    if _trusted.get(path) == (stat.st_size, stat.st_mtime_ns):
        return path
    recorded = _recorded_sha256(path)
    if recorded is None or sha256_of(path) != recorded:
        return None
    _trusted[path] = (stat.st_size, stat.st_mtime_ns)
    return path
