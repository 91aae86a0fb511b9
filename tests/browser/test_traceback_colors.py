"""Rank tracebacks stay as readable as a plain cell's on JupyterLab's light and dark themes.

Ranks once coloured tracebacks with IPython's "linux" scheme, meant for a dark terminal: on the
light theme the failing line's names and punctuation came out near-white. The test measures the
contrast of every piece of traceback text against what it is drawn on, in both themes."""

from __future__ import annotations

import nbformat

from tests.support.lab_page import Page

FAILING = "values = {'key': [1, 2]}\nresult = values['missing'] + len(values)"
PLAIN_CELL, RANK_CELL = 2, 3

_CONTRASTS = r"""(index) => {
  const luminance = (rgb) => {
    const [r, g, b] = rgb.map(v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const parse = (css) => { const m = css.match(/[\d.]+/g).map(Number); return {rgb: m.slice(0, 3), alpha: m.length > 3 ? m[3] : 1}; };
  const background = (element) => {
    for (let e = element; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c.alpha > 0.5) return c.rgb;
    }
    return [255, 255, 255];
  };
  const output = document.querySelectorAll('.jp-CodeCell')[index].querySelector('.jp-OutputArea-output pre');
  const walker = document.createTreeWalker(output, NodeFilter.SHOW_TEXT);
  const pieces = [];
  let line = 0;
  for (let node = walker.nextNode(); node; line += (node.textContent.match(/\n/g) || []).length,
                                           node = walker.nextNode()) {
    if (!node.textContent.trim()) continue;
    const element = node.parentElement;
    const fg = luminance(parse(getComputedStyle(element).color).rgb), bg = luminance(background(element));
    pieces.push({line: line + (node.textContent.match(/^\s*\n/) ? 1 : 0), text: node.textContent.trim(),
                 color: getComputedStyle(element).color,
                 ratio: (Math.max(fg, bg) + 0.05) / (Math.min(fg, bg) + 0.05)});
  }
  return pieces;
}"""


def _notebook(path) -> None:
    cells = [nbformat.v4.new_code_cell("%load_ext fsdp2nb"),
             nbformat.v4.new_code_cell("%fsdp2 start --cpu 2 --no-dashboard"),
             nbformat.v4.new_code_cell(FAILING),
             nbformat.v4.new_code_cell("%%fsdp2\n" + FAILING)]
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)


def _use_theme(page: Page, theme: str) -> None:
    page.page.locator(".lm-MenuBar-itemLabel:text-is('Settings')").click()
    page.page.locator(".lm-Menu-itemLabel:text-is('Theme')").hover()
    page.page.locator(f".lm-Menu-itemLabel:text-is('{theme}')").click()
    page.page.wait_for_function(f"document.body.dataset.jpThemeName === '{theme}'", timeout=60_000)
    # The attribute may change before the theme's stylesheet applies: wait for the notebook's colour.
    page.page.wait_for_function(
        "(dark) => { const [r, g, b] = getComputedStyle(document.querySelector('.jp-Notebook'))"
        ".backgroundColor.match(/\\d+/g).map(Number); return (r + g + b < 384) === dark; }",
        arg=theme.endswith("Dark"), timeout=60_000)


def _failing_line(pieces: list[dict]) -> list[dict]:
    """The pieces of the line the arrow points at, without the arrow and the line number."""
    arrow = next(p["line"] for p in pieces if p["text"].startswith("---->") and p["line"] > 2)
    return [p for p in pieces if p["line"] == arrow and not p["text"].startswith("---->") and not p["text"].isdigit()]


def _check_readable(theme: str, plain: list[dict], ranked: list[dict]) -> None:
    """No piece of the rank traceback is harder to read than the worst of a plain cell's (or 3:1,
    WCAG's floor for large text, where the plain cell does better), and the failing line's names
    and punctuation reach 3:1. String literals are left out there: the neutral scheme's yellow
    is faint on the light theme in a plain cell too."""
    floor = min(min(p["ratio"] for p in plain), 3.0) - 0.01
    worst = min(ranked, key=lambda p: p["ratio"])
    assert worst["ratio"] >= floor, (theme, worst, floor)
    failing = _failing_line(ranked)
    assert "missing" in "".join(p["text"] for p in failing), failing
    for piece in failing:
        if "'" not in piece["text"]:
            assert piece["ratio"] >= 3.0, (theme, piece)


def test_rank_traceback_is_as_readable_as_a_plain_cells(lab, browser, shots):
    _notebook(lab.root / "traceback_colors.ipynb")
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = Page(context.new_page())
    try:
        page.open(lab.url("traceback_colors.ipynb"))
        for index in range(4):
            page.run(index)
            page.wait_done(index)
        assert "KeyError" in page.output(PLAIN_CELL) and "KeyError" in page.output(RANK_CELL)
        for theme in ("JupyterLab Light", "JupyterLab Dark"):
            _use_theme(page, theme)
            plain = page.page.evaluate(_CONTRASTS, PLAIN_CELL)
            ranked = page.page.evaluate(_CONTRASTS, RANK_CELL)
            page.page.locator(".jp-CodeCell").nth(RANK_CELL).scroll_into_view_if_needed()
            page.page.screenshot(path=str(shots / f"traceback-{theme.split()[-1].lower()}.png"))
            _check_readable(theme, plain, ranked)
    finally:
        try:
            _use_theme(page, "JupyterLab Light")  # a setting of the shared server: later tests expect it
        finally:
            context.close()
