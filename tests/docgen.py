"""Small test files built in memory: PDFs (text pages, image-only, encrypted), DOCX, a DOCX zip bomb."""

from __future__ import annotations

import io
import zipfile


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def make_pdf(pages: list[list[str]], title: str | None = None) -> bytes:
    """A PDF with one page per item, each line of text drawn in Helvetica (pypdf extracts it back).
    An empty line list gives a page with no text at all (like a scanned image)."""
    objects: list[bytes] = []
    num_pages = len(pages)
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(num_pages))
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {num_pages} >>".encode())
    font_id = 3 + 2 * num_pages
    for i, lines in enumerate(pages):
        content = "BT /F1 12 Tf 72 720 Td 14 TL " + " ".join(f"({_escape(line)}) Tj T*" for line in lines) + " ET"
        if not lines:
            content = "0 0 1 rg 72 72 400 600 re f"  # a filled rectangle: drawn, but no text
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents {4 + 2 * i} 0 R"
            f" /Resources << /Font << /F1 {font_id} 0 R >> >> >>".encode()
        )
        data = content.encode("latin-1")
        objects.append(b"<< /Length %d >>\nstream\n" % len(data) + data + b"\nendstream")
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    info_ref = ""
    if title is not None:
        objects.append(f"<< /Title ({_escape(title)}) >>".encode("latin-1"))
        info_ref = f" /Info {len(objects)} 0 R"
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % number + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for offset in offsets:
        out.write(b"%010d 00000 n \n" % offset)
    out.write(f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R{info_ref} >>\nstartxref\n{xref}\n%%EOF\n".encode())
    return out.getvalue()


def encrypt_pdf(data: bytes, password: str = "secret") -> bytes:
    """Encrypted with this user password (an empty one: anyone may open it, as with copy-protected PDFs)."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(data)))
    writer.encrypt(user_password=password, owner_password="owner-secret", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def make_docx(title: str, heading: str, paragraphs: list[str], table: list[list[str]] | None = None) -> bytes:
    import docx

    document = docx.Document()
    document.core_properties.title = title
    document.add_heading(heading, level=1)
    for text in paragraphs:
        document.add_paragraph(text)
    if table:
        grid = document.add_table(rows=len(table), cols=len(table[0]))
        for r, row in enumerate(table):
            for c, value in enumerate(row):
                grid.cell(r, c).text = value
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def make_zip_bomb_docx(num_unzipped_bytes: int) -> bytes:
    """A DOCX-shaped zip whose one padding member expands to `num_unzipped_bytes` (compressed ~1000x)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("[Content_Types].xml", "<Types/>")
        archive.writestr("word/document.xml", "<document/>")
        with archive.open("word/media/padding.bin", "w", force_zip64=True) as member:
            block = b"\0" * (1 << 20)
            for _ in range(num_unzipped_bytes >> 20):
                member.write(block)
    return out.getvalue()


BOMB_PART = "word/styles.xml"


def make_lying_zip_bomb_docx(num_unzipped_bytes: int, num_declared_bytes: int = 1024) -> bytes:
    """A real DOCX whose word/styles.xml (a part python-docx reads) is deflated zeros expanding to
    `num_unzipped_bytes` while the zip's directory declares `num_declared_bytes` (with the CRC of that
    many zeros, so the lie holds up to the declared size). Written by hand: zipfile writes true sizes."""
    import struct
    import zlib

    members = []
    with zipfile.ZipFile(io.BytesIO(make_docx("Lying", "Lying", ["A bomb rides along."]))) as real:
        for info in real.infolist():
            if info.filename == BOMB_PART:
                continue
            payload = real.read(info)
            members.append((info.filename, 0, payload, len(payload), zlib.crc32(payload)))
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)  # raw deflate, as zip stores it
    block, compressed = b"\0" * (1 << 20), []
    for _ in range(num_unzipped_bytes >> 20):
        compressed.append(packer.compress(block))
    compressed.append(packer.flush())
    members.append((BOMB_PART, 8, b"".join(compressed), num_declared_bytes,
                    zlib.crc32(b"\0" * num_declared_bytes)))
    out, directory = io.BytesIO(), []
    for name, method, payload, declared, crc in members:
        encoded = name.encode()
        directory.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0x21, crc,
                                     len(payload), declared, len(encoded), 0, 0, 0, 0, 0, out.tell()) + encoded)
        out.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(payload), declared,
                              len(encoded), 0) + encoded + payload)
    start = out.tell()
    out.write(b"".join(directory))
    out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), out.tell() - start, start, 0))
    return out.getvalue()
