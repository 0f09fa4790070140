"""What an adversarial probe of the Python API found, each now a
test: the garbage collector running inside a buffer's own method, NumPy
replacing a pinned array's memory, weak references and PickleBuffers reaching
memory in flight, one buffer in two roles of a batch, a second waiter, and
drops that must not hold the GIL. On any backend (the CPU emulation in CI)."""
import asyncio
import contextlib
import gc
import pickle
import threading
import time
import weakref

import numpy as np
import pytest

import gpufeed


def _long_work(device):
    """(elements, intensity) of an `intensity` kernel that takes a few hundred
    milliseconds on this backend (the emulation is some 10^4 times slower)."""
    return (1 << 22, 2_000_000) if device.kind == "cuda" else (1 << 18, 1500)


@contextlib.contextmanager
def _gc_every(allocations):
    """Collects garbage every `allocations` allocations inside the block."""
    old = gc.get_threshold()
    gc.set_threshold(allocations)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def _cycle(obj):
    """Makes `obj` reachable only from a garbage cycle."""
    c = [obj]
    c.append(c)


def test_an_operation_collected_inside_a_buffer_getter_hands_the_buffers_back(device, alloc):
    s = gpufeed.Stream(device)
    keep, bufs = [], []
    gc.collect()
    with _gc_every(3):
        for _ in range(60):
            x = alloc.alloc((16,), "float32", zero=True)
            d = device.empty((16,), "float32")
            bufs.append((x, d))
            _cycle(s.copy_h2d(x, d))
            for _ in range(5):
                keep.append(x.shape)  # the collector runs inside this getter
    gc.collect()
    s.synchronize()
    # A dropped operation's buffers read as freed (or came back): never stuck.
    assert not [x for x, d in bufs if x.state == "in-flight" or d.state == "in-flight"]


def test_a_view_collected_inside_a_getter_is_released(alloc):
    keep, bufs = [], []
    gc.collect()
    with _gc_every(3):
        for _ in range(40):
            x = alloc.alloc((16,), "float32", zero=True)
            bufs.append(x)
            _cycle(x.get_array())
            for _ in range(5):
                keep.append(x.shape)
    gc.collect()
    assert {b.exports for b in bufs} == {0}
    for b in bufs:
        b.free()


def test_a_pinned_array_whose_memory_numpy_replaced_is_refused_not_read():
    x = np.ones(1 << 16, np.float32)
    pb = gpufeed.pin(x)
    # ndarray.__setstate__ frees the data under a live export.
    x.__setstate__((1, (4,), np.dtype(np.float32), False, b"\0" * 16))
    del x
    with pytest.raises(BufferError, match="replaced or freed"):
        pb.get_array()
    with pytest.raises(BufferError):
        np.asarray(pb)
    assert pb.state == "freed"


def test_weak_references_to_a_pinned_array_block_operations(device):
    s = gpufeed.Stream(device)
    d = device.empty((1024,), "float32")
    d.upload(np.full(1024, 7.0, np.float32))
    x = np.zeros(1024, np.float32)
    w = weakref.ref(x)
    pb = gpufeed.pin(x)
    del x
    with pytest.raises(BufferError, match="weak references"):
        s.copy_d2h(d, pb)
    assert pb.state == "ready"
    del w
    s.copy_d2h(d, pb).wait()
    assert (pb.get_array() == 7.0).all()


def test_a_pickle_buffer_cannot_be_pinned(device):
    ba = bytearray(4096)
    with pytest.raises(BufferError, match="PickleBuffer"):
        gpufeed.pin(pickle.PickleBuffer(ba))


def test_one_pinned_buffer_as_source_and_destination_of_a_batch_is_refused_up_front(device, alloc):
    s = gpufeed.Stream(device)
    x = alloc.alloc((4,), "float32")
    x.get_array()[:] = 1.0
    d = device.empty((4,), "float32")
    d2 = device.empty((4,), "float32")
    d2.upload(np.full(4, 5.0, np.float32))
    with pytest.raises(ValueError, match="source and a copy's destination"):
        s.submit(("d2h", d2, x), ("h2d", x, d))
    with pytest.raises(ValueError, match="source and a copy's destination"):
        s.submit(("h2d", x, d), ("scale", d, 2.0), ("d2h", d, x))
    # Nothing ran: the buffer is as it was, and usable.
    assert x.state == "ready" and (x.get_array() == 1.0).all()
    s.submit(("h2d", x, d), ("scale", d, 2.0)).wait()
    s.submit(("d2h", d, x)).wait()
    assert (x.get_array() == 2.0).all()


