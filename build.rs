//! Builds the kernel crate `gpu-kernels` for `nvptx64-nvidia-cuda` with
//! kernel-builder and embeds the PTX (`OUT_DIR/gpu_kernels.ptx`, read by
//! `src/ptx.rs`).
//! Knobs, rebuild triggers and the shared nested target directory: see the
//! kernel-builder docs (`KERNEL_ARCH`, `KERNEL_PTX_ISA`, `HOST_PTX_STUB`).

fn main() {
    let built = kernel_builder::Builder::new("gpu-kernels")
        .arch("sm_70")
        .export_arch("KERNEL_ARCH")
        .build_or_exit();
    // The commit of the sources this build read, for results files.
    println!("cargo:rustc-env=HOST_GIT_COMMIT={}", built.git_commit());
    // Tests that parse the embedded PTX are ignored, not passed, when it is
    // a stub.
    println!("cargo:rustc-check-cfg=cfg(host_ptx_stub)");
    if built.stub {
        println!("cargo:rustc-cfg=host_ptx_stub");
    }
    // Tests' CUDA halves run by default where the build machine has a GPU.
    kernel_builder::emit_gpu_cfg("host_gpu");
}
