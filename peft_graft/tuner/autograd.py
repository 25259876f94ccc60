"""Autograd Functions for the differentiable grafted parameters of a region being learned (paper Eq. 3-4).

``theta_pre + gamma(S) * delta`` with ``gamma = gamma_base * (1 - sigmoid(S)) + (1 - gamma_base) * sigmoid(S)``, built
without keeping dense temporaries for backward: :class:`GraftedTensors` over a layer's whole flat index space (the
paper's default), :class:`GraftedSearchSpace` over a search space only (``GraftConfig.search_fraction``, with its
reusable outputs in :class:`BufferPool`), :class:`GraftedRows` over the rows of an embedding matrix that a batch looks
up, :class:`SparseLinearDelta`, a linear layer's search space as sparse products (no soft copy of its weight), and
:class:`RecomputeSoftParameters`, saved-tensor hooks that rebuild the grafted tensors in backward instead of
letting the layers' ops keep them.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Literal

import torch

SoftBackward = Literal["keep", "recompute", "rebuild"]
"""How the backward of :class:`GraftedTensors` gets ``sigmoid'(S)``, by what the layers do with the soft parameters:
``"keep"`` (they keep them for backward; the forward keeps ``sigmoid'(S) * delta`` too), ``"recompute"`` (they rebuild
them in backward through :class:`RecomputeSoftParameters`; the forward keeps nothing), ``"rebuild"`` (that rebuild: its
``gamma`` goes to :data:`RECOMPUTED_GAMMA` for the backward that follows)."""


class GraftedTensors(torch.autograd.Function):
    """``theta_pre + gamma(S) * delta`` for every tensor a layer stores, with ``gamma`` of paper Eq. 4.

    The fp32 outputs are views of one flat S-sized tensor. Saved for backward, by ``mode`` (:data:`SoftBackward`):
    ``"keep"``, ``sigmoid'(S) * delta`` (flipped on gamma_base or not, ``gamma * (1 - gamma)`` is the same), computed
    where ``gamma`` was, in the tensor that becomes the gradient of S: the backward is one multiplication by the
    incoming gradient, no second sigmoid, for an S-sized tensor more from forward to backward; the outputs are then
    written into ``pool``'s buffer (a :class:`BufferPool`), released by the backward, so that a step takes no fresh
    S-sized memory (BENCHMARKS.md at 64e350c, "Lockstep processes").
    ``"recompute"``: only references to S and delta (which exist anyway), and ``gamma`` is overwritten by the outputs;
    the backward takes the ``gamma`` of the rebuild (``"rebuild"``), kept in :data:`RECOMPUTED_GAMMA`, or computes it
    again. The tensor that becomes the gradient of S comes from ``gradients`` (a :class:`GradientSlot`).
    """

    @staticmethod
    def forward(ctx, scores, movement, base, offsets, mode: SoftBackward, gradients, pool, *thetas):
        ctx.save_for_backward(scores, movement, base)
        ctx.offsets, ctx.gradients, ctx.derivative, ctx.pool = offsets, gradients, None, None
        derive = mode == "keep" and ctx.needs_input_grad[0]
        separate = derive or mode == "rebuild"  # gamma is still needed once the outputs are written
        gamma = torch.sigmoid(scores.detach(), out=gradients.take(scores) if separate else None)
        if base.numel():
            gamma[base] = 1.0 - gamma[base]
        # The outputs sit at the same offsets in every mode (the recipes of RecomputeSoftParameters rebuild a saved
        # view by its storage offset): in place of gamma, or beside it, in the pool's buffer while keeping.
        flat_out = gamma  # only fp32 outputs are written into it (others are cast copies)
        if separate and any(theta.dtype == torch.float32 for theta in thetas):
            buffers = pool.acquire((gamma,)) if derive and pool is not None else None
            ctx.pool = pool if buffers is not None else None
            flat_out = buffers[0] if buffers is not None else torch.empty_like(gamma)
        outputs = []
        for i, theta in enumerate(thetas):
            a, b = offsets[i], offsets[i + 1]
            flat = theta.detach().reshape(-1)
            if flat.dtype == torch.float32:
                out = torch.addcmul(flat, gamma[a:b], movement[a:b], out=flat_out[a:b])
            else:
                out = torch.addcmul(flat.float(), gamma[a:b], movement[a:b]).to(theta.dtype)
            outputs.append(out.view_as(theta))
        if derive:  # delta * gamma * (1 - gamma), in place
            ctx.derivative = torch.ops.aten.sigmoid_backward.grad_input(movement, gamma, grad_input=gamma)
        elif mode == "rebuild":
            RECOMPUTED_GAMMA.put(scores, gamma)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        scores, movement, base = ctx.saved_tensors
        offsets = ctx.offsets
        if ctx.pool is not None:  # the layers that read the outputs have run their backward
            ctx.pool.release()
        grad, ctx.derivative = ctx.derivative, None  # the only reference: autograd makes it S.grad without a copy
        derived = grad is not None
        if not derived:
            grad = RECOMPUTED_GAMMA.take(scores)  # overwritten by the gradient
        if grad is None:  # not flipped: gamma * (1 - gamma) is the same
            grad = torch.sigmoid(scores.detach(), out=ctx.gradients.take(scores))
        for i, g in enumerate(grads):
            a, b = offsets[i], offsets[i + 1]
            part = grad[a:b]
            if g is None:
                part.zero_()
            elif derived:
                part.mul_(g.reshape(-1))
            else:  # d/dS of sigmoid(S) * delta, in place: g * gamma * (1 - gamma), then times delta
                torch.ops.aten.sigmoid_backward.grad_input(g.reshape(-1).float(), part, grad_input=part)
                part.mul_(movement[a:b])
        if base.numel():
            grad[base] = -grad[base]  # d(1 - sigmoid(S))/dS on gamma_base
        return (grad, None, None, None, None, None, None, *([None] * len(grads)))


REUSED_GRADIENT_BYTES = 1 << 20
"""CPU tensors this large are kept by :class:`GradientSlot`: glibc maps a block over its mmap threshold (128 KiB to 32
MiB, by its own rule) anew each time and gives the top of its heap back once enough of it is free, so a fresh tensor of
a few MiB can fault on every step too."""


class GradientSlot:
    """The tensor that held S's gradient, taken back by S's next backward once the optimizer has let it go.

    Why: a backward that returns a fresh S-sized tensor lets autograd make it ``S.grad`` without a copy, but the
    optimizer's ``zero_grad(set_to_none=True)`` frees it, and on a CPU fresh memory costs page faults on every step:
    the dense S of RoBERTa-base's word embeddings (154 MB) took 68-93 ms of a 0.8 s step to zero (BENCHMARKS.md at
    64e350c, "The gradient of S kept between steps"), and its encoder layers' 28 MB tensors up to 159 thousand faults
    a step (the same, "Lockstep processes"). A hook keeps ``S.grad`` once autograd has accumulated the tensor this slot
    gave; :meth:`take` gives it again only while nothing else refers to it (``S.grad`` was set to ``None`` and no one
    kept it), and a fresh tensor otherwise. Only CPU tensors of at least :data:`REUSED_GRADIENT_BYTES` are kept (CUDA's
    caching allocator reuses memory by itself): this keeps their memory between steps.
    """

    def __init__(self) -> None:
        self.held: torch.Tensor | None = None
        self.given = 0  # data_ptr of the tensor last given
        self.hooked: Callable[[], torch.Tensor | None] | None = None  # a weakref to the S the hook is on

    def take(self, scores: torch.Tensor, zeroed: bool = False) -> torch.Tensor:
        """An uninitialised (``zeroed``: zero) tensor like ``scores``, to be returned as its gradient."""
        if scores.device.type != "cpu" or scores.numel() * scores.element_size() < REUSED_GRADIENT_BYTES:
            return torch.zeros_like(scores) if zeroed else torch.empty_like(scores)
        held, self.held = self.held, None
        # Free when only this slot refers to it: one C++ reference (the tensor's Python object), as many to that object
        # as to a local one (``probe``), and no other tensor or array on its memory (``.detach()``, ``.data``,
        # ``.numpy()``, views). scores.grad set, or the tensor or its memory kept by a caller, adds to one of them.
        probe = object()
        free = (
            held is not None
            and scores.grad is None
            and (held.shape, held.dtype, held.device) == (scores.shape, scores.dtype, scores.device)
            and held._use_count() == 1
            and sys.getrefcount(held) <= sys.getrefcount(probe)
            and _storage_references(held) <= _storage_references(torch.empty(0))
        )
        if free:
            tensor = held.zero_() if zeroed else held
        else:
            tensor = torch.zeros_like(scores) if zeroed else torch.empty_like(scores)
        del held
        if self.hooked is None or self.hooked() is not scores:
            scores.register_post_accumulate_grad_hook(self._keep)
            self.hooked = weakref.ref(scores)
        self.given = tensor.data_ptr()
        return tensor

    def __getstate__(self) -> dict:
        return {}  # a held tensor and the hook are runtime state: a pickled or copied model starts with an empty slot

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def _keep(self, scores: torch.Tensor) -> None:
        grad = scores.grad
        if grad is not None and grad.data_ptr() == self.given and grad._base is None:
            self.held = grad


def _storage_references(tensor: torch.Tensor) -> int:
    """References to ``tensor``'s memory (one more while the storage object asked for it exists)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class RecomputedGamma:
    """A slot for the ``gamma`` of the layer whose soft parameters :class:`RecomputeSoftParameters` rebuilt last.

    That layer's :class:`GraftedTensors` backward runs right after the op that unpacked them, and writes the gradient
    of S into it: no sigmoid pass and no S-sized allocation of its own. One slot only (at most one layer's S-sized
    tensor is held), keyed by the S tensor and its version, so a slot taken by the wrong layer or after S changed is
    ignored.
    """

    def __init__(self) -> None:
        self.scores: torch.Tensor | None = None
        self.version = -1
        self.gamma: torch.Tensor | None = None

    def put(self, scores: torch.Tensor, gamma: torch.Tensor) -> None:
        self.scores, self.version, self.gamma = scores, scores._version, gamma

    def take(self, scores: torch.Tensor) -> torch.Tensor | None:
        """The held gamma if it was computed from ``scores`` as they are now (and empty the slot), else ``None``."""
        held, version, gamma = self.scores, self.version, self.gamma
        self.scores, self.version, self.gamma = None, -1, None
        if held is None or held.data_ptr() != scores.data_ptr() or scores._version != version:
            return None
        return gamma


