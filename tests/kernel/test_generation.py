"""`fsdp2nb.generate` and `fsdp2nb.evaluate` from notebook cells on 2 CPU ranks, against the same
checkpoint whole in the kernel's own process.

One pool and one tiny Llama (printable-character tokenizer) for the module: greedy completions and
their order with uneven shares (5 prompts on 2 ranks), the model sharded as before and trainable
afterwards, the first prompt streamed as one updated line, the sharded lockstep fallback forced with
a limit (a rank done first, a rank without prompts), and evaluation against a plain loop.
"""

from __future__ import annotations

import re
import time

import pytest

PROMPTS = ["The light", "a", "Keeper of the lamp", "zz", "Once upon a time"]

SETUP = """%%fsdp2
import fsdp2nb
from torch.distributed.tensor import DTensor
from fsdp2nb.examples import save_tiny_llama
if rank == 0:
    save_tiny_llama(model_dir, hidden_size=64)
dist.barrier()
model, tokenizer = fsdp2nb.load_model(model_dir, engine=fsdp2nb.FSDP2Engine(mixed_precision="fp32"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
def hook_tables():
    return [list(table) for m in model.modules() for table in (m._forward_pre_hooks, m._forward_hooks)]

local_shapes, hooks = [tuple(p.to_local().shape) for p in model.parameters()], hook_tables()

def sharded_as_loaded():  # FSDP2's forward hooks too, which generation sets aside while gathered
    return all(isinstance(p, DTensor) for p in model.parameters()) and hook_tables() == hooks and \\
        [tuple(p.to_local().shape) for p in model.parameters()] == local_shapes

initial = [p.detach().to_local().clone() for p in model.parameters()]

def train_step():
    # one optimizer step, then the initial weights back: later cells compare with the checkpoint
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(rank))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for param, value in zip(model.parameters(), initial):
            param.to_local().copy_(value)
    return loss.item()
"""

REFERENCE = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

whole = AutoModelForCausalLM.from_pretrained(model_dir).eval()
whole_tokenizer = AutoTokenizer.from_pretrained(model_dir)

def whole_generate(prompts, **kwargs):
    inputs = whole_tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    output = whole.generate(**inputs, do_sample=False, pad_token_id=whole_tokenizer.pad_token_id, **kwargs)
    return whole_tokenizer.batch_decode(output[:, inputs.input_ids.shape[1]:], skip_special_tokens=True)
"""


@pytest.fixture(scope="module")
def loaded(kernel, tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("generation") / "model")
    run = kernel.execute(f"model_dir = {model_dir!r}\nPROMPTS = {PROMPTS!r}\n%fsdp2 push model_dir PROMPTS")
    assert run.status == "ok", run.stderr
    run = kernel.execute(SETUP, timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    run = kernel.execute(REFERENCE, timeout=120)
    assert run.status == "ok", run.traceback_text
    return kernel


def test_greedy_completions_equal_the_whole_model_in_prompt_order_and_training_goes_on(loaded):
    run = loaded.execute("expected = whole_generate(PROMPTS, max_new_tokens=12)\n%fsdp2 push expected")
    assert run.status == "ok", run.traceback_text
    run = loaded.execute("%%fsdp2\nmodel.train()\n"
                         "completions = fsdp2nb.generate(model, tokenizer, PROMPTS, max_new_tokens=12, do_sample=False)\n"
                         "print(completions == expected, len(completions), len(set(completions)) > 1)\n"
                         "print(model.training, sharded_as_loaded())\n"
                         "print('loss', train_step() > 0, sharded_as_loaded())")
    assert run.status == "ok", run.traceback_text
    # Every rank has every completion (5 prompts, one batch, all on rank 0), in prompt order.
    assert run.stdout == "[all] True 5 True\n[all] True True\n[all] loss True True\n", run.stdout + run.stderr
    assert "lockstep" not in run.stderr
    assert "Warning" not in run.stderr, run.stderr  # torch 2.13 warns on all_gather_into_tensor


def test_more_prompts_than_a_batch_are_decoded_on_every_rank_batch_after_batch(loaded):
    """5 prompts, 2 a batch: both CPU ranks work (rank 0: a batch of 2, then 1; rank 1: one of 2),
    gathered and in lockstep alike, and the completions are the whole model's."""
    run = loaded.execute("expected = whole_generate(PROMPTS, max_new_tokens=6, min_new_tokens=6)\n%fsdp2 push expected")
    assert run.status == "ok", run.traceback_text
    run = loaded.execute(
        "%%fsdp2\nfrom transformers import LogitsProcessor, LogitsProcessorList\n"
        "class Rows(LogitsProcessor):  # the batch of each of the 6 tokens decoded\n"
        "    def __init__(self): self.seen = []\n"
        "    def __call__(self, input_ids, scores):\n"
        "        self.seen.append(input_ids.shape[0])\n"
        "        return scores\n"
        "for limit in (None, 1000):\n"
        "    rows = Rows()\n"
        "    out = fsdp2nb.generate(model, tokenizer, PROMPTS, max_new_tokens=6, min_new_tokens=6, do_sample=False,\n"
        "                           batch_size=2, max_gathered_bytes=limit, logits_processor=LogitsProcessorList([rows]))\n"
        "    print(limit, out == expected, rows.seen[::6], sharded_as_loaded())", timeout=120)
    assert run.status == "ok", run.traceback_text
    # In lockstep rank 1 runs a second batch (the first prompt, dropped) while rank 0 runs its last.
    assert sorted(run.stdout.splitlines()) == [
        "[0] None True [2, 1] True", "[1] None True [2] True", "[all] 1000 True [2, 1] True"], run.stdout + run.stderr


