"""Plan a model's memory per rank before loading it, as FSDP2Engine will hold it (`fsdp2nb.plan_memory`).

The model is built on the meta device (shapes only, no weights read) as `load_model` builds it
(model_census.py). From it, per rank:

* parameters: FSDP2 splits every parameter on dim 0 as `torch.chunk` does and gives each rank a
  storage padded to the first chunk's size (a rank past the last chunk holds padding only);
* gradients: views into one padded buffer per unit, in the parameters' dtype (unpadded copies
  when offloaded);
* optimizer state: `zeros_like` of the rank's unpadded shard per state tensor, and AdamW's
  4-byte `step` per parameter;
* activations: what autograd saves in one forward with loss, traced on meta tensors
  (activation_trace.py);
* gathered: what FSDP2 holds unsharded beside them: the root and the head (never resharded
  after forward), the current and the prefetched unit, and one unit's unsharded gradients on
  their way to the reduce-scatter (a peak of backward, added to the rest: an upper bound).
"""

from __future__ import annotations

import dataclasses
import functools
import html
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fsdp2nb.config_checks import check_bool, check_choice
from fsdp2nb.engine.activation_trace import ActivationTrace, trace_activations
from fsdp2nb.engine.config import MIXED_PRECISION_CHOICES, EngineConfig
from fsdp2nb.engine.model_census import (
    ParamLayout,
    build_meta_model,
    load_config,
    param_layout,
    rows_per_rank,
)
from fsdp2nb.errors import InvalidValue
from fsdp2nb.sizes import size

CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer", "activations", "gathered")
"""The keys of each rank's figures in `MemoryPlan.per_rank`."""
_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state",
           "activations": "activations", "gathered": "gathered (in flight)"}
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}
"""State tensors per parameter, each shaped as the rank's shard (Adam: exp_avg and exp_avg_sq)."""
_STEP_BYTES = {"adamw": 4, "adam": 4}  # a float32 `step` tensor per parameter
DEVICE_CHOICES: tuple[str, ...] = ("cuda", "cpu")
FIT_FRACTION = 0.9
"""Above this share of the capacity a plan is tight: the allocator's cache and fragmentation need room."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PlanSettings:
    """What a plan assumes, as `plan_memory` was asked."""

    world_size: int
    """Ranks the model is sharded over."""
    device: Literal["cuda", "cpu"] = "cuda"
    """What the ranks compute on; CPU ranks share the host's memory."""
    mixed_precision: str = "bf16"
    """The engine's: "bf16" (bf16 compute, fp32 trainable weights and gradient reduction) or "fp32"."""
    offload_params: bool = False
    """Sharded parameters, gradients and optimizer state in host memory (CUDA ranks only)."""
    reshard_after_forward: bool = True
    """The engine's: False keeps every unit gathered from forward to backward."""
    lora_rank: int | None = None
    """The LoRA adapters' rank r; None trains every weight."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward."""
    batch_size: int = 1
    """Sequences per rank per step."""
    seq_len: int = 2048
    """Tokens per sequence."""
    optimizer: str = "adamw"
    """Whose state is counted: "adamw", "adam", "sgd_momentum" or "sgd" (no state)."""

    def __post_init__(self) -> None:
        for name in ("world_size", "batch_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidValue(f"{name}={value!r} is not allowed; give a whole number of at least 1")
        check_choice("device", self.device, DEVICE_CHOICES)
        check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISION_CHOICES)
        check_choice("optimizer", self.optimizer, tuple(OPTIMIZER_STATES))
        for name in ("offload_params", "reshard_after_forward", "activation_checkpointing"):
            check_bool(name, getattr(self, name))
        if self.offload_params and self.device == "cpu":
            raise InvalidValue("offload_params=True is not allowed on CPU ranks (their memory is the host's "
                             "already); allowed: offload_params=False, or plan for GPUs")

    def describe(self) -> str:
        """`8 cuda ranks · bf16 · LoRA r=16 · adamw · batch 1 × 2048 tokens · checkpointing`."""
        parts = [f"{self.world_size} {self.device} rank{'s' if self.world_size > 1 else ''}", self.mixed_precision,
                 f"LoRA r={self.lora_rank}" if self.lora_rank else "all weights trained", self.optimizer,
                 f"batch {self.batch_size} × {self.seq_len} tokens per rank"]
        if self.activation_checkpointing:
            parts.append("activation checkpointing")
        if self.offload_params:
            parts.append("offloaded to host memory")
        if not self.reshard_after_forward:
            parts.append("no resharding after forward")
        return " · ".join(parts)


