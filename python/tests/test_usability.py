"""What a new user runs into: stream objects as torch and CuPy hand them out,
masked arrays, out of memory, absurd arguments, and errors that say what
happened."""
import numpy as np
import pytest

import gpufeed


class CudaStreamProtocol:
    """A stream as CuPy and recent PyTorch expose it: `__cuda_stream__`."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class TorchLikeStream:
    """A stream as PyTorch exposes it: `.cuda_stream`."""

    def __init__(self, handle):
        self.cuda_stream = handle


def test_foreign_stream_wait_takes_stream_objects_and_the_default_stream(device):
    stream = gpufeed.Stream(device)
    # 0 is the legacy default stream (torch's `current_stream()` before any
    # other is set), as a bare int and inside stream objects.
    for foreign in (0, 1, CudaStreamProtocol(0), TorchLikeStream(0), CudaStreamProtocol(1)):
        if device.kind == "cuda":
            gpufeed.foreign_stream_wait(stream, foreign)
        else:
            with pytest.raises(gpufeed.BackendUnavailableError):
                gpufeed.foreign_stream_wait(stream, foreign)
    with pytest.raises(TypeError, match="__cuda_stream__"):
        gpufeed.foreign_stream_wait(stream, "not a stream")
    with pytest.raises((ValueError, OverflowError)):
        gpufeed.foreign_stream_wait(stream, -5)


class MaskedCai:
    def __init__(self, mask):
        self.__cuda_array_interface__ = {
            "shape": (4,),
            "typestr": "<f4",
            "data": (0x10000, False),
            "version": 3,
            "strides": None,
            "stream": None,
            "mask": mask,
        }


def test_masked_cuda_array_interface_is_refused(device):
    with pytest.raises(BufferError, match="mask"):
        gpufeed.as_device_array(MaskedCai((0x20000, False)), device)


def test_out_of_memory_is_a_memory_error(device):
    assert issubclass(gpufeed.OutOfMemoryError, MemoryError)
    assert issubclass(gpufeed.OutOfMemoryError, gpufeed.GpuFeedError)
    with pytest.raises(gpufeed.OutOfMemoryError) as e:
        device.empty((1 << 58,), "float32")  # 2^60 bytes of device memory
    assert e.value.kind == "OutOfMemory"
    assert "device memory" in str(e.value)
    with pytest.raises(MemoryError):
        gpufeed.PinnedAllocator(device).alloc((1 << 58,), "float32")
    # Still usable afterwards.
    device.empty((16,), "float32")


def test_absurd_stream_counts_are_refused(device):
    with pytest.raises(gpufeed.InvalidArgumentError, match="streams"):
        gpufeed.Pipeline(device, streams=65)
    with pytest.raises(gpufeed.InvalidArgumentError, match="streams"):
        gpufeed.Pipeline(device, streams=1 << 40)
    assert gpufeed.Pipeline(device, streams=64).streams == 64


def test_compare_sync_async_refuses_zero_reps(device):
    with pytest.raises(gpufeed.InvalidArgumentError, match="reps"):
        gpufeed.compare_sync_async(1024, device, reps=0)


def test_run_info_reports_the_chunks_that_ran(device):
    x = gpufeed.PinnedAllocator(device).alloc((1,), "float32")
    y = gpufeed.PinnedAllocator(device).alloc((1,), "float32")
    info = gpufeed.Pipeline(device, streams=4).run(x, y, kernel="scale", arg=2.0, plan=8)
    assert info["chunks"] == 1


def test_copy_length_mismatch_counts_elements(device):
    src = gpufeed.PinnedAllocator(device).alloc((4,), "float64")
    dst = device.empty((3,), "float64")
    with pytest.raises(gpufeed.LengthMismatchError, match="expected 4 elements, got 3"):
        gpufeed.Stream(device).submit(("h2d", src, dst))



def test_negative_counts_are_value_errors_everywhere(device):
    with pytest.raises(ValueError, match="not a count"):
        gpufeed.Device("cpu", ordinal=-1)
    with pytest.raises(ValueError, match="not a count"):
        gpufeed.Pipeline(device, streams=-1)
    with pytest.raises(ValueError, match="not a count"):
        gpufeed.compare_sync_async(-5, device)
    d = device.empty((8,), "float32")
    s = gpufeed.Stream(device)
    for bad in (lambda: s.intensity(d, -1), lambda: s.submit(("intensity", d, -1))):
        with pytest.raises(ValueError, match="not a count"):
            bad()
    with pytest.raises(ValueError, match="2\\*\\*32"):
        s.intensity(d, 2**32)
    assert d.state == "ready"  # nothing refused took it
    for shape in [-1, (4, -2)]:
        with pytest.raises(ValueError, match="not a count"):
            device.empty(shape, "float32")
        with pytest.raises(ValueError, match="not a count"):
            gpufeed.PinnedAllocator(device).alloc(shape, "float32")


def test_an_exception_from_a_shapes_own_index_propagates(device):
    class Bad:
        def __index__(self):
            raise KeyError("from __index__")

    with pytest.raises(KeyError, match="from __index__"):
        gpufeed.PinnedAllocator(device).alloc((Bad(),), "float32")
    with pytest.raises(TypeError):
        device.empty("12", "float32")  # a str is not a shape
    assert device.empty(np.int64(3), "float32").shape == (3,)


def test_every_error_class_carries_its_kind_however_it_was_raised(device):
    for name, kind in [("BackendUnavailableError", "BackendUnavailable"),
                       ("InvalidArgumentError", "InvalidArgument"), ("InternalError", "Internal"),
                       ("OutOfMemoryError", "OutOfMemory"), ("GpuFeedError", "Other")]:
        assert getattr(gpufeed, name).kind == kind
    if device.kind == "cpu":
        # Raised directly by gpufeed, not from a Rust error: still has .kind.
        with pytest.raises(gpufeed.BackendUnavailableError) as e:
            gpufeed.as_device_array(np.zeros(3), device)
        assert e.value.kind == "BackendUnavailable"
