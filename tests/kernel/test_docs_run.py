"""Every Python and magic block of README.md and docs/*.md runs here, as written, through a real
kernel on 2 CPU ranks with the tiny model from fsdp2nb.examples; one kernel and pool for all.

A block that cannot run here says why in an HTML comment just before it,
`<!-- not run: needs ranks on two hosts -->`. The docs' placeholders (a model's path, a
checkpoint directory, GPUs) are replaced by what exists here through PLACEHOLDERS, and the names
the docs leave to the reader (`batch(step)`, "your data") are defined by READERS_NAMES. Nothing
else of a block changes: a block that stops working fails here with its page and line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.bench_plan import LLAMA_70B
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", ROOT / "docs" / "usage.md",
         *sorted(page for page in (ROOT / "docs").glob("*.md") if page.name != "usage.md"))
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_NOT_RUN = re.compile(r"\s*not run:\s*(.*?)\s*-->", re.DOTALL)

PLACEHOLDERS = {
    # what a page writes             what runs here (filled from the `places` fixture)
    "/models/Qwen2.5-0.5B": "{model_dir}",
    "Qwen/Qwen2.5-0.5B": "{model_dir}",
    "./my-model": "{model_dir}",
    "meta-llama/Llama-3.1-70B": "{llama_70b_dir}",   # config.json only: a plan reads no weights
    "/ckpt/run1": "{ckpt_dir}",
    "%%fsdp2 --gpus 2": "%%fsdp2",                    # the CPU pool that is running
    "start --gpus 4": "start --cpu 2",
}

READERS_NAMES = """%%fsdp2 --cpu 2
import fsdp2nb, torch
# What the docs leave to the reader, made of the sample text that ships with fsdp2nb.
from fsdp2nb.examples import sample_text, text_batches, text_windows
model_dir = {model_dir!r}
num_steps = 4
_batches = {{}}

def batch(step):                      # "your data": this rank's batch for a step
    if "iterator" not in _batches:
        _batches["iterator"] = text_batches(tokenizer, sample_text(), seq_len=32, batch_size=2, device=device)
    return next(_batches["iterator"])

def micro_batches(step):
    return [batch(step), batch(step)]

def train_step(step):
    loss = model(**batch(step)).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with open({steps_file!r}, "a") as trained:
        trained.write(f"{{rank}} {{step}}\\n")
"""

# Cells run just before the block whose text contains the key: what the page's prose says the reader has.
BEFORE = {
    "fsdp2nb.evaluate(model, val_examples": "%%fsdp2\nval_examples = text_windows(tokenizer, sample_text(), seq_len=32)[:6]\n"
                                            "step = 0",
    "ckpt.save(num_steps - 1)": "%%fsdp2\nmodel, tokenizer = fsdp2nb.load_model(model_dir)\n"
                                "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)",
    "trainer = Trainer(model": "%%fsdp2\nfrom transformers import AutoModelForCausalLM, Trainer, TrainingArguments\n"
                               "model = AutoModelForCausalLM.from_pretrained(model_dir)   # a plain model: no trainer_for\n"
                               "data = [{'input_ids': w['input_ids'], 'labels': w['input_ids']}\n"
                               "        for w in text_windows(tokenizer, sample_text(), seq_len=32)]",
    "fsdp2nb.trainer_for(SFTTrainer)": "%%fsdp2\nfrom datasets import Dataset\n"
                                       "data = Dataset.from_dict({'text': sample_text().split('. ')[:16]})",
    "--keep --name llama": "%fsdp2 stop",
}
# Cells run just after such a block: the compiled model's first step compiles it, and its loss is
# the uncompiled model's "up to float rounding", as usage.md says.
AFTER = {
    "engine.shard_model(model, model_dir)": """%%fsdp2