RECOMPUTED_GAMMA = RecomputedGamma()


class GraftedSearchSpace(torch.autograd.Function):
    """``theta_pre`` with ``gamma(S) * delta`` added on the search space only (``GraftConfig.search_fraction``).

    ``scores``, ``movement`` and ``base`` (positions of ``gamma_base`` in the search space) live on the sorted search
    space; ``parts`` gives, per tensor, its slice ``[a, b)`` of the search space and their local flat indices. One
    copy pass per tensor in forward, no dense sigmoid; backward gathers the gradient on the search space only.
    """

    @staticmethod
    def forward(ctx, scores, movement, base, parts, pool, *thetas):
        ctx.save_for_backward(scores, movement, base)
        ctx.parts = parts
        values = _soft_delta(scores, movement, base)
        buffers = pool.acquire(thetas) if pool is not None else None
        ctx.pool = pool if buffers is not None else None
        outputs = []
        for i, ((a, b, local), theta) in enumerate(zip(parts, thetas, strict=True)):
            if buffers is None:
                out = theta.detach().clone(memory_format=torch.contiguous_format)
            else:
                out = buffers[i].copy_(theta.detach())
            flat = out.view(-1)
            if out.dtype == torch.float32:  # index_add_/index_select: far faster than advanced indexing on CPU
                flat.index_add_(0, local, values[a:b])
            else:
                flat.index_copy_(0, local, (flat.index_select(0, local).float() + values[a:b]).to(out.dtype))
            outputs.append(out)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        scores, movement, base = ctx.saved_tensors
        grad = torch.zeros_like(scores)
        for (a, b, local), g in zip(ctx.parts, grads, strict=True):
            if g is not None:
                grad[a:b] = g.reshape(-1).index_select(0, local)
        if ctx.pool is not None:
            ctx.pool.release()
        return (_score_gradient(grad, scores, movement, base), None, None, None, None, *([None] * len(grads)))