def test_a_second_waiter_waits_for_the_first(device, alloc):
    s = gpufeed.Stream(device)

    async def aw(op):
        return await op

    async def main():
        n, k = _long_work(device)
        x = alloc.alloc((n,), "float32", zero=True)
        d = device.empty((n,), "float32")
        op = s.submit(("h2d", x, d), ("intensity", d, k))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(aw(op), 0.01)
        op.wait()  # the executor still waits: this waits with it
        assert x.state == "ready" and op.done()

    asyncio.run(main())


def test_dropping_a_stream_or_pipeline_never_holds_the_gil(device, alloc):
    n, k = _long_work(device)
    x = alloc.alloc((n,), "float32", zero=True)
    y = alloc.alloc((n,), "float32")
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.002)

    t = threading.Thread(target=ticker, daemon=True)
    t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    # A temporary pipeline: its Python object goes at once, the run goes on.
    op = gpufeed.Pipeline(device).run_async(x, y, kernel="intensity", arg=k)
    issued = time.monotonic() - t0
    op.wait()
    total = time.monotonic() - t0
    s = gpufeed.Stream(device)
    d = device.empty((n,), "float32")
    op2 = s.submit(("h2d", x, d), ("intensity", d, k))
    del s  # the operation keeps the stream: nothing waits here
    op2.wait()
    stop.set()
    t.join()
    assert x.state == "ready" and y.state == "ready"
    gaps = [b - a for a, b in zip(ticks, ticks[1:]) if a >= t0]
    # The run was not waited for when the temporary pipeline went, and the
    # other thread ran while the work did (the GIL was never held for it).
    assert total > 0.2, total  # long enough to tell
    assert issued < total / 2, (issued, total)
    assert gaps and max(gaps) < total / 2, (max(gaps), total)


def test_a_subclass_cannot_hide_whose_memory_it_pins(device):
    class Hides(np.ndarray):
        base = None  # hides the array the memory belongs to

    owner = np.arange(1024, dtype=np.float32)
    with pytest.raises(BufferError, match="subclass"):
        gpufeed.pin(owner.view(Hides), device)
    with pytest.raises(BufferError, match="subclass"):
        gpufeed.pin(np.arange(8, dtype=np.float32).view(Hides), device)


def test_the_garbage_collector_hands_out_nothing_that_reaches_memory_in_flight(device):
    n = 1 << 16
    b = gpufeed.pin(np.zeros(n, np.float32), device)
    d = device.empty((n,), "float32")
    d.upload(np.ones(n, np.float32))
    op = gpufeed.Stream(device).copy_d2h(d, b)
    found = [
        o for o in gc.get_objects()
        if (isinstance(o, memoryview) and o.nbytes == 4 * n)
        or (isinstance(o, np.ndarray) and o.size == n and o.dtype == np.float32)
    ]
    assert not found, found
    op.wait()
    assert (b.get_array() == 1.0).all()


def test_upload_reads_the_source_with_the_gil_held(device):
    n = 1 << 22
    d = device.empty((n,), "float32")
    a = np.ones(n, np.float32)
    swapped = threading.Event()

    def swap():
        time.sleep(0.001)
        a.__setstate__((1, (4,), np.dtype(np.float32), False, b"\0" * 16))
        swapped.set()

    t = threading.Thread(target=swap)
    t.start()
    # The swap lands before or after upload() reads `a`, never during it: either
    # every element arrives, or the 16-byte array is refused as too short.
    try:
        d.upload(a)
        uploaded = True
    except ValueError as e:
        assert "upload of 16 bytes" in str(e), e
        uploaded = False
    t.join()
    assert swapped.is_set()
    if uploaded:
        assert (d.download() == 1.0).all()


def test_shapes_whose_strides_overflow_are_refused(device, alloc):
    for shape in [(0, 2**33, 2**33), (2**62, 2**62, 0)]:
        with pytest.raises(ValueError, match="overflows"):
            alloc.alloc(shape, "uint8")
        with pytest.raises(ValueError, match="overflows"):
            device.empty(shape, "uint8")


