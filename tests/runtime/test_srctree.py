"""fp4gen.runtime.srctree: importing the checkout without installing it (as on the GPU machine)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_use_source_tree_maps_the_namespace(tmp_path):
    # -S: no site-packages, so the editable install cannot help; only the mapping can
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            "from fp4gen.runtime.srctree import use_source_tree; "
            f"use_source_tree({str(ROOT)!r}); "
            "import fp4gen.ir.spec, fp4gen.generated; "
            "print(fp4gen.ir.spec.__file__); print(fp4gen.generated.__file__)")
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    spec_file, gen_file = r.stdout.split()
    assert Path(spec_file) == ROOT / "ir" / "spec.py"
    assert Path(gen_file) == ROOT / "generated" / "__init__.py"
