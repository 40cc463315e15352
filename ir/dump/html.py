"""to_html(plan): one self-contained page with the SVG pictures and the text dump."""
from __future__ import annotations

from html import escape

from ..plan import KernelPlan
from .svg import to_svg
from .text import to_text


def to_html(plan: KernelPlan) -> str:
    s = plan.spec
    return ("<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
            f"<title>fp4gen schedule: {escape(s.name)} ({s.target.value})</title>"
            "<style>body{font-family:sans-serif;margin:20px} pre{font-size:12px;background:#f7f7f7;"
            "padding:10px;overflow-x:auto}</style></head><body>\n"
            f"<h1>{escape(s.name)} <small>({s.target.value})</small></h1>\n"
            + to_svg(plan) +
            "\n<h2>Plan</h2>\n<pre>" + escape(to_text(plan)) + "</pre>\n</body></html>\n")