@dataclass(frozen=True)
class MemoryPlan:
    """What each rank will hold, by category, against what it has; a table in the notebook."""

    model: str
    """The model planned: its path, Hub id or config class."""
    settings: PlanSettings
    per_rank: tuple[dict[str, int], ...]
    """Bytes by category (`CATEGORIES`) for each rank, rank 0 first."""
    on_host: tuple[str, ...]
    """Categories held in host memory rather than on the device (offloaded)."""
    capacity_bytes: int | None
    """Memory one rank may use: its GPU's, or for CPU ranks the host's (its cgroup's if lower)
    shared among them; None where unknown."""
    verdict: str
    """One line: fits with what to spare, or what to change."""
    notes: tuple[str, ...] = ()

    def device_bytes(self, rank: int) -> int:
        """What `rank` holds on its device (on the host for CPU ranks): its total less what is offloaded."""
        return sum(v for k, v in self.per_rank[rank].items() if k not in self.on_host)

    def host_bytes(self, rank: int) -> int:
        return sum(v for k, v in self.per_rank[rank].items() if k in self.on_host)

    @property
    def busiest_rank(self) -> int:
        return max(range(len(self.per_rank)), key=self.device_bytes)

    def __str__(self) -> str:
        rows = self._rows()
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        table = "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in
                                    enumerate(zip(row, widths, strict=True))).rstrip() for row in rows)
        return "\n".join([f"memory plan for {self.model}: {self.settings.describe()}", table, self.verdict,
                          *self.notes])

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        rows = self._rows()
        head = "".join(f"<th style='text-align:right'>{html.escape(c)}</th>" for c in rows[0][1:])
        body = "".join(
            "<tr" + (" style='font-weight:600'" if row[0].startswith("total") else "") + ">"
            + f"<td style='text-align:left'>{html.escape(row[0])}</td>"
            + "".join(f"<td style='text-align:right'>{html.escape(c)}</td>" for c in row[1:]) + "</tr>"
            for row in rows[1:])
        colour = "#15803d" if self.verdict.startswith("fits with") else "#dc2626"
        notes = "".join(f"<br><small style='color:#6b7280'>{html.escape(n)}</small>" for n in self.notes)
        return (f"<div class='fsdp2nb-plan'><b>memory plan</b> for <code>{html.escape(self.model)}</code>: "
                f"{html.escape(self.settings.describe())}<table><tr><th></th>{head}</tr>{body}</table>"
                f"<span style='color:{colour}'>{html.escape(self.verdict)}</span>{notes}</div>")

    def _rows(self) -> list[tuple[str, ...]]:
        """Category rows by column; ranks with the same figures share a column."""
        groups: dict[tuple, list[int]] = {}
        for rank, figures in enumerate(self.per_rank):
            groups.setdefault(tuple(figures.items()), []).append(rank)
        columns = [(ranks_label(ranks), ranks[0]) for ranks in groups.values()]
        where = "host" if self.settings.device == "cpu" else "device"
        rows = [("", *(label for label, _ in columns))]
        rows += [(_LABELS[c] + (" (host)" if c in self.on_host else ""),
                  *(size(self.per_rank[r][c]) for _, r in columns)) for c in CATEGORIES]
        rows.append((f"total on the {where}", *(size(self.device_bytes(r)) for _, r in columns)))
        if self.on_host:
            rows.append(("total in host memory", *(size(self.host_bytes(r)) for _, r in columns)))
        capacity = size(self.capacity_bytes) if self.capacity_bytes else "unknown"
        rows.append((f"{where} memory per rank", *(capacity for _ in columns)))
        return rows