def test_one_batch_is_decoded_by_one_rank_on_every_core(loaded):
    """5 prompts in one batch: rank 0 decodes them all on the host's cores (split over two
    processes, every weight would be read twice per token); rank 1 waits with its own threads."""
    run = loaded.execute(
        "%%fsdp2\nimport os\nfrom transformers import LogitsProcessor, LogitsProcessorList\n"
        "class Rows(LogitsProcessor):\n"
        "    def __init__(self): self.seen = set()\n"
        "    def __call__(self, input_ids, scores):\n"
        "        self.seen.add((input_ids.shape[0], torch.get_num_threads()))\n"
        "        return scores\n"
        "rows = Rows()\n"
        "out = fsdp2nb.generate(model, tokenizer, PROMPTS, max_new_tokens=3, do_sample=False,\n"
        "                       logits_processor=LogitsProcessorList([rows]))\n"
        "print(len(out), sorted(rows.seen), len(os.sched_getaffinity(0)))", timeout=120)
    assert run.status == "ok", run.traceback_text
    cores = int(run.stdout.split()[-1])
    assert sorted(run.stdout.splitlines()) == [f"[0] 5 [(5, {cores})] {cores}", f"[1] 5 [] {cores}"], run.stdout


PACED = """%%fsdp2
import time
from transformers import LogitsProcessor, LogitsProcessorList
class Paced(LogitsProcessor):  # a token every DELAY_S, as a bigger model would take
    def __call__(self, input_ids, scores):
        time.sleep(DELAY_S)
        return scores
streamed = fsdp2nb.generate(model, tokenizer, PROMPTS[:3], max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                            do_sample=False,
                            stream=True, logits_processor=LogitsProcessorList([Paced()]))
print('done')
"""


def _streamed_states(run) -> list[str]:
    """The first prompt's line as the notebook showed it: its display, then each update."""
    return [m["content"]["data"]["text/plain"] for m in run.messages
            if m["msg_type"] in ("display_data", "update_display_data") and "[0] The light" in
            m["content"].get("data", {}).get("text/plain", "")]


