"""A simulated accelerator for machines without one: device placement checked op by op, on the CPU.

Why not ``FakeTensorMode`` with a fake CUDA device: fake tensors carry no values, and one GRPO
iteration needs values (sampled tokens are decoded to text, the text is scored, rewards become
advantages, ``.item()`` feeds the metrics), and a CPU-only torch cannot even create a tensor on
``cuda`` (``Torch not compiled with CUDA enabled``) nor run autograd over a tensor that says it is
on ``cuda`` (the device guard aborts the process). So the accelerator is simulated instead:

- its device is ``meta`` (a device every torch build knows, with a device guard, so autograd
  works), and a tensor "on the accelerator" is an :class:`OnDevice` wrapper: it reports
  ``device == meta`` and holds a real CPU tensor (``.elem``) that every op computes on;
- a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op, factory ops
  included (``torch.zeros(..., device=dev)`` lands on the accelerator, ``torch.tensor([...])`` on
  the CPU, as on a real GPU), and every op on an ``OnDevice`` goes through the same check;
- the check applies CUDA's rules: an op may not mix accelerator tensors with CPU tensors (0-dim CPU
  tensors, CPU index tensors and cross-device copies excepted, as CUDA allows them); a random op's
  ``generator`` must be on the op's device ("Expected a 'cuda' device type for generator");
  collectives (``c10d`` ops, which go through the dispatcher) must get accelerator tensors, as
  NCCL has no CPU backend ("No backend type associated with device type cpu");
- ``torch.Generator(device=dev)`` cannot be built for ``meta``, so inside the simulation it returns
  a real CPU generator recorded as the accelerator's (the one stand-in: for hardware this machine
  lacks, not for the code under test).

- autocast on the accelerator (``torch.autocast("meta", ...)``, which torch refuses: "unsupported
  autocast device_type 'meta'") is simulated with CUDA's op lists: inside an enabled region the
  matmul-class ops (``linear``, ``matmul``, ``bmm``, ``baddbmm``, ``addmm``, scaled-dot-product
  attention) take their floating inputs in the region's dtype and the reductions that CUDA keeps in
  fp32 (softmax, log-softmax, cross-entropy, layer norm) take fp32, by casts above autograd, so the
  backward sees them as a real run does; a nested ``enabled=False`` region turns it off, and
  ``torch.is_autocast_enabled("meta")`` / ``get_autocast_dtype`` report the region, so
  ``torch.utils.checkpoint`` recomputes a checkpointed block under the autocast of its forward.

One difference from a GPU: torch skips copies into parameters that report ``meta``
(``load_state_dict`` warns and leaves them), so a model moved onto the simulated device keeps the
weights it had, not a checkpoint's loaded afterwards: the values are real, placement is what is
checked.

A program that passes here places its tensors the way a CUDA run needs; the three GPU crashes of
the GRPO loop (sampling generator on the CPU, CPU rewards in the loss, CPU tensors in all-reduces)
each fail here with CUDA's own message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")
aten = torch.ops.aten

# ops that may take tensors on both devices (CUDA allows them): copies and device moves
_CROSS_DEVICE = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default,
                 aten._copy_from_and_resize.default}
# ops whose index tensors may stay on the CPU (advanced indexing moves them)
_INDEX_OPS = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class DeviceMismatch(RuntimeError):
    """What CUDA would have raised."""


class OnDevice(torch.Tensor):
    """A tensor on the simulated accelerator: reports `device == meta`, computes on `.elem` (CPU)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=DEVICE, requires_grad=elem.requires_grad)

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # reached when no mode is active (e.g. an autograd worker thread): the same rules
        return _run(func, args, kwargs or {}, _SIM_STATE.get("generators", {}))


_SIM_STATE: dict = {}


def _is_scalar_cpu(t: torch.Tensor) -> bool:
    return not isinstance(t, OnDevice) and t.dim() == 0


