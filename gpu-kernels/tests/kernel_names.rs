//! `KERNEL_NAMES` joins every module's `kernels!` list: each entry point
//! once, in module order, each named by its kernel type.

use gpu_kernels::{gemm, gemm_mma, histogram, reduce, scan, softmax};
use kernel_abi::Kernel;

#[test]
fn kernel_names_list_every_module_s_entry_points_once() {
    let names = gpu_kernels::KERNEL_NAMES;
    for (part, want) in [
        (reduce::KERNEL_NAMES, reduce::sum_f32::NAME),
        (scan::KERNEL_NAMES, scan::scan_f32::NAME),
        (softmax::KERNEL_NAMES, softmax::softmax_f32::NAME),
        (histogram::KERNEL_NAMES, histogram::histogram_u8::NAME),
        (gemm::KERNEL_NAMES, gemm::sgemm::NAME),
    ] {
        assert!(part.contains(&want));
        assert!(part.iter().all(|n| names.contains(n)), "{part:?} missing");
    }
    assert!(names.contains(&"saxpy"));
    let mut sorted = names.to_vec();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), names.len(), "a name twice: {names:?}");
    assert_eq!(names.len(), 7 + 6 + 3 + 1 + 1 + 1);
    // The sm_80-only entries are apart, and not in the sm_70 list.
    assert_eq!(gpu_kernels::SM80_KERNEL_NAMES, gemm_mma::KERNEL_NAMES);
    assert!(gpu_kernels::SM80_KERNEL_NAMES
        .iter()
        .all(|n| !names.contains(n)));
}
