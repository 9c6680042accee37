"""Zero-copy hand-off of arrays between torch and JAX over DLPack, in CUDA stream order.

`to_jax(tensor)` returns a `jax.Array` and `to_torch(array)` a `torch.Tensor` that share
memory with their input: no copy on the CPU or on a GPU.

What is accepted:
- dtypes (to_jax): bfloat16, float16, float32, int32, bool. `to_torch` takes any single-
  device JAX array (they are always dense and row-major, so it never copies).
- layout (to_jax): a row-major contiguous tensor with an aligned data pointer (64 bytes on
  the CPU, JAX's rule for using host memory in place; 16 bytes on CUDA, the alignment XLA
  and Triton kernels assume for their arguments). Anything else (a transpose, a strided
  slice, a view with an odd storage offset) is refused with a ValueError unless
  `copy=True`, which always copies the tensor into a fresh contiguous one first, on
  torch's current stream. No copy is ever made silently.
- devices: a CPU tensor goes to JAX's CPU device, even where JAX's default backend is a
  GPU; a tensor on `cuda:i` goes to the JAX CUDA device whose local hardware id is i, even
  if it is not JAX's default device. The resulting array is committed to that device, so
  JAX computes where the data is. A CUDA tensor without a JAX CUDA backend, or on a device
  JAX does not see, is refused with a ValueError. `to_torch` returns a tensor on the
  array's device (`cuda:i` for the JAX GPU with local hardware id i).

Stream order on CUDA (nothing to order on the CPU, where torch runs synchronously and
`to_torch` waits for JAX's result on the host):
- torch -> JAX: `to_jax` records an event on torch's current stream of the tensor's device
  and makes JAX's stream for external buffers (`Device.get_stream_for_external_ready_events`)
  wait for it; the new array's definition event is recorded on that stream after the wait,
  so every JAX computation reading the array runs after all work that was queued on torch's
  current stream before the call. Write the tensor on the current stream, or make the
  current stream wait for the producing stream, before calling `to_jax`.
- JAX -> torch: `to_torch` passes torch's current stream to JAX's DLPack export, which
  makes that stream wait (cudaStreamWaitEvent) for the array's definition event: every
  torch operation queued on that stream afterwards sees the finished array. The host does
  not wait for the GPU; it waits at most until JAX has queued the producing computation.
- Neither call synchronizes the device or the host with the GPU.

What is not ordered: torch work on other streams than the current one, and writes into a
tensor after `to_jax` while a JAX computation reading it may still run (the hand-off is
read-only sharing; `xattn_estimate` is safe here because torch's stream waits for its
results, which come after its reads). A JAX array keeps its torch tensor alive until JAX
releases the buffer after its last use. A tensor from `to_torch` shares JAX's immutable
buffer: do not write into it while the JAX array is in use. Once that tensor and the JAX
array are both gone, JAX may reuse the memory without waiting for torch work still queued
on it; JAX work fed through `to_jax` from the same stream waits for that work anyway.

Implementation notes. These are the exchanges `jax.dlpack.from_dlpack(tensor)` and
`torch.from_dlpack(array)` perform, without their per-call Python (docs/tuning.md:
bridge-dlpack-import). The torch capsule comes from `torch.utils.dlpack.to_dlpack`
(what `Tensor.__dlpack__` returns after its argument handling) and JAX views it with
jaxlib's `dlpack_managed_tensor_to_buffer` (where `jax.dlpack.from_dlpack` ends); the JAX
capsule comes from jaxlib's `buffer_to_dlpack_managed_tensor` (where `jax.Array.__dlpack__`
ends) and torch views it with `torch._C._from_dlpack` (where `torch.from_dlpack` ends).
The stream-order step that `Tensor.__dlpack__(stream=...)` performs with a new event and
stream object per call is done here with one reused event per thread, through the event's
C++ methods; the stream handed to JAX's export is the one `torch.from_dlpack` passes, read
with `torch._C._cuda_getCurrentRawStream` (the call Triton and inductor use). These
jaxlib and torch functions are private: the jaxlib ones have these signatures from
jax 0.10.2 to 0.11; `torch._C._from_dlpack` is in torch 2.11 and 2.13, and the event's
C++ methods were run with torch 2.11 (the CUDA build on the H200). Devices are looked up
once per torch device (to_jax) and once per JAX sharding (to_torch).
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np
import torch
import torch.utils.dlpack
import torch.utils.weak
from jax._src.lib import _jax

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # of q and k
DTYPES = (*FLOAT_DTYPES, torch.int32, torch.bool)
CPU_ALIGN = 64  # bytes: JAX refuses to view less aligned host memory
CUDA_ALIGN = 16  # bytes: XLA's alignment of kernel arguments
_DL_CPU, _DL_CUDA = 1, 2  # DLPack device types
_LEGACY_DEFAULT_STREAM = 1  # DLPack's name for CUDA's legacy default stream (pointer 0)


@dataclasses.dataclass(frozen=True)
class Place:
    """Where the tensors of one torch device land in JAX, and how to order them there.

    index: the CUDA device index, None on the CPU. jax_stream: JAX's stream for external
    buffers as a pointer (for jaxlib) and as a torch stream (for events); None on the CPU.
    """

    jax_device: jax.Device
    dl_type: int
    align: int
    index: int | None = None
    jax_stream: int | None = None
    jax_stream_torch: torch.cuda.Stream | None = None


_places: dict[torch.device, Place] = {}
_torch_indices: dict[jax.sharding.Sharding, int | None] = {}
_UNKNOWN = object()
_thread = threading.local()
_persistent = torch.utils.weak.WeakIdKeyDictionary()  # tensor -> (key, view)


def cuda_available() -> bool:
    """Whether CUDA tensors can be handed over here: torch sees a CUDA GPU and JAX has its
    CUDA backend."""
    if not torch.cuda.is_available():
        return False
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def _new_place(device: torch.device, name: str) -> Place:
    if device.type == "cpu":
        return Place(jax.devices("cpu")[0], _DL_CPU, CPU_ALIGN)
    if device.type != "cuda":
        raise ValueError(f"{name} must be on the CPU or a CUDA device, got {device}")
    try:
        cuda_devices = jax.devices("cuda")
    except RuntimeError:
        raise ValueError(
            f"{name} is on {device}, which needs JAX's CUDA backend; JAX has only "
            f"{jax.default_backend()!r}: install jax[cuda13], or pass CPU tensors") from None
    match = [d for d in cuda_devices if d.local_hardware_id == device.index]
    if not match:
        raise ValueError(
            f"{name} is on {device}, but JAX has no CUDA device with local hardware id "
            f"{device.index} (it has {[d.local_hardware_id for d in cuda_devices]})")
    stream = match[0].get_stream_for_external_ready_events()
    return Place(match[0], _DL_CUDA, CUDA_ALIGN, device.index, stream,
                 torch.cuda.ExternalStream(stream, device=device))


def place_of(tensor: torch.Tensor, name: str, copy: bool,
             dtypes: tuple[torch.dtype, ...] = DTYPES) -> tuple[torch.Tensor, Place]:
    """Checks `tensor` for a zero-copy hand-off and finds its JAX device.

    dtypes: those accepted (default: every dtype `to_jax` hands over; the caller's own
    rule where it is narrower, so that the message names only what is accepted).
    Returns the tensor (a fresh contiguous copy if `copy`) and its Place. Raises TypeError
    or ValueError naming `name` and the rule it broke.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        allowed = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
        raise ValueError(f"{name} must have dtype {allowed}, got {tensor.dtype}")
    if tensor.requires_grad:
        raise ValueError(f"{name} requires grad, which DLPack cannot carry: pass "
                         f"{name}.detach()")
    if tensor.layout is not torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {tensor.layout}")
    place = _places.get(tensor.device)
    if place is None:
        place = _places[tensor.device] = _new_place(tensor.device, name)
    if copy:
        return tensor.clone(memory_format=torch.contiguous_format), place
    if not tensor.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous (shape {tuple(tensor.shape)}, strides "
            f"{tensor.stride()}), so JAX cannot use its memory in place: pass copy=True to "
            f"copy it, or {name}.contiguous()")
    if tensor.data_ptr() % place.align:
        raise ValueError(
            f"{name}'s data pointer {tensor.data_ptr():#x} is not aligned to {place.align} "
            f"bytes, which JAX needs to use the memory in place on {tensor.device} (a view "
            "with a storage offset, such as x[1:], is the usual cause): pass copy=True")
    return tensor, place