def _same_generator(a: torch.Generator, b: torch.Generator) -> bool:
    """Whether two Python generator objects are one generator (the dispatcher hands a mode a new
    wrapper object each time, so identity is tested by aliasing: re-seed one, look at the other)."""
    old = b.get_state()
    if not torch.equal(a.get_state(), old):
        return False
    for seed in (12345, 54321):  # two seeds: the state cannot already equal both
        b.manual_seed(seed)
        changed = not torch.equal(a.get_state(), old)
        b.set_state(old)
        if changed:
            return True
    return False


def _check(func, args, kwargs, generators: dict[int, torch.Generator]) -> bool:
    """Raise what CUDA would raise; return whether the op runs on the accelerator."""
    flat_args, _ = tree_flatten(args)
    flat_kwargs, _ = tree_flatten({k: v for k, v in kwargs.items() if k != "generator"})
    tensors = [t for t in flat_args + flat_kwargs if isinstance(t, torch.Tensor)]
    on_dev = any(isinstance(t, OnDevice) for t in tensors)
    dev_kw = kwargs.get("device")
    if dev_kw is not None:
        wants_dev = torch.device(dev_kw) == DEVICE
    else:
        wants_dev = on_dev
    if func.namespace == "c10d":
        cpu = [t for t in tensors if not isinstance(t, OnDevice)]
        if cpu:
            raise DeviceMismatch(f"{func}: No backend type associated with device type cpu "
                                 "(a collective on the accelerator's process group got a CPU tensor)")
        return True
    if func not in _CROSS_DEVICE and on_dev:
        if func in _INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
            allowed = {id(t) for t in indices if isinstance(t, torch.Tensor)}
        else:
            allowed = set()
        cpu = [t for t in tensors if not isinstance(t, OnDevice) and not _is_scalar_cpu(t) and id(t) not in allowed]
        if cpu:
            raise DeviceMismatch(f"{func}: Expected all tensors to be on the same device, but found at least "
                                 f"two devices, cuda:0 (simulated) and cpu! (CPU tensor of shape "
                                 f"{tuple(cpu[0].shape)})")
    gen = kwargs.get("generator")
    if gen is not None:
        gen_on_dev = any(_same_generator(gen, g) for g in generators.values())
        if wants_dev and not gen_on_dev:
            raise DeviceMismatch(f"{func}: Expected a 'cuda' device type for generator but found 'cpu'")
        if not wants_dev and gen_on_dev:
            raise DeviceMismatch(f"{func}: Expected a 'cpu' device type for generator but found 'cuda'")
    return wants_dev


def _run(func, args, kwargs, generators):
    wants_dev = _check(func, args, kwargs, generators)
    if func is aten._to_copy.default and kwargs.get("device") is not None:
        wants_dev = torch.device(kwargs["device"]) == DEVICE
    by_elem = {}

    def unwrap(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) and t.device == DEVICE:
            raise RuntimeError(f"{func}: a real meta tensor (no values) reached the simulation")
        if isinstance(t, OnDevice):
            by_elem[id(t.elem)] = t
            return t.elem
        if isinstance(t, torch.device) and t == DEVICE:
            return torch.device("cpu")
        return t

    kwargs = dict(kwargs)
    if kwargs.get("device") is not None and torch.device(kwargs["device"]) == DEVICE:
        kwargs["device"] = torch.device("cpu")
    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    if not wants_dev:
        return out

    def wrap(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice):
            same = by_elem.get(id(t))  # an in-place op returns its own argument
            if same is not None:
                return same
            # under inference_mode a view of a normal tensor is a normal tensor: so is its wrapper
            with torch.inference_mode(t.is_inference()):
                return OnDevice(t)
        return t

    return tree_map(wrap, out)


class _Mode(TorchDispatchMode):
    def __init__(self, generators: dict[int, torch.Generator]) -> None:
        super().__init__()
        self.generators = generators

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {}, self.generators)


