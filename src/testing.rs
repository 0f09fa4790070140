//! Test support: the devices every test body runs against, random data and
//! bit-exact verification. Not part of the API (behind the `hooks` feature,
//! hidden from the docs): the crate's own tests and demonstration use it.

use crate::backend::cuda::{CudaBackend, DeviceMemory, WaitMode};
use crate::runtime::device::Device;
use crate::runtime::kernel::Kernel;
use std::sync::Arc;

/// Device frees deferred to another thread and not yet done.
pub fn parked_device_frees(device: &Device) -> usize {
    device.backend.parked_frees()
}

/// Bytes allocated from the device's stream-ordered pool and not yet
/// freed (`None` without one).
pub fn ordered_bytes_in_use(device: &Device) -> Option<u64> {
    device.backend.ordered_bytes_in_use()
}

/// Whether `REQUIRE_GPU=1` is set: GPU tests must then run, not skip.
pub fn gpu_required() -> bool {
    std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The CUDA device; a panic when it does not open (see [`or_skip`]).
pub fn cuda(test: &str) -> Option<Device> {
    let opened = CudaBackend::new(0, WaitMode::default(), DeviceMemory::default())
        .map(|b| Device::wrap(Arc::new(b), "test".into()));
    or_skip(test, opened)
}

/// What opening a GPU gave; a panic when it failed. The rule of every GPU
/// test: it is ignored (`#[cfg_attr(not(host_gpu), ignore)]`) where the
/// building machine shows no GPU and `REQUIRE_GPU=1` is not set, so it is
/// reported as ignored, never as passed; a GPU test that runs anyway
/// (`--include-ignored`, or a GPU gone since the build) fails without one
/// instead of passing unchecked. Always `Some` when it returns.
pub fn or_skip<T>(test: &str, opened: crate::base::error::Result<T>) -> Option<T> {
    match opened {
        Ok(v) => Some(v),
        Err(e) => panic!(
            "{test}: no CUDA device ({e}). GPU tests are ignored on a machine without \
             a GPU; run without --include-ignored there{}",
            if gpu_required() {
                " (REQUIRE_GPU=1 is set)"
            } else {
                ""
            }
        ),
    }
}

/// Test bodies that use the GPU run one at a time in a process: a test
/// holding a GPU-side gate closed must not share the device with another
/// test's `cuMemFree`, which waits for the whole device to go idle (and so
/// for the gate) while holding driver locks the first test may need.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Opens `gate` after 20 s if the test has not, so a failing test fails
/// instead of hanging the suite. Dropping the guard disarms it.
///
/// The thread holds the gate weakly: holding it (and so its device) would
/// make this thread the device's last owner once the test ends, tearing
/// the CUDA context down on its own schedule, even while the process
/// exits (heap corruption at exit under compute-sanitizer).
pub fn watchdog(gate: &Arc<crate::runtime::memory::MappedFlag>) -> Watchdog {
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (a, g) = (armed.clone(), Arc::downgrade(gate));
    std::thread::spawn(move || {
        for _ in 0..200 {
            std::thread::sleep(std::time::Duration::from_millis(100));
            if !a.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
        }
        if let Some(g) = g.upgrade() {
            eprintln!("watchdog: opening a gate the test left closed");
            g.set(1);
        }
    });
    Watchdog(armed)
}

/// Disarms its watchdog on drop.
pub struct Watchdog(Arc<std::sync::atomic::AtomicBool>);

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Defines a test body once and runs it as one test per backend: for each
/// `name`, a function `fn name(device: gpufeed::Device)` written next to the
/// invocation becomes the tests `name::cpu` (the CPU emulation, always) and
/// `name::cuda`, so each backend's result is reported on its own.
///
/// `name::cuda` is ignored unless the machine that built the tests has a GPU
/// (`host_gpu`, set by the build script), so without one it shows as ignored,
/// never as passed. Run anyway (`--include-ignored`), it opens CUDA with
/// [`cuda`](crate::testing::cuda), which fails the test without a GPU.
///
/// ```text
/// gpufeed::backend_tests!(round_trips_keep_every_bit);
/// fn round_trips_keep_every_bit(device: gpufeed::Device) {
///     let _serial = gpufeed::testing::serial();
///     // ...
/// }
/// ```
#[macro_export]
#[doc(hidden)]
macro_rules! backend_tests {
    ($($name:ident),+ $(,)?) => {$(
        mod $name {
            #[test]
            fn cpu() {
                $crate::testing::run_on(|| Some($crate::Device::cpu()), super::$name);
            }

            #[test]
            #[cfg_attr(
                not(host_gpu),
                ignore = "needs a CUDA GPU (build on a GPU machine, or run with --include-ignored)"
            )]
            fn cuda() {
                $crate::testing::run_on(
                    || $crate::testing::cuda(module_path!()),
                    super::$name,
                );
            }
        }
    )+};
}