def forward_only(tensor, name: str):
    """`tensor` as an input of a forward-only call (no gradient): refused (ValueError)
    where it requires grad while torch's grad mode is on, since the output could carry no
    graph; under torch.no_grad() or torch.inference_mode() detached, as DLPack needs."""
    if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad:
        return tensor
    if torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, but this call is forward only (it has no "
                         f"gradient): call it under torch.no_grad() or "
                         f"torch.inference_mode(), or pass {name}.detach()")
    return tensor.detach()


def _event(index: int) -> torch.cuda.Event:
    """This thread's reusable event on CUDA device `index` (a stream wait captures the
    event's latest record at the time of the wait, so reusing it is safe)."""
    events = _thread.__dict__.setdefault("events", {})
    event = events.get(index)
    if event is None:
        event = events[index] = torch.cuda.Event()
    return event


def jax_waits_for_torch(place: Place) -> None:
    """Makes JAX's external-buffer stream wait for the work queued so far on torch's
    current stream of `place`'s device. Nothing to do on the CPU."""
    if place.jax_stream is None:
        return
    event = _event(place.index)
    # torch.cuda.Event's C++ methods, without their Python wrappers
    # (docs/tuning.md: bridge-stream-order-event)
    torch._C._CudaEventBase.record(event, current_stream(place.index))
    torch._C._CudaEventBase.wait(event, place.jax_stream_torch)


