"""Make ``import fp4gen...`` work from this checkout where fp4gen is not pip-installed (the
GPU machine runs the benchmark scripts from a plain copy of the tree)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ensure_fp4gen_importable():
    """Map the checkout's packages (pyproject's ir/ -> fp4gen.ir, ...) unless fp4gen is installed."""
    try:
        import fp4gen.generated  # noqa: F401
        import fp4gen.ir  # noqa: F401
        return
    except ImportError:
        pass
    sys.path.insert(0, str(ROOT))
    from fp4gen.runtime.srctree import use_source_tree

    use_source_tree(ROOT)