def test_the_first_prompt_streams_as_one_line_updated_during_the_cell(loaded):
    run = loaded.execute(PACED.replace("DELAY_S", "0.05").replace("NUM_TOKENS", "40"), timeout=120)
    assert run.status == "ok", run.traceback_text
    assert run.stdout == "[all] done\n", run.stdout  # the streamed text is no line of plain output
    shown = _streamed_states(run)
    assert len(shown) >= 3, shown  # shown once, then updated in place while the tokens came
    assert all(later.startswith(earlier.rstrip()) for earlier, later in zip(shown, shown[1:], strict=False)), shown
    final = loaded.execute("%fsdp2 pull streamed\nprint(repr(streamed[0]))")
    assert shown[-1].rstrip() == "[0] The light" + eval(final.stdout).rstrip(), (shown[-1], final.stdout)


def test_a_stream_of_a_quarter_of_a_second_is_seen_growing(loaded):
    """8 tokens 25 ms apart, about a quarter of a second in all: the line is shown while the tokens
    come (not only once they are all there), then completed in place."""
    run = loaded.execute(PACED.replace("DELAY_S", "0.025").replace("NUM_TOKENS", "8"), timeout=120)
    assert run.status == "ok", run.traceback_text
    assert run.stdout == "[all] done\n", run.stdout + run.stderr
    shown = _streamed_states(run)
    assert len(shown) >= 2 and len(shown[0].rstrip()) < len(shown[-1].rstrip()), shown
    assert all(later.startswith(earlier.rstrip()) for earlier, later in zip(shown, shown[1:], strict=False)), shown


def test_sharded_lockstep_when_a_limit_forbids_gathering(loaded):
    """With max_gathered_bytes under the model's size the ranks generate sharded: rank 1's one
    prompt ends at its first token while rank 0 goes on, and with one prompt rank 1 has none."""
    run = loaded.execute("three = PROMPTS[:3]\n"
                         "inputs = whole_tokenizer(three, return_tensors='pt', padding=True, padding_side='left')\n"
                         "first = whole.generate(**inputs, max_new_tokens=1, do_sample=False,\n"
                         "                       pad_token_id=whole_tokenizer.pad_token_id)[2, -1].item()\n"
                         "expected = whole_generate(three, max_new_tokens=12, eos_token_id=first)\n"
                         "expected_one = whole_generate(PROMPTS[:1], max_new_tokens=6)\n"
                         "%fsdp2 push three first expected expected_one")
    assert run.status == "ok", run.traceback_text
    run = loaded.execute("%%fsdp2\nout = fsdp2nb.generate(model, tokenizer, three, max_new_tokens=12, do_sample=False,\n"
                         "                       eos_token_id=first, max_gathered_bytes=1000)\n"
                         "one = fsdp2nb.generate(model, tokenizer, PROMPTS[0], max_new_tokens=6, do_sample=False,\n"
                         "                       max_gathered_bytes=1000)\n"
                         "print(out == expected, len(out[2]) < len(out[0]), one == expected_one[0], sharded_as_loaded())",
                         timeout=120)
    assert run.status == "ok", run.traceback_text
    assert run.stdout == "[all] True True True True\n", run.stdout + run.stderr
    reasons = re.findall(r"\[0\] fsdp2nb.generate runs sharded, in lockstep: the gathered model needs [0-9.]+ KiB "
                         r"per rank, over the limit of 1000 B", run.stderr)
    assert len(reasons) == 2, run.stderr  # said once per call, by rank 0


