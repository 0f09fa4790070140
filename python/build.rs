//! Builds the example user kernel crate (`examples/bf16-kernels`) to PTX
//! with kernel-builder (`OUT_DIR/bf16_kernels.ptx`, embedded by src/ops.rs),
//! as any crate that brings its own kernels does. Knobs: KERNEL_ARCH,
//! KERNEL_PTX_ISA, HOST_PTX_STUB (see the kernel-builder docs).

fn main() {
    kernel_builder::Builder::new("../examples/bf16-kernels")
        .arch("sm_70")
        .expect_entries(["widen_bf16", "narrow_f32", "scale_bf16_f32", "scale_bf16"])
        .build_or_exit();
}
