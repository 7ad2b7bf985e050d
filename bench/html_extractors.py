"""Which HTML extractor: on five small pages (article, docs with a table, FAQ, manual, a bare table),
the share of the content sentences each keeps, of the boilerplate (nav, footer, cookie banner,
sidebar) it keeps, and its time. `python -m bench.html_extractors [--json out.json]`."""

from __future__ import annotations

import argparse
import json
import time

import html2text
import trafilatura

from app.extract.html import extract_html

NAV = "<nav><a href='/'>Home</a> <a href='/p'>Products</a> <a href='/c'>Contact us today</a></nav>"
FOOT = "<footer><p>Copyright 2026 Example Corp. All rights reserved.</p><p>Subscribe to our newsletter.</p></footer>"
COOKIE = "<div class='cookie'>We use cookies to improve your experience. Accept all cookies?</div>"
BOILERPLATE = ["Contact us today", "All rights reserved", "newsletter", "cookies", "Ten best museums"]
PAGES = {  # page: (html, sentences that are content)
    "article": (f"<title>Vault news</title>{NAV}{COOKIE}<article><h1>The green vault reopens</h1><p>The green vault in "
                "Dresden reopened on Monday after a two year restoration.</p><p>Its secret code was changed to 7391 by "
                "the new curator.</p><ul><li>Opening hours are nine to five.</li><li>Guided tours run every hour.</li>"
                f"</ul></article><aside><p>Related: Ten best museums in Germany.</p></aside>{FOOT}",
                ["reopened on Monday", "changed to 7391", "nine to five", "Guided tours run every hour"]),
    "docs": (f"<title>API limits</title>{NAV}<main><h1>Limits</h1><p>Each request may carry at most 64 documents.</p>"
             "<table><tr><th>setting</th><th>default</th></tr><tr><td>max_body_bytes</td><td>8 MB</td></tr></table>"
             f"<h2>Errors</h2><p>A request over a limit gets a 413 answer.</p></main>{FOOT}",
             ["at most 64 documents", "max_body_bytes", "8 MB", "gets a 413 answer"]),
    "faq": (f"<title>FAQ</title>{NAV}<div><div><b>Can I bring a dog?</b><div>Dogs are allowed on a lead.</div></div>"
            f"<div><b>Is there parking?</b><div>Parking costs five euros a day.</div></div></div>{FOOT}",
            ["Can I bring a dog", "allowed on a lead", "Parking costs five euros"]),
    "manual": (f"<title>Manual</title>{NAV}<div id='content'><h1>Pump manual</h1><h2>Start</h2><p>Press the green button."
               "</p><h2>Cleaning</h2><p>Rinse the filter weekly.</p></div>" + FOOT,
               ["Press the green button", "Rinse the filter weekly", "Cleaning"]),
    "bare_table": ("<title>Prices</title><table><tr><td>Apples cost two euros per kilo.</td></tr></table>",
                   ["Apples cost two euros"]),
}


def _html2text(markup: str) -> str:
    converter = html2text.HTML2Text()
    converter.body_width, converter.ignore_links, converter.ignore_images = 0, True, True
    return converter.handle(markup)


EXTRACTORS = {
    "html2text (whole page)": _html2text,
    "trafilatura": lambda markup: trafilatura.extract(markup, include_tables=True) or "",
    "ragblend (trafilatura, html2text fallback)": lambda markup: extract_html(markup)[1],
}


def measure() -> list[dict]:
    rows = []
    for name, extract in EXTRACTORS.items():
        extract(PAGES["docs"][0])  # warm-up
        num_kept = num_content = num_noise = num_boilerplate = 0
        start = time.perf_counter()
        for markup, content in PAGES.values():
            text = extract(markup)
            num_kept += sum(s in text for s in content)
            num_content += len(content)
            present = [s for s in BOILERPLATE if s in markup]
            num_noise += sum(s in text for s in present)
            num_boilerplate += len(present)
        ms = (time.perf_counter() - start) * 1000 / len(PAGES)
        rows.append({"extractor": name, "content_kept": num_kept, "content": num_content,
                     "boilerplate_kept": num_noise, "boilerplate": num_boilerplate, "ms_per_page": round(ms, 2)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = measure()
    print(f"{'extractor':44} {'content kept':>12} {'boilerplate kept':>17} {'ms/page':>8}")
    for r in rows:
        print(f"{r['extractor']:44} {r['content_kept']:>6}/{r['content']:<5} {r['boilerplate_kept']:>9}/{r['boilerplate']:<7} "
              f"{r['ms_per_page']:>8}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
