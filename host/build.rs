//! Builds the example kernel crate `bf16-kernels` for `nvptx64-nvidia-cuda`
//! (`OUT_DIR/bf16_kernels.ptx`), which the demonstration's "fewer bytes"
//! part launches as a user would, and passes on the commit its sources came
//! from.

fn main() {
    let built = kernel_builder::Builder::new("../examples/bf16-kernels")
        .arch("sm_70")
        .expect_entries(["widen_bf16", "narrow_f32", "scale_bf16_f32", "scale_bf16"])
        .build_or_exit();
    println!("cargo:rustc-env=HOST_GIT_COMMIT={}", built.git_commit());
    kernel_builder::emit_gpu_cfg("host_gpu");
}
