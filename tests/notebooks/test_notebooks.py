"""The example notebooks run as a reader runs them (nbclient, a real kernel, real ranks on gloo)
and show what their text promises: the loss falls, checkpoints are listed, a resume lands on the
saved step, exports load, text is generated. finetune_gpu.ipynb runs its CPU variant here."""

import re
from pathlib import Path

import nbformat
import pytest

from fsdp2nb.examples import save_tiny_llama
from scripts.make_notebooks import NOTEBOOKS, build
from scripts.run_demo import execute, main, quickstart_facts, tagged_text
from tests.support.kernel_client import WITHOUT_GPUS

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"


def _run(name: str, out_dir: Path, env: dict[str, str]) -> nbformat.NotebookNode:
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {**WITHOUT_GPUS, **env}.items():
            patch.setenv(key, value)  # the kernel inherits this process's environment
        notebook, _, error = execute(NOTEBOOKS_DIR / name, out_dir / name)
    assert error is None, f"{name} failed:\n{error}"
    return notebook


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    return _run("quickstart.ipynb", tmp_path_factory.mktemp("quickstart"), {})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return _run("checkpoints.ipynb", tmp_path_factory.mktemp("checkpoints"), {})


def test_committed_notebooks_are_the_generated_ones():
    for name, cells in NOTEBOOKS.items():
        committed = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
        assert committed == build(cells), f"notebooks/{name} differs: run python scripts/make_notebooks.py"
        assert not any(cell.get("outputs") for cell in committed.cells), f"{name} was committed with outputs"


def test_run_demo_refuses_a_path_without_a_notebook(tmp_path, capsys):
    assert main([str(tmp_path / "missing.ipynb")]) == 2
    assert capsys.readouterr().err.startswith(f"no notebook at {tmp_path / 'missing.ipynb'}; ")


def test_run_demo_stops_at_a_failing_cell_and_keeps_the_executed_copy(tmp_path, capsys):
    path = tmp_path / "fails.ipynb"
    cells = ["print('before')", "raise ValueError('the third cell never runs')", "print('after')"]
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), path)
    assert main([str(path)]) == 1
    assert "ValueError: the third cell never runs" in capsys.readouterr().err
    executed = nbformat.read(tmp_path / "fails.out.ipynb", as_version=4)
    assert executed.cells[0].outputs[0].text == "before\n" and executed.cells[2].outputs == []


@pytest.mark.timeout(900)
def test_quickstart_trains_saves_resumes_exports_and_generates(quickstart):
    facts = quickstart_facts(quickstart)
    assert facts["num_ranks"] == 2 and facts["devices"] == ["cpu"]
    assert facts["last_loss"] < facts["first_loss"] - 0.3, facts
    assert facts["saved_step"] == 39 and facts["resumed_step"] == 39
    assert "checkpoints: [39] LATEST: 39" in tagged_text(quickstart, "resume")  # listed after the restart
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in Path(facts["export_dir"]).iterdir()}
    assert facts["generated"].startswith("The light") and len(facts["generated"]) > len("The light") + 20
    assert facts["eval_loss_after"] < facts["eval_loss_before"] - 0.3, facts
    for tag in ("sample_before", "sample_after"):  # fsdp2nb.generate: every prompt's completion, in order
        prompts = re.findall(r"^\[0\] '([^']+)' -> ", tagged_text(quickstart, tag), re.MULTILINE)
        assert prompts == ["The light", "The keeper", "At night", "The sea"], tagged_text(quickstart, tag)


@pytest.mark.timeout(900)
def test_quickstart_dashboard_shows_the_pool_as_text(quickstart):
    start = tagged_text(quickstart, "start")
    assert "fsdp2nb pool: --cpu 2" in start and re.search(r"^1 +idle +cpu", start, re.MULTILINE), start


@pytest.mark.timeout(900)
def test_checkpoints_save_from_the_dashboard_lands_during_training(checkpoints):
    text = tagged_text(checkpoints, "dashboard_save")
    found = re.search(r"made at step (\d+); training went on to step (\d+)", text)
    assert found, text
    saved_at, last = int(found.group(1)), int(found.group(2))
    assert last == saved_at + 5  # the loop went on after the save it was asked for
    assert f"checkpoints: [{saved_at}]" in text