fixed = next(text_batches(tokenizer, sample_text(), seq_len=32, batch_size=2, device=device, seed=7))
compiled_loss = model(**fixed).loss
compiled_loss.backward()
reference, _ = fsdp2nb.load_model(model_dir)
reference_loss = reference(**fixed).loss
assert torch.allclose(compiled_loss, reference_loss, rtol=2e-2), (compiled_loss, reference_loss)
del reference""",
}


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str
    not_run: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _is_runnable(language: str, code: str) -> bool:
    first = next((line.strip() for line in code.splitlines() if line.strip()), "")
    return language.strip() in ("python", "ipython") or first.startswith("%")


def doc_blocks(pages: tuple[Path, ...] = PAGES) -> list[Block]:
    """The Python and magic blocks of `pages`, in reading order, each with its marked reason not to run."""
    blocks = []
    for page in pages:
        text = page.read_text()
        for fence in _FENCE.finditer(text):
            if not _is_runnable(fence.group(1), fence.group(2)):
                continue
            before = text[:fence.start()].rstrip()
            marker = _NOT_RUN.fullmatch(before.rsplit("<!--", 1)[-1]) if before.endswith("-->") else None
            blocks.append(Block(str(page.relative_to(ROOT)), text.count("\n", 0, fence.start()) + 1,
                                fence.group(2), marker.group(1) if marker else None))
    return blocks


def as_run_here(code: str, places: dict[str, str]) -> str:
    for written, here in PLACEHOLDERS.items():
        code = code.replace(written, here.format(**places))
    return code


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    from fsdp2nb.examples import save_tiny_llama

    root = tmp_path_factory.mktemp("docs")
    llama_70b = root / "llama-70b"
    llama_70b.mkdir()
    (llama_70b / "config.json").write_text(json.dumps(LLAMA_70B))
    return {"model_dir": str(save_tiny_llama(root / "tiny-llama")), "llama_70b_dir": str(llama_70b),
            "ckpt_dir": str(root / "ckpt" / "run1"), "steps_file": str(root / "steps.txt"), "root": str(root)}


@pytest.fixture(scope="module")
def docs_kernel(places):
    kernel = Kernel(env=WITHOUT_GPUS, cwd=places["root"])  # relative paths ("out", "export") land there
    assert kernel.execute("%load_ext fsdp2nb").status == "ok"
    names = kernel.execute(READERS_NAMES.format(**places), timeout=300)
    assert names.status == "ok", names.traceback_text
    yield kernel
    kernel.stop()


def _run(kernel: Kernel, code: str, where: str) -> None:
    run = kernel.execute(code, timeout=600)
    assert run.status == "ok", f"{where}:\n{code}\n{run.traceback_text or run.stderr}"


def test_every_block_runs_or_says_why_not():
    blocks = doc_blocks()
    assert len(blocks) >= 15, [block.id for block in blocks]
    unexplained = [block.id for block in blocks if block.not_run == ""]
    assert not unexplained, f"`<!-- not run: -->` without a reason before {unexplained}"


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("block", [b for b in doc_blocks() if b.not_run is None], ids=lambda b: b.id)
def test_doc_block_runs_as_written(block, docs_kernel, places):
    for key, cell in BEFORE.items():
        if key in block.code:
            _run(docs_kernel, cell, f"before {block.id}")
    _run(docs_kernel, as_run_here(block.code, places), block.id)
    for key, cell in AFTER.items():
        if key in block.code:
            _run(docs_kernel, cell, f"after {block.id}")


def test_a_cells_logged_points_are_in_metrics_once_it_has_ended(docs_kernel):
    """usage.md: "A cell's points are there when the cell has ended" (no waiting for a snapshot)."""
    _run(docs_kernel, "%%fsdp2\nimport fsdp2nb\nfor step in range(1000, 1003):\n    fsdp2nb.log(step, probe=float(rank))", "logging")
    rows = docs_kernel.execute("rows = %fsdp2 metrics\nrecords = rows.to_dict('records') if hasattr(rows, 'to_dict') "
                               "else rows\nprint(sorted((r['rank'], r['step']) for r in records if r['step'] >= 1000))")
    assert rows.stdout.strip() == str([(rank, step) for rank in (0, 1) for step in range(1000, 1003)]), rows.stdout


def _resume_recipe() -> Block:
    """usage.md's checkpoint recipe: the block under "## Checkpoints" that loads "latest"."""
    usage = (ROOT / "docs" / "usage.md").read_text()
    section = usage.split("\n## Checkpoints\n", 1)[1].split("\n## ", 1)[0]
    recipes = [block for block in doc_blocks((ROOT / "docs" / "usage.md",))
               if 'ckpt.load("latest")' in block.code and block.code in section]
    assert len(recipes) == 1, [block.id for block in recipes]
    return recipes[0]


@pytest.mark.timeout(900)
def test_the_resume_recipe_trains_each_step_once_across_a_restart(docs_kernel, places, tmp_path):
    """Last in the module: it restarts the pool. Steps 0-4, a restart, the same cell again: 5-9."""
    recipe = _resume_recipe()
    code = as_run_here(recipe.code, {**places, "ckpt_dir": str(tmp_path / "run1")})
    steps_file = Path(places["steps_file"])
    steps_file.write_text("")
    for num_steps in (5, 10):
        _run(docs_kernel, READERS_NAMES.format(**places), "the reader's names")
        _run(docs_kernel, "%%fsdp2\nmodel, tokenizer = fsdp2nb.load_model(model_dir)\n"
                          f"optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)\nnum_steps = {num_steps}",
             "the set-up before the recipe")
        _run(docs_kernel, code, recipe.id)
        _run(docs_kernel, "%fsdp2 restart", "a restart: every rank's state is lost")
    trained = [int(step) for rank, step in (line.split() for line in steps_file.read_text().splitlines())
               if rank == "0"]
    assert trained == list(range(10)), f"{recipe.id} trained steps {trained} across a restart"