def current_stream(index: int) -> torch.cuda.Stream:
    """torch's current stream on CUDA device `index`, its Python object cached by the raw
    stream pointer (building a new one per call is a measurable part of a hand-off)."""
    streams = _thread.__dict__.setdefault("streams", {})
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    stream = streams.get(key)
    if stream is None:
        stream = streams[key] = torch.cuda.current_stream(index)
    return stream


def view_in_jax(tensor: torch.Tensor, place: Place, ordered: bool = True) -> jax.Array:
    """The JAX array over `tensor`'s memory, for a tensor checked by `place_of`.

    ordered: the array's definition event is recorded on JAX's external-buffer stream, so
    JAX work reading it waits for what `jax_waits_for_torch` ordered before it. False:
    the array counts as ready at once, which saves host time (docs/tuning.md:
    bridge-unordered-views). Only for an array that is read solely by
    computations that also read an ordered one made after the same `jax_waits_for_torch`:
    a computation waits for every input's event before it starts.
    """
    return _jax.dlpack_managed_tensor_to_buffer(
        torch.utils.dlpack.to_dlpack(tensor), place.jax_device,
        place.jax_stream if ordered else None, False, place.dl_type)


def views_for_one_computation(place: Place, *tensors: torch.Tensor,
                              persistent: tuple[torch.Tensor, ...] = ()
                              ) -> tuple[jax.Array, ...]:
    """JAX arrays over `tensors`, then over `persistent` (all checked by `place_of`, all on
    `place`) for one JAX computation that reads them all: one stream-order step, the first
    view ordered and the others not. The computation waits for the first view's
    definition event, recorded after torch's work on every tensor, before it starts.

    persistent: tensors passed again and again (a cache's pages, a reused buffer): their
    unordered views are made once and reused while the tensor object lives with the same
    memory, shape and dtype (`persistent_view`), which is safe for the same reason."""
    first, *others = tensors
    jax_waits_for_torch(place)
    return (view_in_jax(first, place),
            *(view_in_jax(tensor, place, ordered=False) for tensor in others),
            *(persistent_view(tensor, place) for tensor in persistent))


