//! Builds ../bf16-kernels to PTX (OUT_DIR/bf16_kernels.ptx, embedded by
//! src/lib.rs) with kernel-builder. Knobs: KERNEL_ARCH, KERNEL_PTX_ISA,
//! HOST_PTX_STUB (see the kernel-builder docs).

fn main() {
    kernel_builder::Builder::new("../bf16-kernels")
        .arch("sm_70")
        .export_arch("BF16_KERNELS_ARCH")
        .expect_entries(["widen_bf16", "narrow_f32", "scale_bf16_f32", "scale_bf16"])
        .build_or_exit();
    // Tests' CUDA halves run by default where the build machine has a GPU.
    kernel_builder::emit_gpu_cfg("host_gpu");
}
