"""Discovery at the first forward: a model of one's own protected without ``example=``.

Which modules of such a model call ``F.scaled_dot_product_attention``, which linear layers make
their Q, K and V, and whether some attention runs by hand or through flex attention, is known
only by running it (:mod:`~attnchecker.models.sdpa_trace`); class sources only say where to
look. So ``protect_(model)`` without an example installs one root forward pre-hook and nothing
else; the model's first forward, on its first real batch, runs the trace once, eagerly (one
more forward, gradients on, its graph dropped; the random state and the buffers are restored so
the real forward computes what it would have), then wires protection exactly as
``protect_(model, example=...)`` does, and the same forward then runs checked. What protect_
would have raised with ``example=`` this forward raises, in the same words, and leaves the model
unprotected.

Under ``torch.compile`` (``fullgraph=True`` included) the hook is a ``torch.compiler.disable``d
function: the first call runs discovery outside the compiled region and compiles the checked
step with the wiring it installed; the second call compiles once more (the clock's tick hook,
installed during the first, joins the graph); later calls compile nothing
(``tests/integration/test_protect_sdpa.py``). Where a compiler cannot leave its region, its
error carries this module's reason, which says to pass ``example=``.

Before the first forward the handle has no protected module; ``summary()`` lists the modules
whose source names SDPA, each with every configured op unchecked as "pending discovery".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map

from attnchecker.errors import UnsupportedModelError
from attnchecker.models.sdpa import sdpa_modules

__all__ = ["Call", "Pending", "defer"]

_COMPILED = (
    "attnchecker finds a model's attention and projections at its first forward, in eager; "
    "pass example=(batch,) to protect_ to find them before compiling with fullgraph=True"
)
_CAPTURED = (
    "the first forward of {model} runs inside a CUDA graph capture, where discovery's traced "
    "forward cannot run: pass example=(batch,) to protect_"
)
_ROOT = (
    "{model} itself calls scaled_dot_product_attention, which protect_ routes from the "
    "module's forward; its first call has entered that forward before discovery can run: "
    "pass example=(batch,) to protect_"
)


@dataclass(frozen=True)
class Call:
    """The arguments of the forward that discovery traces."""

    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class Pending:
    """What is known of a model before its first forward: where to look (the innermost
    modules whose class source names SDPA, ``nn.MultiheadAttention`` modules)."""

    candidates: tuple[str, ...]


def defer(model: nn.Module, handle, resolve: Callable[[Call], Callable[..., None]]) -> None:
    """Install discovery at ``model``'s first forward into ``handle``: ``resolve`` wires
    protection from the traced call and returns the clock's tick, run once for that forward
    (the tick hook it installs runs from the next one)."""
    where = sdpa_modules(model)
    if "" in where.sdpa:
        raise UnsupportedModelError(_ROOT.format(model=type(model).__name__))
    handle._pending = Pending(where.sdpa)

    def discover(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hook.remove()
        try:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise UnsupportedModelError(_CAPTURED.format(model=type(model).__name__))
            with _untouched(model):
                tick = resolve(Call(*_usable(args, kwargs)))
            if "" in handle._states:  # the root is a checked module: too late for this call
                raise UnsupportedModelError(_ROOT.format(model=type(model).__name__))
        except BaseException as e:
            handle._pending = None
            handle.unprotected = f"refused at the first forward: {e}"
            handle._remove()  # the model is as it was; this forward raises
            handle._states.clear()
            raise
        handle._pending = None
        tick(module)

    try:
        outside = torch.compiler.disable(discover, reason=_COMPILED)
    except TypeError:  # a torch without disable's reason (the GPU machine's 2.11 may lack it)
        outside = torch.compiler.disable(discover)
    hook = model.register_forward_pre_hook(outside, with_kwargs=True)
    handle._undo.append(hook.remove)


def _usable(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments as a traced forward with gradients can take them: tensors made
    under ``torch.inference_mode`` copied out of it (autograd cannot record them)."""

    def fix(x: object) -> object:
        return x.clone() if isinstance(x, torch.Tensor) and x.is_inference() else x

    if not torch.is_inference_mode_enabled():
        return args, kwargs
    with torch.inference_mode(False):
        return tree_map(fix, args), tree_map(fix, kwargs)


@contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """Run the body (the traced forward and the wiring) leaving the model's random state and
    buffers as they were, so the forward that follows computes what it would have without
    protection (dropout draws the same masks; running statistics move once)."""
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    saved = [
        (m, name, b, b.detach().clone())
        for m in model.modules()
        for name, b in m._buffers.items()
        if b is not None
    ]
    with torch.random.fork_rng(devices=cuda), torch.inference_mode(False):
        try:
            yield
        finally:
            with torch.no_grad():
                for m, name, b, copy in saved:
                    m._buffers[name] = b
                    b.copy_(copy)