def persistent_view(tensor: torch.Tensor, place: Place) -> jax.Array:
    """An unordered view of `tensor`, made once per tensor object and reused while its
    data pointer, shape and dtype stay the same. The view is made of an alias
    (`detach()`): torch keeps alive the Python object of a tensor exported to DLPack, so
    a view of `tensor` itself would keep `tensor`, and its entry, forever. The view holds
    the memory only, and the entry goes when the tensor object does."""
    key = (tensor.data_ptr(), tensor.shape, tensor.dtype)
    entry = _persistent.get(tensor)
    if entry is None or entry[0] != key:
        entry = _persistent[tensor] = (key, view_in_jax(tensor.detach(), place, ordered=False))
    return entry[1]


def to_jax(tensor: torch.Tensor, *, copy: bool = False) -> jax.Array:
    """The JAX array over `tensor`'s memory (a copy's memory if `copy=True`).

    tensor: any shape; bfloat16, float16, float32, int32 or bool; on the CPU or a CUDA
    device; contiguous and aligned unless `copy=True`. Returns the same shape and dtype on
    the matching JAX device. See the module docstring for the stream-order guarantee.
    """
    tensor, place = place_of(tensor, "tensor", copy)
    return views_for_one_computation(place, tensor)[0]


def _torch_index(array: jax.Array) -> int | None:
    """The CUDA device index torch uses for `array`'s device, None for the CPU (cached)."""
    if not isinstance(array, jax.Array):
        raise TypeError(f"array must be a jax.Array, got {type(array).__name__}")
    devices = array.sharding.device_set
    if len(devices) != 1:
        raise ValueError(f"array must live on one device to be handed to torch, it spans "
                         f"{len(devices)}: move it with jax.device_put(array, device)")
    (device,) = devices
    if device.platform not in ("cpu", "gpu"):
        raise ValueError(f"array must be on the CPU or a CUDA GPU, got {device}")
    index = device.local_hardware_id if device.platform == "gpu" else None
    _torch_indices[array.sharding] = index
    return index


def consumer_stream(index: int) -> int:
    """torch's current stream on CUDA device `index`, as a DLPack stream argument (the raw
    pointer; 1 for CUDA's legacy default stream, whose pointer is 0)."""
    return torch._C._cuda_getCurrentRawStream(index) or _LEGACY_DEFAULT_STREAM


def to_torch(array: jax.Array) -> torch.Tensor:
    """The torch tensor over `array`'s memory: same shape and dtype, on the same device.

    See the module docstring for the stream-order guarantee.
    """
    index = _torch_indices.get(getattr(array, "sharding", None), _UNKNOWN)
    if index is _UNKNOWN:
        index = _torch_index(array)
    stream = None if index is None else consumer_stream(index)
    # what torch.utils.dlpack.from_dlpack calls for a capsule, without its checks
    # (docs/tuning.md: bridge-dlpack-import)
    return torch._C._from_dlpack(_jax.buffer_to_dlpack_managed_tensor(array, stream))



def read_through_torch(array: jax.Array) -> np.ndarray:
    """The values of a single-device `array` on the host, as numpy (waiting for them):
    `to_torch` (ordered after JAX's work on torch's current stream), then torch's copy
    to the host, sooner than `jax.device_get` (docs/tuning.md: policy-read-through-torch).
    No JAX transfer happens, so JAX's transfer guards do not see it. On the
    CPU the array may be viewed in place: read it only."""
    return to_torch(array).cpu().numpy()