def test_evaluate_equals_one_process_and_logs_to_the_curves(loaded):
    run = loaded.execute(
        "ids = whole_tokenizer('The keeper climbed the stairs of the lighthouse every night.').input_ids\n"
        "examples = [{'input_ids': ids[:length]} for length in (5, 9, 14, 6, 11, 8, 12)]\n"
        "with torch.no_grad():\n"
        "    sums = [torch.nn.functional.cross_entropy(whole(input_ids=torch.tensor([e['input_ids']])).logits[0, :-1],\n"
        "            torch.tensor(e['input_ids'][1:]), reduction='sum').item() for e in examples]\n"
        "reference_loss = sum(sums) / sum(len(e['input_ids']) - 1 for e in examples)\n"
        "%fsdp2 push examples reference_loss")
    assert run.status == "ok", run.traceback_text
    # 7 examples on 2 ranks, 3 a batch: rank 0 runs 2 batches, rank 1 one; lengths differ, so padded.
    run = loaded.execute("%%fsdp2\nimport math\nfrom transformers import DataCollatorWithPadding\nmodel.train()\n"
                         "pad = DataCollatorWithPadding(tokenizer)\n"
                         "gathered = fsdp2nb.evaluate(model, examples, batch_size=3, collate_fn=pad, step=7)\n"
                         "sharded = fsdp2nb.evaluate(model, examples, batch_size=3, collate_fn=pad, max_gathered_bytes=0)\n"
                         "print([abs(r.loss - reference_loss) < 1e-5 for r in (gathered, sharded)], gathered.num_tokens,\n"
                         "      abs(gathered.perplexity - math.exp(reference_loss)) < 1e-3, model.training, sharded_as_loaded())",
                         timeout=120)
    assert run.status == "ok", run.traceback_text
    assert run.stdout == "[all] [True, True] 58 True True True\n", run.stdout + run.stderr
    bars = [m["content"]["data"].get("text/plain", "") for m in run.messages
            if m["msg_type"] in ("display_data", "update_display_data")]
    assert any("evaluating: done, 2 batches" in text for text in bars), bars
    assert _eval_loss_logged_at(loaded, 7)


def test_evaluate_runs_one_batch_on_one_rank_with_the_same_loss(loaded):
    """3 examples, 3 a batch: one batch, so rank 0 runs it alone on the host's cores, and the loss
    is the one both ranks find with a batch each."""
    run = loaded.execute(
        "%%fsdp2\nimport os\nexamples3 = [list(range(3, 3 + length)) for length in (6, 6, 6)]\n"
        "passes = []\n"
        "hook = model.register_forward_pre_hook(lambda module, args: passes.append(torch.get_num_threads()))\n"
        "try:\n"
        "    one = fsdp2nb.evaluate(model, examples3, batch_size=3)\n"
        "    mine = len(passes)\n"
        "    split = fsdp2nb.evaluate(model, examples3, batch_size=2)\n"
        "finally:\n"
        "    hook.remove()\n"
        "print(mine, passes[:1] == [len(os.sched_getaffinity(0))] if mine else '-', abs(one.loss - split.loss) < 1e-5,\n"
        "      len(passes) - mine)", timeout=120)
    assert run.status == "ok", run.traceback_text
    assert sorted(run.stdout.splitlines()) == ["[0] 1 True True 1", "[1] 0 - True 1"], run.stdout + run.stderr


def test_bad_input_fails_the_cell_in_one_line_and_changes_nothing(loaded, assert_pool_usable):
    run = loaded.execute("%%fsdp2\nfsdp2nb.generate(model, tokenizer, [], max_new_tokens=4)")
    assert run.status == "error"
    assert run.traceback_text.strip() == ("[all] ranks 0, 1 raised GenerationInputError: no prompts: pass a string "
                                          "or a non-empty list of strings"), run.traceback_text
    run = loaded.execute("%%fsdp2\nfsdp2nb.generate(model, tokenizer, PROMPTS[:rank + 1], max_new_tokens=4)")
    assert run.traceback_text.strip() == (  # found in the collective that plans, so no rank waits for another
        "[all] ranks 0, 1 raised GenerationInputError: the ranks were given different prompts (rank 0: 1, rank 1: 2 "
        "prompts): pass the same list on every rank; each rank generates its share"), run.traceback_text
    assert_pool_usable()
    run = loaded.execute("%%fsdp2\nprint(model.training, sharded_as_loaded())")
    assert run.stdout == "[all] True True\n"


def _eval_loss_logged_at(kernel, step: int, wait_s: float = 10.0) -> bool:
    """Whether `%fsdp2 metrics` lists eval_loss at `step`; the ranks send logged points twice a second."""
    code = ("import math\nrows = %fsdp2 metrics\nrows = rows.to_dict('records') if hasattr(rows, 'to_dict') else rows\n"
            f"print(any(r.get('step') == {step} and math.isfinite(r.get('eval_loss') or math.nan) for r in rows))")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if kernel.execute(code).stdout.strip() == "True":
            return True
        time.sleep(0.5)
    return False
