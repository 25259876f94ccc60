"""Forget-free continual learning by grafting (paper section 5.2, appendix C.3).

Tasks arrive one at a time. Task ``t_n`` comes with its region ``gamma_n`` (from an independent fine-tune and
``MaskTrainer`` run on ``t_n``, or given), and the continual model is trained only on
``gamma_n - (gamma_1 | ... | gamma_{n-1})`` (plus the task's own head), through :class:`TrainingRestriction`. Inference
for task ``t_i`` grafts the continual model's values on ``gamma_1 | ... | gamma_i`` onto theta_pre: an ordinary graft
adapter. Earlier tasks' entries are never trained again, so their grafts stay bit-identical whatever comes later.

What is kept: the one model being trained (theta_pre outside the regions), and per task its name, arrival order,
region, the trained values with theta_pre there, and its head. Memory grows with the number of grafted entries, not
with the number of tasks times the model size.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from peft import PeftModel, get_peft_model
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .._checksum import CONFIG_NAME, state_checksum, tensor_bytes
from .._files import check_file, read_json
from ..parameter_layout import FlatIndexSpace, build_layout
from ..regions import Region
from ..regions.region import saved_region
from ..sharding import (
    deepspeed_refusal,
    full_numel,
    full_shape,
    is_partitioned,
    is_sharded,
    read_entries,
    whole,
    write_entries,
    zero_stage,
)
from ..tuner import GraftConfig
from ..tuner.model import check_adapter_name

logger = logging.getLogger(__name__)

STATE_NAME = "continual_state.safetensors"
FORMAT = "peft_graft.continual/1"


@dataclass
class ContinualTask:
    """One task of a :class:`ContinualGrafter`: its region ``gamma``, and what training it wrote.

    ``trained`` is ``region`` minus the earlier tasks' regions: the entries this task trained, whose values
    (``values``, and theta_pre there, ``pretrained``) are per tensor in the order of ``trained``'s indices.
    """

    name: str
    order: int
    region: Region
    trained: Region
    values: dict[str, torch.Tensor] = field(repr=False)
    pretrained: dict[str, torch.Tensor] = field(repr=False)
    head: dict[str, torch.Tensor] = field(repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes this task keeps: its region's indices, the trained values with theta_pre there, its head."""
        tensors = [*self.region.values(), *self.values.values(), *self.pretrained.values(), *self.head.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


class ContinualGrafter:
    """Forget-free continual learning: train each new task only outside the regions of earlier tasks.

    Args:
        model: The pre-trained model theta_pre (a plain model, not a peft model). It becomes the continual model and
            is trained in place, one task at a time; outside the tasks' regions and heads it stays theta_pre.
        heads: Modules trained whole for each task and kept per task (e.g. ``["classifier"]``), like a graft's
            ``modules_to_save``. Every task shares their shape; each task's head starts from the values they have now
            (or from ``head=`` of :meth:`start_task`).

    Train a task with a ``Trainer`` (or :func:`~peft_graft.restrict_training` in a custom loop)::

        learner = ContinualGrafter(model, heads=["classifier"])
        with learner.task("mr", region) as allowed:  # region: a Region, a graft PeftModel, or a saved graft's path
            Trainer(model=learner.model, args=args, train_dataset=mr,
                    callbacks=[RestrictTrainingCallback(allowed=allowed)]).train()
        grafts = learner.to_peft_model()  # one graft adapter per task: set_adapter("mr"), save_pretrained, ...
        learner.save_pretrained("continual")  # resume: ContinualGrafter.from_pretrained("continual", pretrained_model)
    """

    def __init__(self, model: nn.Module, heads: Sequence[str] = ()) -> None:
        if isinstance(model, PeftModel) or any("graft_" in name for name, _ in model.named_parameters()):
            raise TypeError("ContinualGrafter trains the plain pre-trained model: pass the model a graft wraps.")
        _refuse_zero12("ContinualGrafter", model)
        if isinstance(heads, str):
            heads = [heads]
        self.model = model
        self.heads = list(heads)
        self._canonical: dict[str, str] = {}  # any name of a parameter (tied ones have several) -> its first name
        first_name: dict[int, str] = {}
        aliases: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            self._canonical[name] = first_name.setdefault(id(param), name)
            aliases.setdefault(id(param), []).append(name)
        self._head_params: list[str] = []
        for head in self.heads:
            try:
                module = model.get_submodule(head)
            except AttributeError as error:
                raise ValueError(f"heads: the model has no module {head!r}.") from error
            for attr, param in module.named_parameters(remove_duplicate=False):
                shared = [name for name in aliases[id(param)] if not name.startswith(f"{head}.")]
                if shared:
                    raise ValueError(
                        f"heads: {head}.{attr} is tied to {shared[0]!r} outside the head (tied embeddings), so it "
                        "cannot be trained whole per task. Leave that head out of heads: its tensor is trained "
                        "through the task regions like the rest of the body."
                    )
            self._head_params += [self._canonical[f"{head}.{n}"] for n, _ in module.named_parameters()]
        self.tasks: list[ContinualTask] = []
        self._running: dict | None = None
        self._broken: str | None = None
        self.pretrained_head = self._head_state()
        self.base_fingerprint = self._fingerprint()

    @property
    def _params(self) -> dict[str, nn.Parameter]:
        """The model's parameters by first name, looked up afresh: FSDP2 replaces them by sharded ones when a Trainer
        shards the model (every read and write below then works on each process's shard, see
        :mod:`peft_graft.sharding`). Under DeepSpeed ZeRO-3 they stay the same parameters, partitioned: reads gather
        them, writes go to each process's partition (between the tasks' Trainer runs)."""
        return dict(self.model.named_parameters())

    # ------------------------------------------------------------------------------------------ regions
    @property
    def task_names(self) -> list[str]:
        return [task.name for task in self.tasks]

    @property
    def learned_region(self) -> Region:
        """The union of every finished task's region: entries no later task trains."""
        return self.region_for(self.tasks[-1].name) if self.tasks else Region()

    def region_for(self, name: str) -> Region:
        """The region task ``name`` is inferred with: its own and every earlier task's, ``gamma_1 | ... | gamma_i``."""
        union = Region()
        for task in self.tasks[: self._task(name).order]:
            union = union | task.region
        return union

    def _task(self, name: str) -> ContinualTask:
        for task in self.tasks:
            if task.name == name:
                return task
        raise ValueError(f"No task {name!r}: the learner has {self.task_names}.")

    def _as_region(self, region: object, name: str) -> Region:
        """A task's region by canonical parameter name, checked against the model and theta_pre."""
        checksums = None
        if isinstance(region, PeftModel):
            checksums = region.peft_config[region.active_adapter].base_checksum
            region = region.get_region()
        elif isinstance(region, (str, os.PathLike)):
            folder, region = region, saved_region(region, build_layout(self.model))  # checks the folder first
            checksums = read_json(os.path.join(folder, CONFIG_NAME), "adapter config").get("base_checksum") or {}
        elif isinstance(region, Mapping) and not isinstance(region, Region):
            region = Region(region)
        if not isinstance(region, Region):
            raise TypeError(
                f"Task {name!r}: region must be a Region, a graft PeftModel or a saved graft's path, got "
                f"{type(region).__name__}."
            )
        by_canonical: dict[str, list[torch.Tensor]] = {}
        for tensor, indices in region.items():
            if tensor not in self._canonical:
                raise ValueError(f"Task {name!r}: the region names {tensor!r}, which the model does not have.")
            canonical = self._canonical[tensor]
            if canonical in self._head_params:
                raise ValueError(
                    f"Task {name!r}: the region names {tensor!r} of a head ({self.heads}); heads are trained whole "
                    "for each task: leave them out of the region."
                )
            if int(indices.max()) >= full_numel(self._params[canonical]):
                raise ValueError(f"Task {name!r}: region indices of {tensor!r} fall outside the tensor.")
            by_canonical.setdefault(canonical, []).append(indices)
        region = Region({n: torch.cat(parts) for n, parts in by_canonical.items()})
        if not region.num_entries:
            raise ValueError(f"Task {name!r}: the region is empty; a task needs entries to graft.")
        if checksums:
            self._check_graft_base(region, checksums, name)
        return region

    def _check_graft_base(self, region: Region, checksums: Mapping[str, str], name: str) -> None:
        """Refuse a graft made on another pre-trained model: its recorded checksums of theta_pre must match ours."""
        layout = build_layout(self.model)
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        for tensor, indices in region.items():
            info = layout.tensors.get(tensor)
            if info is not None:
                by_module.setdefault(info.module, {})[info.attr] = indices
        for module, parts in by_module.items():
            if module not in checksums:
                continue
            attrs = layout.stored[module]
            space = FlatIndexSpace(attrs, [full_numel(getattr(self.model.get_submodule(module), a)) for a in attrs])
            flat = torch.cat([space.start(attr) + local for attr, local in parts.items()]).sort().values
            digest = hashlib.sha256()
            for attr, local, _ in space.split(flat):
                digest.update(tensor_bytes(self._pretrained_values(layout.by_site[(module, attr)].name, local)))
            if digest.hexdigest()[:16] != checksums[module]:
                raise ValueError(
                    f"Task {name!r}: its graft was made on another pre-trained model (theta_pre differs at its "
                    f"entries of {module!r}). Learn the task's region from this learner's pre-trained model."
                )

    # ------------------------------------------------------------------------------------------ values
    def _pretrained_values(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        """theta_pre of tensor ``name`` at flat ``indices``: the model's values, with trained entries restored."""
        values = self._values_at(name, indices)
        for task in self._tasks_and_running():
            if name in task.trained:
                hit = torch.isin(indices, task.trained[name])
                values[hit] = task.pretrained[name][torch.searchsorted(task.trained[name], indices[hit])]
        return values

    def _values_at(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        """The model's current values of tensor ``name`` at flat ``indices``, as a CPU copy."""
        return read_entries(self._params[name], indices).cpu()

    def _tasks_and_running(self) -> list[ContinualTask]:
        return self.tasks + ([self._running["task"]] if self._running else [])

    def _head_state(self) -> dict[str, torch.Tensor]:
        params = self._params
        return {name: whole(params[name]).detach().cpu().clone() for name in self._head_params}

    def _load_head(self, head: Mapping[str, torch.Tensor], what: str) -> None:
        missing = sorted(set(self._head_params) - set(head))
        if missing:
            raise ValueError(f"{what} has no values for the head tensors {missing}.")
        params = self._params
        for name in self._head_params:  # every shape checked before any value is written
            param, value = params[name], head[name]
            if tuple(value.shape) != tuple(full_shape(param)):
                raise ValueError(
                    f"{what}: head tensor {name!r} has shape {tuple(value.shape)}, the model's "
                    f"{tuple(full_shape(param))}."
                )
        for name in self._head_params:
            param = params[name]
            write_entries(param, torch.arange(full_numel(param)), head[name].reshape(-1))

    def _write(self, task: ContinualTask, values: Mapping[str, torch.Tensor]) -> None:
        params = self._params
        for name, indices in task.trained.items():
            write_entries(params[name], indices, values[name])

    def _fingerprint(self) -> str:
        """sha256 of theta_pre outside the heads: the model's values with every trained entry restored."""
        digest = hashlib.sha256()
        restore: dict[str, list[ContinualTask]] = {}
        for task in self._tasks_and_running():
            for name in task.trained:
                restore.setdefault(name, []).append(task)
        for name, param in self._params.items():
            if name in self._head_params:
                continue
            value = whole(param).detach().cpu()
            if name in restore:
                value = value.clone().reshape(-1)
                for task in restore[name]:
                    value[task.trained[name]] = task.pretrained[name]
            digest.update(name.encode())
            digest.update(tensor_bytes(value))
        return digest.hexdigest()

    # ------------------------------------------------------------------------------------------ tasks
    def start_task(self, name: str, region: object, head: Mapping[str, torch.Tensor] | None = None) -> Region:
        """Begin task ``name`` with region ``gamma`` (a :class:`Region`, a graft ``PeftModel`` or a saved graft's path).

        Resets the heads to ``head`` (default: their pre-trained values) and returns the region the task's training
        may change: ``gamma`` minus the earlier tasks' regions, plus the heads. Train ``self.model`` under it
        (``RestrictTrainingCallback(allowed=...)`` or ``restrict_training``), then call :meth:`finish_task`.
        """
        if self._broken:
            raise ValueError(self._broken)
        if self._running is not None:
            raise ValueError(
                f"Task {self._running['task'].name!r} is still running: finish_task() or abort_task() it first."
            )
        check_adapter_name(name)  # a task's name becomes its adapter's name
        _refuse_zero12(f"ContinualGrafter.start_task({name!r})", self.model)
        if name in self.task_names:
            raise ValueError(f"A task named {name!r} was already learned (order {self._task(name).order}).")
        region = self._as_region(region, name)
        trained = region - self.learned_region
        if not trained.num_entries and not self._head_params:
            raise ValueError(
                f"Task {name!r}: its region lies inside earlier tasks' regions and there is no head, so nothing "
                "could be trained for it. Give it a region with new entries."
            )
        if not trained.num_entries:
            logger.warning("Task %r: its region lies inside earlier tasks' regions; only its head is trained.", name)
        pretrained = {n: self._values_at(n, idx) for n, idx in trained.items()}
        task = ContinualTask(name, len(self.tasks) + 1, region, trained, {}, pretrained, {})
        head_before = self._head_state()
        self._load_head(self.pretrained_head if head is None else head, f"Task {name!r}'s head")
        self._running = {"task": task, "head_before": head_before}
        heads = Region({n: torch.arange(full_numel(self._params[n])) for n in self._head_params})
        return trained | heads

    def finish_task(self) -> ContinualTask:
        """Record the running task: its trained values and head. Refuses (``ValueError``) a run that changed entries
        outside what :meth:`start_task` allowed; :meth:`abort_task` then rolls the model back to before the task."""
        if self._running is None:
            raise ValueError("No task is running: start_task() first.")
        task = self._running["task"]
        for earlier in self.tasks:
            for name, indices in earlier.trained.items():
                now = self._values_at(name, indices)
                if not torch.equal(now, earlier.values[name].to(now.dtype)):
                    raise ValueError(
                        f"Task {task.name!r} changed entries of earlier task {earlier.name!r} in {name!r}: train under "
                        "the region start_task returned (RestrictTrainingCallback(allowed=...)). abort_task() rolls "
                        "the model back."
                    )
        if self._fingerprint() != self.base_fingerprint:
            raise ValueError(
                f"Task {task.name!r} changed entries outside the region start_task returned: train under it "
                "(RestrictTrainingCallback(allowed=...) or restrict_training). abort_task() rolls the model back."
            )
        task.values = {n: self._values_at(n, idx) for n, idx in task.trained.items()}
        task.head = self._head_state()
        self.tasks.append(task)
        self._running = None
        return task

    def abort_task(self) -> None:
        """Drop the running task: its entries go back to theta_pre, earlier tasks' entries to their values, and the
        heads to what they were before it. Entries outside every region cannot be restored (theta_pre is not kept
        there): if a run changed them, the learner refuses further work with a ``ValueError``; resume it with
        :meth:`from_pretrained` from its last save."""
        if self._running is None:
            return
        task = self._running["task"]
        self._write(task, task.pretrained)
        for earlier in self.tasks:
            self._write(earlier, earlier.values)
        self._load_head(self._running["head_before"], "The heads before the task")
        self._running = None
        if self._fingerprint() != self.base_fingerprint:
            self._broken = (
                f"Training during task {task.name!r} changed entries outside every task's region, where theta_pre "
                "is not kept: the continual model cannot be rolled back. Resume with ContinualGrafter.from_pretrained"
                "(<last save>, <pre-trained model>)."
            )
            raise ValueError(self._broken)

    @contextmanager
    def task(self, name: str, region: object, head: Mapping[str, torch.Tensor] | None = None) -> Iterator[Region]:
        """:meth:`start_task` on entering, :meth:`finish_task` on leaving, :meth:`abort_task` if the block raises."""
        allowed = self.start_task(name, region, head)
        try:
            yield allowed
        except BaseException:
            self.abort_task()
            raise
        try:
            self.finish_task()
        except ValueError:
            self.abort_task()
            raise

    # ------------------------------------------------------------------------------------------ inference
    def _check_idle(self, what: str) -> None:
        if self._broken:
            raise ValueError(self._broken)
        if self._running is not None:
            raise ValueError(f"Task {self._running['task'].name!r} is running: finish_task() before {what}.")

    def _check_whole(self, what: str) -> None:
        engine = next(filter(None, map(_split_by, self.model.parameters())), None)
        if engine is not None:
            raise ValueError(
                f"{what} copies the whole continual model, which {engine}: save_pretrained() the learner (from "
                "rank 0), then in one process ContinualGrafter.from_pretrained(path, <pre-trained model>) and call "
                f"{what} there."
            )

    def pretrained_model(self) -> nn.Module:
        """A copy of theta_pre (in eval mode): the continual model with every trained entry and the heads restored."""
        self._check_idle("pretrained_model()")
        self._check_whole("pretrained_model()")
        model = copy.deepcopy(self.model).eval()
        params = dict(model.named_parameters())
        with torch.no_grad():
            for task in self.tasks:
                for name, indices in task.trained.items():
                    params[name].view(-1)[indices.to(params[name].device)] = task.pretrained[name].to(params[name])
            for name, value in self.pretrained_head.items():
                params[name].copy_(value)
        return model

    def task_config(self, name: str) -> GraftConfig:
        """The ``GraftConfig`` of task ``name``'s inference graft: the continual values on ``gamma_1 | ... | gamma_i``
        and the task's head, for ``get_peft_model(theta_pre, config)`` or ``add_adapter``."""
        self._check_idle("task_config()")
        self._check_whole("task_config()")
        task = self._task(name)
        finetuned = dict(self.model.state_dict())
        for alias, canonical in self._canonical.items():
            if canonical in task.head:
                finetuned[alias] = task.head[canonical]
        return GraftConfig(
            finetuned=finetuned,
            region="given",
            given_region=self.region_for(name),
            only_moved=False,
            modules_to_save=self.heads or None,
        )

    def to_peft_model(self, base: nn.Module | None = None) -> PeftModel:
        """Every task's inference graft as an adapter named after it, on ``base`` (default: :meth:`pretrained_model`).
        The last task's adapter is active; ``set_adapter(name)`` switches tasks."""
        self._check_idle("to_peft_model()")
        if not self.tasks:
            raise ValueError("No task was learned yet.")
        if base is None:
            base = self.pretrained_model()
        elif ContinualGrafter(base, self.heads).base_fingerprint != self.base_fingerprint:
            raise ValueError("base is not this learner's pre-trained model: its values differ from theta_pre.")
        model = get_peft_model(base, self.task_config(self.tasks[0].name), adapter_name=self.tasks[0].name)
        for task in self.tasks[1:]:
            model.add_adapter(task.name, self.task_config(task.name))
        model.set_adapter(self.tasks[-1].name)
        return model

    @property
    def nbytes(self) -> int:
        """Bytes kept besides the model: the tasks' entries and heads (:attr:`ContinualTask.nbytes`), the first head."""
        initial_head = sum(t.numel() * t.element_size() for t in self.pretrained_head.values())
        return sum(task.nbytes for task in self.tasks) + initial_head

    # ------------------------------------------------------------------------------------------ persistence
    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Save the finished tasks to ``save_directory/continual_state.safetensors`` (one file, written atomically)."""
        self._check_idle("save_pretrained()")
        tensors = {f"pretrained_head/{n}": v for n, v in self.pretrained_head.items()}
        for i, task in enumerate(self.tasks):
            tensors.update({f"task{i}/region/{n}": idx for n, idx in task.region.items()})
            tensors.update({f"task{i}/values/{n}": v for n, v in task.values.items()})
            tensors.update({f"task{i}/pretrained/{n}": v for n, v in task.pretrained.items()})
            tensors.update({f"task{i}/head/{n}": v for n, v in task.head.items()})
        metadata = {
            "format": FORMAT,
            "heads": json.dumps(self.heads),
            "tasks": json.dumps(self.task_names),
            "base_fingerprint": self.base_fingerprint,
        }
        metadata["checksum"] = state_checksum(tensors, metadata)
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, STATE_NAME)
        partial = f"{path}.partial-{os.getpid()}"
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, partial, metadata=metadata)
            os.replace(partial, path)  # atomic: an interrupted save leaves the previous state whole
        finally:
            if os.path.exists(partial):
                os.remove(partial)

    @classmethod
    def from_pretrained(
        cls, save_directory: str | os.PathLike, model: nn.Module, require_checksum: bool = True
    ) -> ContinualGrafter:
        """Resume a saved learner on ``model``, the pre-trained model it was created with (loaded afresh): the trained
        values and the last task's head are written into it. Another pre-trained model is a ``ValueError``, and so is
        a file whose tensors or metadata differ from the checksum it records (a flipped bit, an edit).
        ``require_checksum=False`` loads a state saved by an older peft_graft, which recorded none."""
        path = os.path.join(save_directory, STATE_NAME)
        if not check_file(path, "ContinualGrafter state", missing_ok=True):
            raise ValueError(f"{os.fspath(save_directory)!r} holds no {STATE_NAME}: not a saved ContinualGrafter.")
        try:
            with safe_open(path, framework="pt") as handle:
                metadata = handle.metadata() or {}
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        except Exception as error:  # safetensors raises its own error types for truncated or foreign files
            raise ValueError(f"{path!r} is not a readable safetensors file ({error}).") from error
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path!r} is not a {FORMAT} state (format {metadata.get('format')!r}).")
        recorded = metadata.get("checksum")
        if recorded is None and require_checksum:
            raise ValueError(
                f"{path!r} records no checksum: it was altered, or saved by an older peft_graft (load that knowingly "
                "with ContinualGrafter.from_pretrained(path, model, require_checksum=False))."
            )
        if recorded is not None and recorded != state_checksum(tensors, metadata):
            raise ValueError(
                f"{path!r} does not match the checksum it records: the file is corrupt or was altered after saving."
            )
        heads, names = json.loads(metadata["heads"]), json.loads(metadata["tasks"])
        learner = cls(model, heads)
        pretrained_head = _group(tensors, "pretrained_head/")
        learner._load_head(pretrained_head, f"{path!r}")
        learner.pretrained_head = learner._head_state()
        learner.base_fingerprint = learner._fingerprint()
        if learner.base_fingerprint != metadata.get("base_fingerprint"):
            raise ValueError(
                f"{path!r} was saved for another pre-trained model: this model's values differ from the learner's "
                "theta_pre. Pass the pre-trained model the learner was created with, freshly loaded."
            )
        for i, name in enumerate(names):
            region = learner._as_region(Region(_group(tensors, f"task{i}/region/")), name)
            trained = region - learner.learned_region
            values, pretrained = _group(tensors, f"task{i}/values/"), _group(tensors, f"task{i}/pretrained/")
            for n, idx in trained.items():
                if any(n not in part or part[n].numel() != idx.numel() for part in (values, pretrained)):
                    raise ValueError(f"{path!r}: task {name!r}'s stored values of {n!r} do not match its region.")
                if not torch.equal(learner._pretrained_values(n, idx), pretrained[n]):
                    raise ValueError(f"{path!r}: task {name!r} was trained from other theta_pre values in {n!r}.")
            task = ContinualTask(name, i + 1, region, trained, values, pretrained, _group(tensors, f"task{i}/head/"))
            learner._write(task, values)
            learner.tasks.append(task)
        if learner.tasks:
            learner._load_head(learner.tasks[-1].head, f"{path!r}")
        return learner


def _split_by(param: torch.Tensor) -> str | None:
    """What splits ``param`` across processes, in words; ``None`` for a whole parameter."""
    if is_sharded(param):
        return "FSDP2 shards"
    return "DeepSpeed ZeRO-3 partitions" if is_partitioned(param) else None


def _refuse_zero12(action: str, model: nn.Module) -> None:
    """Refuse ``action`` under DeepSpeed ZeRO-1/2, where the tasks' restricted training cannot run."""
    stage = zero_stage(model)
    if stage is not None and stage != 3:
        reason = (
            "a continual learner trains each task under a training restriction, which peft_graft runs under DeepSpeed "
            "only at ZeRO-3 (zero_optimization.stage 3). Use ZeRO-3, FSDP2 (fully_shard: Trainer fsdp=True with "
            "fsdp_config={'version': 2}) or DDP; see docs/fsdp.md."
        )
        raise deepspeed_refusal(action, f"DeepSpeed ZeRO-{stage}", reason)


def _group(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {key[len(prefix) :]: value for key, value in tensors.items() if key.startswith(prefix)}
