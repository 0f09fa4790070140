//! Block-level kernels through the library's launch API on the CPU
//! emulation: a 3-D block with dynamic shared memory exchanging through a
//! barrier computes every element; a barrier some threads skip and a shared
//! index out of bounds are `Error::KernelFault` naming the kernel (never a
//! hang), and the context is broken afterwards, as after a GPU fault.

use gpufeed::kernel_abi::{kernels, shared, shared_array, thread, SliceMut};
use gpufeed::{block_on, Device, DeviceBuffer, Error, LaunchConfig, Module, Stream};
use std::time::Duration;

kernels! {
    /// Each block reverses its 256 elements of `y` through dynamic shared
    /// memory: every thread writes its slot, the barrier, then every thread
    /// reads its mirror's.
    ///
    /// # Safety
    /// `y` holds 256 elements a block.
    pub unsafe fn reverse_blocks(y: SliceMut<u32>) {
        let s = shared::dynamic::<u32>();
        let t = thread::linear_thread_idx() as usize;
        let n = thread::block_threads() as usize;
        let base = thread::block_idx() as usize * n;
        // SAFETY: base + t < y.len() by the contract; one thread an index.
        s.set(t, unsafe { y.read(base + t) });
        thread::sync_threads();
        // SAFETY: as above.
        unsafe { y.write(base + t, s.get(n - 1 - t)) };
    }

    /// Threads below 16 return before the barrier the others wait at.
    ///
    /// # Safety
    /// None needed: it touches no memory.
    pub unsafe fn divergent_barrier() {
        if thread::thread_idx() < 16 {
            return;
        }
        thread::sync_threads();
    }

    /// Reads one past the end of a 32-element shared array.
    ///
    /// # Safety
    /// None needed: the index is checked (the fault is the test).
    pub unsafe fn shared_past_the_end(y: SliceMut<f32>) {
        let s = shared_array!(f32, 32);
        let t = thread::thread_idx() as usize;
        s.set(t % 32, 1.0);
        thread::sync_threads();
        let v = s.get(t + 1);
        if t < y.len() {
            // SAFETY: t < y.len().
            unsafe { y.write(t, v) };
        }
    }
}

/// Runs `f` on its own thread and fails the test if it takes past the bound
/// (a hang would otherwise hold the suite forever).
fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(120))
        .expect("the launch did not finish within 120 s: a hang")
}

fn module(device: &Device) -> Module {
    // SAFETY: on the CPU emulation no PTX is loaded; the declarations' own
    // host bodies run.
    unsafe { Module::from_ptx(device, "") }.unwrap()
}

#[test]
fn a_three_d_block_with_dynamic_shared_memory_reverses_every_block() {
    let device = Device::cpu();
    let f = module(&device).function::<reverse_blocks>().unwrap();
    let blocks = 37usize;
    let n = blocks * 256;
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    let input: Vec<u32> = (0..n).map(|_| rng.u32(..)).collect();
    let mut y = DeviceBuffer::<u32>::new(&device, n).unwrap();
    y.copy_from_host_sync(&input).unwrap();
    let stream = Stream::new(&device).unwrap();
    // 256 threads as 8 x 4 x 8; 1 KiB of dynamic shared memory a block.
    let cfg = LaunchConfig::new(blocks as u32, (8, 4, 8)).with_shared_bytes(256 * 4);
    let (mut y, ()) = block_on(stream.run(y, |c, y| c.launch(&f, cfg, (y.view_mut(),)))).unwrap();
    let mut out = vec![0xdead_beefu32; n];
    y.copy_to_host_sync(&mut out).unwrap();
    for b in 0..blocks {
        for t in 0..256 {
            assert_eq!(
                out[b * 256 + t],
                input[b * 256 + 255 - t],
                "block {b}, thread {t}"
            );
        }
    }
}

#[test]
fn a_barrier_some_threads_skip_is_a_kernel_fault_not_a_hang() {
    let device = Device::cpu();
    let f = module(&device).function::<divergent_barrier>().unwrap();
    let stream = Stream::new(&device).unwrap();
    let (e, after) = bounded(move || {
        let r = block_on(stream.run((), |c, ()| c.launch(&f, LaunchConfig::linear(4, 64), ())));
        let e = r.expect_err("a divergent barrier is a fault").error;
        let after = block_on(stream.run((), |_, ()| Ok(()))).map(|_| ());
        (e, after)
    });
    match e {
        Error::KernelFault { kernel, reason } => {
            assert_eq!(kernel, "divergent_barrier");
            assert!(reason.contains("barrier"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // The context is broken for good, as a GPU's would be.
    assert!(
        matches!(after, Err(ref e) if matches!(e.error, Error::ContextBroken(_))),
        "{after:?}"
    );
}

#[test]
fn a_shared_index_past_the_end_is_a_kernel_fault_naming_the_kernel() {
    let device = Device::cpu();
    let f = module(&device).function::<shared_past_the_end>().unwrap();
    let stream = Stream::new(&device).unwrap();
    let y = DeviceBuffer::<f32>::new(&device, 32).unwrap();
    let e = bounded(move || {
        block_on(stream.run(y, |c, y| {
            c.launch(&f, LaunchConfig::linear(1, 32), (y.view_mut(),))
        }))
        .expect_err("index 32 of 32 is out of bounds")
    });
    match &e.error {
        Error::KernelFault { kernel, reason } => {
            assert_eq!(*kernel, "shared_past_the_end");
            assert!(reason.contains("shared"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(e.bundle.is_some(), "the buffer comes back");
}