def ranks_label(ranks: list[int]) -> str:
    """`rank 3`, `ranks 0-6`, `ranks 0, 2-3`."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


# --- the plan -----------------------------------------------------------------------------------


def plan_memory(
    model: Any,
    world_size: int,
    *,
    lora: Any = None,
    engine: Any = None,
    activation_checkpointing: bool = False,
    batch_size: int = 1,
    seq_len: int = 2048,
    optimizer: str = "adamw",
    device: str | None = None,
    capacity_bytes: int | None = None,
) -> MemoryPlan:
    """What each of `world_size` ranks will hold training `model` with FSDP2Engine, and whether it fits.

    `model`: a directory or config.json path, a transformers config, or a Hub id already in the
    local cache (nothing is downloaded, no weights are read). `lora`: the adapters' rank (an int,
    adapting every Linear but the head) or a peft.LoraConfig, as `load_model` takes it. `engine`:
    an FSDP2Engine or EngineConfig (default: bf16, no offload). `batch_size` counts sequences per
    rank. `device`: "cuda" or "cpu" (default: the engine's device, else "cuda"); `capacity_bytes`
    overrides the memory one rank may use (default: the GPU's, asked of nvidia-smi, or the host's
    shared among CPU ranks).
    """
    engine_config, engine_device = _engine_settings(engine)
    lora_config = _lora_config(lora)
    settings = PlanSettings(
        world_size=world_size, device=device or engine_device or "cuda",
        mixed_precision=engine_config.mixed_precision, offload_params=engine_config.offload_params,
        reshard_after_forward=engine_config.reshard_after_forward,
        lora_rank=lora_config.r if lora_config is not None else None,
        activation_checkpointing=activation_checkpointing, batch_size=batch_size, seq_len=seq_len,
        optimizer=optimizer,
    )
    config, name = load_config(model)
    planned = build_meta_model(config, lora_config, compute_dtype(settings.mixed_precision))
    layout = param_layout(planned)
    trace = trace_activations(planned, settings.batch_size, settings.seq_len, compute_dtype(settings.mixed_precision))
    if capacity_bytes is None:
        capacity_bytes = _engine_capacity(engine) or device_capacity(settings.device, world_size)
    return assemble_plan(name, settings, layout, trace, capacity_bytes)


def assemble_plan(name: str, settings: PlanSettings, layout: ParamLayout, trace: ActivationTrace,
                  capacity_bytes: int | None) -> MemoryPlan:
    """The plan from its parts: each rank's figures, the verdict and the notes."""
    per_rank = rank_figures(layout, trace, settings)
    on_host = ("parameters", "gradients", "optimizer") if settings.offload_params else ()
    need = need_bytes(layout, trace, settings)
    busiest = next(r for r, figures in enumerate(per_rank)
                   if sum(v for k, v in figures.items() if k not in on_host) == need)
    notes = [f"activations traced for batch {settings.batch_size} × {settings.seq_len} tokens on meta tensors; "
             "the CUDA context, the allocator's cache and the loss's temporary copies of the logits come on top"]
    if trace.error:
        notes.insert(0, f"activations unknown (counted as 0): the forward could not be traced on meta: {trace.error}")
    verdict = _verdict(need, busiest, capacity_bytes, settings, _alternatives(layout, trace, settings, capacity_bytes))
    return MemoryPlan(model=name, settings=settings, per_rank=per_rank, on_host=on_host,
                      capacity_bytes=capacity_bytes, verdict=verdict, notes=tuple(notes))


def compute_dtype(mixed_precision: str) -> torch.dtype:
    return torch.bfloat16 if mixed_precision == "bf16" else torch.float32


def _engine_settings(engine: Any) -> tuple[EngineConfig, str | None]:
    if engine is None:
        return EngineConfig(), None
    if isinstance(engine, EngineConfig):
        return engine, None
    config = getattr(engine, "config", None)
    if isinstance(config, EngineConfig):
        return config, engine.device.type
    raise InvalidValue(f"engine={engine!r} is not allowed; give an fsdp2nb.FSDP2Engine, an EngineConfig or None")


def _engine_capacity(engine: Any) -> int | None:
    """A GPU rank's engine knows its device: ask CUDA there (the kernel never does)."""
    device = getattr(engine, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def _lora_config(lora: Any) -> Any:
    """A peft.LoraConfig from `lora`: an int r adapts every Linear but the head (peft's "all-linear")."""
    if lora is None:
        return None
    if isinstance(lora, int) and not isinstance(lora, bool) and lora >= 1:
        from peft import LoraConfig

        return LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear", lora_dropout=0.0)
    if hasattr(lora, "r") and hasattr(lora, "target_modules"):
        return lora
    raise InvalidValue(f"lora={lora!r} is not allowed; give the adapters' rank (an int, e.g. 16) or a peft.LoraConfig")


# --- each rank's figures ------------------------------------------------------------------------


def rank_figures(layout: ParamLayout, trace: ActivationTrace, settings: PlanSettings) -> tuple[dict[str, int], ...]:
    world_size = settings.world_size
    parameters = 0
    gradients = [0] * world_size
    optimizer = [0] * world_size
    states, step_bytes = OPTIMIZER_STATES[settings.optimizer], _STEP_BYTES.get(settings.optimizer, 0)
    for param in layout.params:
        local = rows_per_rank(param.rows, world_size)
        row_bytes = param.row_numel * param.itemsize * param.count
        parameters += local[0] * row_bytes  # every rank's storage is padded to the first chunk
        if not param.trainable:
            continue
        for rank in range(world_size):
            # Offloading copies each gradient to the host unpadded; on the device they stay views
            # into the unit's padded reduce-scatter output.
            gradients[rank] += (local[rank] if settings.offload_params else local[0]) * row_bytes
            optimizer[rank] += states * local[rank] * row_bytes + step_bytes * param.count
    activations = trace.bytes(settings.activation_checkpointing, settings.batch_size)
    gathered = gathered_bytes(layout, settings)
    return tuple(dict(parameters=parameters, gradients=gradients[rank], optimizer=optimizer[rank],
                      activations=activations, gathered=gathered) for rank in range(world_size))


def gathered_bytes(layout: ParamLayout, settings: PlanSettings) -> int:
    """Unsharded parameters and gradients at backward's peak: the units never resharded after
    forward, the two largest others (the current and the prefetched), and the largest unit's
    gradients in the compute dtype plus their copy in the reduce dtype."""
    world_size, bf16 = settings.world_size, settings.mixed_precision == "bf16"
    unsharded = [0] * len(layout.unit_kinds)
    grads_in_flight = [0] * len(layout.unit_kinds)
    for param in layout.params:
        numel = rows_per_rank(param.rows, world_size)[0] * world_size * param.row_numel  # padded
        gathered_size = 2 if bf16 and param.floating else param.itemsize
        unsharded[param.unit] += numel * gathered_size
        if param.trainable:
            grads_in_flight[param.unit] += numel * (gathered_size + (4 if bf16 else param.itemsize))
    resident = [i for i, kind in enumerate(layout.unit_kinds)
                if kind in ("head", "root") or not settings.reshard_after_forward]
    unsharded = [size * (layout.unit_counts[i] if i in resident else 1) for i, size in enumerate(unsharded)]
    others = sorted((unsharded[i] for i in range(len(unsharded)) if i not in resident
                     for _ in range(min(layout.unit_counts[i], 2))), reverse=True)
    return sum(unsharded[i] for i in resident) + sum(others[:2]) + max(grads_in_flight, default=0)


# --- capacity and verdict -----------------------------------------------------------------------


def device_capacity(device: str, world_size: int) -> int | None:
    """Memory one rank may use: a GPU's (the smallest), or the host's shared among CPU ranks."""
    if device == "cpu":
        from fsdp2nb.host_memory import host_limit_bytes

        return host_limit_bytes() // world_size
    return gpu_memory_bytes()


@functools.cache
def gpu_memory_bytes() -> int | None:
    """The smallest GPU's memory here, asked of nvidia-smi: the kernel never initialises CUDA."""
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return None
    try:
        output = subprocess.run([executable, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    mib = [int(value) for value in output.split() if value.isdigit()]
    return min(mib) * 2**20 if mib else None


Change = tuple[str, ParamLayout, PlanSettings]
"""A change a verdict may suggest: its label, and the layout and settings it would plan."""


def _changes(layout: ParamLayout, trace: ActivationTrace, settings: PlanSettings, fits: float) -> list[Change]:
    """Each single change that lowers what a rank needs: checkpointing, LoRA, offloading, more
    ranks (the fewest doublings that fit, else 8x), a smaller batch (the largest that fits, else 1)."""
    changes: list[Change] = []
    if not settings.activation_checkpointing and not trace.error:
        changes.append(("activation checkpointing", layout,
                        dataclasses.replace(settings, activation_checkpointing=True)))
    if settings.lora_rank is None:  # the adapters' own bytes are left out: a few MiB
        changes.append(("LoRA", layout.all_frozen(compute_dtype(settings.mixed_precision).itemsize), settings))
    if settings.device == "cuda" and not settings.offload_params:
        changes.append(("offloading (offload_params=True)", layout,
                        dataclasses.replace(settings, offload_params=True)))
    if settings.device == "cuda":
        sizes = [settings.world_size * 2**k for k in range(1, 4)]
        more = next((n for n in sizes if need_bytes(layout, trace, dataclasses.replace(settings, world_size=n)) <= fits),
                    sizes[-1])
        changes.append((f"{more} ranks", layout, dataclasses.replace(settings, world_size=more)))
    if settings.batch_size > 1:
        smaller = next((b for b in range(settings.batch_size - 1, 1, -1)
                        if need_bytes(layout, trace, dataclasses.replace(settings, batch_size=b)) <= fits), 1)
        changes.append((f"batch {smaller}", layout, dataclasses.replace(settings, batch_size=smaller)))
    return changes


def _alternatives(layout: ParamLayout, trace: ActivationTrace, settings: PlanSettings,
                  capacity: int | None) -> list[tuple[str, int]]:
    """(change, what the busiest rank would then need) for the single changes that would fit, or
    failing those, for the pairs of changes that would."""
    if not capacity:
        return []
    fits = capacity * FIT_FRACTION
    changes = _changes(layout, trace, settings, fits)
    singles = [(label, need_bytes(changed, trace, new)) for label, changed, new in changes]
    if any(need <= fits for _, need in singles):
        return [(label, need) for label, need in singles if need <= fits]
    pairs = []
    for index, (label, changed, new) in enumerate(changes):
        for other_label, other_layout, other in changes[index + 1:]:
            merged = dataclasses.replace(new, **{f.name: getattr(other, f.name) for f in dataclasses.fields(other)
                                                 if getattr(other, f.name) != getattr(settings, f.name)})
            both = changed if changed is not layout else other_layout
            pairs.append((f"{label} and {other_label}", need_bytes(both, trace, merged)))
    return [(label, need) for label, need in pairs if need <= fits]


def need_bytes(layout: ParamLayout, trace: ActivationTrace, settings: PlanSettings) -> int:
    """What the busiest rank holds on its device under `settings`."""
    on_host = ("parameters", "gradients", "optimizer") if settings.offload_params else ()
    return max(sum(v for k, v in figures.items() if k not in on_host)
               for figures in rank_figures(layout, trace, settings))


def _verdict(need: int, rank: int, capacity: int | None, settings: PlanSettings,
             alternatives: list[tuple[str, int]]) -> str:
    where = "the host's share" if settings.device == "cpu" else "the GPU's"
    if not capacity:
        return (f"needs {size(need)} on rank {rank}; the GPUs' memory is unknown here: pass "
                "capacity_bytes= (`%fsdp2 plan ... --memory 80GiB`)")
    if need <= capacity * FIT_FRACTION:
        return f"fits with {size(capacity - need)} to spare (rank {rank} needs {size(need)} of {size(capacity)})"
    if need <= capacity:
        spare = f"fits with only {size(capacity - need)} to spare (rank {rank} needs {size(need)} of {size(capacity)})"
        return spare + "; the allocator needs some room" + (
            f": {_options_text(alternatives)} would leave more" if alternatives else "")
    short = f"does not fit: rank {rank} needs {size(need)}, {where} is {size(capacity)}"
    if not alternatives:
        return short + ("; no change or pair of changes planned here fits (LoRA, activation checkpointing, "
                        "offloading, 8x the ranks, batch 1): a larger device or more of them")
    return f"{short}; it would fit with {_options_text(alternatives)}"


def _options_text(alternatives: list[tuple[str, int]], most: int = 3) -> str:
    """The first `most` in the order `_changes` tries them (least disruptive first)."""
    return ", or ".join(f"{label} ({size(need)})" for label, need in alternatives[:most])