@pytest.mark.timeout(900)
def test_checkpoints_async_saves_keep_two_and_resume_on_one_rank(checkpoints):
    retention = tagged_text(checkpoints, "retention")
    kept = re.search(r"checkpoints kept \(keep=2\): \[(\d+), (\d+)\] LATEST: (\d+)", retention)
    assert kept and int(kept.group(2)) == int(kept.group(3)) == int(kept.group(1)) + 5, retention
    resumed = re.search(r"resumed step (\d+) on 1 rank; one more step: loss ([0-9.]+)", tagged_text(checkpoints, "fewer_ranks"))
    assert resumed and int(resumed.group(1)) == int(kept.group(3))
    export = tagged_text(checkpoints, "export")
    assert "adapter_model.safetensors" in export and "model.safetensors.index.json" in export


@pytest.mark.timeout(900)
def test_finetune_gpu_notebook_runs_its_cpu_variant(tmp_path):
    model_dir = save_tiny_llama(tmp_path / "tiny-llama")
    notebook = _run("finetune_gpu.ipynb", tmp_path, {
        "FSDP2NB_MODEL": str(model_dir), "FSDP2NB_GPUS": "cpu", "FSDP2NB_STEPS": "3",
        "FSDP2NB_SEQ_LEN": "32", "FSDP2NB_BATCH_SIZE": "2"})
    for tag in ("lora", "full"):
        assert re.findall(r"\[0\] step +2 +loss [0-9.]+", tagged_text(notebook, tag)), tag
    assert "offloaded to CPU memory: False" in tagged_text(notebook, "full")
    assert "model.safetensors.index.json" in tagged_text(notebook, "export")
    assert re.search(r"^generated: The light.", tagged_text(notebook, "generate"), re.MULTILINE)


@pytest.mark.timeout(900)
def test_sft_trainer_notebook_trains_logs_saves_and_resumes(tmp_path):
    notebook = _run("sft_trainer.ipynb", tmp_path, {})
    assert re.search(r"model /\S+/tiny-llama; ranks: --cpu 2$", tagged_text(notebook, "setup").strip())  # no CUDA
    train = tagged_text(notebook, "train")
    losses = [float(x) for x in re.search(r"losses: \[([^\]]*)\]", train).group(1).split(",")]
    assert len(losses) == 8 and losses[-1] < losses[0], train
    assert "checkpoints: ['checkpoint-4', 'checkpoint-8']" in train
    assert "steps with a loss on the dashboard: [1, 2, 3, 4, 5, 6, 7, 8]" in tagged_text(notebook, "metrics")
    resume = tagged_text(notebook, "resume")
    assert "adapter_model.safetensors" in resume and "resumed, now at step 12" in resume, resume
    assert "loaded: PeftModelForCausalLM with adapter default" in tagged_text(notebook, "load")


def test_sft_trainer_notebook_takes_a_real_model_on_gpus(monkeypatch):
    """Its parameters: GPUs asked for (or visible) mean a real model; CPU ranks the tiny one."""
    (cell,) = [c for c in build(NOTEBOOKS["sft_trainer.ipynb"]).cells if "parameters" in c.metadata.get("tags", ())]
    for name, value in WITHOUT_GPUS.items():
        monkeypatch.setenv(name, value)
    for name in ("FSDP2NB_GPUS", "FSDP2NB_MODEL", "FSDP2NB_SEQ_LEN"):
        monkeypatch.delenv(name, raising=False)
    chosen: dict = {}
    exec(cell.source, chosen)
    assert (chosen["GPUS"], chosen["MODEL"], chosen["MAX_LENGTH"]) == ("cpu", "tiny", 64)
    monkeypatch.setenv("FSDP2NB_GPUS", "0,1")
    exec(cell.source, chosen)
    assert (chosen["GPUS"], chosen["MODEL"], chosen["MAX_LENGTH"]) == ("0,1", "Qwen/Qwen2.5-0.5B", 512)
