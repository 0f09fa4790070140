//! The PTX that `build.rs` compiled from `gpu-kernels`, embedded in the binary.

/// The kernels' PTX text, as the nested nvptx64 build produced it.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gpu_kernels.ptx"));

/// The same kernels built for sm_80 and newer, with those that need
/// Ampere's instructions (the tensor-core GEMM); loaded instead of [`PTX`]
/// on a device of compute capability 8.0 or more.
pub const PTX_SM80: &str = include_str!(concat!(env!("OUT_DIR"), "/gpu_kernels_sm80.ptx"));

/// The GPU architecture the PTX targets (`KERNEL_ARCH` at build time).
pub const ARCH: &str = env!("KERNEL_ARCH");

/// The `.entry` names found in a PTX text, in order.
pub fn entry_points(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter_map(|line| line.trim().strip_prefix(".visible .entry "))
        .map(|rest| rest.split(['(', ' ']).next().unwrap_or(rest))
        .collect()
}

/// The `.target` directive's value.
pub fn target(ptx: &str) -> Option<&str> {
    ptx.lines()
        .find_map(|line| line.trim().strip_prefix(".target "))
        .map(|t| t.split([',', ' ']).next().unwrap_or(t).trim())
}

/// Names of functions declared `.extern .func`: calls the PTX cannot resolve on its own.
pub fn unresolved_externs(ptx: &str) -> Vec<&str> {
    ptx.lines()
        .filter(|line| line.contains(".extern .func"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_ptx_has_every_kernel_and_no_externs() {
        let entries = entry_points(PTX);
        for name in gpu_kernels::KERNEL_NAMES {
            assert!(
                entries.contains(name),
                "missing .entry {name} in {entries:?}"
            );
        }
        assert_eq!(entries.len(), gpu_kernels::KERNEL_NAMES.len());
        // The sm_80 build: the same, and the kernels only it has.
        let sm80 = entry_points(PTX_SM80);
        for name in gpu_kernels::KERNEL_NAMES
            .iter()
            .chain(gpu_kernels::SM80_KERNEL_NAMES)
        {
            assert!(
                sm80.contains(name),
                "missing .entry {name} in the sm_80 PTX"
            );
        }
        assert_eq!(
            sm80.len(),
            gpu_kernels::KERNEL_NAMES.len() + gpu_kernels::SM80_KERNEL_NAMES.len()
        );
        assert!(unresolved_externs(PTX_SM80).is_empty());
        assert!(
            unresolved_externs(PTX).is_empty(),
            "{:?}",
            unresolved_externs(PTX)
        );
    }

    #[test]
    fn embedded_ptx_targets_the_requested_arch() {
        assert_eq!(target(PTX), Some(ARCH));
    }

    #[test]
    fn vector_loads_and_fma_are_in_the_ptx() {
        // 16-byte vector accesses: `ld.global.v4` when the pointer is a kernel
        // argument of its own, generic `ld.v4` when it comes out of a
        // `Slice` parameter (resolved to global memory at run time).
        let has = |op: &str| {
            ["global.v4", "v4"]
                .iter()
                .any(|space| PTX.contains(&format!("{op}.{space}")))
        };
        assert!(has("ld"), "no 16-byte loads");
        assert!(has("st"), "no 16-byte stores");
        assert!(PTX.contains("fma.rn.f32"), "no fused multiply-add");
    }

    #[test]
    fn parsers_read_a_sample() {
        let sample = ".version 8.0\n.target sm_90\n.visible .entry foo(\n.extern .func bar()\n";
        assert_eq!(entry_points(sample), vec!["foo"]);
        assert_eq!(target(sample), Some("sm_90"));
        assert_eq!(unresolved_externs(sample).len(), 1);
    }
}
