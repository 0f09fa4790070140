//! Whether the building machine has a GPU, for build scripts that mark the
//! GPU halves of their tests.

/// Whether this machine shows an NVIDIA GPU to the driver
/// (`/proc/driver/nvidia/gpus` lists one).
pub fn gpu_present() -> bool {
    std::fs::read_dir("/proc/driver/nvidia/gpus").is_ok_and(|mut d| d.next().is_some())
}

/// For a build script: declares the cfg `name` and sets it when the building
/// machine has a GPU, or when `REQUIRE_GPU=1` is set for the build, so tests
/// can mark their GPU halves `#[cfg_attr(not(name), ignore)]`: shown as
/// ignored, not passed, on a machine without one; run (and failing without
/// a GPU) when the GPU is required.
pub fn emit_gpu_cfg(name: &str) {
    println!("cargo:rustc-check-cfg=cfg({name})");
    println!("cargo:rerun-if-env-changed=REQUIRE_GPU");
    if gpu_present() || gpu_required() {
        println!("cargo:rustc-cfg={name}");
    }
}

/// Whether `REQUIRE_GPU=1` is set: GPU tests must run (and fail without a
/// GPU) instead of being skipped.
pub fn gpu_required() -> bool {
    std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1")
}