def _soft_delta(scores: torch.Tensor, movement: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``gamma(S) * delta`` over a search space (paper Eq. 4; ``base``: positions of ``gamma_base``), without grad."""
    values = torch.sigmoid(scores.detach())
    if base.numel():
        values[base] = 1.0 - values[base]
    return values.mul_(movement)


def _score_gradient(
    grad_values: torch.Tensor, scores: torch.Tensor, movement: torch.Tensor, base: torch.Tensor
) -> torch.Tensor:
    """The gradient of S from the gradient of ``gamma(S) * delta`` at the same entries (overwrites ``grad_values``)."""
    grad = torch.ops.aten.sigmoid_backward(grad_values.mul_(movement), torch.sigmoid(scores.detach()))
    if base.numel():
        grad[base] = -grad[base]
    return grad


class GraftedRows(torch.autograd.Function):
    """Rows ``rows`` of ``theta_pre + gamma(S) * delta`` for an embedding matrix, as a ``[len(rows), dim]`` tensor.

    A batch looks up a few hundred rows of a vocabulary-sized matrix: grafting only those skips the dense passes over
    the rest (and the dense gradient of the whole matrix that ``F.embedding`` would build). Dense S
    (``positions=None``): S and the movement are the flat matrix, taken by whole rows. With a search space:
    ``positions`` are the entries of S that fall in ``rows`` and ``targets`` their flat places in the output.
    ``flipped`` marks the gathered entries that are in ``gamma_base``. Entries outside ``rows`` get a zero gradient, as
    through the matrix.
    """

    @staticmethod
    def forward(ctx, scores, movement, theta, rows, positions, targets, flipped, gradients):
        ctx.save_for_backward(scores, movement, rows, positions, targets, flipped)
        ctx.dim, ctx.gradients = theta.shape[1], gradients
        gathered, delta = _gather_rows(scores.detach(), movement, rows, positions, ctx.dim)
        gamma = torch.sigmoid(gathered)
        gamma[flipped] = 1.0 - gamma[flipped]
        out = theta.detach().index_select(0, rows).float()
        if positions is None:  # same op as GraftedTensors, so both give the same values
            out.view(-1).addcmul_(gamma, delta)
        else:
            out.view(-1).index_add_(0, targets, gamma.mul_(delta))
        return out.to(theta.dtype)

    @staticmethod
    def backward(ctx, grad_rows):
        scores, movement, rows, positions, targets, flipped = ctx.saved_tensors
        gathered, delta = _gather_rows(scores.detach(), movement, rows, positions, ctx.dim)
        grad_rows = grad_rows.reshape(-1) if targets is None else grad_rows.reshape(-1).index_select(0, targets)
        values = torch.ops.aten.sigmoid_backward(grad_rows.float() * delta, torch.sigmoid(gathered))
        values[flipped] = -values[flipped]
        grad = ctx.gradients.take(scores, zeroed=True)
        if positions is None:
            grad.view(-1, ctx.dim).index_copy_(0, rows, values.view(-1, ctx.dim))
        else:
            grad.index_copy_(0, positions, values)
        return grad, None, None, None, None, None, None, None


def _gather_rows(scores, movement, rows, positions, dim):
    """S and the movement at the entries :class:`GraftedRows` applies: whole ``rows``, or ``positions``."""
    if positions is None:
        return tuple(t.view(-1, dim).index_select(0, rows).view(-1) for t in (scores, movement))
    return scores[positions], movement[positions]


class BufferPool:
    """Reusable output tensors of one layer's :class:`GraftedSearchSpace` (one per stored tensor) or, keeping the soft
    parameters, :class:`GraftedTensors` (one flat tensor).

    Allocating fresh parameter-sized tensors every step costs page faults that, on CPU, weigh as much as the copy
    itself. A buffer is taken by a forward and released by its backward, so it is never overwritten while a graph
    still needs it: a second forward before the backward (a module called twice) gets fresh tensors instead.
    """

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.busy = False

    def acquire(self, thetas: tuple[torch.Tensor, ...]) -> list[torch.Tensor] | None:
        """Buffers shaped like ``thetas``, or ``None`` while a forward's graph still holds them."""
        if self.busy:
            return None
        self.busy = True
        for i, theta in enumerate(thetas):
            buffer = self.buffers.get(i)
            layout = (theta.shape, theta.dtype, theta.device)
            if buffer is None or (buffer.shape, buffer.dtype, buffer.device) != layout:
                self.buffers[i] = torch.empty_like(theta, memory_format=torch.contiguous_format)
        return [self.buffers[i] for i in range(len(thetas))]

    def release(self) -> None:
        self.busy = False


class RecomputeSoftParameters(torch.autograd.graph.saved_tensors_hooks):
    """Do not keep the soft parameters ``theta_pre + gamma * delta`` alive for backward: recompute them there.

    The layer's own ops save the tensors they read (``F.linear`` saves its weight for the input gradient), which would
    hold one fp32 copy of every learning layer's parameters from forward until backward. Within this context, a saved
    tensor that is (a view of) a soft parameter is packed as a recipe (a function rebuilding the soft parameters of
    its source, the tensor's name, plus the view's size, stride and offset) and rebuilt without grad at unpacking. S
    does not change between forward and backward, so the rebuilt values are the same. The rebuilt tensor carries no
    graph: a double backward (``create_graph=True``) would miss the second-order terms through it.
    """

    def __init__(self, sources: dict[int, tuple[torch.dtype, Callable[[], dict[str, torch.Tensor]], str]]) -> None:
        def pack(tensor: torch.Tensor):
            try:
                source = sources.get(tensor.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # no plain storage (sparse, nested, ...)
                return tensor
            if source is None or source[0] != tensor.dtype:
                return tensor
            return (source[1:], tensor.size(), tensor.stride(), tensor.storage_offset())

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            (rebuild, attr), size, stride, offset = packed
            with torch.no_grad():
                return rebuild()[attr].as_strided(size, stride, offset)

        super().__init__(pack, unpack)


SPARSE_LINEAR_COSTS = {"product": 40.0, "layout": 470.0, "copy": 93.0, "call": 1.5e7, "margin": 1.1}
"""The cost model of :meth:`LinearPattern.sparse_is_cheaper`, in multiply-adds of a dense fp32 matrix product (the
unit): per weight entry of the search space and token, the three CSR products (``product``); per token and feature (in
plus out), the transposed copies they need (``layout``); per weight entry, the copy of theta_pre and the write of the
dense weight gradient (``copy``); the sparse path's extra fixed cost per layer call (``call``). Fitted to forward plus
backward times of one layer, both paths, shapes 384-3072 x 384-3072, 32-2048 tokens, 0.2-5% of the weight in the search
space (torch 2.13 CPU, AVX2, one thread; ``benchmarks/bench_mask_step.py --layers`` measures them). The sparse path
keeps no copy of the weight for backward, so it is taken unless the copy is estimated ``margin`` times cheaper: in a
whole RoBERTa-base step at 4 x 32 tokens its 768 x 768 layers, 6% apart by the model, were faster sparse. Where the
rule picks the slower path in the grid, the two differ by at most 10% of the layer's step (0.3% on average)."""


class LinearPattern:
    """Where a search space falls in a linear layer's weight (``[out, in]``) and bias, as sparse CSR patterns.

    ``weight``/``bias``: ``(a, b, local flat indices)`` of the search-space slice in each tensor, or ``None``. Kept per
    learner: the search space does not change while S is learned.
    """

    def __init__(self, weight, bias, out_features: int, in_features: int) -> None:
        self.shape = (out_features, in_features)
        self.weight_slice = self.bias_slice = None
        if weight is not None:
            a, b, local = weight
            self.weight_slice = (a, b)
            rows, cols = local // in_features, local % in_features  # local is sorted: CSR (row-major) order
            self.crow = _compressed(rows, out_features)
            self.col = cols
            self.order_t = torch.argsort(cols * out_features + rows)  # the transposed pattern's order
            self.crow_t = _compressed(cols, in_features)
            self.col_t = rows[self.order_t]
        if bias is not None:
            a, b, local = bias
            self.bias_slice, self.bias_index = (a, b), local

    def sparse_is_cheaper(self, tokens: int) -> bool:
        """Whether :class:`SparseLinearDelta` costs less than the soft weight copy (:class:`GraftedSearchSpace`) for a
        batch of ``tokens`` rows (examples x positions), by the cost model of :data:`SPARSE_LINEAR_COSTS`.

        The copy path adds a copy of the weight and its dense gradient (one more matrix product); the sparse path three
        CSR products over the search space's weight entries and copies of the input and output in the layouts they
        need. So the sparse path pays for small batches and sparse layers, the copy for large batches (all-MiniLM-L6-v2
        at 32 x 64 tokens) and dense ones. A search space only in the bias always takes the sparse path (no weight
        copy either way).
        """
        if self.weight_slice is None:
            return True
        out_features, in_features = self.shape
        costs = SPARSE_LINEAR_COSTS
        a, b = self.weight_slice
        sparse = (b - a) * tokens * costs["product"] + tokens * (in_features + out_features) * costs["layout"]
        copy = out_features * in_features * (tokens + costs["copy"])
        return sparse + costs["call"] < copy * costs["margin"]

    def weight(self, values: torch.Tensor, transposed: bool = False) -> torch.Tensor:
        """The sparse ``dW`` (or ``dW.T``) with ``values`` in search-space order."""
        if transposed:
            shape = self.shape[::-1]
            return torch.sparse_csr_tensor(self.crow_t, self.col_t, values[self.order_t], shape, check_invariants=False)
        return torch.sparse_csr_tensor(self.crow, self.col, values, self.shape, check_invariants=False)


def _compressed(rows: torch.Tensor, size: int) -> torch.Tensor:
    crow = torch.zeros(size + 1, dtype=torch.int64, device=rows.device)
    crow[1:] = torch.bincount(rows, minlength=size).cumsum(0)
    return crow


class SparseLinearDelta(torch.autograd.Function):
    """``x @ dW.T + db`` with ``dW``, ``db`` = ``gamma(S) * delta`` on a search space: what a linear layer's output
    gains from its soft parameters, so that ``F.linear(x, theta_pre) + this`` is its soft forward.

    Sparse products (CSR): no dense copy of the weight in forward, and in backward the gradient of S comes from a
    sampled product at the search space (``sampled_addmm``), never from the dense weight gradient. Computed in fp32;
    ``x``'s gradient gets ``g @ dW``.
    """

    @staticmethod
    def forward(ctx, x, scores, movement, base, pattern: LinearPattern):
        ctx.save_for_backward(x, scores, movement, base)
        ctx.pattern = pattern
        ctx.values = values = _soft_delta(scores, movement, base)
        x2 = x.detach().reshape(-1, x.shape[-1]).float()
        tokens, out_features = x2.shape[0], pattern.shape[0]
        bias = None
        if pattern.bias_slice is not None:
            a, b = pattern.bias_slice
            bias = torch.zeros(out_features, dtype=torch.float32, device=x.device)
            bias.index_add_(0, pattern.bias_index, values[a:b])
        if pattern.weight_slice is None:
            out_t = bias.unsqueeze(1).expand(-1, tokens)  # no copy: the caller's addition reads it
        else:  # [out, tokens]: the layout the CSR product writes; returned transposed, read once by the caller's add
            a, b = pattern.weight_slice
            out_t = torch.sparse.mm(pattern.weight(values[a:b]), x2.t().contiguous())
            if bias is not None:
                out_t += bias.unsqueeze(1)
        return out_t.t().to(x.dtype).reshape(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_out):
        x, scores, movement, base = ctx.saved_tensors
        pattern, values = ctx.pattern, ctx.values
        g2 = grad_out.reshape(-1, pattern.shape[0]).float()
        grad_values = torch.zeros_like(scores)
        grad_x = None
        if pattern.weight_slice is not None:
            a, b = pattern.weight_slice
            x2 = x.detach().reshape(-1, x.shape[-1]).float()
            zeros = pattern.weight(torch.zeros(b - a, dtype=torch.float32, device=g2.device))
            grad_values[a:b] = torch.sparse.sampled_addmm(zeros, g2.t().contiguous(), x2, beta=0.0).values()
            if ctx.needs_input_grad[0]:
                grad_x = torch.sparse.mm(pattern.weight(values[a:b], transposed=True), g2.t()).t()
                grad_x = grad_x.to(x.dtype).reshape(x.shape)
        if pattern.bias_slice is not None:
            a, b = pattern.bias_slice
            grad_values[a:b] = g2.index_select(1, pattern.bias_index).sum(0)
        return grad_x, _score_gradient(grad_values, scores, movement, base), None, None, None
