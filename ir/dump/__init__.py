"""Plan dumps: text (default of ``fp4gen schedule``), JSON (versioned schema), SVG and HTML.

    from fp4gen.ir.dump import to_text, to_json, to_svg, to_html, SCHEMA_VERSION
"""
from .html import to_html
from .jsonform import SCHEMA_VERSION, to_json
from .svg import to_svg
from .text import to_text

__all__ = ["to_text", "to_json", "to_svg", "to_html", "SCHEMA_VERSION"]