def test_views_are_counted_by_objects_nobody_can_release_early(alloc):
    b = alloc.alloc((1 << 12,), "float32")
    arr = b.get_array()
    assert isinstance(arr.base, gpufeed.PinnedView)
    with pytest.raises(AttributeError):
        arr.base.release()  # a memoryview base could be released under `arr`
    with pytest.raises(TypeError):
        memoryview(b)  # no buffer protocol: NumPy views of a memoryview outlive its release
    with pytest.raises(BufferError, match="live view"):
        b.free()
    sub = arr[10:20]
    del arr
    with pytest.raises(BufferError, match="live view"):
        b.free()  # the slice keeps the view
    del sub
    assert b.exports == 0
    # A DLPack consumer's array keeps a counted view too.
    t = np.from_dlpack(b)
    with pytest.raises(BufferError, match="live view"):
        b.free()
    assert not [o for o in gc.get_objects() if isinstance(o, memoryview)
                and getattr(o, "obj", None) is b]
    del t
    gc.collect()
    b.free()
    assert b.state == "freed"


def test_a_big_endian_dtype_object_is_refused_not_misread(device, alloc):
    for dt in [np.dtype(">f4"), np.dtype(">i4")]:
        with pytest.raises(TypeError, match="byte order"):
            device.empty((4,), dt)
        with pytest.raises(TypeError, match="byte order"):
            alloc.alloc((4,), dt)


def test_an_mmap_cannot_be_pinned(device):
    import mmap
    m = mmap.mmap(-1, 4096)
    with pytest.raises(TypeError, match="mmap"):
        gpufeed.pin(m, device)


def test_a_pipeline_refuses_buffers_of_another_device():
    d1 = gpufeed.Device("cpu")
    d2 = gpufeed.Device("auto")  # another device (the GPU, or another emulated one)
    x = gpufeed.PinnedAllocator(d2).alloc((1024,), "float32")
    y = gpufeed.PinnedAllocator(d1).alloc((1024,), "float32")
    out = d2.empty((1024,), "float32")
    pipe = gpufeed.Pipeline(d1)
    with pytest.raises(gpufeed.InvalidArgumentError, match="another device"):
        pipe.run(x, y)
    with pytest.raises(gpufeed.InvalidArgumentError, match="another device"):
        pipe.run(y, out)
    assert x.state == y.state == out.state == "ready"


def test_a_forked_child_gets_errors_from_the_parents_streams_not_a_hang(device, alloc):
    import os
    import sys
    if device.kind != "cpu":
        pytest.skip("CUDA does not survive fork(); the CPU emulation's streams are checked")
    s = gpufeed.Stream(device)
    x = alloc.alloc((1024,), "float32", zero=True)
    d = device.empty((1024,), "float32")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            try:
                s.copy_h2d(x, d).wait()
                code = 3  # the parent's stream ran in the child?
            except gpufeed.InvalidArgumentError:
                pass
            # A stream of the child's own works.
            s2 = gpufeed.Stream(device)
            s2.copy_h2d(x, d).wait()
            del s2, s  # dropping the parent's stream in the child joins nothing
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(w, repr(e).encode())
            code = 4
        os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    err = os.read(r, 4096).decode()
    os.close(r)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, err)


def test_no_python_code_runs_under_a_buffers_lock(device):
    import builtins
    s = gpufeed.Stream(device)
    d = device.empty((1024,), "float32")
    buf = gpufeed.pin(np.zeros(1024, np.float32), device)
    seen = []
    real = builtins.__import__

    def traced(name, *a, **k):
        seen.append(buf.state)  # would wait for the lock the caller holds
        return real(name, *a, **k)

    builtins.__import__ = traced
    try:
        for _ in range(5):
            s.submit(("h2d", buf, d)).wait()
    finally:
        builtins.__import__ = real
    assert buf.state == "ready"


def test_the_default_plan_fits_a_pipeline_of_any_stream_count(device, alloc):
    n = 1 << 20
    x = alloc.alloc((n,), "float32")
    x.get_array()[:] = np.arange(n, dtype=np.float32)
    y = alloc.alloc((n,), "float32")
    for streams in (1, 2, 3, 4):
        info = gpufeed.Pipeline(device, streams=streams).run(x, y, kernel="scale", arg=2.0)
        assert info["streams"] <= streams, info
        assert (y.get_array() == x.get_array() * np.float32(2.0)).all()


def test_a_forked_child_waiting_for_the_parents_operation_gets_an_error(device, alloc):
    import os
    if device.kind != "cpu":
        pytest.skip("CUDA does not survive fork(); the CPU emulation's streams are checked")
    n, k = _long_work(device)
    d = device.empty((n,), "float32")
    op = gpufeed.Stream(device).submit(("intensity", d, k))
    pid = os.fork()
    if pid == 0:
        code = 5
        try:
            op.wait()
            code = 3  # the parent's work completed in the child?
        except gpufeed.InvalidArgumentError:
            code = 0
        except BaseException:  # noqa: BLE001
            code = 4
        os._exit(code)
    op.wait()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert d.state == "ready"


