"""Triton's interpreter (TRITON_INTERPRET=1), where the kernel tests run on a machine without a GPU, without
costs it repeats to no effect: re-patching the language in helper calls, and rebuilding type objects.

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


def reuse_type_objects() -> bool:
    """Two pure functions of a type that the interpreter recomputes on every tensor operation: `_get_np_dtype`
    (the numpy dtype of a Triton dtype, from a table of 19 entries built anew on each call) and the block type of
    an element type and shape (`block_type(...)`, formatting its name each time). Both are looked up, once made,
    by the element type's name and the shape: an equal type object, not a new one. False (nothing changed) where
    this Triton's interpreter is laid out otherwise."""
    import triton.language as tl
    from triton.runtime import interpreter

    numpy_dtype, builder = getattr(interpreter, "_get_np_dtype", None), getattr(interpreter, "InterpreterBuilder", None)
    if numpy_dtype is None or builder is None or not hasattr(builder, "get_block_ty"):
        return False
    make_block_type = tl.block_type

    def type_key(element_ty) -> tuple:  # a pointer's name says its element and constness, not its address space
        return element_ty.name, getattr(element_ty, "address_space", None)

    numpy_dtypes: dict = {}

    def get_np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        key = type_key(element)
        found = numpy_dtypes.get(key)
        if found is None:
            found = numpy_dtypes[key] = numpy_dtype(element)
        return found

    block_types: dict = {}

    def block_type(element_ty, shape):
        key = (*type_key(element_ty), tuple(shape))
        found = block_types.get(key)
        if found is None:
            found = block_types[key] = make_block_type(element_ty, shape)
        return found

    interpreter._get_np_dtype = get_np_dtype
    builder.get_block_ty = lambda self, dtype, shape: block_type(dtype, shape)
    tl.block_type.with_element_ty = lambda self, scalar_ty: block_type(scalar_ty, self.shape)
    return True
