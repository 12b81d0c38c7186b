"""Triton's interpreter (TRITON_INTERPRET=1), where the kernel tests run on a machine without a GPU, without
costs it repeats to no effect. Each shortcut leaves every value a kernel computes, and every error it raises, as the
interpreter makes them; each is installed only where this Triton's interpreter is laid out as expected (False
otherwise, and nothing changed).

- re-patching the language in helper calls: a kernel launch patches triton.language for the interpreter
  (`_patch_lang`) and restores it when the grid is done. Every call of a @triton.jit helper from inside the kernel
  (tl.sum, tl.zeros, our own) patches the modules the helper's file imports again (`InterpretedFunction.__call__`),
  walking their members with inspect.getmembers: after the first time in a launch a no-op (the patches are the
  same functions), and about a third of an interpreted kernel test's time (Triton 3.8; 114,000 helper calls in
  test_gdn_triton's varlen tests). `skip_repatching_in_helper_calls` makes a helper call patch only modules not
  yet patched in the running launch.
- rebuilding type objects and what a tensor derives from its type (`reuse_type_objects`, `share_tensor_shapes`).
- integer overflow checks whose result is dropped (`skip_unasserted_overflow_checks`) and broadcasts of operands
  whose shapes are equal already (`skip_broadcasting_equal_shapes`).

One block type object per element type and shape, shared tensor shapes, the skipped overflow checks and broadcasts
take about 30% off the interpreted kernel tests (Triton 3.8, one core: sixteen modules of kernel tests 192 s -> 134 s,
test_gla_triton.py 30 s -> 22 s).
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
    an element type and shape (`tl.block_type(...)`, which checks the shape and formats its name each time). The
    first is looked up, once made, by the element type's name; the second is one object per element type and
    shape, however it is asked for (Python calls `__new__`, which returns the one made first, and then `__init__`,
    which leaves a type already made as it is). Nothing changes a block type once it is made."""
    import triton.language as tl
    from triton.runtime import interpreter

    numpy_dtype, builder = getattr(interpreter, "_get_np_dtype", None), getattr(interpreter, "InterpreterBuilder", None)
    if numpy_dtype is None or builder is None or not hasattr(builder, "get_block_ty"):
        return False
    block_type_class = tl.block_type
    make_block_type = block_type_class.__init__

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
        dims = tuple(d.value if isinstance(d, tl.constexpr) else d for d in shape)
        if not all(type(d) is int for d in dims):  # refused as block_type refuses it
            made = object.__new__(block_type_class)
            make_block_type(made, element_ty, shape)
            return made
        key = (*type_key(element_ty), dims)
        found = block_types.get(key)
        if found is None:
            found = object.__new__(block_type_class)
            make_block_type(found, element_ty, shape)
            block_types[key] = found
        return found

    def new(cls, element_ty=None, shape=None):  # no arguments: a copy being made, filled in by its caller
        if cls is not block_type_class or shape is None:
            return object.__new__(cls)
        return block_type(element_ty, shape)

    def init(self, element_ty, shape):
        if "name" not in self.__dict__:
            make_block_type(self, element_ty, shape)

    interpreter._get_np_dtype = get_np_dtype
    block_type_class.__new__, block_type_class.__init__ = new, init
    builder.get_block_ty = lambda self, dtype, shape: block_type(dtype, shape)
    block_type_class.with_element_ty = lambda self, scalar_ty: block_type(scalar_ty, self.shape)
    return True


def share_tensor_shapes() -> bool:
    """What a tensor derives from its type on every tensor operation (`tl.tensor.__init__`: the shape as a tuple of
    constexprs, and the element count as one) made once per type object, kept on it and shared by the tensors of
    that type. Neither is changed once made: a tensor's shape and numel are rebound, never modified."""
    import math

    import triton.language as tl

    tensor = getattr(tl, "tensor", None)
    if tensor is None or not {"handle", "type"} <= set(inspect.signature(tensor.__init__).parameters):
        return False
    make_tuple, constexpr = tl.tuple, tl.constexpr

    def init(self, handle, type):
        self.handle, self.type, self.dtype = handle, type, type.scalar
        derived = type.__dict__.get("_interpreted_shape_numel")
        if derived is None:
            shape = type.shape if type.is_block() else ()
            derived = type._interpreted_shape_numel = (make_tuple([constexpr(s) for s in shape]),
                                                       constexpr(math.prod(shape)))
        self.shape, self.numel = derived

    tensor.__init__ = init
    return True


def skip_unasserted_overflow_checks() -> bool:
    """Triton checks integer additions, subtractions and multiplications for overflow (sanitize_overflow, on in the
    interpreter's options) by computing each again in int64 and comparing it with the type's range, which it hands
    to device_assert; device_assert checks nothing unless the launch is a debug one (`options.debug`, never set by
    the interpreter), so the check's five extra operations on every integer operation of a kernel are dropped
    unread. The check is skipped where its result would be: a launch with debug set still makes it."""
    from triton.language import semantic

    language = getattr(semantic, "TritonSemantic", None)
    check = getattr(language, "binary_op_sanitize_overflow_impl", None)
    if check is None or not hasattr(language, "device_assert"):
        return False

    def check_where_asserted(self, lhs, rhs, binary_op):
        if not self.builder.options.debug:
            return None
        return check(self, lhs, rhs, binary_op)

    language.binary_op_sanitize_overflow_impl = check_where_asserted
    return True


def skip_broadcasting_equal_shapes() -> bool:
    """Every binary operation broadcasts its operands (`broadcast_impl_value`), which, for two blocks, builds both
    shapes and the result's dimension by dimension and returns the operands as they are where the shapes are equal
    (most operations). Two operands of the same type, or blocks of the same shape, are returned at once."""
    from triton.language import semantic

    language = getattr(semantic, "TritonSemantic", None)
    broadcast = getattr(language, "broadcast_impl_value", None)
    if broadcast is None:
        return False

    def broadcast_unless_equal(self, lhs, rhs):
        lhs_ty, rhs_ty = lhs.type, rhs.type
        if lhs_ty is rhs_ty or (lhs_ty.is_block() and rhs_ty.is_block() and lhs_ty.shape == rhs_ty.shape):
            return lhs, rhs
        return broadcast(self, lhs, rhs)

    language.broadcast_impl_value = broadcast_unless_equal
    return True
