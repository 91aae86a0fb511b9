"""`%load_ext fsdp2nb` stays light: the kernel side imports no torch."""

import subprocess
import sys

CODE = """
import sys
from IPython.testing.globalipapp import start_ipython
start_ipython().run_line_magic("load_ext", "fsdp2nb")
import fsdp2nb, fsdp2nb.frontend.status, fsdp2nb.wire.channels
missing = sorted(set(fsdp2nb.__all__) - set(dir(fsdp2nb)))
assert not missing, f"dir(fsdp2nb) leaves out {missing}: tab completion would not offer them"
assert "TrainerCallback" in fsdp2nb.__all__
heavy = sorted(name for name in ("torch", "transformers", "fsdp2nb.engine", "fsdp2nb.checkpoint.manager")
               if name in sys.modules)
assert not heavy, f"loading the extension imported {heavy}"
"""


def test_loading_the_extension_imports_no_torch():
    subprocess.run([sys.executable, "-c", CODE], check=True, timeout=120)
