"""Extraction per format on small files built here; every bad file is refused with its name."""

from __future__ import annotations

import re
import tracemalloc

import pytest

from app.extract import ExtractionLimits, FileFormat, extract_file
from app.documents.protocol import DOCUMENT_ID_PATTERN
from app.extract.dispatch import document_id, join_pages, page_at
from app.extract.types import FileRejected
from tests.docgen import encrypt_pdf, make_docx, make_lying_zip_bomb_docx, make_pdf, make_zip_bomb_docx

LIMITS = ExtractionLimits(max_document_chars=10_000, max_unzipped_bytes=4 << 20, max_documents=3)


def extract_one(name: str, data: bytes):
    docs = extract_file(name, data, LIMITS)
    assert len(docs) == 1
    return docs[0]


def test_pdf_keeps_pages_title_and_offsets():
    pdf = make_pdf([["The green vault code is 7391."], ["Page two: the moon is made of cheese."]], title="Vault Report")
    doc = extract_one("Vault report.pdf", pdf)
    assert doc.file_format is FileFormat.PDF and doc.title == "Vault Report" and doc.id == document_id("Vault report.pdf")
    assert doc.metadata == {"source": "Vault report.pdf", "format": "pdf", "num_pages": 2}
    assert len(doc.page_starts) == 2
    assert page_at(doc.page_starts, doc.text.index("7391")) == 1
    assert page_at(doc.page_starts, doc.text.index("cheese")) == 2


def test_a_pdf_encrypted_only_against_copying_opens_and_long_titles_are_cut():
    data = encrypt_pdf(make_pdf([["Readable text."]], title="T" * 2000), password="")
    doc = extract_one("restricted.pdf", data)
    assert doc.text == "Readable text." and doc.title == "T" * 512


def test_pdf_without_title_uses_its_first_line():
    assert extract_one("a.pdf", make_pdf([["Annual figures", "More text."]])).title == "Annual figures"


def test_html_keeps_the_main_content_and_drops_boilerplate_scripts_and_markup():
    html = (b"<html><head><title>Bridge page</title><style>p{color:red}</style><script>var x = 1;</script></head>"
            b"<body><nav><a href='/'>Home</a> <a href='/c'>Contact us today</a></nav><article><h1>Bridges</h1>"
            b"<p>The <b>red</b> bridge was <a href='/y'>painted</a> in 1966 by a team of forty workers.</p>"
            b"<ul><li>It crosses the Tagus river.</li><li>It is two kilometres long.</li></ul>"
            b"<table><tr><td>opened</td><td>1966</td></tr></table></article>"
            b"<footer>Copyright 2026 Example Corp. All rights reserved.</footer></body></html>")
    doc = extract_one("bridges.htm", html)
    assert doc.title == "Bridge page" and doc.file_format is FileFormat.HTML
    for kept in ("The red bridge was painted in 1966", "It crosses the Tagus river.", "opened", "Bridges"):
        assert kept in doc.text
    for dropped in ("var x", "color", "href", "Contact us", "All rights reserved"):
        assert dropped not in doc.text


def test_a_page_too_short_for_content_detection_keeps_all_its_text():
    doc = extract_one("tiny.html", b"<title>Tiny</title><table><tr><td>Hi.</td><td>2</td></tr></table>")
    assert doc.title == "Tiny" and "Hi." in doc.text and "2" in doc.text


def test_html_charset_from_meta():
    html = '<meta charset="iso-8859-1"><title>Café</title><p>Crème brûlée</p>'.encode("latin-1")
    doc = extract_one("menu.html", html)
    assert doc.title == "Café" and "Crème brûlée" in doc.text


def test_docx_headings_paragraphs_tables_and_title():
    data = make_docx("Handbook", "Holidays", ["Staff get 25 days.", "Ask your manager."], [["year", "days"], ["2024", "25"]])
    doc = extract_one("handbook.docx", data)
    assert doc.title == "Handbook" and doc.file_format is FileFormat.DOCX
    assert doc.text.startswith("# Holidays") and "Staff get 25 days." in doc.text and "2024 | 25" in doc.text


def test_markdown_text_and_jsonl():
    assert extract_one("notes.md", b"intro\n# The Title\n\nBody.").title == "The Title"
    text = extract_one("plain.txt", b"\xef\xbb\xbfFirst line\nsecond")
    assert text.title == "First line" and text.text == "First line\nsecond"
    docs = extract_file("set.jsonl", b'{"id": "a", "text": "one", "metadata": {"k": 1}}\n\n{"title": "B", "text": "two"}\n', LIMITS)
    assert [(d.id, d.title, d.text) for d in docs] == [("a", None, "one"), ("set.jsonl:1", "B", "two")]
    assert docs[0].metadata == {"source": "set.jsonl", "format": "jsonl", "k": 1}


def test_join_pages_offsets():
    text, starts = join_pages(["a b", "", "c"])
    assert text == "a b\n\f\n\n\f\nc" and starts == (0, 6, 9)  # a page break between pages, an empty one kept
    assert [page_at(starts, text.index(s)) for s in ("a", "c")] == [1, 3]


