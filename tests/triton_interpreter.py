"""Triton's interpreter (TRITON_INTERPRET=1), where the kernel tests run on a machine without a GPU, without one
repeated cost.

A kernel launch patches triton.language for the interpreter (`_patch_lang`) and restores it when the grid is done.
Every call of a @triton.jit helper from inside the kernel (tl.sum, tl.zeros, our own) patches the modules the
helper's file imports again (`InterpretedFunction.__call__`), walking their members with inspect.getmembers: after
the first time in a launch a no-op (the patches are the same functions), and about a third of an interpreted kernel
test's time (Triton 3.8; 114,000 helper calls in test_gdn_triton's varlen tests). `skip_repatching_in_helper_calls`
makes a helper call patch only modules not yet patched in the running launch: the language is in the same state as
without it, and every kernel still runs as the interpreter runs it.
"""
import functools
import inspect

_patched_by_launch: set = set()  # ids of the language modules patched in the running launch


@functools.lru_cache(maxsize=None)
def _language_modules(fn) -> frozenset:
    import triton.language as tl

    return frozenset(id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core))


def skip_repatching_in_helper_calls() -> bool:
    """Install the shortcut; False (and nothing changed) where this Triton's interpreter is laid out otherwise."""
    from triton.runtime import interpreter

    launch, helper_call = getattr(interpreter, "GridExecutor", None), getattr(interpreter, "InterpretedFunction", None)
    if launch is None or helper_call is None or not hasattr(interpreter, "_patch_lang") or not hasattr(helper_call, "rewrite"):
        return False
    run_grid = launch.__call__

    def launch_call(self, *args, **kwargs):
        _patched_by_launch.update(_language_modules(self.fn))  # _patch_lang patches these as the launch starts
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            _patched_by_launch.clear()

    def call_helper(self, *args, **kwargs):
        modules = _language_modules(self.fn)
        if not modules <= _patched_by_launch:
            interpreter._patch_lang(self.fn)  # left patched, as Triton leaves it: for the rest of the launch
            _patched_by_launch.update(modules)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    launch.__call__, helper_call.__call__ = launch_call, call_helper
    return True
