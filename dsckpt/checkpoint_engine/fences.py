"""What may rewrite the optimizer's state while a save's deferred copies still read it, made to wait for them.

A background save leaves an optimizer-states file's copies past the call (``background``); until they are done the
state they read must not change.  ``fence_state_writers(engine, before)`` makes each DeepSpeed entry point that writes
that state call ``before()`` (the wait for the copies) first:
* the optimizer's ``step``;
* ZeRO-3's ``set_full_hp_param`` / ``set_local_hp_param``, behind ``safe_set_full_*`` / ``safe_set_local_*`` (fp32
  masters and optimizer states);
* ZeRO-1/2's and BF16's per-parameter ``set_full_hp_param``, behind ``safe_set_full_*`` (parameters linked already,
  and those DeepSpeed links later);
* the engine's ``load_checkpoint`` (``background`` wraps it).
Optimizers that write their masters outside these (SuperOffload, ZenFlow) get no deferred copies: their files are
copied in the call.  Returns whether an optimizer-states file's copies may be deferred.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable

UNFENCED = ("SuperOffload", "ZenFlow")  # optimizers that write fp32 masters outside the fenced calls


def fence_state_writers(engine: Any, before: Callable[[], None]) -> bool:
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or not callable(getattr(optimizer, "step", None)):
        return False
    if any(name in cls.__name__ for cls in type(optimizer).__mro__ for name in UNFENCED):
        return False

    def fenced(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            before()
            return method(*args, **kwargs)
        return call

    step = optimizer.step

    def fenced_step(_optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        before()
        return step(*args, **kwargs)
    optimizer.step = types.MethodType(fenced_step, optimizer)  # (a method: torch's LR schedulers rewrap it)
    for name in ("set_full_hp_param", "set_local_hp_param"):
        if callable(getattr(optimizer, name, None)):
            setattr(optimizer, name, fenced(getattr(optimizer, name)))
    module = getattr(engine, "module", None)
    for param in module.parameters() if module is not None else ():
        if callable(getattr(param, "set_full_hp_param", None)):
            param.set_full_hp_param = fenced(param.set_full_hp_param)
    try:
        from deepspeed.utils import mixed_precision_linkage as linkage
    except ImportError:  # pragma: no cover - the runtime extra always brings DeepSpeed
        return True
    if not getattr(linkage.set_full_hp_param, "_dsckpt_fenced", False):  # (one process may hold several engines)
        original = linkage.set_full_hp_param

        def linked_later(param: Any, *args: Any, **kwargs: Any) -> Any:
            for hook in _BEFORE:
                hook()
            return original(param, *args, **kwargs)
        linked_later._dsckpt_fenced = True  # type: ignore[attr-defined]
        linkage.set_full_hp_param = linked_later
    _BEFORE.append(before)
    return True


_BEFORE: list[Callable[[], None]] = []  # every engine's wait, for parameters linked after it was enabled