/// Runs `body` on the device `open` gives, if any (the two halves of
/// `backend_tests!`). The device is opened, and its last handle dropped,
/// under [`serial`], as in a test that holds it around its whole body: a
/// CUDA context's teardown must not meet another test's closed gate.
pub fn run_on(open: impl FnOnce() -> Option<Device>, body: impl FnOnce(Device)) {
    let device = {
        let _serial = serial();
        open()
    };
    let Some(device) = device else { return };
    body(device.clone());
    let _serial = serial();
    drop(device);
}

/// Fresh random floats in [-1, 1), never zero.
pub fn random_floats(out: &mut [f32], seed: u64) {
    let mut rng = fastrand_lite(seed);
    for v in out {
        let x = rng();
        *v = if x == 0.0 { 0.5 } else { x };
    }
}

/// A small xorshift generator: the library needs random test data without
/// pulling a dependency into users' builds.
fn fastrand_lite(seed: u64) -> impl FnMut() -> f32 {
    // Scramble the seed (splitmix64's finalizer): a small seed fed straight to
    // xorshift gives a long run of values near -1.0 before it mixes.
    let mut s = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    s = (s ^ (s >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    s = (s ^ (s >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let mut s = (s ^ (s >> 31)) | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// What `kernel` gives for `x`, written out here as plain arithmetic,
/// independently of the kernel crate's code (which the CPU emulation runs, so
/// comparing with it would not catch a wrong kernel): `scale` is `x * s`, one
/// rounding; `intensity` is `k` fused multiply-adds `x = x * 0.9999 + 1e-4`
/// (one rounding each, `f32::mul_add`, as `fma.rn.f32` on the GPU).
pub fn expected(kernel: Kernel, x: f32) -> f32 {
    match kernel {
        Kernel::Scale { s } => x * s,
        Kernel::Intensity { k } => {
            let mut v = x;
            for _ in 0..k {
                v = v.mul_add(0.9999, 1.0e-4);
            }
            v
        }
    }
}

/// Above this many kernel operations (elements times `k`), [`verify`]
/// checks a sample instead of every element.
pub const FULL_CHECK_WORK: u64 = 4_000_000_000;
/// Elements at each end of the array a sampled check covers.
pub const SAMPLE_ENDS: usize = 4096;
/// Further elements a sampled check covers, drawn uniformly over the array.
pub const SAMPLE_RANDOM: usize = 1_000_000;

/// Fills `out` with all-ones bytes (a NaN for `f32`, `f64` and bf16, the
/// largest value of an unsigned integer) before a run whose result is
/// checked: an element the run failed to write then cannot hold the right
/// answer left there by an earlier run (a pooled block handed back, the same
/// output reused). On all CPU threads.
pub fn poison<T: bytemuck::Pod + Send>(out: &mut [T]) {
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let chunk = bytes.len().div_ceil(threads).max(1 << 16);
    std::thread::scope(|s| {
        for c in bytes.chunks_mut(chunk) {
            s.spawn(move || c.fill(0xFF));
        }
    });
}

/// Checks `output` against [`expected`] of `kernel` on `input`, bit for bit,
/// on all CPU threads: `(elements checked, mismatches)`.
///
/// Every element is checked when `n * k` is at most [`FULL_CHECK_WORK`]
/// (`k` = 1 for `scale`). Above it (heavy `intensity` settings, whose CPU
/// reference would take minutes), the first and last [`SAMPLE_ENDS`] elements
/// and [`SAMPLE_RANDOM`] indices drawn uniformly from the whole array (a
/// 64-bit generator, so every index can be drawn) are checked, and
/// `elements checked` says how many: less than the output's length.
pub fn verify(kernel: Kernel, input: &[f32], output: &[f32]) -> (usize, usize) {
    let n = input.len().min(output.len());
    let wrong = |i: usize| expected(kernel, input[i]).to_bits() != output[i].to_bits();
    if work(kernel, n) <= FULL_CHECK_WORK {
        return (n, count_parallel(n, |r| r.filter(|&i| wrong(i)).count()));
    }
    let indices = sample_indices(n);
    let bad = count_parallel(indices.len(), |r| r.filter(|&j| wrong(indices[j])).count());
    (indices.len(), bad)
}

/// Kernel operations of `kernel` over `n` elements.
fn work(kernel: Kernel, n: usize) -> u64 {
    match kernel {
        Kernel::Intensity { k } => n as u64 * k.max(1) as u64,
        Kernel::Scale { .. } => n as u64,
    }
}

/// The indices a sampled check covers (see [`verify`]).
fn sample_indices(n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n.min(SAMPLE_ENDS))
        .chain(n.saturating_sub(SAMPLE_ENDS)..n)
        .collect();
    let mut s: u64 = 0x9E37_79B9_7F4A_7C15;
    v.extend((0..SAMPLE_RANDOM).map(|_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        // The high bits times n: uniform over 0..n for any n below 2^64.
        ((s as u128 * n as u128) >> 64) as usize
    }));
    v
}

/// `count` over `0..len` cut into one range per CPU thread, summed. A thread
/// that panicked counts as `len` mismatches.
fn count_parallel(len: usize, count: impl Fn(std::ops::Range<usize>) -> usize + Sync) -> usize {
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let chunk = len.div_ceil(threads).max(1);
    let count = &count;
    std::thread::scope(|s| {
        (0..len)
            .step_by(chunk)
            .map(|a| s.spawn(move || count(a..(a + chunk).min(len))))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap_or(len))
            .sum()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_floats_spread_from_the_first_value_even_for_small_seeds() {
        for seed in [0u64, 1, 3, 5] {
            let mut v = vec![0f32; 1000];
            random_floats(&mut v, seed);
            assert!(v.iter().all(|x| (-1.0..1.0).contains(x) && *x != 0.0));
            let first: Vec<_> = v[..8].to_vec();
            assert!(
                first.windows(2).all(|w| w[0] != w[1]),
                "seed {seed}: {first:?}"
            );
            let mean = v.iter().map(|x| *x as f64).sum::<f64>() / v.len() as f64;
            assert!(mean.abs() < 0.1, "seed {seed}: mean {mean}");
        }
    }

    #[test]
    fn verify_checks_every_element_below_the_threshold() {
        let kernel = Kernel::Scale { s: 1.5 };
        let mut input = vec![0f32; 1_000_003];
        random_floats(&mut input, 9);
        let good: Vec<f32> = input.iter().map(|x| x * 1.5).collect();
        assert_eq!(verify(kernel, &input, &good), (input.len(), 0));
        // One wrong element anywhere is found.
        for i in [0, 1, 777_777, input.len() - 1] {
            let mut bad = good.clone();
            bad[i] = f32::from_bits(bad[i].to_bits() ^ 1);
            assert_eq!(
                verify(kernel, &input, &bad),
                (input.len(), 1),
                "element {i}"
            );
        }
        let mut poisoned = good.clone();
        poison(&mut poisoned[500_000..500_010]);
        assert_eq!(verify(kernel, &input, &poisoned).1, 10);
    }

    #[test]
    fn expected_is_the_plain_arithmetic() {
        assert_eq!(expected(Kernel::Scale { s: 1.5 }, 2.0), 3.0);
        assert_eq!(expected(Kernel::Intensity { k: 0 }, 0.25), 0.25);
        let once = 0.5f32.mul_add(0.9999, 1.0e-4);
        assert_eq!(
            expected(Kernel::Intensity { k: 1 }, 0.5).to_bits(),
            once.to_bits()
        );
    }

    #[test]
    fn sampled_indices_reach_the_whole_of_a_large_array() {
        // Indices computed in f32 reach only about 2^24 distinct values: a
        // sample of a billion-element array must reach past them.
        let n = 1usize << 33;
        let v = sample_indices(n);
        assert_eq!(v.len(), 2 * SAMPLE_ENDS + SAMPLE_RANDOM);
        assert!(v.iter().all(|&i| i < n));
        let odd = v[2 * SAMPLE_ENDS..].iter().filter(|&&i| i % 2 == 1).count();
        assert!(odd > SAMPLE_RANDOM / 3, "odd indices: {odd}");
        let top = v[2 * SAMPLE_ENDS..].iter().filter(|&&i| i > n / 2).count();
        assert!(top > SAMPLE_RANDOM / 3, "upper half: {top}");
    }
}