def test_float_and_int_are_64_bit_as_numpy_reads_them(device, alloc):
    for dt, want in [(float, "float64"), ("float", "float64"), (int, "int64"), ("int", "int64")]:
        b = alloc.alloc(3, dt)
        assert b.dtype == want == np.dtype(dt).name, (dt, b.dtype)
        a = np.asarray(b)
        a[:] = np.array([1 / 3, 2**40 + 1, 16777217], dtype=np.dtype(dt))
        assert a.tolist() == np.array([1 / 3, 2**40 + 1, 16777217], dtype=np.dtype(dt)).tolist()
        del a
        assert device.empty(3, dt).dtype == want


def test_a_finalizer_that_replaces_a_pinned_arrays_memory_mid_submit_is_caught(device):
    # The garbage collector can run finalizers inside any call into Python
    # the library makes while checking a buffer; the memory check comes
    # after every such call, so a finalizer that frees the pinned memory
    # there is seen and the operation refused, never run on freed memory.
    s = gpufeed.Stream(device)
    n = 4096
    d = device.empty((n,), "float32")
    d.upload(np.full(n, 7, np.float32))
    fired = []

    class Bomb:
        def __init__(self, arr):
            self.arr, self.me = arr, self  # a reference cycle

        def __del__(self):
            self.arr.resize((1,), refcheck=False)  # frees the pinned memory
            fired.append(1)
            self.arr = None

    old = gc.get_threshold()
    try:
        for k in range(1, 40):
            # The last buffer holds its pinned range until dropped, even once
            # the finalizer freed the memory: NumPy may give it to the next x.
            buf = None
            x = np.ones(n, np.float32)
            buf = gpufeed.pin(x, device)
            gc.collect()
            gc.set_threshold(k)
            Bomb(x)
            del x
            fired.clear()
            try:
                op = s.submit(("d2h", d, buf))
            except BufferError:
                continue  # seen: refused
            finally:
                gc.set_threshold(*old)
            op.wait()
            # Accepted: then the memory was still the array's when it was taken.
            assert not fired, f"threshold {k}: the finalizer freed the memory, yet it ran"
            gc.collect()
    finally:
        gc.set_threshold(*old)


def test_rebinding_numpy_or_weakref_later_changes_no_check(device):
    import weakref
    real_ndarray, real_count = np.ndarray, weakref.getweakrefcount
    owner = np.zeros(64, np.float32)

    class Sub(np.ndarray):
        pass

    np.ndarray = Sub
    try:
        with pytest.raises(BufferError):
            gpufeed.pin(owner[:].view(Sub), device)
    finally:
        np.ndarray = real_ndarray
    keep = []
    x = np.zeros(64, np.float32)
    pb = gpufeed.pin(x, device)

    def sneaky(o):
        keep.append(weakref.ref(o))
        return real_count(o)

    weakref.getweakrefcount = sneaky
    try:
        s = gpufeed.Stream(device)
        d = device.empty((64,), "float32")
        del x
        s.copy_d2h(d, pb).wait()  # the library's own count, not the rebound one
        assert not keep
    finally:
        weakref.getweakrefcount = real_count


def test_a_finalizer_that_makes_the_array_a_view_of_bytes_mid_pin_is_caught(device):
    # A finalizer run by the garbage collector inside pin() turns the array
    # into a view of a bytes object the user keeps: the pin, or the first
    # operation, must refuse it; the device never writes the bytes.
    n = 4096
    b = bytes(n)
    s = gpufeed.Stream(device)
    d = device.empty((n,), "uint8")
    d.upload(np.full(n, 0xAB, np.uint8))
    box = []

    class G:
        def __del__(self):
            if box:
                box.pop().__setstate__((1, (n,), np.dtype(np.uint8), False, b))

    old = gc.get_threshold()
    try:
        for off in range(0, 6):
            x = np.zeros(n, np.uint8)
            box[:] = [x]
            g = G()
            g.cycle = g
            del g
            gc.set_threshold(gc.get_count()[0] + off)
            try:
                buf = gpufeed.pin(x, device)
            except BufferError:
                continue
            finally:
                gc.set_threshold(*old)
                gc.collect()
            del x
            try:
                s.submit(("d2h", d, buf)).wait()
            except BufferError:
                pass
            assert b == bytes(n), f"offset {off}: the device wrote an immutable bytes object"
    finally:
        gc.set_threshold(*old)