def test_document_ids_from_file_names():
    assert document_id("dir/report-v2.pdf") == "report-v2.pdf" and document_id("C:\\docs\\a.txt") == "a.txt"
    assert re.fullmatch(r"My-report--v2-[0-9a-f]{10}\.pdf", document_id("dir/My report (v2).pdf"))
    assert re.fullmatch(r"[0-9a-f]{10}", document_id("..."))


def test_names_that_clean_alike_keep_different_ids():
    """Cleaning is lossy ('\\xff\\xfe.txt' and '   .txt' both clean to 'txt'), so a cleaned name is tagged
    with its hash; a cut name keeps its extension; every id is valid."""
    names = ["\udcff\udcfe.txt", "   .txt", ".txt", "txt", "my notes.pdf", "my-notes.pdf", "my:notes.pdf",
             "x" * 200 + "1.docx", "x" * 200 + "2.docx", "é.html", "e.html"]
    ids = [document_id(name) for name in names]
    assert len(set(ids)) == len(names), ids
    assert all(re.fullmatch(DOCUMENT_ID_PATTERN, i) for i in ids), ids
    assert ids[5] == "my-notes.pdf" and ids[-1] == "e.html"
    assert ids[7].endswith(".docx") and len(ids[7]) == 128


@pytest.mark.parametrize(
    ("name", "data", "fragment", "is_too_large"),
    [
        ("secret.pdf", encrypt_pdf(make_pdf([["hidden"]])), "encrypted", False),
        ("broken.pdf", make_pdf([["some text"]])[:200], "not a readable pdf", False),
        ("scan.pdf", make_pdf([[], []]), "no extractable text", False),
        ("fake.pdf", b"just some text", "not a pdf", False),
        ("fake.docx", b"just some text", "not a docx", False),
        ("other.docx", make_zip_bomb_docx(0).replace(b"word/document.xml", b"word/documenX.xml"), "no word/document.xml", False),
        ("bomb.docx", make_zip_bomb_docx(8 << 20), "zip bomb", True),
        ("garbled.docx", make_zip_bomb_docx(0), "not a readable docx", False),
        ("really-a-pdf.txt", make_pdf([["x"]]), "is the extension right", False),
        ("really-a-zip.md", make_docx("t", "h", ["p"]), "is the extension right", False),
        ("binary.txt", b"abc\x00def", "nul bytes", False),
        ("latin1.txt", "caf\xe9".encode("latin-1"), "not utf-8", False),
        ("program.exe", b"MZ...", "unsupported file type", False),
        ("empty.md", b"  \n", "empty", False),
        ("huge.txt", b"word " * 3000, "limit is 10000", True),
        ("bad.jsonl", b'{"text": "ok"}\nnot json\n', "bad.jsonl:2", False),
        ("notext.jsonl", b'{"title": "no text"}\n', "non-empty 'text'", False),
        ("many.jsonl", b'{"text": "x"}\n' * 4, "limit is 3", False),
    ],
)
def test_bad_files_are_refused_by_name(name, data, fragment, is_too_large):
    with pytest.raises(FileRejected) as caught:
        extract_file(name, data, LIMITS)
    assert name.split(".")[0] in caught.value.message
    assert fragment.lower() in caught.value.message.lower()
    assert caught.value.is_too_large is is_too_large


def peak_traced_bytes(fn) -> tuple[object, int]:
    """(what fn returns or raises, the peak of Python allocations meanwhile: zlib's output included)."""
    tracemalloc.start()
    try:
        result = fn()
    except FileRejected as exc:
        result = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return result, peak


@pytest.mark.parametrize("num_declared", [1024, 3 << 20])
def test_a_docx_lying_about_its_sizes_is_never_decompressed_past_the_cap(num_declared):
    """A member declared small whose deflate stream expands to 256 MB: decompressing it whole (what
    zipfile's read() does before its CRC check) would allocate 256 MB; reading is bounded instead."""
    bomb = make_lying_zip_bomb_docx(256 << 20, num_declared)
    assert len(bomb) < 2 << 20
    result, peak = peak_traced_bytes(lambda: extract_file("lying.docx", bomb, LIMITS))
    assert peak < 3 * LIMITS.max_unzipped_bytes, f"{peak >> 20} MiB allocated"
    # refused either way, by name: the CRC of more than the declared zeros is wrong, and zeros are no XML
    assert isinstance(result, FileRejected) and "lying.docx" in result.message, result



@pytest.mark.parametrize(("name", "data"), [
    ("broken.pdf", make_pdf([["some text"]])[:200]),
    ("garbled.docx", make_zip_bomb_docx(0)),
    ("lying.docx", make_lying_zip_bomb_docx(8 << 20, 1024)),
])
def test_refusals_name_no_internal_exception_class(name, data):
    with pytest.raises(FileRejected) as refused:
        extract_file(name, data, LIMITS)
    assert not re.search(r"[A-Z]\w*(Error|Exception|File)\b", refused.value.message), refused.value.message