class _FromData(TorchFunctionMode):
    """`torch.tensor(data, device=dev)` builds its tensor below the dispatcher (no aten op is seen):
    build it on the CPU and wrap it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]) == DEVICE:
            t = func(*args, **{**kwargs, "device": "cpu"})
            return t.to(DEVICE)  # through the dispatch mode: an OnDevice
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- autocast on the device

F = torch.nn.functional
LOWER_PRECISION = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
                   torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm, torch.addmm, torch.Tensor.addmm,
                   F.scaled_dot_product_attention}
FP32 = {F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
        F.cross_entropy, F.layer_norm}
_REGIONS: list[tuple[bool, torch.dtype]] = []  # the simulated device's open autocast regions, innermost last
AUTOCAST_COUNTS = {"lower_precision": 0}


class _Autocast(TorchFunctionMode):
    """Inside an enabled region (the innermost open one), CUDA autocast's casts of the listed ops'
    floating inputs. Each region enters one; nested ones cast what is cast already, a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _REGIONS and _REGIONS[-1][0] and (func in LOWER_PRECISION or func in FP32):
            dtype = _REGIONS[-1][1] if func in LOWER_PRECISION else torch.float32

            def cast(t):
                return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t

            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
            AUTOCAST_COUNTS["lower_precision"] += func in LOWER_PRECISION
        return func(*args, **kwargs)


def _sim_autocast(real):
    """`torch.autocast` / `torch.amp.autocast` with the simulated device's regions; other devices: `real`."""

    class autocast:  # noqa: N801 - stands in for torch's class of that name
        def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
            self.sim = device_type == DEVICE.type
            self.region = (bool(enabled), dtype or torch.bfloat16)
            self.inner = None if self.sim else real(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

        def __enter__(self):
            if not self.sim:
                return self.inner.__enter__()
            _REGIONS.append(self.region)
            # a mode of its own: a checkpointed block is recomputed in the backward, where torch runs no
            # function mode of the forward, under a region checkpoint opens again from what it saved
            self.mode = _Autocast()
            self.mode.__enter__()
            return self

        def __exit__(self, *exc):
            if not self.sim:
                return self.inner.__exit__(*exc)
            self.mode.__exit__(*exc)
            _REGIONS.pop()
            return False

    return autocast


@contextlib.contextmanager
def _autocast_patched() -> Iterator[None]:
    saved = {"autocast": torch.autocast, "amp": torch.amp.autocast, "available": torch.amp.is_autocast_available,
             "enabled": torch.is_autocast_enabled, "dtype": torch.get_autocast_dtype}
    torch.autocast, torch.amp.autocast = _sim_autocast(saved["autocast"]), _sim_autocast(saved["amp"])
    torch.amp.is_autocast_available = lambda device_type: device_type == DEVICE.type or saved["available"](device_type)
    torch.is_autocast_enabled = lambda *a: (bool(_REGIONS) and _REGIONS[-1][0]) if a and a[0] == DEVICE.type \
        else saved["enabled"](*a)
    torch.get_autocast_dtype = lambda device_type: (_REGIONS[-1][1] if _REGIONS else torch.bfloat16) \
        if device_type == DEVICE.type else saved["dtype"](device_type)
    try:
        yield
    finally:
        torch.autocast, torch.amp.autocast = saved["autocast"], saved["amp"]
        torch.amp.is_autocast_available, torch.is_autocast_enabled = saved["available"], saved["enabled"]
        torch.get_autocast_dtype = saved["dtype"]
        _REGIONS.clear()


@contextlib.contextmanager
def simulated_accelerator() -> Iterator[torch.device]:
    """Run the block with a simulated accelerator; yields its device (pass it where a CUDA device goes)."""
    generators: dict[int, torch.Generator] = {}
    real_generator = torch.Generator

    class _Meta(type(real_generator)):
        def __instancecheck__(cls, obj) -> bool:
            return isinstance(obj, real_generator)

    class generator(real_generator, metaclass=_Meta):  # a class, so `torch.Generator | None` still works
        def __new__(cls, device="cpu"):
            g = real_generator()  # a real (CPU) generator; recorded as the accelerator's if asked for one
            if torch.device(device) == DEVICE:
                generators[id(g)] = g
            return g

    torch.Generator = generator
    _SIM_STATE["generators"] = generators
    try:
        with _Mode(generators), _FromData(), _autocast_patched():
            yield DEVICE
    finally:
        torch.Generator = real_generator
        _SIM_STATE.clear()


def to_cpu(t):
    """The real values of a (possibly simulated-device) tensor, outside the simulation."""
    return t.elem if isinstance(t, OnDevice) else t
