//! Build a Rust kernel crate to PTX from any crate's `build.rs`, in the
//! spirit of rust-gpu's `spirv-builder`: point it at the kernel crate, get
//! the PTX in `OUT_DIR` to embed with `include_str!`.
//!
//! ```no_run
//! // build.rs of the crate that launches the kernels, in its `fn main`:
//! kernel_builder::Builder::new("../my-kernels")
//!     .arch("sm_70")
//!     .build_or_exit();
//! ```
//! ```ignore
//! // src/lib.rs: `<lib name>.ptx`, the kernel crate's library name
//! pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/my_kernels.ptx"));
//! ```
//!
//! The kernel crate is compiled by rustc's own `nvptx64-nvidia-cuda` backend
//! in a nested cargo build: `cargo rustc --lib --release --crate-type cdylib
//! --target nvptx64-nvidia-cuda -Zbuild-std=core`, in a target directory of
//! its own (the outer build holds the lock on its own), with the outer
//! build's `CARGO_*` / `RUSTC*` / `RUSTFLAGS` variables cleared, its flags
//! passed through `CARGO_ENCODED_RUSTFLAGS`, `RUSTC_BOOTSTRAP=1` for the
//! nested build only (the `abi_ptx` / `stdarch_nvptx` features and
//! `-Zbuild-std`; the calling crate stays on plain stable), and fat LTO in
//! one codegen unit (a kernel edit rebuilds in seconds).
//!
//! The toolchain needs the rustup components `rust-src`,
//! `llvm-bitcode-linker` and `llvm-tools`; when one is missing the error
//! says which and how to install it ([`MissingComponent`]).
//!
//! # Knobs (each reruns the build script when it changes)
//! - `KERNEL_ARCH`: the PTX `.target`; overrides [`Builder::arch`]; default
//!   `sm_70` (every GPU from Volta on can JIT it).
//! - `KERNEL_PTX_ISA`: the PTX ISA version as a target feature, e.g.
//!   `ptx80`; overrides [`Builder::ptx_isa`]; default: the lowest the
//!   architecture allows (`.version 6.0` for sm_70).
//! - `HOST_PTX_STUB=1`: nothing is built; the PTX file holds one comment
//!   (for tools that can't run the nvptx build, such as Miri), and
//!   [`Built::stub`] says so.
//!
//! # Rebuild triggers
//! The build script reruns when a source of the kernel crate or of its path
//! dependencies changes (read from the nested build's dep-info), when one
//! of their `Cargo.toml`s or the workspace's `Cargo.lock` changes, when the
//! calling crate's `build.rs` changes, and when a knob changes.
//!
//! # Where the nested build goes
//! One directory per architecture next to the profile directories
//! (`target/nvptx-kernels/sm_70`), shared by every profile, feature set and
//! calling crate: `core` is compiled for the GPU once (the long part of a
//! first build, announced by one status line), not once per profile.

#![deny(missing_docs)]
mod builder;
mod command;
mod config;
mod depinfo;
mod env;
mod error;
mod git;
mod gpu;
mod hint;
mod manifest;
mod nested;
mod notice;
pub mod ptx;
mod reruns;

pub use builder::{Builder, Built};
pub use command::{
    artifact_dir, is_outer_build_var, kernels_target_dir, nested_args, nested_env, TARGET,
    USER_CARGO_SETTINGS,
};
pub use config::{is_gpu_arch, is_ptx_isa, DEFAULT_ARCH, ENV_ARCH, ENV_PTX_ISA, ENV_STUB};
pub use depinfo::{packages as dep_info_packages, parse as parse_dep_info};
pub use env::Env;
pub use error::{Error, Result};
pub use git::{git_commit, WORKSPACE_FILES};
pub use gpu::{emit_gpu_cfg, gpu_present, gpu_required};
pub use hint::MissingComponent;
pub use manifest::lib_name;
pub use notice::notice;
