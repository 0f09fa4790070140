//! The block-level demonstration kernel on the CPU emulation: its sum and
//! per-block maxima against plain loops.

use gpu_kernels::block_sum_demo;
use kernel_abi::thread::{emulate_launch, Launch};
use kernel_abi::{Kernel, Slice, SliceMut};

#[test]
fn block_sum_demo_sums_with_one_atomic_per_block_and_finds_each_blocks_maximum() {
    let n = 100_007;
    let x: Vec<f32> = (0..n).map(|i| ((i * 37) % 101) as f32 - 50.0).collect();
    let (grid, block) = (13u32, 256u32);
    let mut total = [0f32];
    let mut maxes = vec![0f32; grid as usize];
    // SAFETY: the vectors outlive the launch.
    let params = unsafe {
        (
            Slice::from_raw_parts(x.as_ptr(), x.len()),
            SliceMut::from_raw_parts(total.as_mut_ptr(), 1),
            SliceMut::from_raw_parts(maxes.as_mut_ptr(), maxes.len()),
        )
    };
    emulate_launch(
        block_sum_demo::NAME,
        &Launch::linear(grid, block),
        2,
        &|| {
            // SAFETY: the kernel's contract: valid slices, block a multiple of 32.
            unsafe { block_sum_demo::thread(params) }
        },
    )
    .unwrap();
    let exact: f64 = x.iter().map(|&v| f64::from(v)).sum();
    let bound = 1e-6 * x.iter().map(|v| f64::from(v.abs())).sum::<f64>();
    assert!((f64::from(total[0]) - exact).abs() <= bound);
    let stride = (grid * block) as usize;
    for (b, &m) in maxes.iter().enumerate() {
        let want = (0..n)
            .filter(|i| (i % stride) / block as usize == b)
            .map(|i| x[i])
            .fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(m, want, "block {b}");
    }
}
