//! Builds `gpu-kernels` for `nvptx64-nvidia-cuda` with a nested cargo and
//! embeds the PTX (`OUT_DIR/gpu_kernels.ptx`, read by `src/ptx.rs`).
//!
//! Knobs (each reruns this script when it changes):
//! - `KERNEL_ARCH`: the PTX `.target`, default `sm_70` (every GPU from Volta on
//!   can JIT it; e.g. `sm_90` for Hopper-only code).
//! - `KERNEL_PTX_ISA`: the PTX ISA version as a target feature, e.g. `ptx80`;
//!   default: the lowest the architecture allows (`.version 6.0` for sm_70).
//!
//! The script reruns exactly when a kernel source changes: it reads the nested
//! build's dep-info and names each source with `rerun-if-changed`.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const DEFAULT_ARCH: &str = "sm_70";

fn main() {
    if let Err(msg) = run() {
        eprintln!("\nerror: building the GPU kernels failed\n\n{msg}\n");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let kernels_dir = manifest_dir.join("../gpu-kernels");
    let out_dir = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let target_dir = out_dir.join("kernels-target");

    println!("cargo:rerun-if-env-changed=KERNEL_ARCH");
    println!("cargo:rerun-if-env-changed=HOST_PTX_STUB");
    if env::var("HOST_PTX_STUB").is_ok_and(|v| v == "1") {
        // For tools that cannot run the nvptx build (Miri runs the CUDA-free
        // completion core): no kernels, and every PTX test fails loudly.
        println!("cargo:warning=HOST_PTX_STUB=1: kernels not built; the embedded PTX is empty");
        std::fs::write(
            out_dir.join("gpu_kernels.ptx"),
            "// HOST_PTX_STUB=1: kernels not built\n",
        )
        .map_err(|e| e.to_string())?;
        println!("cargo:rustc-env=KERNEL_ARCH=none");
        println!("cargo:rustc-env=HOST_GIT_COMMIT=stub");
        return Ok(());
    }
    println!("cargo:rerun-if-env-changed=KERNEL_PTX_ISA");
    println!(
        "cargo:rerun-if-changed={}",
        kernels_dir.join("Cargo.toml").display()
    );
    println!("cargo:rerun-if-changed=build.rs");

    let arch = env::var("KERNEL_ARCH").unwrap_or_else(|_| DEFAULT_ARCH.to_string());
    if !arch.starts_with("sm_") || arch[3..].parse::<u32>().is_err() {
        return Err(format!(
            "KERNEL_ARCH={arch:?} is not a GPU architecture: use a value like sm_70 or sm_90"
        ));
    }
    let mut rustflags = vec![format!("-Ctarget-cpu={arch}")];
    if let Ok(isa) = env::var("KERNEL_PTX_ISA") {
        rustflags.push(format!("-Ctarget-feature=+{isa}"));
    }

    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    // The outer build's variables (CARGO_*, RUSTFLAGS, RUSTC_WRAPPER...) describe the
    // host build; the nested build must not inherit them. RUSTUP_TOOLCHAIN stays, so
    // the nested cargo uses the toolchain rust-toolchain.toml pinned.
    for (key, _) in env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        if key.starts_with("CARGO_")
            || key.starts_with("RUSTC")
            || key == "RUSTFLAGS"
            || key == "RUSTDOCFLAGS"
            || key.starts_with("DEP_")
        {
            cmd.env_remove(&key);
        }
    }
    cmd.current_dir(&kernels_dir)
        .args(["rustc", "--lib", "--release", "--crate-type", "cdylib"])
        .args(["--target", "nvptx64-nvidia-cuda", "-Zbuild-std=core"])
        .arg("--target-dir")
        .arg(&target_dir)
        // The nvptx-only features (abi_ptx, stdarch_nvptx, core_float_math) and
        // -Zbuild-std need an unstable switch: for this nested build only.
        .env("RUSTC_BOOTSTRAP", "1")
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags.join("\u{1f}"))
        // One fat-LTO unit: a kernel edit rebuilds in seconds and the PTX is whole.
        .env("CARGO_PROFILE_RELEASE_LTO", "fat")
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1")
        .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env("CARGO_TERM_COLOR", "never");

    let output = cmd
        .output()
        .map_err(|e| format!("could not start cargo for the nested kernel build: {e}"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(format!("{stderr}\n{}", hint(&stderr)));
    }

    let built = target_dir.join("nvptx64-nvidia-cuda/release");
    let ptx = built.join("gpu_kernels.ptx");
    let text = std::fs::read_to_string(&ptx).map_err(|e| {
        format!(
            "the nested build succeeded but {} is unreadable: {e}",
            ptx.display()
        )
    })?;
    let dest = out_dir.join("gpu_kernels.ptx");
    std::fs::write(&dest, &text).map_err(|e| format!("writing {}: {e}", dest.display()))?;

    for source in dep_info_sources(&built.join("gpu_kernels.d"), &kernels_dir)? {
        println!("cargo:rerun-if-changed={}", source.display());
    }
    println!("cargo:rustc-env=KERNEL_ARCH={arch}");
    println!(
        "cargo:rustc-env=HOST_GIT_COMMIT={}",
        git_commit(&manifest_dir)
    );
    Ok(())
}

/// `git describe`-style commit of the source tree, for results files.
fn git_commit(dir: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(dir)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    if let Some(top) = git(&["rev-parse", "--git-dir"]) {
        let top = dir.join(top);
        println!("cargo:rerun-if-changed={}", top.join("HEAD").display());
        println!("cargo:rerun-if-changed={}", top.join("index").display());
    }
    match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(c) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{c}-dirty")
            } else {
                c
            }
        }
        None => "unknown".into(),
    }
}

/// The kernel crate's own sources, from the nested build's dep-info file.
fn dep_info_sources(dep_info: &Path, kernels_dir: &Path) -> Result<Vec<PathBuf>, String> {
    let text = std::fs::read_to_string(dep_info)
        .map_err(|e| format!("reading dep-info {}: {e}", dep_info.display()))?;
    let kernels_dir = kernels_dir
        .canonicalize()
        .map_err(|e| format!("{}: {e}", kernels_dir.display()))?;
    let deps = text.split_once(':').map(|(_, d)| d).unwrap_or("");
    Ok(deps
        .split_whitespace()
        .map(PathBuf::from)
        .filter(|p| p.starts_with(&kernels_dir))
        .collect())
}

/// A fix for the usual failures of a machine that lacks a rustup component.
fn hint(stderr: &str) -> String {
    let install = "run `rustup toolchain install` in the repository root: rust-toolchain.toml \
                   lists the components the kernel build needs (rust-src, llvm-bitcode-linker, \
                   llvm-tools)";
    if stderr.contains("rust-src") || stderr.contains("can't find crate for `core`") {
        format!("hint: the `rust-src` component is missing (needed by -Zbuild-std=core); {install}")
    } else if stderr.contains("linker `rust-ptx-linker`")
        || stderr.contains("llvm-bitcode-linker")
        || stderr.contains("linker") && stderr.contains("not found")
    {
        format!("hint: the `llvm-bitcode-linker` component is missing; {install}")
    } else if stderr.contains("llvm-link")
        || stderr.contains("llc")
        || stderr.contains("opt failed")
    {
        format!("hint: the `llvm-tools` component is missing (the bitcode linker runs llvm-link, opt and llc from it); {install}")
    } else {
        format!("hint: if a toolchain component is missing, {install}")
    }
}
