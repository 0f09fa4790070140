//! Test support: the devices every test body runs against, random data and
//! bit-exact verification. Not part of the API (behind the `hooks` feature,
//! hidden from the docs): the crate's own tests and demonstration use it.

use crate::cuda::{CudaBackend, DeviceMemory, WaitMode};
use crate::device::Device;
use crate::kernel::Kernel;
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

/// The CUDA device, or `None` with a printed notice (a panic when
/// `REQUIRE_GPU=1`).
pub fn cuda(test: &str) -> Option<Device> {
    let opened = CudaBackend::new(0, WaitMode::default(), DeviceMemory::default())
        .map(|b| Device::wrap(Arc::new(b), "test".into()));
    or_skip(test, opened)
}

/// What opening a GPU gave, or `None` with a printed notice when it failed
/// (a panic when `REQUIRE_GPU=1`): the skip rule of every GPU test.
pub fn or_skip<T>(test: &str, opened: crate::Result<T>) -> Option<T> {
    match opened {
        Ok(v) => Some(v),
        Err(e) => {
            assert!(
                !gpu_required(),
                "{test}: REQUIRE_GPU=1 but no CUDA device: {e}"
            );
            // Written to the stderr handle directly: the test harness
            // captures eprintln!, and a skip must be visible.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIPPED (no GPU): {test}: {e}");
            None
        }
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
pub fn watchdog(gate: &Arc<crate::MappedFlag>) -> Watchdog {
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
/// `name`, a function `fn name(device: host::Device)` written next to the
/// invocation becomes the tests `name::cpu` (the CPU emulation, always) and
/// `name::cuda`, so each backend's result is reported on its own.
///
/// `name::cuda` is ignored unless the machine that built the tests has a GPU
/// (`host_gpu`, set by the build script), so without one it shows as ignored,
/// never as passed. Run anyway (`--include-ignored`), it opens CUDA with
/// [`cuda`](crate::testing::cuda): with no GPU it prints a skip notice and
/// returns, or fails when `REQUIRE_GPU=1`.
///
/// ```text
/// host::backend_tests!(round_trips_keep_every_bit);
/// fn round_trips_keep_every_bit(device: host::Device) {
///     let _serial = host::testing::serial();
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

/// Checks `output` against the CPU reference of `kernel` on `input`, bit for
/// bit, on all CPU threads: `(elements checked, mismatches)`.
pub fn verify(kernel: Kernel, input: &[f32], output: &[f32]) -> (usize, usize) {
    let n = input.len().min(output.len());
    let work = match kernel {
        Kernel::Intensity { k } => n as u64 * k.max(1) as u64,
        Kernel::Scale { .. } => n as u64,
    };
    let indices: Vec<usize> = if work <= 4_000_000_000 {
        (0..n).collect()
    } else {
        let mut next = fastrand_lite(0xA5A5);
        let mut v: Vec<usize> = (0..n.min(4096)).chain(n.saturating_sub(4096)..n).collect();
        v.extend((0..1_000_000).map(|_| ((next() + 1.0) * 0.5 * n as f32) as usize % n.max(1)));
        v
    };
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let chunk = indices.len().div_ceil(threads).max(1);
    let bad: usize = std::thread::scope(|s| {
        indices
            .chunks(chunk)
            .map(|c| {
                s.spawn(move || {
                    c.iter()
                        .filter(|&&i| kernel.reference(input[i]).to_bits() != output[i].to_bits())
                        .count()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap_or(usize::MAX / threads))
            .sum()
    });
    (indices.len(), bad)
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
}
