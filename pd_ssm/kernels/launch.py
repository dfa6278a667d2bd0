"""Triton launches with less host time, for kernels launched eagerly many times with the same
argument signature: every launcher in pd_ssm/kernels (eager prefill and mixed steps launch ~11
kernels a layer; benchmarks/RESULTS.md, sessions 16-17).

Triton's `fn[grid](...)` binds every argument into a dict, specializes each, builds and looks up a
cache key (with `str()` of the options), checks the kernel's globals, then launches. On the lent
H200 hosts an eager SSD call spent 290-610 us of host time on its launches and arguments, more than
its device time up to 8192 tokens (benchmarks/RESULTS.md, session 16).

`FastKernel(fn)[grid](*args, **constexprs)` takes the same arguments. Its first call for an argument
signature goes through Triton, which compiles and launches, and keeps the compiled kernel; later
calls launch that kernel directly. (The kernel's very first call keeps nothing: Triton's backend
object, which the signature needs, exists only after it.) The signature is Triton's own
specialization of each runtime argument (`native_specialize_impl`: a tensor's dtype and 16-byte
alignment, an int's width and whether it is 1 or a multiple of 16, a descriptor's dtype and block),
plus the constexprs and launch options by value and the device. So a compiled kernel is reused
exactly where Triton itself would reuse it. Runtime arguments go positionally; constexprs by
keyword, or by position (keyed by value). A call that passes a runtime argument by keyword always
goes through Triton. Under TRITON_INTERPRET=1 every call goes through the interpreter unchanged.

Computing that signature costs ~0.7 us an argument (a C call per argument), ~20 us for the SSD
scan's 27-argument launch. A caller that knows two calls share a signature (the SSD launcher keys
its whole plan by the shapes, strides, dtypes and alignments of its inputs) keeps the `Compiled`
that `run` returns and hands it back: that launch skips the signature. `FastKernel.verify` checks
the promise (the GPU tests set it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.runtime import driver
from triton.runtime.interpreter import InterpretedFunction


class Compiled(NamedTuple):
    """A compiled kernel and the constexprs it was compiled for, in parameter order, on one device."""

    kernel: Any
    constexprs: tuple[Any, ...]  # the parameters after the positional arguments, in order (constexprs, defaults)
    device: int


class FastKernel:
    """A @triton.jit function with a cache of its compiled kernels by argument signature."""

    # NOTE: tests set this: every launch handed a Compiled also computes Triton's specialization of its
    # arguments and raises if that would pick another kernel (the caller's signature promise broken)
    verify: ClassVar[bool] = False
    # NOTE: benchmarks clear this to time Triton's own launch path in the same process
    enabled: ClassVar[bool] = True
    __slots__ = ("_fn", "_specialize", "_defaults", "_runtime", "_cache", "_backends")

    def __init__(self, fn: Any) -> None:
        self._fn = fn
        self._cache: dict[tuple[Any, ...], Compiled] = {}
        self._backends: dict[int, Any] = {}
        # per parameter, in order: (constexpr, specialize on value, specialize on alignment)
        self._specialize: list[tuple[bool, bool, bool]] = []
        self._defaults: dict[str, Any] = {}
        self._runtime: frozenset[str] = frozenset()
        if isinstance(fn, InterpretedFunction):
            return
        # NOTE: the direct path does not know annotated runtime parameters (Triton types them by
        # their annotation) or const ones: such a kernel always goes through Triton
        if any(p.annotation_type or p.is_const for p in fn.params if not p.is_constexpr):
            return
        self._specialize = [(p.is_constexpr, not p.do_not_specialize, not p.do_not_specialize_on_alignment)
                            for p in fn.params]
        self._defaults = {p.name: p.default for p in fn.params if p.has_default}
        self._runtime = frozenset(p.name for p in fn.params if not p.is_constexpr)

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., object]:
        # interpreted, a kernel the direct path does not know, or switched off
        if not self._specialize or not FastKernel.enabled:
            return self._fn[grid]  # type: ignore[no-any-return]
        return lambda *args, **kwargs: self._launch(tuple(grid), args, kwargs)

    def run(self, grid: tuple[int, ...], args: tuple[Any, ...], constexprs: dict[str, Any],
            compiled: Compiled | None) -> Compiled | None:
        """Launch `args` (runtime arguments, in order) with `constexprs` (by keyword).

        `compiled` is what an earlier run returned for a call of the same argument signature (the
        caller vouches for that: the same dtypes, 16-byte alignments, integers equal to 1 or
        multiples of 16 where Triton tells those apart, the same constexprs); it is launched without
        computing the signature. Returns the compiled kernel to hand the next such call, or None
        where there is none yet (interpreted, the kernel's very first call, another layout).
        """
        if not self._specialize or not FastKernel.enabled:
            self._fn[grid](*args, **constexprs)
            return None
        if compiled is None or compiled.device != driver.active.get_current_device():
            return self._launch(grid, args, constexprs)
        if FastKernel.verify:
            self._verify(compiled, args, constexprs)
        self._direct(compiled, grid, args)
        return compiled

    def _launch(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Compiled | None:
        device = driver.active.get_current_device()
        backend = self._backends.get(device)
        if backend is None or len(args) > len(self._specialize):
            return self._through_triton(grid, args, kwargs, device)
        key = self._signature(backend, device, args, kwargs)
        hit = self._cache.get(key)
        if hit is None:
            return self._through_triton(grid, args, kwargs, device, key)
        self._direct(hit, grid, args)
        return hit

    def _signature(self, backend: Any, device: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        # a positional constexpr by its value, a runtime argument by Triton's specialization of it
        return (device, tuple(a if const else native_specialize_impl(backend, a, False, value, align)
                              for a, (const, value, align) in zip(args, self._specialize, strict=False)),
                tuple(kwargs.items()))

    def _verify(self, compiled: Compiled, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        key = self._signature(self._backends[compiled.device], compiled.device, args, kwargs)
        if self._cache.get(key) is not compiled:
            raise RuntimeError(f"FastKernel({self._fn.__name__}): the caller's compiled kernel is not the one "
                               f"Triton's specialization of these arguments picks: {key}")

    @staticmethod
    def _direct(compiled: Compiled, grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
        kernel, constexprs = compiled.kernel, compiled.constexprs
        stream = driver.active.get_current_stream(compiled.device)
        g0, g1, g2 = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *args, *constexprs), knobs.runtime.launch_enter_hook,
                   knobs.runtime.launch_exit_hook, *args, *constexprs)

    def _through_triton(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any], device: int,
                        key: tuple[Any, ...] | None = None) -> Compiled | None:
        kernel = self._fn[grid](*args, **kwargs)
        if device not in self._backends:
            self._backends[device] = self._fn.device_caches[device][3]
        if key is None or kernel is None:
            return None  # the next call computes the key
        if hasattr(kernel, "result"):  # an asynchronous compile's future
            kernel = kernel.result()
        # the parameters after the positional arguments, in order: the kernel's full argument list is
        # the call's positional arguments, then these
        names = self._fn.arg_names[len(args):]
        if any(n in self._runtime for n in kwargs):
            return None  # a runtime argument by keyword: its value is not part of the key, never cached
        compiled = Compiled(kernel, tuple(kwargs[n] if n in kwargs else self._defaults[n] for n in names), device)
        self._cache[key] = compiled
        return compiled
