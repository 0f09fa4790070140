//! Builds the kernel crate `gpu-kernels` for `nvptx64-nvidia-cuda` with
//! kernel-builder and embeds the PTX (`OUT_DIR/gpu_kernels.ptx`, read by
//! `src/ptx.rs`).
//! Knobs, rebuild triggers and the shared nested target directory: see the
//! kernel-builder docs (`KERNEL_ARCH`, `KERNEL_PTX_ISA`, `HOST_PTX_STUB`).

fn main() {
    // The kernel crate where cargo resolved it (this workspace's folder, a
    // git checkout or the registry), its own dependency on kernel-abi
    // resolved to the sources this build has.
    let mut builder = kernel_builder::Builder::from_dependency("gpu_kernels", "gpu-kernels");
    if let Some(abi) = std::env::var_os("DEP_KERNEL_ABI_MANIFEST_DIR") {
        builder = builder.patch("gpufeed-kernel-abi", abi);
    }
    let built = builder
        .clone()
        .arch("sm_70")
        .export_arch("KERNEL_ARCH")
        .build_or_exit();
    // The same crate for sm_80 and newer (`gpu_kernels_sm80.ptx`): what
    // needs Ampere's instructions (the tensor-core GEMM: mma.sync,
    // ldmatrix, cp.async) is only in it. `KERNEL_ARCH` at sm_80 or above
    // sets its target too; below, it stays sm_80. In stub mode it is a stub.
    let sm80 = "gpu_kernels_sm80.ptx";
    if built.stub {
        let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
        std::fs::write(out.join(sm80), "// HOST_PTX_STUB=1: kernels not built\n")
            .expect("writing the stub PTX");
    } else {
        let arch = std::env::var("KERNEL_ARCH")
            .ok()
            .filter(|a| a.strip_prefix("sm_").and_then(|n| n.parse::<u32>().ok()) >= Some(80))
            .unwrap_or_else(|| "sm_80".into());
        builder
            .arch(arch)
            .env_knobs(false)
            .file_name(sm80)
            .build_or_exit();
    }
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
