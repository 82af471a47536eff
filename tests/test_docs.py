"""The docs drawn from the code stay current: docs/architecture.md's import graph (docs/import_graph.py)."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_import_graph_is_current():
    """Rewrite it with `python docs/import_graph.py` after an import changes."""
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "import_graph.py"), "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
