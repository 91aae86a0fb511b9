"""nbclient (`nbconvert --execute`) reads only the running cell's messages, so a profiled cell run
by it keeps its profile view in the saved notebook: the cell ends only once the view came."""

import nbformat
from nbclient import NotebookClient

from tests.support.kernel_client import WITHOUT_GPUS


def test_a_notebook_run_by_nbclient_keeps_the_profile_view(monkeypatch):
    for name, value in WITHOUT_GPUS.items():
        monkeypatch.setenv(name, value)  # the kernel inherits this process's environment
    cells = ["%load_ext fsdp2nb", "%%fsdp2 --profile --cpu 2 --no-dashboard\nsummed = torch.ones(16).cumsum(0)",
             "print('after')"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    views = [output.data.get("text/html", "") for output in notebook.cells[1].outputs if "data" in output]
    assert any("fsdp2nb-profile-table" in view and "aten::cumsum" in view for view in views), views
    assert not any("fsdp2nb-profile-pending" in view for view in views), views
